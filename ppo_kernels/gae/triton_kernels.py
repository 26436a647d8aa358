"""Triton kernels for gae: the flat token sequence is cut into chunks, one program per chunk; a
program walks its chunk right to left in blocks of BLOCK tokens, loading each block at reversed
offsets so that a *forward* tl.associative_scan over the (p, q, m, cv, ca) maps of
csrc/common/gae_combine.h runs right to left in time. Row edges are constant maps that inject the
row's carry (bootstrap value / carry), so a chunk may span several rows.

  aligned (dense rows, every chunk's right edge is a row's end): one pass;
  otherwise: (1) each chunk's composed map, (2) one program scans the chunk maps right to left into
  the carry entering each chunk, (3) each chunk reruns from its carry and writes the outputs.
No host synchronisation: packed rows find their row with a binary search in cu_seqlens."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._backend import new_output, triton_interpreting

# Tests shrink these to exercise many blocks and chunks through the interpreter.
CONFIG = dict(block=None, chunk=None, programs=None)


@triton.jit
def _compose(p1, q1, m1, cv1, ca1, p2, q2, m2, cv2, ca2):
    # map 1 (the positions to the right, earlier in the scan) first, then map 2
    return p2 * p1, q2 * p1 + m2 * q1, m2 * m1, p2 * cv1 + cv2, q2 * cv1 + m2 * ca1 + ca2


@triton.jit
def _lane(x, sel):
    return tl.sum(tl.where(sel, x, 0.0), 0)


@triton.jit
def _chunk_kernel(
    R,
    V,
    M,
    D,
    G,
    L,
    IV,
    IA,
    CU,
    ADV,
    RET,
    CV,
    CA,
    MAPS,
    CARRY,
    N,
    CHUNK,
    row_len,
    n_rows,
    search_iters,
    gamma,
    lam,
    HAS_MASK: tl.constexpr,
    HAS_DONES: tl.constexpr,
    TOKEN_GL: tl.constexpr,
    HAS_IV: tl.constexpr,
    HAS_IA: tl.constexpr,
    PACKED: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # MODE 0: aligned single pass; 1: the chunk's composed map only; 2: final pass from CARRY.
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * CHUNK
    hi = tl.minimum(lo + CHUNK, N)
    j = tl.arange(0, BLOCK)
    last = j == BLOCK - 1
    if MODE == 2:
        s_nv = tl.load(CARRY + 2 * pid)
        s_a = tl.load(CARRY + 2 * pid + 1)
    else:
        s_nv = 0.0
        s_a = 0.0
    # the running composition of the blocks processed so far (MODE 1)
    t_p = 1.0
    t_q = 0.0
    t_m = 1.0
    t_cv = 0.0
    t_ca = 0.0
    n_blocks = tl.cdiv(hi - lo, BLOCK)
    for b in range(0, n_blocks):
        offs = hi - 1 - b * BLOCK - j
        valid = offs >= lo
        offs = tl.where(valid, offs, lo)  # never an out-of-range address
        r = tl.load(R + offs, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(V + offs, mask=valid, other=0.0).to(tl.float32)
        if HAS_MASK:
            act = (tl.load(M + offs, mask=valid, other=0) != 0) & valid
        else:
            act = valid
        if HAS_DONES:
            k = tl.where(tl.load(D + offs, mask=valid, other=0) != 0, 0.0, 1.0)
        else:
            k = tl.full([BLOCK], 1.0, tl.float32)
        if TOKEN_GL:
            g = tl.load(G + offs, mask=valid, other=0.0)
            gl = g * tl.load(L + offs, mask=valid, other=0.0)
        else:
            g = gamma
            gl = gamma * lam
        p = tl.where(act, 0.0, k)
        q = tl.where(act, g * k, 0.0)
        m = tl.where(act, gl * k, k)
        cv = tl.where(act, v, 0.0)
        ca = tl.where(act, r - v, 0.0)
        # Which row each position is in, and the row's edges.
        if PACKED:
            rlo = tl.zeros([BLOCK], tl.int32)
            rhi = tl.full([BLOCK], 0, tl.int32) + (n_rows - 1)
            for _ in range(0, search_iters):  # largest row with cu[row] <= offs
                mid = (rlo + rhi + 1) // 2
                go = tl.load(CU + mid).to(tl.int64) <= offs
                rlo = tl.where(go, mid, rlo)
                rhi = tl.where(go, rhi, mid - 1)
            row = rlo.to(tl.int64)
            is_end = valid & (offs == tl.load(CU + row + 1).to(tl.int64) - 1)
            is_start = valid & (offs == tl.load(CU + row).to(tl.int64))
        else:
            row = offs // row_len
            is_end = valid & ((offs + 1) % row_len == 0)
            is_start = valid & (offs % row_len == 0)
        # A row's last position first takes the row's carry: compose with a constant map.
        if HAS_IV:
            iv = tl.load(IV + row, mask=is_end, other=0.0)
        else:
            iv = tl.zeros([BLOCK], tl.float32)
        if HAS_IA:
            ia = tl.load(IA + row, mask=is_end, other=0.0)
        else:
            ia = tl.zeros([BLOCK], tl.float32)
        cv = tl.where(is_end, p * iv + cv, cv)
        ca = tl.where(is_end, q * iv + m * ia + ca, ca)
        p = tl.where(is_end, 0.0, p)
        q = tl.where(is_end, 0.0, q)
        m = tl.where(is_end, 0.0, m)
        P, Q, Mm, CV_, CA_ = tl.associative_scan((p, q, m, cv, ca), 0, _compose)
        if MODE == 1:
            b_p = _lane(P, last)
            b_q = _lane(Q, last)
            b_m = _lane(Mm, last)
            b_cv = _lane(CV_, last)
            b_ca = _lane(CA_, last)
            t_p, t_q, t_m, t_cv, t_ca = _compose(
                t_p, t_q, t_m, t_cv, t_ca, b_p, b_q, b_m, b_cv, b_ca
            )
        else:
            nv_j = P * s_nv + CV_
            a_j = Q * s_nv + Mm * s_a + CA_
            tl.store(ADV + offs, a_j, mask=valid)
            tl.store(RET + offs, a_j + v, mask=valid)
            tl.store(CV + row, nv_j, mask=is_start)
            tl.store(CA + row, a_j, mask=is_start)
            s_nv = _lane(nv_j, last)
            s_a = _lane(a_j, last)
    if MODE == 1:
        tl.store(MAPS + 5 * pid + 0, t_p)
        tl.store(MAPS + 5 * pid + 1, t_q)
        tl.store(MAPS + 5 * pid + 2, t_m)
        tl.store(MAPS + 5 * pid + 3, t_cv)
        tl.store(MAPS + 5 * pid + 4, t_ca)


@triton.jit
def _carry_kernel(MAPS, CARRY, NC, CB: tl.constexpr):
    # One program: the carry entering each chunk, scanning the chunk maps right to left.
    j = tl.arange(0, CB)
    last = j == CB - 1
    s_nv = 0.0
    s_a = 0.0
    tl.store(CARRY + 2 * (NC - 1), 0.0)  # the last chunk ends at a row end: its carry is unused
    tl.store(CARRY + 2 * (NC - 1) + 1, 0.0)
    for b in range(0, tl.cdiv(NC, CB)):
        idx = NC - 1 - b * CB - j
        valid = idx >= 0
        idx = tl.where(valid, idx, 0).to(tl.int64)
        p = tl.load(MAPS + 5 * idx + 0, mask=valid, other=1.0)
        q = tl.load(MAPS + 5 * idx + 1, mask=valid, other=0.0)
        m = tl.load(MAPS + 5 * idx + 2, mask=valid, other=1.0)
        cv = tl.load(MAPS + 5 * idx + 3, mask=valid, other=0.0)
        ca = tl.load(MAPS + 5 * idx + 4, mask=valid, other=0.0)
        P, Q, Mm, CV_, CA_ = tl.associative_scan((p, q, m, cv, ca), 0, _compose)
        nv_j = P * s_nv + CV_
        a_j = Q * s_nv + Mm * s_a + CA_
        # the state left of chunk idx is the carry entering chunk idx - 1
        ok = valid & (idx >= 1)
        tl.store(CARRY + 2 * (idx - 1), nv_j, mask=ok)
        tl.store(CARRY + 2 * (idx - 1) + 1, a_j, mask=ok)
        s_nv = _lane(nv_j, last)
        s_a = _lane(a_j, last)


_SMS: dict = {}


def _programs_target(device):
    if CONFIG["programs"] is not None:
        return CONFIG["programs"]
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return 4 * _SMS[i]


def gae(
    rewards,
    values,
    mask,
    dones,
    gamma_t,
    lam_t,
    gamma,
    lam,
    init_value,
    init_adv,
    cu_seqlens,
    n_rows,
    row_len,
):
    """Flat inputs as for ppo_kernels_C::gae_fwd; returns (adv, returns, carry_value, carry_adv)."""
    dev = rewards.device
    N = rewards.numel()
    f32 = dict(dtype=torch.float32, device=dev)
    adv = new_output((N,), **f32)
    ret = new_output((N,), **f32)
    packed = cu_seqlens is not None
    if packed:
        # Empty rows are never visited: they keep the carry they came with.
        cv = init_value.clone() if init_value is not None else torch.zeros(n_rows, **f32)
        ca = init_adv.clone() if init_adv is not None else torch.zeros(n_rows, **f32)
    else:
        cv = new_output((n_rows,), **f32)
        ca = new_output((n_rows,), **f32)
    if N == 0:
        if not packed:
            cv.copy_(init_value if init_value is not None else torch.zeros_like(cv))
            ca.copy_(init_adv if init_adv is not None else torch.zeros_like(ca))
        return adv, ret, cv, ca
    interp = triton_interpreting()
    block = CONFIG["block"] or (16 if interp else 2048)
    warps = 8 if block >= 2048 else 4
    target = _programs_target(dev)
    chunk = CONFIG["chunk"]
    aligned = False
    if not packed and chunk is None:
        rows_per = max(1, block // row_len)
        if math.ceil(n_rows / rows_per) >= max(1, target // 2):
            chunk, aligned = rows_per * row_len, True
    elif not packed:
        aligned = chunk % row_len == 0
    if chunk is None:
        chunk = max(block, triton.cdiv(triton.cdiv(N, target), block) * block)
    nc = triton.cdiv(N, chunk)
    dummy = adv
    u8 = lambda t: None if t is None else (t.view(torch.uint8) if t.dtype == torch.bool else t)  # noqa: E731
    m8, d8 = u8(mask), u8(dones)
    search_iters = max(1, math.ceil(math.log2(max(n_rows, 1))) + 1) if packed else 0
    args = (
        rewards,
        values,
        m8 if m8 is not None else dummy,
        d8 if d8 is not None else dummy,
        gamma_t if gamma_t is not None else dummy,
        lam_t if lam_t is not None else dummy,
        init_value if init_value is not None else dummy,
        init_adv if init_adv is not None else dummy,
        cu_seqlens if packed else dummy,
        adv,
        ret,
        cv,
        ca,
    )
    flags = dict(
        HAS_MASK=mask is not None,
        HAS_DONES=dones is not None,
        TOKEN_GL=gamma_t is not None,
        HAS_IV=init_value is not None,
        HAS_IA=init_adv is not None,
        PACKED=packed,
        BLOCK=block,
        num_warps=warps,
    )
    scalars = (N, chunk, max(row_len, 1), n_rows, search_iters, float(gamma), float(lam))
    if aligned:
        _chunk_kernel[(nc,)](*args, dummy, dummy, *scalars, MODE=0, **flags)
        return adv, ret, cv, ca
    maps = torch.empty(nc * 5, **f32)
    carry = torch.empty(nc * 2, **f32)
    _chunk_kernel[(nc,)](*args, maps, carry, *scalars, MODE=1, **flags)
    cb = 16 if interp else 1024
    _carry_kernel[(1,)](maps, carry, nc, CB=cb, num_warps=4)
    _chunk_kernel[(nc,)](*args, maps, carry, *scalars, MODE=2, **flags)
    return adv, ret, cv, ca
