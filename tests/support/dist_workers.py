"""Workers of tests/ops/test_distributed.py: `python tests/support/dist_workers.py CASE[,CASE...]
WORLD` starts WORLD processes on gloo (CPU) once; each runs the cases in turn, checking the
distributed op against the single-process op on the same seeded data; the script exits non-zero
if any rank failed (naming the case)."""

import importlib
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# run by path: the checkout (ppo_kernels) and tests/ (the support package) on the path
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)


def _fresh_vocab_layouts():
    """Forget the vocabulary layouts earlier cases of this process taught the vocab-parallel
    forms (derived starts, validated layouts): a case that counts gathers or expects an error for
    a new layout must not depend on which cases ran before it."""
    from ppo_kernels.distributed import vocab_layout

    vocab_layout.forget_layouts()


def _uneven_split(n, world, seed=1):
    """Contiguous, uneven, possibly empty slices of range(n)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
    bounds = [0] + cuts + [n]
    return [(bounds[i], bounds[i + 1]) for i in range(world)]


def case_vocab_parallel(rank, world):
    import ppo_kernels as pk
    from support.utils import GRAD_TOL, TOL, poisoned

    for dtype in (torch.float32, torch.bfloat16):
        for temperature, ignore in ((1.0, -100), (0.7, 3)):
            g = torch.Generator().manual_seed(7)
            N, V = 37, 53
            logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
            labels = torch.randint(0, V, (N,), generator=g)
            labels[::5] = ignore if ignore >= 0 else -100
            gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
            ig = ignore if ignore >= 0 else -100
            # the single-process op: the reference result
            full = logits.clone().requires_grad_()
            lp_w, ent_w = pk.token_logprobs(
                full, labels, temperature=temperature, ignore_index=ig, return_entropy=True
            )
            (lp_w * gl + ent_w * ge).sum().backward()
            v0, v1 = _uneven_split(V, world)[rank]
            if world == 3 and temperature != 1.0:  # an empty slice on rank 1
                v0, v1 = ((0, 20), (20, 20), (20, V))[rank]
            shard = logits[:, v0:v1].clone().requires_grad_()
            with poisoned():
                lp, ent = pk.token_logprobs(
                    shard,
                    labels,
                    temperature=temperature,
                    ignore_index=ig,
                    return_entropy=True,
                    process_group=dist.group.WORLD,
                    vocab_start=v0 if temperature != 1.0 else None,
                )
                (lp * gl + ent * ge).sum().backward()
            tol = TOL[dtype]
            torch.testing.assert_close(lp, lp_w, **tol)
            torch.testing.assert_close(ent, ent_w, **tol)
            torch.testing.assert_close(
                shard.grad.float(), full.grad[:, v0:v1].float(), **GRAD_TOL[dtype]
            )


def case_vocab_parallel_layouts(rank, world):
    """vocab_start derived (not given) across calls whose uneven layouts change so that some ranks
    keep their slice size and others do not: every rank settles the same way (no rank left in a
    collective the others skip), results match the unsharded op, and a layout seen before costs
    one collective."""
    import ppo_kernels as pk
    from ppo_kernels.distributed import _comm

    _fresh_vocab_layouts()
    g = torch.Generator().manual_seed(3)
    N = 11
    even = [5] * world
    layouts = [even, [5] * (world - 1) + [9], [9] + [5] * (world - 1), even, even]
    for i, sizes in enumerate(layouts):
        V = sum(sizes)
        logits = torch.randn(N, V, generator=g) * 2
        labels = torch.randint(0, V, (N,), generator=g)
        v0 = sum(sizes[:rank])
        shard = logits[:, v0 : v0 + sizes[rank]].contiguous()
        before = _comm.CALLS["all_gather"]
        lp, ent = pk.token_logprobs(
            shard, labels, return_entropy=True, process_group=dist.group.WORLD
        )
        gathers = _comm.CALLS["all_gather"] - before
        lp_w, ent_w = pk.token_logprobs(logits, labels, return_entropy=True)
        torch.testing.assert_close(lp, lp_w)
        torch.testing.assert_close(ent, ent_w)
        checks = 1 if _comm.cross_checks(shard) else 0  # the CPU's cross-rank size check
        if i in (0, 4):  # even shards (the first guess), then the layout of the call before
            assert gathers == 1 + checks, (i, gathers)
    # a vocab_start given on some ranks only must fit the rank-order layout
    shard = torch.randn(N, 5)
    bad = 3 if rank == 0 else None
    try:
        pk.token_logprobs(
            shard, torch.zeros(N, dtype=torch.long), process_group=dist.group.WORLD, vocab_start=bad
        )
    except ValueError as e:
        assert "vocab_start" in str(e), e
    else:
        raise AssertionError("a vocab_start off the rank-order layout was accepted")


def case_vocab_parallel_device_checks(rank, world):
    """The GPU's path (device_checks, forced on gloo): once a layout is validated on the host,
    later calls read nothing back (no host sync) and still match the unsharded op; a header that
    disagrees with the validated layout gives NaN rows on every rank instead of an error."""
    import ppo_kernels as pk
    from ppo_kernels.distributed import vocab_layout as vl

    _fresh_vocab_layouts()
    g = torch.Generator().manual_seed(4)
    sizes = [3 + 2 * r for r in range(world)]  # uneven
    V, N = sum(sizes), 9
    v0 = sum(sizes[:rank])
    reads = [0]
    read = vl.read_header

    def counting(gathered):
        reads[0] += 1
        return read(gathered)

    vl.read_header, vl.DEVICE_CHECKS_ON_CPU = counting, True
    try:
        for call in range(3):
            logits = torch.randn(N, V, generator=g) * 2
            labels = torch.randint(0, V, (N,), generator=g)
            shard = logits[:, v0 : v0 + sizes[rank]].clone().requires_grad_()
            before = reads[0]
            lp, ent = pk.token_logprobs(
                shard, labels, return_entropy=True, process_group=dist.group.WORLD
            )
            (lp.sum() + ent.sum()).backward()
            full = logits.clone().requires_grad_()
            lp_w, ent_w = pk.token_logprobs(full, labels, return_entropy=True)
            (lp_w.sum() + ent_w.sum()).backward()
            torch.testing.assert_close((lp, ent), (lp_w, ent_w))
            torch.testing.assert_close(shard.grad, full.grad[:, v0 : v0 + sizes[rank]])
            if call == 0:
                assert reads[0] - before == 2, reads  # the guess settled, then the layout checked
            else:
                assert reads[0] == before, reads  # nothing read back: no host sync on a GPU
        # a given start that disagrees with the validated layout: NaN rows, no error, no hang
        lp = pk.token_logprobs(
            shard.detach(), labels, process_group=dist.group.WORLD, vocab_start=v0 + (rank == 0)
        )
        assert lp.isnan().all(), lp
    finally:
        vl.read_header, vl.DEVICE_CHECKS_ON_CPU = read, False


def case_vocab_parallel_linear(rank, world):
    import ppo_kernels as pk
    from support.utils import GRAD_TOL, TOL

    # a partial (unreduced) hidden gradient is rounded to the input dtype per rank, so the bf16
    # case checks the reduced one
    for dtype, bias, partial in (
        (torch.float32, True, False),
        (torch.float32, False, True),
        (torch.bfloat16, True, False),
    ):
        g = torch.Generator().manual_seed(11)
        N, H, V = 29, 16, 61
        h = (torch.randn(N, H, generator=g)).to(dtype)
        w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
        b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
        labels = torch.randint(0, V, (N,), generator=g)
        labels[3] = -100
        gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
        hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
        bf = b.clone().requires_grad_() if bias else None
        lp_w, ent_w = pk.linear_token_logprobs(
            hf, wf, labels, bias=bf, temperature=0.8, return_entropy=True
        )
        (lp_w * gl + ent_w * ge).sum().backward()
        v0, v1 = _uneven_split(V, world, seed=2)[rank]
        hs, ws = h.clone().requires_grad_(), w[v0:v1].clone().requires_grad_()
        bs = b[v0:v1].clone().requires_grad_() if bias else None
        lp, ent = pk.linear_token_logprobs(
            hs,
            ws,
            labels,
            bias=bs,
            temperature=0.8,
            return_entropy=True,
            process_group=dist.group.WORLD,
            max_chunk_bytes=4096,
            reduce_hidden_grad=not partial,
        )
        (lp * gl + ent * ge).sum().backward()
        torch.testing.assert_close(lp, lp_w, **TOL[dtype])
        torch.testing.assert_close(ent, ent_w, **TOL[dtype])
        gt = GRAD_TOL[dtype]
        torch.testing.assert_close(ws.grad.float(), wf.grad[v0:v1].float(), **gt)
        if bias:
            torch.testing.assert_close(bs.grad.float(), bf.grad[v0:v1].float(), **gt)
        gh = hs.grad.float()
        if partial:  # each rank holds its slice's share; the sum is the gradient
            dist.all_reduce(gh)
        torch.testing.assert_close(gh, hf.grad.float(), **gt)


def case_vocab_parallel_full_kl(rank, world):
    import ppo_kernels as pk
    from support.utils import GRAD_TOL, TOL

    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(13)
        N, V = 19, 47
        z = (torch.randn(N, V, generator=g) * 2).to(dtype)
        w = (torch.randn(N, V, generator=g) * 2).to(dtype)
        mask = torch.rand(N, generator=g) > 0.2
        gk = torch.randn(N, generator=g)
        zf, wf = z.clone().requires_grad_(), w.clone().requires_grad_()
        kl_w = pk.full_kl(zf, wf, temperature=0.9, mask=mask)
        (kl_w * gk).sum().backward()
        v0, v1 = _uneven_split(V, world, seed=4)[rank]
        if world == 3:  # an empty slice on rank 1
            v0, v1 = ((0, 20), (20, 20), (20, V))[rank]
        zs, ws = z[:, v0:v1].clone().requires_grad_(), w[:, v0:v1].clone().requires_grad_()
        kl = pk.full_kl(zs, ws, temperature=0.9, mask=mask, process_group=dist.group.WORLD)
        (kl * gk).sum().backward()
        torch.testing.assert_close(kl, kl_w, **TOL[dtype])
        torch.testing.assert_close(zs.grad.float(), zf.grad[:, v0:v1].float(), **GRAD_TOL[dtype])
        torch.testing.assert_close(ws.grad.float(), wf.grad[:, v0:v1].float(), **GRAD_TOL[dtype])


def _policy_inputs(dtype, B=3, T=7, H=8, V=23, seed=31):
    g = torch.Generator().manual_seed(seed)
    d = dict(
        hidden=torch.randn(B, T, H, generator=g).to(dtype),
        weight=(torch.randn(V, H, generator=g) * 0.7).to(dtype),
        bias=(torch.randn(V, generator=g) * 0.2).to(dtype),
        labels=torch.randint(0, V, (B, T), generator=g),
        advantages=torch.randn(B, T, generator=g).to(dtype),
        old_logprobs=(-torch.rand(B, T, generator=g) * 4 - 0.5).to(dtype),
        mask=torch.rand(B, T, generator=g) > 0.2,
        ref_logprobs=(-torch.rand(B, T, generator=g) * 4 - 0.5).to(dtype),
        ref_hidden=torch.randn(B, T, H, generator=g).to(dtype),
        ref_weight=(torch.randn(V, H, generator=g) * 0.7).to(dtype),
    )
    d["labels"][0, 2] = d["labels"][2, 5] = -100  # ignore_index rows
    d["mask"][0, 2] = True  # an ignored token on the mask
    # old log-probs near the current ones: ratios inside and outside the clip range
    with torch.no_grad():
        lp = torch.log_softmax(d["hidden"].double() @ d["weight"].double().T, -1)
        cur = lp.gather(-1, d["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        d["old_logprobs"] = (cur + torch.randn(B, T, generator=g) * 0.3).to(dtype)
    return d


# (name, options): loss types, KL, entropy, temperature, softcap, the exact KL to a sharded
# reference head, batch / sequence statistics (a first pass), bypass mode
POLICY_CASES = [
    (
        "ppo",
        dict(
            loss_type="ppo",
            dual_clip=3.0,
            kl_coef=0.1,
            entropy_coef=0.01,
            temperature=0.8,
            max_chunk_bytes=None,
        ),
    ),
    ("grpo", dict(loss_type="grpo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.02)),
    (
        "dapo",
        dict(loss_type="dapo", clip_high=0.28, entropy_coef=0.01, temperature=1.3, z_loss=0.02),
    ),
    ("gspo", dict(loss_type="gspo", kl_coef=0.1, max_chunk_bytes=300, z_loss=0.05)),  # 2 passes
    ("cispo", dict(loss_type="cispo", entropy_coef=0.01, kl_coef=0.02)),
    (
        "softcap_ref_head",
        dict(loss_type="ppo", softcap=2.0, ref_head=True, kl_coef=0.2, z_loss=0.1),
    ),
    ("kl_cov", dict(loss_type="kl_cov", kl_cov_ratio=0.2, agg="seq-mean-token-mean")),
    ("bypass", dict(loss_type="ppo", bypass_mode=True, rollout_is="sequence", entropy_coef=0.01)),
]


def _policy_call(d, opts, weight, bias, ref_weight, hidden, **kw):
    import ppo_kernels as pk

    opts = dict(opts)
    kw.setdefault("max_chunk_bytes", opts.pop("max_chunk_bytes", 600))
    if opts.pop("ref_head", False):
        kw.update(ref_hidden=d["ref_hidden"], ref_weight=ref_weight)
    elif opts.get("kl_coef"):
        kw["ref_logprobs"] = d["ref_logprobs"]
    adv = d["advantages"]
    if opts.get("loss_type") == "grpo":
        adv = adv[:, 0]  # one per sequence
    return pk.linear_policy_loss(
        hidden, weight, d["labels"], adv, d["old_logprobs"], d["mask"], bias=bias, **opts, **kw
    )


def case_vocab_parallel_policy(rank, world):
    """linear_policy_loss(..., process_group=...) against the single-process op on the unsharded
    head: loss, every statistic, per-token outputs, and the hidden / weight / bias gradients
    (float32 within 1e-5, float64 1e-10), outputs NaN-poisoned; V = 23 is uneven over 2 and 3
    ranks, and world 3 has an empty slice in one case. Counts the collectives: one header
    gather, one gather per row block (per pass), one all-reduce."""
    from ppo_kernels.distributed import _comm
    from support.utils import poisoned

    _fresh_vocab_layouts()
    for dtype, names in ((torch.float32, None), (torch.float64, ("ppo", "gspo"))):
        d = _policy_inputs(dtype)
        V = d["weight"].shape[0]
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
        for i, (name, opts) in enumerate(POLICY_CASES):
            if names is not None and name not in names:
                continue
            v0, v1 = _uneven_split(V, world, seed=5 + i)[rank]
            if world == 3 and name == "dapo":
                v0, v1 = ((0, 11), (11, 11), (11, V))[rank]
            hf, wf, bf = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
            loss_w, st_w = _policy_call(d, opts, wf, bf, d["ref_weight"], hf)
            loss_w.backward()
            hs = d["hidden"].clone().requires_grad_()
            ws = d["weight"][v0:v1].clone().requires_grad_()
            bs = d["bias"][v0:v1].clone().requires_grad_()
            before = dict(_comm.CALLS)
            with poisoned():
                loss, st = _policy_call(
                    d, opts, ws, bs, d["ref_weight"][v0:v1], hs,
                    process_group=dist.group.WORLD, vocab_start=v0 if i % 2 else None,
                )  # fmt: skip
                loss.backward()
            gathers = _comm.CALLS["all_gather"] - before["all_gather"]
            reduces = _comm.CALLS["all_reduce"] - before["all_reduce"]
            msg = f"{name} {dtype} rank {rank}"
            torch.testing.assert_close(loss, loss_w, **tol, msg=msg)
            assert sorted(st) == sorted(st_w), (msg, sorted(st), sorted(st_w))
            for k in st_w:
                torch.testing.assert_close(st[k], st_w[k], **tol, msg=f"{msg}: {k}")
            torch.testing.assert_close(hs.grad, hf.grad, **tol, msg=msg)
            torch.testing.assert_close(ws.grad, wf.grad[v0:v1], **tol, msg=msg)
            torch.testing.assert_close(bs.grad, bf.grad[v0:v1], **tol, msg=msg)
            # one header gather, one gather per row block and pass, one all-reduce
            assert reduces == 1, (msg, reduces)
            if name == "ppo":  # the whole batch in one row block
                assert gathers == 2, (msg, gathers)
            elif name == "gspo":  # two passes over the same row blocks
                assert gathers > 3 and (gathers - 1) % 2 == 0, (msg, gathers)
        # the loss is identical on every rank
        got = [torch.zeros((), dtype=dtype) for _ in range(world)]
        dist.all_gather(got, loss.detach())
        assert all(bool(x == got[0]) for x in got), got


def case_vocab_parallel_policy_partial(rank, world):
    """reduce_hidden_grad=False leaves each rank's share of the hidden gradient (their sum is the
    gradient) and runs no all-reduce; a frozen head (no weight grad) and no grad at all."""
    from ppo_kernels.distributed import _comm

    d = _policy_inputs(torch.float32, seed=5)
    V = d["weight"].shape[0]
    opts = dict(loss_type="ppo", entropy_coef=0.01)
    v0, v1 = _uneven_split(V, world, seed=9)[rank]
    hf = d["hidden"].clone().requires_grad_()
    loss_w, _ = _policy_call(d, opts, d["weight"], d["bias"], None, hf)
    loss_w.backward()
    hs = d["hidden"].clone().requires_grad_()
    before = _comm.CALLS["all_reduce"]
    loss, _ = _policy_call(
        d, opts, d["weight"][v0:v1], d["bias"][v0:v1], None, hs,
        process_group=dist.group.WORLD, reduce_hidden_grad=False,
    )  # fmt: skip
    loss.backward()
    assert _comm.CALLS["all_reduce"] == before
    gh = hs.grad.clone()
    dist.all_reduce(gh)
    torch.testing.assert_close(gh, hf.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, loss_w, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss, st = _policy_call(
            d, opts, d["weight"][v0:v1], d["bias"][v0:v1], None, d["hidden"],
            process_group=dist.group.WORLD,
        )  # fmt: skip
    torch.testing.assert_close(loss, loss_w.detach(), atol=1e-5, rtol=1e-5)
    # bfloat16, float32 tiles and input-dtype tiles (the reference head and softcap too)
    from support.utils import GRAD_TOL

    d = _policy_inputs(torch.bfloat16, seed=8)
    for ldt in ("float32", "input"):
        opts = dict(loss_type="ppo", softcap=3.0, ref_head=True, kl_coef=0.1, entropy_coef=0.01)
        hf, wf, bf = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss_w, st_w = _policy_call(d, opts, wf, bf, d["ref_weight"], hf, logits_dtype=ldt)
        loss_w.backward()
        hs = d["hidden"].clone().requires_grad_()
        ws = d["weight"][v0:v1].clone().requires_grad_()
        bs = d["bias"][v0:v1].clone().requires_grad_()
        loss, st = _policy_call(
            d, opts, ws, bs, d["ref_weight"][v0:v1], hs, logits_dtype=ldt,
            process_group=dist.group.WORLD,
        )  # fmt: skip
        loss.backward()
        torch.testing.assert_close(loss, loss_w, atol=1e-4, rtol=1e-4)
        for k in ("logprobs", "entropy", "kl"):
            torch.testing.assert_close(st[k], st_w[k], atol=1e-4, rtol=1e-4)
        gt = GRAD_TOL[torch.bfloat16]
        gth = gt
        if ldt == "input":  # each rank's product g @ W_slice is rounded to bf16 before the sum
            gth = dict(gt, atol=float(hf.grad.abs().max()) * 2**-8)
        torch.testing.assert_close(hs.grad.float(), hf.grad.float(), **gth)
        torch.testing.assert_close(ws.grad.float(), wf.grad[v0:v1].float(), **gt)
        torch.testing.assert_close(bs.grad.float(), bf.grad[v0:v1].float(), **gt)


def case_vocab_parallel_policy_errors(rank, world):
    """Bad inputs raise a clear error naming the argument on every rank (no hang, no silent
    answer); the group stays usable."""
    import pytest

    d = _policy_inputs(torch.float32, seed=6)
    V = d["weight"].shape[0]
    grp = dist.group.WORLD
    opts = dict(loss_type="ppo")
    v0, v1 = _uneven_split(V, world, seed=3)[rank]
    w, b = d["weight"][v0:v1], d["bias"][v0:v1]
    with pytest.raises(ValueError, match="vocab_start: the ranks' vocabulary slices"):
        _policy_call(d, opts, w, b, None, d["hidden"], process_group=grp, vocab_start=0)
    with pytest.raises(ValueError, match="bias"):
        _policy_call(d, opts, w, d["bias"][: v1 - v0 + 1], None, d["hidden"], process_group=grp)
    with pytest.raises(ValueError, match="weight"):
        _policy_call(d, opts, w[:, :-1], b, None, d["hidden"], process_group=grp)
    with pytest.raises(ValueError, match="ref_weight"):
        bad = dict(opts, ref_head=True, kl_coef=0.1)
        _policy_call(d, bad, w, b, d["ref_weight"][: v1 - v0 + 1], d["hidden"], process_group=grp)
    with pytest.raises(ValueError, match="ref_logprobs: give either"):
        bad = dict(opts, ref_head=True, kl_coef=0.1)
        _policy_call(
            d, bad, w, b, d["ref_weight"][v0:v1], d["hidden"], process_group=grp,
            ref_logprobs=d["ref_logprobs"],
        )  # fmt: skip
    labels = d["labels"].clone()
    labels[1, 1] = V  # out of range of the whole vocabulary
    with pytest.raises(IndexError, match="labels"):
        _policy_call(dict(d, labels=labels), opts, w, b, None, d["hidden"], process_group=grp)
    # shapes that differ across the ranks: the header gather catches them on every rank
    dd = d if rank else {k: (t[:, :-1] if t.dim() >= 2 and k != "weight" and k != "ref_weight"
                             else t) for k, t in d.items()}  # fmt: skip
    with pytest.raises(ValueError, match="rows: the ranks"):
        _policy_call(dd, opts, w, b, None, dd["hidden"], process_group=grp)
    loss, _ = _policy_call(d, opts, w, b, None, d["hidden"], process_group=grp)
    assert torch.isfinite(loss)


def case_sequence_parallel_gae(rank, world):
    import ppo_kernels as pk
    from support.utils import poisoned

    g = torch.Generator().manual_seed(3)
    B, T = 5, 41
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    dones = torch.rand(B, T, generator=g) > 0.9
    gamma = 0.9 + 0.1 * torch.rand(B, T, generator=g)
    boot = torch.randn(B, generator=g)
    splits = _uneven_split(T, world, seed=world)
    t0, t1 = splits[rank]
    # (the same data on every rank) a rank whose slice is all mask = 0, a done at a slice border
    if world > 2:
        mask[:, splits[1][0] : splits[1][1]] = False
    if splits[-1][0] > 0:
        dones[:, splits[-1][0] - 1] = True
    for kw in (
        dict(gamma=0.99, lam=0.95),
        dict(gamma=gamma, lam=0.9, dones=dones, bootstrap_value=boot),
    ):
        adv_w, ret_w = pk.gae(r, v, mask, **kw)
        kws = {
            k: (x[:, t0:t1] if isinstance(x, torch.Tensor) and x.dim() == 2 else x)
            for k, x in kw.items()
        }
        with poisoned():
            adv, ret = pk.gae(
                r[:, t0:t1], v[:, t0:t1], mask[:, t0:t1], process_group=dist.group.WORLD, **kws
            )
        torch.testing.assert_close(adv, adv_w[:, t0:t1], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ret, ret_w[:, t0:t1], atol=2e-5, rtol=2e-5)


def case_sequence_parallel_gae_packed(rank, world):
    """Packed rows split contiguously over the ranks: rows spanning ranks, a rank inside one row,
    row boundaries on rank borders, an empty row, an empty rank, a rank with no action."""
    import ppo_kernels as pk
    from support.utils import poisoned

    g = torch.Generator().manual_seed(17)
    lens = [5, 0, 3, 40, 2, 1, 7, 9]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    N, n = int(cu[-1]), len(lens)
    r, v = torch.randn(N, generator=g), torch.randn(N, generator=g)
    mask = torch.rand(N, generator=g) > 0.3
    dones = torch.rand(N, generator=g) > 0.9
    gamma = 0.9 + 0.1 * torch.rand(N, generator=g)
    boot = torch.randn(n, generator=g)
    # borders: 8 and 48 are row boundaries; rows 3 ([8, 48)) spans several ranks
    splits = {
        2: ([0, 8, N], [0, 20, N]),
        3: ([0, 10, 45, N], [0, 5, 5, N]),
        4: ([0, 8, 30, 48, N], [0, 20, 30, 31, N]),
    }[world] + ([b for b, _ in _uneven_split(N, world, seed=world)] + [N],)
    for cuts in splits:
        t0, t1 = cuts[rank], cuts[rank + 1]
        m = mask.clone()
        if world > 2:
            m[cuts[1] : cuts[2]] = False  # a rank with no action (inside row 3 for the first cuts)
        for kw in (
            dict(gamma=0.99, lam=0.95),
            dict(gamma=gamma, lam=0.9, dones=dones, bootstrap_value=boot),
            dict(gamma=0.97, lam=1.0, carry=(boot, boot.flip(0))),
        ):
            adv_w, ret_w = pk.gae(r, v, m, cu_seqlens=cu, **kw)
            kws = {
                k: (x[t0:t1] if isinstance(x, torch.Tensor) and x.numel() == N else x)
                for k, x in kw.items()
            }
            with poisoned():
                adv, ret = pk.gae(
                    r[t0:t1],
                    v[t0:t1],
                    m[t0:t1],
                    cu_seqlens=cu - t0,
                    process_group=dist.group.WORLD,
                    **kws,
                )
            msg = f"cuts {cuts}, {sorted(kw)}"
            torch.testing.assert_close(adv, adv_w[t0:t1], atol=2e-5, rtol=2e-5, msg=msg)
            torch.testing.assert_close(ret, ret_w[t0:t1], atol=2e-5, rtol=2e-5, msg=msg)


def case_cross_rank_checks(rank, world):
    """Shapes that differ across the ranks raise a ValueError naming the argument on every rank
    (instead of a mismatched all-gather: gloo aborts, NCCL garbles); the group stays usable."""
    import pytest

    import ppo_kernels as pk

    grp = dist.group.WORLD
    B = 3 + (rank == world - 1)  # the last rank has one more row
    with pytest.raises(ValueError, match="rewards: the ranks"):
        pk.gae(torch.randn(B, 4), torch.randn(B, 4), process_group=grp)
    with pytest.raises(ValueError, match="labels: the ranks"):
        pk.token_logprobs(
            torch.randn(B, 5), torch.zeros(B, dtype=torch.long), process_group=grp, vocab_start=0
        )
    with pytest.raises(ValueError, match="scores: the ranks"):
        pk.grpo_advantages(torch.randn(B), group_size=1, process_group=grp)
    cu = torch.tensor([0, 2, 4] + [4] * (rank == 0), dtype=torch.int32) - 2 * rank
    with pytest.raises(ValueError, match="cu_seqlens: the ranks hold different numbers of rows"):
        pk.gae(torch.randn(2), torch.randn(2), cu_seqlens=cu, process_group=grp)
    cu = torch.tensor([0, 3, 2, 2 * world], dtype=torch.int32) - 2 * rank  # decreasing
    with pytest.raises(ValueError, match=r"cu_seqlens: on rank\(s\) \[0"):
        pk.gae(torch.randn(2), torch.randn(2), cu_seqlens=cu, process_group=grp)
    adv, _ = pk.gae(torch.ones(2), torch.zeros(2), cu_seqlens=cu.sort().values, process_group=grp)
    assert adv.shape == (2,)


def case_compile(rank, world):
    """torch.compile (aot_eager, fullgraph=True) of the distributed forms equals eager: sequence-
    parallel gae (dense and packed), data-parallel masked_whiten / masked_mean, and the vocab-
    parallel token_logprobs / linear_token_logprobs / full_kl forward and both outputs' (every
    input's) gradients -- their all-gathers are functional collectives and their per-slice work
    registered ops, all traced into the graph. Under compile a vocab_start that is not given is
    not settled by a second gather: right for even shards, a clear error for a new uneven
    layout."""
    import pytest

    import ppo_kernels as pk

    torch._dynamo.reset()
    _fresh_vocab_layouts()
    grp = dist.group.WORLD
    g = torch.Generator().manual_seed(23)
    r, v = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    m = torch.rand(2, 6, generator=g) > 0.3
    cu = torch.tensor([0, 4, 4, 9, 6 * world], dtype=torch.int32) - 6 * rank

    def sp(r, v, m, rf, vf, mf, cu):
        dense = pk.gae(r, v, m, gamma=0.9, lam=0.8, process_group=grp)
        packed = pk.gae(rf, vf, mf, gamma=0.9, lam=0.8, cu_seqlens=cu, process_group=grp)
        return dense + packed

    def dp(x, m):
        return pk.masked_whiten(x, m, process_group=grp), pk.masked_mean(x, m, process_group=grp)

    for fn, args in ((sp, (r, v, m, r[0], v[0], m[0], cu)), (dp, (r, m))):
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        torch.testing.assert_close(got, fn(*args), atol=1e-6, rtol=1e-6)

    # vocab parallel: uneven slices (vocab_start given), and even ones (derived)
    N, H = 5, 3
    sizes = [3 + 2 * q for q in range(world)]
    V, v0 = sum(sizes), sum(sizes[:rank])
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    mine = slice(v0, v0 + sizes[rank])  # the same data on every rank, then this rank's slice
    z, zr = torch.randn(N, V, generator=g)[:, mine], torch.randn(N, V, generator=g)[:, mine]
    h = torch.randn(N, H, generator=g)
    w, b = torch.randn(V, H, generator=g)[mine], torch.randn(V, generator=g)[mine]
    mask = torch.rand(N, generator=g) > 0.3
    even = torch.randn(N, 4 * world, generator=g)[:, 4 * rank : 4 * rank + 4]
    labels_even = torch.randint(0, 4 * world, (N,), generator=g)

    def vp(z, zr, h, w, b, even):
        lp, ent = pk.token_logprobs(
            z, labels, temperature=0.8, return_entropy=True, process_group=grp, vocab_start=v0
        )
        lp2, ent2 = pk.linear_token_logprobs(
            h, w, labels, bias=b, return_entropy=True, process_group=grp, vocab_start=v0
        )
        kl = pk.full_kl(z, zr, temperature=0.9, mask=mask, process_group=grp)
        lp3 = pk.token_logprobs(even, labels_even, process_group=grp)  # vocab_start derived
        return lp * 2 + ent + lp2 - ent2 * 0.5 + kl * 3 + lp3

    inputs = [t.clone().requires_grad_() for t in (z, zr, h, w, b, even)]
    got, want = [], []
    for fn, out in ((torch.compile(vp, fullgraph=True, backend="aot_eager"), got), (vp, want)):
        y = fn(*inputs)
        out += [y, *torch.autograd.grad(y.sum(), inputs)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

    # a new uneven layout without vocab_start: a clear error on every rank (no second gather)
    def derived(z):
        return pk.token_logprobs(z, labels, process_group=grp)

    with pytest.raises(ValueError, match="vocab_start: the derived slice starts"):
        torch.compile(derived, fullgraph=True, backend="aot_eager")(z)


def case_data_parallel_whiten(rank, world):
    import ppo_kernels as pk

    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3 + r, 17, generator=g) * 1e3 + 5e3 for r in range(world)]
    ms = [torch.rand(3 + r, 17, generator=g) > 0.4 for r in range(world)]
    if world > 2:
        ms[-1][:] = False  # a rank with no unmasked position
    cat_x = torch.cat([x.reshape(-1) for x in xs])
    cat_m = torch.cat([m.reshape(-1) for m in ms])
    want = pk.masked_whiten(cat_x, cat_m)
    got = pk.masked_whiten(xs[rank], ms[rank], process_group=dist.group.WORLD)
    off = sum(x.numel() for x in xs[:rank])
    torch.testing.assert_close(
        got.reshape(-1), want[off : off + xs[rank].numel()], atol=1e-5, rtol=1e-5
    )
    mean = pk.masked_mean(xs[rank], ms[rank], process_group=dist.group.WORLD)
    torch.testing.assert_close(mean, pk.masked_mean(cat_x, cat_m), atol=1e-3, rtol=1e-6)
    # float masks weight positions (the peers' x * mask sums), across ranks too
    ws = [torch.rand(m.shape, generator=g) * m for m in ms]
    cat_w = torch.cat([w.reshape(-1) for w in ws])
    got = pk.masked_whiten(xs[rank], ws[rank], process_group=dist.group.WORLD)
    torch.testing.assert_close(
        got.reshape(-1),
        pk.masked_whiten(cat_x, cat_w)[off : off + xs[rank].numel()],
        atol=1e-5,
        rtol=1e-5,
    )
    mean = pk.masked_mean(xs[rank], ws[rank], process_group=dist.group.WORLD)
    torch.testing.assert_close(mean, pk.masked_mean(cat_x, cat_w), atol=1e-3, rtol=1e-6)
    # finite inputs of any spread: per-rank scales differ by powers of two, nothing overflows
    big = [x / 5e3 * (1e38 if r == 0 else 1e20) for r, x in enumerate(xs)]
    cat_b = torch.cat([b.reshape(-1) for b in big])
    got = pk.masked_whiten(big[rank], ms[rank], process_group=dist.group.WORLD)
    want = pk.masked_whiten(cat_b, cat_m)[off : off + xs[rank].numel()]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.reshape(-1), want, atol=1e-5, rtol=1e-4)


def case_data_parallel_grpo(rank, world):
    import ppo_kernels as pk

    g = torch.Generator().manual_seed(9)
    B = 6
    scores = torch.randn(world * B, generator=g)
    ids = torch.randint(0, world * 2, (world * B,), generator=g)  # groups spanning ranks
    mask = torch.rand(world * B, 4, generator=g) > 0.3
    mine = slice(rank * B, (rank + 1) * B)
    for kw in (dict(group_index=ids), dict(group_size=3), dict(group_size=world * B)):
        want = pk.grpo_advantages(scores, mask=mask, **kw)
        got = pk.grpo_advantages(
            scores[mine],
            mask=mask[mine],
            process_group=dist.group.WORLD,
            **{k: (v[mine] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
        )
        torch.testing.assert_close(got, want[mine])
        want = pk.rloo_advantages(scores, **kw)
        got = pk.rloo_advantages(
            scores[mine],
            process_group=dist.group.WORLD,
            **{k: (v[mine] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
        )
        torch.testing.assert_close(got, want[mine])


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}


def _worker(rank, world, case, init_file, errors, module=None):
    """Runs the cases, then leaves with os._exit: tearing the gloo process group down (or letting
    the interpreter's exit do it) while a peer is still closing its connections can abort the
    process from a gloo thread ("terminate called without an active exception"), which would
    fail a run whose checks all passed. The exit code carries the verdict. module: the module
    (under tests/) whose CASES to run (None: this one's)."""
    c = None
    code = 0
    try:
        cases = CASES if module is None else importlib.import_module(module).CASES
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        for c in case.split(","):
            torch.manual_seed(0)
            cases[c](rank, world)
            dist.barrier()
        dist.barrier()  # every rank is done with every collective before anyone leaves
    except Exception:
        errors.put(f"rank {rank}, case {c}: {traceback.format_exc()}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(script, cases, world):
    """Runs `python tests/support/SCRIPT CASES WORLD` in a child process (a test's body): the
    cases pass on every rank, or the assertion shows the output of the ranks that failed."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    r = subprocess.run(
        [sys.executable, os.path.join(TESTS, "support", script), cases, str(world)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def main(module=None):
    """Runs the cases named by argv[1] (comma-separated) on argv[2] gloo processes; module: the
    module (under tests/) that holds them (None: this one)."""
    case, world = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    # Forked workers inherit this process's imports (torch, ppo_kernels, the cases) where spawned
    # ones would import them again, seconds each. Nothing here holds what a fork breaks: no
    # parallel region has run, no process group or thread pool exists yet.
    importlib.import_module("ppo_kernels")
    if module is not None:
        importlib.import_module(module)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context(method)
        errors = ctx.SimpleQueue()
        try:
            mp.start_processes(
                _worker,
                args=(world, case, os.path.join(d, "init"), errors, module),
                nprocs=world,
                start_method=method,
            )
        except Exception as e:
            while not errors.empty():
                print(errors.get(), file=sys.stderr)
            print(f"FAILED: {e}", file=sys.stderr)
            sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
