"""Triton kernels of token_logprobs_sampler: the log-probs under the rollout engine's distribution
(temperature, min-p, top-k, top-p) and the head's statistics, one program per row (semantics:
naive.py and docs/ppo-math.md; the plain pass: triton_kernels.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import new_output
from .._triton_math import FLT_MAX
from .._triton_utils import row_indexer

# One program per row. The kept set is found by a search that ends exact, not by sorting the row:
# on the order-preserving int32 key of each logit, every pass over the row counts the tokens (and
# sums their masses) above P pivots at once, which narrows the key range P + 1 times; the range
# of 2^32 keys closes in at most 8 passes (fewer for a narrow row). Triton has no cheap per-row
# histogram with masses (the CUDA kernel's radix select), and this needs nothing but reductions.
# Masses are exp(nd) with nd = (x - max x) * inv_t: relative to the unscaled max, so no finite
# logit overflows at any temperature.

_PIVOTS = 16


@triton.jit
def _order_key(x):
    """int64 key whose order is the float order (-0.0 as +0.0)."""
    b = (x + 0.0).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _key_value(k):
    """The float32 of an _order_key."""
    b = k.to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _load_row(base, offs, V):
    return tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)


@triton.jit
def _above(base, V, t, xmax, inv_t, BLOCK: tl.constexpr):
    """(count, mass) of the tokens whose key exceeds t, and (count, mass) of those equal to it."""
    n_gt = 0
    m_gt = 0.0
    n_eq = 0
    m_eq = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(base, offs, V)
        k = _order_key(x)
        e = tl.exp((x - xmax) * inv_t)
        gt = (k > t) & (offs < V)
        eq = (k == t) & (offs < V)
        n_gt += tl.sum(gt.to(tl.int32), 0)
        m_gt += tl.sum(tl.where(gt, e, 0.0), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)
        m_eq += tl.sum(tl.where(eq, e, 0.0), 0)
    return n_gt, m_gt, n_eq, m_eq


@triton.jit
def _search(base, V, lo, hi, xmax, inv_t, target, MODE: tl.constexpr, BLOCK: tl.constexpr,
            P: tl.constexpr):  # fmt: skip
    """The smallest key t in [lo, hi] where pred(t) holds (pred is false then true along t, and
    true at hi): MODE 0: count(key > t) < target; 1: mass(key > t) < target; 2: mass <= target."""
    i = tl.arange(0, P).to(tl.int64)
    while lo < hi:
        piv = lo + ((hi - lo) * (i + 1)) // (P + 1)
        cnt = tl.zeros([P], dtype=tl.int32)
        mass = tl.zeros([P], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_row(base, offs, V)
            k = _order_key(x)
            e = tl.exp((x - xmax) * inv_t)
            gt = (k[:, None] > piv[None, :]) & (offs < V)[:, None]
            cnt += tl.sum(gt.to(tl.int32), 0)
            mass += tl.sum(tl.where(gt, e[:, None], 0.0), 0)
        if MODE == 0:
            ok = cnt < target
        elif MODE == 1:
            ok = mass < target
        else:
            ok = mass <= target
        hi = tl.minimum(hi, tl.min(tl.where(ok, piv, hi), 0))
        lo = tl.maximum(lo, tl.max(tl.where(ok, lo, piv + 1), 0))
    return hi


@triton.jit
def _nth_tie(base, V, v, m, BLOCK: tl.constexpr):
    """The index of the m-th (1-based) token whose logit equals v, in index order."""
    seen = 0
    idx = V - 1
    found = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(base, offs, V)
        eq = (x == v) & (offs < V)
        c = seen + tl.cumsum(eq.to(tl.int32), 0)
        hit = eq & (c == m) & (found == 0)
        idx = tl.where(tl.sum(hit.to(tl.int32), 0) > 0, tl.max(tl.where(hit, offs, -1), 0), idx)
        found = tl.where(tl.sum(hit.to(tl.int32), 0) > 0, 1, found)
        seen += tl.sum(eq.to(tl.int32), 0)
    return idx


@triton.jit
def _store_fill(LP, ENT, LSE, CUT, CUTI, OUT, SP2, FLSE, TIDS, TLP, ARGM, row, V, stats_k, value,
                ids, WITH_ENT: tl.constexpr, WITH_SP2: tl.constexpr, WITH_LSE: tl.constexpr,
                WITH_ARGM: tl.constexpr, KPAD: tl.constexpr):  # fmt: skip
    """One row whose outputs are all `value` (0: an ignored label; NaN: an undefined row)."""
    tl.store(LP + row, value)
    tl.store(LSE + row, value)
    tl.store(CUT + row, -float("inf"))
    tl.store(CUTI + row, V - 1)
    tl.store(OUT + row, 0)
    if WITH_ENT:
        tl.store(ENT + row, value)
    if WITH_SP2:
        tl.store(SP2 + row, value)
    if WITH_LSE:
        tl.store(FLSE + row, value)
    if WITH_ARGM:
        tl.store(ARGM + row, 0)
    if KPAD > 0:
        kk = tl.arange(0, KPAD)
        tl.store(TIDS + row * stats_k + kk, ids, mask=kk < stats_k)
        tl.store(TLP + row * stats_k + kk, value, mask=kk < stats_k)


@triton.jit
def _sampler_row(
    base, label, valid, xl, xmax, xmin, inv_t, k, p, mp, V, stats_k, row,
    LP, ENT, LSE, CUT, CUTI, OUT, SP2, FLSE, TIDS, TLP, ARGM, SCR,
    SGLANG: tl.constexpr, WITH_ENT: tl.constexpr, WITH_SP2: tl.constexpr,
    WITH_LSE: tl.constexpr, WITH_ARGM: tl.constexpr, KPAD: tl.constexpr,
    BLOCK: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    mp_on = mp > 0.0
    # the whole row's mass S (relative to the max)
    s_all = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(base, offs, V)
        s_all += tl.sum(tl.exp((x - xmax) * inv_t), 0)
    hi = _order_key(xmax)
    lo = _order_key(xmin)
    cut = -float("inf")
    cut_i = (V - 1).to(tl.int64)
    if mp_on:  # min-p: the smallest logit with nd >= log(min_p)
        lmp = tl.log(mp)
        cmin = float("inf")
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_row(base, offs, V)
            keep = ((x - xmax) * inv_t >= lmp) & (offs < V)
            cmin = tl.minimum(cmin, tl.min(tl.where(keep, x, float("inf")), 0))
        cut = cmin
        lo = _order_key(cmin)
    if SGLANG:
        # positions as (value, tie number): each filter's last kept token; the earliest wins
        best_v = cut
        best_m = 2147483647  # min-p keeps whole tie groups
        if k_on:
            t = _search(base, V, _order_key(xmin), hi, xmax, inv_t, k, 0, BLOCK, P)
            n_gt, m_gt, n_eq, m_eq = _above(base, V, t, xmax, inv_t, BLOCK)
            vk = _key_value(t)
            mk = (k - n_gt).to(tl.int32)
            earlier = (vk > best_v) | ((vk == best_v) & (mk < best_m))
            best_v = tl.where(earlier, vk, best_v)
            best_m = tl.where(earlier, mk, best_m)
        if p_on:
            tau = p * s_all
            t = _search(base, V, _order_key(xmin), hi, xmax, inv_t, tau, 2, BLOCK, P)
            n_gt, m_gt, n_eq, m_eq = _above(base, V, t, xmax, inv_t, BLOCK)
            vp = _key_value(t)
            e1 = m_eq / tl.maximum(n_eq, 1).to(tl.float32)
            # the tie that crosses tau: the first m with m_gt + m * e1 > tau
            nf = n_eq.to(tl.float32)
            r = tl.where(e1 > 0, tl.minimum((tau - m_gt) / e1, nf), nf)
            m_p = (tl.floor(r) + 1).to(tl.int32)
            crossed = m_p <= n_eq
            m_p = tl.where(crossed, m_p, 2147483647)
            earlier = (vp > best_v) | ((vp == best_v) & (m_p < best_m))
            best_v = tl.where(earlier, vp, best_v)
            best_m = tl.where(earlier, m_p, best_m)
        cut = best_v
        if k_on | p_on:
            n_gt, m_gt, n_eq, m_eq = _above(base, V, _order_key(best_v), xmax, inv_t, BLOCK)
            if best_m < n_eq:
                cut_i = _nth_tie(base, V, best_v, best_m, BLOCK).to(tl.int64)
    else:
        if k_on:  # every tie of the k-th value (among what min-p keeps) stays
            t = _search(base, V, lo, hi, xmax, inv_t, k, 0, BLOCK, P)
            cut = _key_value(t)
        if p_on:  # on what min-p and top-k keep, renormalised
            n_gt, m_gt, n_eq, m_eq = _above(base, V, _order_key(tl.maximum(cut, xmin)), xmax,
                                            inv_t, BLOCK)  # fmt: skip
            mass_b = m_gt + m_eq
            t = _search(base, V, _order_key(tl.maximum(cut, xmin)), hi, xmax, inv_t,
                        p * mass_b, 1, BLOCK, P)  # fmt: skip
            cut = tl.maximum(cut, _key_value(t))
    active = k_on | p_on | mp_on
    cut = tl.where(active, cut, -float("inf"))
    # sums over the kept set
    s_k = 0.0
    u_k = 0.0
    e2_k = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(base, offs, V)
        nd = (x - xmax) * inv_t
        kept = ((x > cut) | ((x == cut) & (offs <= cut_i))) & (offs < V)
        e = tl.where(kept, tl.exp(nd), 0.0)
        s_k += tl.sum(e, 0)
        u_k += tl.sum(e * tl.maximum(nd, -FLT_MAX), 0)
        e2_k += tl.sum(e * e, 0)
    log_sk = tl.log(s_k)
    in_set = (xl > cut) | ((xl == cut) & (label <= cut_i))
    lp = tl.where(in_set, (xl - xmax) * inv_t - log_sk, -float("inf"))
    tl.store(LP + row, tl.where(valid, lp, float("nan")))
    tl.store(LSE + row, xmax * inv_t + log_sk)
    tl.store(CUT + row, cut)
    tl.store(CUTI + row, cut_i)
    tl.store(OUT + row, (valid & ~in_set).to(tl.int8))
    if WITH_ENT:
        tl.store(ENT + row, tl.where(valid, log_sk - u_k / s_k, float("nan")))
    if WITH_SP2:
        tl.store(SP2 + row, tl.where(valid, e2_k / (s_k * s_k), float("nan")))
    if WITH_LSE:
        tl.store(FLSE + row, xmax * inv_t + tl.log(s_all))
    if WITH_ARGM:
        tl.store(ARGM + row, (valid & (xl == xmax)).to(tl.int8))
    if KPAD > 0:
        # the stats_k-th value, then every token above it and the first ties, sorted
        t = _search(base, V, _order_key(xmin), hi, xmax, inv_t, stats_k, 0, BLOCK, P)
        n_gt, m_gt, n_eq, m_eq = _above(base, V, t, xmax, inv_t, BLOCK)
        ties = stats_k - n_gt
        written = 0
        tie_seen = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_row(base, offs, V)
            kx = _order_key(x)
            eq = (kx == t) & (offs < V)
            tie_rank = tie_seen + tl.cumsum(eq.to(tl.int32), 0)
            take = ((kx > t) | (eq & (tie_rank <= ties))) & (offs < V)
            pos = written + tl.cumsum(take.to(tl.int32), 0) - 1
            comp = (kx << 32) | (0x7FFFFFFF - offs).to(tl.int64)
            tl.store(SCR + row * KPAD + pos, comp, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            tie_seen += tl.sum(eq.to(tl.int32), 0)
        kk = tl.arange(0, KPAD)
        comp = tl.load(SCR + row * KPAD + kk)
        comp = tl.sort(comp, 0, descending=True)
        ids = 0x7FFFFFFF - (comp & 0xFFFFFFFF)
        xv = _key_value(comp >> 32)
        kept_t = (xv > cut) | ((xv == cut) & (ids <= cut_i))
        tlp = tl.where(kept_t, (xv - xmax) * inv_t - log_sk, -float("inf"))
        tl.store(TIDS + row * stats_k + kk, ids, mask=kk < stats_k)
        tl.store(TLP + row * stats_k + kk, tlp, mask=kk < stats_k)


@triton.jit
def _sampler_fwd_kernel(
    X, LAB, LP, ENT, LSE, CUT, CUTI, OUT, SP2, FLSE, TIDS, TLP, ARGM, SCR,
    INV_TS, KS, PS, MPS,
    V, inner, stride_outer, stride_inner,
    inv_t0, k0, p0, mp0, ignore_index, stats_k,
    SGLANG: tl.constexpr, WITH_ENT: tl.constexpr, WITH_SP2: tl.constexpr,
    WITH_LSE: tl.constexpr, WITH_ARGM: tl.constexpr, KPAD: tl.constexpr,
    HAS_TS: tl.constexpr, HAS_KS: tl.constexpr, HAS_PS: tl.constexpr, HAS_MPS: tl.constexpr,
    BLOCK: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    if label == ignore_index:
        _store_fill(LP, ENT, LSE, CUT, CUTI, OUT, SP2, FLSE, TIDS, TLP, ARGM, row, V, stats_k,
                    0.0, -1, WITH_ENT, WITH_SP2, WITH_LSE, WITH_ARGM, KPAD)  # fmt: skip
    else:
        base = X + (row // inner) * stride_outer + (row % inner) * stride_inner
        inv_t = inv_t0
        if HAS_TS:
            inv_t = tl.load(INV_TS + row).to(tl.float32)
        k = k0
        if HAS_KS:
            k = tl.load(KS + row)
        p = p0
        if HAS_PS:
            p = tl.load(PS + row).to(tl.float32)
        mp = mp0
        if HAS_MPS:
            mp = tl.load(MPS + row).to(tl.float32)
        # the row's max and min logits, and whether it is defined (no NaN / +inf, not all -inf)
        xmax = -float("inf")
        xmin = float("inf")
        bad = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_row(base, offs, V)
            bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 0)
            xmax = tl.maximum(xmax, tl.max(x, 0))
            xmin = tl.minimum(xmin, tl.min(tl.where(offs < V, x, float("inf")), 0))
        valid = (label >= 0) & (label < V)
        xl = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
        if (bad > 0) | (xmax == -float("inf")):
            _store_fill(LP, ENT, LSE, CUT, CUTI, OUT, SP2, FLSE, TIDS, TLP, ARGM, row, V,
                        stats_k, float("nan"), -1, WITH_ENT, WITH_SP2, WITH_LSE, WITH_ARGM,
                        KPAD)  # fmt: skip
        else:
            _sampler_row(
                base, label, valid, xl, xmax, xmin, inv_t, k, p, mp, V, stats_k, row,
                LP, ENT, LSE, CUT, CUTI, OUT, SP2, FLSE, TIDS, TLP, ARGM, SCR,
                SGLANG, WITH_ENT, WITH_SP2, WITH_LSE, WITH_ARGM, KPAD, BLOCK, P,
            )  # fmt: skip


@triton.jit
def _sampler_bwd_kernel(
    X, G, LAB, GLP, GENT, ENT, CUT, CUTI, INV_TS,
    V, inner, stride_outer, stride_inner, g_inner, g_stride_outer, g_stride_inner,
    inv_t0, ignore_index,
    WITH_ENT: tl.constexpr, HAS_TS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """grad_j = inv_t (a (onehot_j - q_j) - b q_j (log q_j + H)) on the kept set, 0 outside; a = 0
    when the label is outside. q from the kept set's sums relative to the row max (recomputed:
    the saved lse may have overflowed)."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LAB + row).to(tl.int64)
    base = X + (row // inner) * stride_outer + (row % inner) * stride_inner
    gbase = G + (row // g_inner) * g_stride_outer + (row % g_inner) * g_stride_inner
    ignored = label == ignore_index
    valid = (label >= 0) & (label < V) & ~ignored
    inv_t = inv_t0
    if HAS_TS:
        inv_t = tl.load(INV_TS + row).to(tl.float32)
    cut = tl.load(CUT + row)
    cut_i = tl.load(CUTI + row)
    xmax = -float("inf")
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        xmax = tl.maximum(xmax, tl.max(_load_row(base, offs, V), 0))
    s_k = 0.0
    u_k = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(base, offs, V)
        nd = (x - xmax) * inv_t
        kept = ((x > cut) | ((x == cut) & (offs <= cut_i))) & (offs < V)
        e = tl.where(kept, tl.exp(nd), 0.0)
        s_k += tl.sum(e, 0)
        u_k += tl.sum(e * tl.maximum(nd, -FLT_MAX), 0)
    log_sk = tl.log(s_k)
    h = log_sk - u_k / s_k
    xl = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    in_set = (xl > cut) | ((xl == cut) & (label <= cut_i))
    a = tl.where(in_set, tl.load(GLP + row).to(tl.float32) * inv_t, 0.0)
    b = 0.0
    if WITH_ENT:
        b = tl.load(GENT + row).to(tl.float32) * inv_t
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < V
        x = _load_row(base, offs, V)
        kept = (x > cut) | ((x == cut) & (offs <= cut_i))
        logq = (x - xmax) * inv_t - log_sk
        q = tl.where(kept, tl.exp(logq), 0.0)
        g = -a * q - b * (q * tl.maximum(logq + h, -FLT_MAX))
        g = g + tl.where(offs == label, a, 0.0)  # (a = 0 when the label is outside the set)
        g = tl.where(valid, g, float("nan"))
        g = tl.where(ignored, 0.0, g)
        tl.store(gbase + offs, g.to(G.dtype.element_ty), mask=msk)


def _sampler_block(V):
    return min(triton.next_power_of_2(max(V, 16)), 1024)


def sampler_forward(logits, labels, inv_temperature, inv_temperatures, top_k, top_ks, top_p,
                    top_ps, min_p, min_ps, sampler, ignore_index, with_entropy, with_sum_p2,
                    with_lse, stats_top_k, with_is_argmax):  # fmt: skip
    V = logits.shape[-1]
    idx, logits = row_indexer(logits)
    labels = labels.contiguous()
    N = labels.numel()
    dev = logits.device
    f32 = dict(dtype=torch.float32, device=dev)
    shape = labels.shape

    def rows(on, dtype=torch.float32):
        return new_output(shape, dtype, dev) if on else torch.empty(0, dtype=dtype, device=dev)

    lp, ent, lse = rows(True), rows(with_entropy), rows(True)
    cut, cut_i, outside = rows(True), rows(True, torch.int64), rows(True, torch.bool)
    sp2, flse, argm = rows(with_sum_p2), rows(with_lse), rows(with_is_argmax, torch.bool)
    top = (*shape, stats_top_k) if stats_top_k > 0 else (0,)
    tids = new_output(top, torch.int64, dev)
    tlp = new_output(top, torch.float32, dev)
    if N == 0:
        return lp, ent, lse, cut, cut_i, outside, sp2, flse, tids, tlp, argm
    kpad = triton.next_power_of_2(stats_top_k) if stats_top_k > 0 else 0
    scratch = torch.full((N, max(kpad, 1)), -(2**63) + 1, dtype=torch.int64, device=dev)
    # bool outputs are written as int8 (the same bytes)
    out8, argm8 = outside.view(torch.int8), argm.view(torch.int8) if with_is_argmax else lp
    dummy = torch.empty(1, **f32)
    block = _sampler_block(V)
    _sampler_fwd_kernel[(N,)](
        logits, labels, lp, ent if with_entropy else lp, lse, cut, cut_i, out8,
        sp2 if with_sum_p2 else lp, flse if with_lse else lp, tids if kpad else cut_i,
        tlp if kpad else lp, argm8, scratch,
        inv_temperatures if inv_temperatures is not None else dummy,
        top_ks if top_ks is not None else cut_i, top_ps if top_ps is not None else dummy,
        min_ps if min_ps is not None else dummy,
        V, *idx, float(inv_temperature), int(top_k), float(top_p), float(min_p),
        int(ignore_index), int(stats_top_k),
        SGLANG=sampler == "sglang", WITH_ENT=with_entropy, WITH_SP2=with_sum_p2,
        WITH_LSE=with_lse, WITH_ARGM=with_is_argmax, KPAD=kpad,
        HAS_TS=inv_temperatures is not None, HAS_KS=top_ks is not None,
        HAS_PS=top_ps is not None, HAS_MPS=min_ps is not None,
        BLOCK=block, P=_PIVOTS, num_warps=4,
    )  # fmt: skip
    return lp, ent, lse, cut, cut_i, outside, sp2, flse, tids, tlp, argm


def sampler_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy, cut, cut_index,
                     inv_temperature, inv_temperatures, ignore_index, grad_logits):  # fmt: skip
    V = logits.shape[-1]
    idx, logits = row_indexer(logits)
    gidx, g = row_indexer(grad_logits)
    labels = labels.contiguous()
    N = labels.numel()
    if N == 0:
        return
    with_ent = grad_entropy is not None and grad_entropy.numel() > 0
    glp = grad_logprobs.float().contiguous()
    gent = grad_entropy.float().contiguous() if with_ent else glp
    dummy = torch.empty(1, dtype=torch.float32, device=logits.device)
    _sampler_bwd_kernel[(N,)](
        logits, g, labels, glp, gent, entropy if with_ent else lse, cut.contiguous(),
        cut_index.contiguous(),
        inv_temperatures if inv_temperatures is not None else dummy,
        V, *idx, *gidx, float(inv_temperature), int(ignore_index),
        WITH_ENT=with_ent, HAS_TS=inv_temperatures is not None, BLOCK=_sampler_block(V),
    )  # fmt: skip
    if g is not grad_logits:
        grad_logits.copy_(g)
