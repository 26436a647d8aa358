"""Workers of tests/ops/test_distributed_sampler.py: `python tests/support/dist_sampler_workers.py
CASE[,CASE...] WORLD` spawns WORLD gloo processes (support/dist_workers.py's runner); each case
checks a vocab-parallel form with the rollout sampler's options (per-row temperatures, top-k,
top-p, min-p, both samplers) against the single-process op on the gathered logits, outputs
NaN-poisoned, uneven (and empty) slices."""

import os
import sys

import torch
import torch.distributed as dist

# run by path: the checkout (ppo_kernels) and tests/ (the support package) on the path
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

from support.dist_workers import _uneven_split, main  # noqa: E402


def _slices(V, world, seed):
    """Uneven contiguous slices; with 3 ranks the middle one empty on odd seeds."""
    if world == 3 and seed % 2:
        return [(0, V // 2), (V // 2, V // 2), (V // 2, V)]
    return _uneven_split(V, world, seed)


def _raises_everywhere(name, fn):
    """fn raises a ValueError naming `name` (on this rank: every rank runs it)."""
    try:
        fn()
    except ValueError as e:
        assert str(e).startswith(f"{name}:") or f"{name}:" in str(e), e
    else:
        raise AssertionError(f"no ValueError naming {name}")


def case_temperature_logits(rank, world):
    """token_logprobs and full_kl with per-row / per-token temperature tensors: values, entropy,
    gradients (none to the temperatures), bf16; bad temperature tensors raise on every rank."""
    import ppo_kernels as pk
    from support.utils import GRAD_TOL, TOL, poisoned

    grp = dist.group.WORLD
    B, T, V = 4, 5, 29
    for dtype, per_token, seed in ((torch.float32, False, 1), (torch.bfloat16, True, 2)):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
        ref = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
        labels = torch.randint(0, V, (B, T), generator=g)
        labels[0, 1] = -100
        temps = torch.rand((B, T) if per_token else (B,), generator=g) * 1.5 + 0.3
        gl, ge, gk = (torch.randn(B, T, generator=g) for _ in range(3))
        full = logits.clone().requires_grad_()
        fref = ref.clone().requires_grad_()
        tw = temps.clone().requires_grad_()
        lp_w, ent_w = pk.token_logprobs(full, labels, temperature=tw, return_entropy=True)
        kl_w = pk.full_kl(full, fref, temperature=temps)
        (lp_w * gl + ent_w * ge + kl_w * gk).sum().backward()
        assert tw.grad is None or not tw.grad.any()
        v0, v1 = _slices(V, world, seed)[rank]
        shard = logits[..., v0:v1].clone().requires_grad_()
        rshard = ref[..., v0:v1].clone().requires_grad_()
        ts = temps.clone().requires_grad_()
        with poisoned():
            lp, ent = pk.token_logprobs(
                shard, labels, temperature=ts, return_entropy=True, process_group=grp
            )
            kl = pk.full_kl(shard, rshard, temperature=temps, process_group=grp)
            (lp * gl + ent * ge + kl * gk).sum().backward()
        assert ts.grad is None or not ts.grad.any()
        tol = TOL[dtype]
        torch.testing.assert_close(lp, lp_w, **tol)
        torch.testing.assert_close(ent, ent_w, **tol)
        torch.testing.assert_close(kl, kl_w, **tol)
        gt = GRAD_TOL[dtype]
        torch.testing.assert_close(shard.grad.float(), full.grad[..., v0:v1].float(), **gt)
        torch.testing.assert_close(rshard.grad.float(), fref.grad[..., v0:v1].float(), **gt)
    x = torch.randn(2, 3, 4)
    y = torch.zeros(2, 3, dtype=torch.long)
    for bad in (torch.ones(3), torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")])):
        _raises_everywhere(
            "temperature", lambda: pk.token_logprobs(x, y, temperature=bad, process_group=grp)
        )
        _raises_everywhere(
            "temperature", lambda: pk.full_kl(x, x, temperature=bad, process_group=grp)
        )


def _compare(msg, got, want, tol):
    """The outputs of a fused loss (loss, stats dict) against the single-process op's."""
    (loss, st), (loss_w, st_w) = got, want
    torch.testing.assert_close(loss, loss_w, **tol, msg=msg)
    assert sorted(st) == sorted(st_w), (msg, sorted(st), sorted(st_w))
    for k in st_w:
        torch.testing.assert_close(st[k], st_w[k], **tol, msg=f"{msg}: {k}")


def case_temperature_linear(rank, world):
    """linear_token_logprobs, linear_policy_loss and linear_preference_loss with per-row and
    per-token temperature tensors (float32 and float64): log-probs, entropy, loss, every statistic
    (num_outside 0, the outside flags), the hidden / weight / bias gradients; a first pass (gspo's
    sequences longer than a block), the preference loss's pairs walked side by side and its
    reference head sharded; a temperature tensor of the wrong shape raises on every rank."""
    import ppo_kernels as pk
    from support import dist_preference_workers as pw
    from support import dist_workers as dw
    from support.utils import poisoned

    grp = dist.group.WORLD
    for dtype in (torch.float32, torch.float64):
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
        d = dw._policy_inputs(dtype)
        B, T = d["labels"].shape
        V = d["weight"].shape[0]
        g = torch.Generator().manual_seed(3)
        per_seq = torch.rand(B, generator=g) + 0.4
        per_tok = torch.rand(B, T, generator=g) + 0.4
        for i, (temps, opts) in enumerate((
            (per_seq, dict(loss_type="ppo", kl_coef=0.1, entropy_coef=0.01)),
            (per_tok, dict(loss_type="gspo", entropy_coef=0.02, max_chunk_bytes=300)),
        )):  # fmt: skip
            v0, v1 = _slices(V, world, seed=i)[rank]
            msg = f"{opts['loss_type']} {dtype} rank {rank}"
            # linear_token_logprobs
            hf, wf, bf = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
            lp_w, ent_w = pk.linear_token_logprobs(
                hf, wf, d["labels"], bias=bf, temperature=temps, return_entropy=True
            )
            (lp_w.nan_to_num(0.0).sum() + ent_w.sum()).backward()
            hs = d["hidden"].clone().requires_grad_()
            ws, bs = (d[k][v0:v1].clone().requires_grad_() for k in ("weight", "bias"))
            with poisoned():
                lp, ent = pk.linear_token_logprobs(
                    hs, ws, d["labels"], bias=bs, temperature=temps, return_entropy=True,
                    process_group=grp, max_chunk_bytes=200,
                )  # fmt: skip
                (lp.nan_to_num(0.0).sum() + ent.sum()).backward()
            torch.testing.assert_close((lp, ent), (lp_w, ent_w), **tol, msg=msg)
            torch.testing.assert_close(hs.grad, hf.grad, **tol, msg=msg)
            torch.testing.assert_close(ws.grad, wf.grad[v0:v1], **tol, msg=msg)
            torch.testing.assert_close(bs.grad, bf.grad[v0:v1], **tol, msg=msg)
            # linear_policy_loss
            for t in (hf, wf, bf, hs, ws, bs):
                t.grad = None
            # (the single-process op holds whole rows and their gradient: a larger budget)
            want = dw._policy_call(d, dict(opts, max_chunk_bytes=None), wf, bf, None, hf,
                                   temperature=temps)  # fmt: skip
            want[0].backward()
            with poisoned():
                got = dw._policy_call(d, opts, ws, bs, None, hs, temperature=temps,
                                      process_group=grp)  # fmt: skip
                got[0].backward()
            _compare(msg, got, want, tol)
            torch.testing.assert_close(hs.grad, hf.grad, **tol, msg=msg)
            torch.testing.assert_close(ws.grad, wf.grad[v0:v1], **tol, msg=msg)
            torch.testing.assert_close(bs.grad, bf.grad[v0:v1], **tol, msg=msg)
        # linear_preference_loss: the pairs walked side by side, the reference head sharded
        p = pw._inputs(dtype)
        R, T = p["labels"].shape
        for i, (name, opts) in enumerate(pw.CASES_[:3]):
            opts = {k: v for k, v in opts.items() if k != "temperature"}
            temps = (torch.rand(R, generator=g) + 0.4, torch.rand(R, T, generator=g) + 0.4)[i % 2]
            v0, v1 = _slices(V, world, seed=i)[rank]
            hf, wf, bf = (p[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
            want = pw._call(p, opts, wf, bf, p["ref_weight"], hf, temperature=temps)
            want[0].backward()
            hs = p["hidden"].clone().requires_grad_()
            ws, bs = (p[k][v0:v1].clone().requires_grad_() for k in ("weight", "bias"))
            with poisoned():
                got = pw._call(p, opts, ws, bs, p["ref_weight"][v0:v1], hs, temperature=temps,
                               process_group=grp)  # fmt: skip
                got[0].backward()
            msg = f"{name} {dtype} rank {rank}"
            _compare(msg, got, want, tol)
            torch.testing.assert_close(hs.grad, hf.grad, **tol, msg=msg)
            torch.testing.assert_close(ws.grad, wf.grad[v0:v1], **tol, msg=msg)
            torch.testing.assert_close(bs.grad, bf.grad[v0:v1], **tol, msg=msg)
    bad = torch.ones(B + 1)
    w = d["weight"][v0:v1]
    _raises_everywhere("temperature", lambda: pk.linear_token_logprobs(
        d["hidden"], w, d["labels"], temperature=bad, process_group=grp))  # fmt: skip
    _raises_everywhere("temperature", lambda: dw._policy_call(
        d, dict(loss_type="ppo"), w, None, None, d["hidden"], temperature=bad,
        process_group=grp))  # fmt: skip
    _raises_everywhere("temperature", lambda: dw._policy_call(
        d, dict(loss_type="ppo"), w, None, None, d["hidden"], temperature=-per_seq,
        process_group=grp))  # fmt: skip


def _compare_sampled(msg, got, want, stats, tol, exact_ids=True):
    """(log-probs, entropy, HeadStats) of the vocab-parallel form against the single-device's.
    The top ids: equal (exact_ids), else where the logits may round apart (the linear forms'
    GEMMs on a slice and on the whole head), equal but within runs of the single-device's
    log-probs that lie within tol of each other (near-ties may swap)."""
    for name, x, y in zip(("logprobs", "entropy"), got[:2], want[:2]):
        torch.testing.assert_close(x, y, **tol, msg=f"{msg}: {name}")
    for name in stats:
        if name == "topk":
            x, y = got[2].top_logprobs, want[2].top_logprobs
            torch.testing.assert_close(x, y, **tol, msg=f"{msg}: top_logprobs")
            ids, ids_w = got[2].top_ids, want[2].top_ids
            if not exact_ids:
                d = (y[..., 1:] - y[..., :-1]).abs().nan_to_num(0.0)
                near = d <= tol["atol"] + tol["rtol"] * y[..., 1:].abs().nan_to_num(0.0)
                tied = torch.zeros_like(ids, dtype=torch.bool)
                tied[..., 1:] |= near
                tied[..., :-1] |= near
                ids, ids_w = ids.masked_fill(tied, -2), ids_w.masked_fill(tied, -2)
            assert torch.equal(ids, ids_w), (msg, got[2].top_ids, want[2].top_ids)
            continue
        x, y = getattr(got[2], name), getattr(want[2], name)
        torch.testing.assert_close(x, y, **tol, msg=f"{msg}: {name}")
    assert int(got[2].num_outside) == int(want[2].num_outside), msg


def _sampler_logits(g, B, T, V, dtype):
    """Logits with ties across the slices' borders: a row of few distinct values (every value
    repeats, so top-k's k-th value and top-p's cut fall in tie groups), the rest random."""
    x = torch.randn(B, T, V, generator=g) * 2
    x[0] = torch.randint(0, 4, (T, V), generator=g).float()
    x[1, 0, :] = 1.0  # all tied
    x[2, 3, 7] = float("nan")  # an undefined row: NaN outputs and gradient
    return x.to(dtype)


# (options, the cases' name): scalars, per-row tensors, the edges (k = 1, k >= V, p -> 0, p = 1,
# min_p = 1), both samplers
def _sampler_options(B, T, V, g):
    per_row = dict(
        top_k=torch.randint(0, V + 3, (B,), generator=g),
        top_p=torch.rand(B, T, generator=g) * 0.9 + 0.1,
        min_p=torch.rand(B, generator=g) * 0.3,
        temperature=torch.rand(B, T, generator=g) + 0.5,
    )
    return [
        dict(top_k=5),
        dict(top_p=0.7, temperature=0.8),
        dict(min_p=0.2),
        dict(top_k=4, top_p=0.8, min_p=0.05, temperature=1.3),
        dict(top_k=1),
        dict(top_k=V + 2, top_p=1.0),
        dict(top_p=1e-6),
        dict(min_p=1.0),
        per_row,
        dict(per_row, top_k=0),
    ]


def case_sampler_logits(rank, world):
    """token_logprobs(process_group=..., top_k / top_p / min_p, both samplers) against the
    single-process op on the gathered logits and the float64 reference (sampler_forward on
    float64 logits): log-probs (-inf outside the kept set), entropy, stats outside / sum_p2 / lse
    / is_argmax, the gradient of both outputs on the kept set only; ties across the slices'
    borders; ignored labels; a NaN row; fixed collectives per call; bad inputs on every rank."""
    import ppo_kernels as pk
    from ppo_kernels.distributed import _comm
    from support.utils import GRAD_TOL, TOL, poisoned

    grp = dist.group.WORLD
    B, T, V = 3, 4, 23
    stats = ("outside", "sum_p2", "lse", "is_argmax", "topk")
    for dtype, seed in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float64, 3)):
        g = torch.Generator().manual_seed(seed)
        logits = _sampler_logits(g, B, T, V, dtype)
        labels = torch.randint(0, V, (B, T), generator=g)
        labels[2, 1] = -100
        gl, ge = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        v0, v1 = _slices(V, world, seed)[rank]
        tol = dict(TOL.get(dtype, dict(atol=1e-10, rtol=1e-10)), equal_nan=True)
        gtol = dict(GRAD_TOL.get(dtype, dict(atol=1e-10, rtol=1e-10)), equal_nan=True)
        for sampler in ("vllm", "sglang"):
            for i, opts in enumerate(_sampler_options(B, T, V, g)):
                msg = f"{dtype} {sampler} {i} {sorted(opts)} rank {rank}"
                full = logits.clone().requires_grad_()
                top = dict(stats_top_k=(5, 1, V)[i % 3])  # (k = V: every token)
                lp_w, ent_w, st_w = pk.token_logprobs(
                    full, labels, return_entropy=True, sampler=sampler, stats=stats, **top, **opts
                )
                # (-inf outside the kept set: the gradient has no log-prob term there)
                (lp_w * gl + ent_w * ge).sum().backward()
                shard = logits[..., v0:v1].clone().requires_grad_()
                before = dict(_comm.CALLS)
                with poisoned():
                    lp, ent, st = pk.token_logprobs(
                        shard, labels, return_entropy=True, sampler=sampler, stats=stats,
                        process_group=grp, vocab_start=v0 if i % 2 else None, **top, **opts,
                    )  # fmt: skip
                    (lp * gl + ent * ge).sum().backward()
                _compare_sampled(msg, (lp, ent, st), (lp_w, ent_w, st_w), stats, tol)
                torch.testing.assert_close(
                    shard.grad.float(), full.grad[..., v0:v1].float(), **gtol, msg=msg
                )
                if i == 3:  # the collectives of a call with every option on, fixed
                    rounds = 8 if dtype == torch.float64 else 4
                    gathers = _comm.CALLS["all_gather"] - before["all_gather"]
                    reduces = _comm.CALLS["all_reduce"] - before["all_reduce"]
                    assert reduces == 2 * rounds + 1, (msg, reduces)
                    checks = 2  # the CPU's cross-rank checks of sizes and options
                    want = 1 + (sampler == "sglang") + checks + 1  # (+1: the top-k candidates)
                    assert gathers in (want, want + 1), (msg, gathers)  # (+1: a layout settled)
        if dtype == torch.float64:  # the float64 reference of the sampler's rules
            from ppo_kernels.token_logprobs import naive

            opts = _sampler_options(B, T, V, g)[3]
            for sampler in ("vllm", "sglang"):
                one = lambda v: torch.full((B, T), v, dtype=torch.float64)  # noqa: E731
                want = naive.sampler_forward(
                    logits, labels, one(1 / 1.3), one(4).long(), one(0.8), one(0.05), sampler
                )
                got = pk.token_logprobs(logits[..., v0:v1], labels, sampler=sampler,
                                        process_group=grp, **opts)  # fmt: skip
                torch.testing.assert_close(got, want[0], **tol)
    # slices not in rank order (rank r holds the slice of world - 1 - r): the top-k statistics
    # still merge ties by global id
    u0, u1 = _slices(V, world, 2)[world - 1 - rank]
    x = torch.randint(0, 3, (B, T, V), generator=torch.Generator().manual_seed(7)).float()
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8))
    kw = dict(top_k=6, sampler="sglang", stats=("topk",), stats_top_k=8)
    _, st = pk.token_logprobs(x[..., u0:u1], y, process_group=grp, vocab_start=u0, **kw)
    _, st_w = pk.token_logprobs(x, y, **kw)
    assert torch.equal(st.top_ids, st_w.top_ids), (st.top_ids, st_w.top_ids)
    torch.testing.assert_close(st.top_logprobs, st_w.top_logprobs)
    # the GPU's path (device-side layout checks, forced on gloo): once the layout is validated,
    # a call reads nothing back (no host sync), and still matches
    from ppo_kernels.distributed import vocab_layout as vl

    reads, read = [0], vl.read_header

    def counting(gathered):
        reads[0] += 1
        return read(gathered)

    vl.read_header, vl.DEVICE_CHECKS_ON_CPU = counting, True
    try:
        opts = dict(top_k=torch.tensor([2, 5, 0]), top_p=0.8, sampler="sglang")
        for call in range(2):
            before = reads[0]
            lp = pk.token_logprobs(logits[..., v0:v1], labels, process_group=grp,
                                   vocab_start=v0, **opts)  # fmt: skip
            if call:
                assert reads[0] == before, reads
        want = pk.token_logprobs(logits, labels, **opts)
        torch.testing.assert_close(lp, want, **tol)
    finally:
        vl.read_header, vl.DEVICE_CHECKS_ON_CPU = read, False
    # bad inputs: a ValueError naming the argument on every rank
    x, y = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    for name, kw in (
        ("top_k", dict(top_k=-1)),
        ("top_k", dict(top_k=torch.tensor([1, -2]))),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=torch.ones(3))),
        ("min_p", dict(min_p=1.5)),
        ("temperature", dict(top_k=2, temperature=torch.zeros(2))),
        ("sampler", dict(top_k=2, sampler="hf")),
        ("stats_top_k", dict(stats=("topk",), stats_top_k=4 * world + 1)),  # more than V
    ):
        _raises_everywhere(name, lambda: pk.token_logprobs(x, y, process_group=grp, **kw))


def case_sampler_linear(rank, world):
    """linear_token_logprobs(process_group=..., top_k / top_p / min_p, both samplers) against the
    single-process op on the unsharded head (float32 with and without bias, bf16, float64): log-
    probs, entropy, the statistics, the hidden / weight / bias gradients (on the kept set only);
    row blocks smaller than the batch (the collectives per block); reduce_hidden_grad=False
    leaves each rank's share; per-row tensors; bad inputs on every rank."""
    import ppo_kernels as pk
    from support.utils import GEMM_TOL, poisoned

    grp = dist.group.WORLD
    B, T, H, V = 3, 4, 8, 23
    stats = ("outside", "sum_p2", "lse", "is_argmax", "topk")
    for dtype, bias, budget, seed in (
        (torch.float32, True, None, 1),
        (torch.float32, False, 400, 2),
        (torch.bfloat16, True, None, 3),
        (torch.float64, True, 700, 4),
    ):
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(B, T, H, generator=g).to(dtype)
        w = (torch.randn(V, H, generator=g) * 0.8).to(dtype)
        w[5] = w[17]  # tied logits across the slices' borders
        b = (torch.randn(V, generator=g) * 0.2).to(dtype) if bias else None
        if b is not None:
            b[5] = b[17]
        labels = torch.randint(0, V, (B, T), generator=g)
        labels[0, 0] = -100
        gl, ge = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        v0, v1 = _slices(V, world, seed)[rank]
        tol = GEMM_TOL if dtype != torch.float64 else dict(atol=1e-10, rtol=1e-10)
        gtol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else tol
        opts_all = _sampler_options(B, T, V, g)
        for sampler in ("vllm", "sglang"):
            for i in (0, 1, 3, 8) if dtype == torch.float32 else (3,):
                opts = opts_all[i]
                msg = f"{dtype} {sampler} {i} {sorted(opts)} rank {rank}"
                hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
                bf = None if b is None else b.clone().requires_grad_()
                top = dict(stats_top_k=(4, V)[i % 2])
                lp_w, ent_w, st_w = pk.linear_token_logprobs(
                    hf, wf, labels, bias=bf, return_entropy=True, sampler=sampler, stats=stats,
                    **top, **opts,
                )  # fmt: skip
                (lp_w * gl + ent_w * ge).sum().backward()
                hs, ws = h.clone().requires_grad_(), w[v0:v1].clone().requires_grad_()
                bs = None if b is None else b[v0:v1].clone().requires_grad_()
                partial = i == 1
                with poisoned():
                    lp, ent, st = pk.linear_token_logprobs(
                        hs, ws, labels, bias=bs, return_entropy=True, sampler=sampler,
                        stats=stats, process_group=grp, max_chunk_bytes=budget,
                        vocab_start=v0 if i % 2 else None, reduce_hidden_grad=not partial,
                        **top, **opts,
                    )  # fmt: skip
                    (lp * gl + ent * ge).sum().backward()
                _compare_sampled(msg, (lp, ent, st), (lp_w, ent_w, st_w), stats, tol, False)
                gh = hs.grad
                if partial:  # each rank's share: their sum is the gradient
                    gh = gh.clone()
                    dist.all_reduce(gh)
                torch.testing.assert_close(gh.float(), hf.grad.float(), **gtol, msg=msg)
                torch.testing.assert_close(ws.grad.float(), wf.grad[v0:v1].float(), **gtol,
                                           msg=msg)  # fmt: skip
                if b is not None:
                    torch.testing.assert_close(bs.grad.float(), bf.grad[v0:v1].float(), **gtol,
                                               msg=msg)  # fmt: skip
    x, y = torch.randn(4, H), torch.zeros(4, dtype=torch.long)
    w = torch.randn(3, H)
    for name, kw in (
        ("top_k", dict(top_k=-1)),
        ("top_p", dict(top_p=torch.ones(5))),
        ("min_p", dict(min_p=-0.5)),
        ("softcap", dict(top_k=2, softcap=3.0)),
        ("stats_top_k", dict(stats=("topk",), stats_top_k=3 * world + 1)),  # more than V
    ):
        _raises_everywhere(name, lambda: pk.linear_token_logprobs(x, w, y, process_group=grp, **kw))


def _fused_loss_cases(rank, world, inputs, call, cases, ref_head):
    """A fused loss's vocab-parallel form (call: dist_workers._policy_call's signature) under the
    sampler's options against the single-process op: cases(d, g) -> [(options, budget)] on the
    inputs(dtype) of float32 (all) and float64 (the first two); ref_head: the reference head's
    weight is sharded too. Loss, statistics, outputs, gradients; some label is outside."""
    from support.utils import poisoned

    grp = dist.group.WORLD
    for dtype in (torch.float32, torch.float64):
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
        tol = dict(tol, equal_nan=True)
        d = inputs(dtype)
        V = d["weight"].shape[0]
        all_cases = cases(d, torch.Generator().manual_seed(8))
        for i, (opts, budget) in enumerate(all_cases if dtype == torch.float32 else all_cases[:2]):
            v0, v1 = _slices(V, world, seed=i)[rank]
            msg = f"{i} {dtype} rank {rank}"
            rw = d["ref_weight"] if ref_head else None
            hf, wf, bf = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
            want = call(d, dict(opts, max_chunk_bytes=None), wf, bf, rw, hf)
            want[0].backward()
            hs = d["hidden"].clone().requires_grad_()
            ws, bs = (d[k][v0:v1].clone().requires_grad_() for k in ("weight", "bias"))
            with poisoned():
                got = call(d, dict(opts, max_chunk_bytes=budget), ws, bs,
                           None if rw is None else rw[v0:v1], hs, process_group=grp)  # fmt: skip
                got[0].backward()
            _compare(msg, got, want, tol)
            truncates = any(k in opts for k in ("top_k", "top_p", "min_p"))
            if truncates and "gspo" not in str(opts):
                assert int(got[1]["num_outside"]) > 0, (msg, "none outside")
            torch.testing.assert_close(hs.grad, hf.grad, **tol, msg=msg)
            torch.testing.assert_close(ws.grad, wf.grad[v0:v1], **tol, msg=msg)
            torch.testing.assert_close(bs.grad, bf.grad[v0:v1], **tol, msg=msg)


def case_sampler_policy(rank, world):
    """linear_policy_loss(process_group=..., top_k / top_p / min_p, both samplers) against the
    single-process op on the unsharded head: loss, every statistic (num_outside), the outside
    flags, log-probs, entropy, the hidden / weight / bias gradients; mask_outside on (its first
    pass) and off; a sequence longer than a row block; a top-k at or above a slice's size but
    below V (the same first pass on every rank)."""
    from support import dist_workers as dw

    def call(d, opts, weight, bias, ref_weight, hidden, **kw):
        return dw._policy_call(d, opts, weight, bias, ref_weight, hidden,
                               ref_logprobs=d["ref_logprobs"], **kw)  # fmt: skip

    def cases(d, g):
        B, T = d["labels"].shape
        V = d["weight"].shape[0]
        return [
            (dict(loss_type="ppo", entropy_coef=0.01, top_k=4, min_p=0.05, z_loss=0.03), 2000),
            (dict(loss_type="grpo", top_p=0.6, temperature=torch.rand(B, generator=g) + 0.5,
                  sampler="sglang", kl_coef=0.1), 2000),
            (dict(loss_type="ppo", top_k=torch.randint(0, V, (B, T), generator=g),
                  top_p=torch.rand(B, generator=g) * 0.5 + 0.5, mask_outside=False), 2000),
            (dict(loss_type="gspo", top_k=V - 2, sampler="sglang", z_loss=0.05), 300),  # blocks < T
            # temperatures alone (the plain shard, each row scaled) with the z-loss
            (dict(loss_type="ppo", temperature=torch.rand(B, T, generator=g) + 0.5, z_loss=0.1),
             2000),
        ]  # fmt: skip

    _fused_loss_cases(rank, world, dw._policy_inputs, call, cases, ref_head=False)


def case_sampler_preference(rank, world):
    """linear_preference_loss(process_group=..., top_k / top_p / min_p, both samplers) against
    the single-process op on the unsharded heads: loss, every statistic (num_outside), per-row
    and per-token outputs, the outside flags, the gradients; each head's own kept set (the
    reference head sharded, its pass first), pairs walked side by side, sft's batch count (a
    first pass), mask_outside off, pairs longer than a block."""
    from support import dist_preference_workers as pw

    def cases(d, g):
        R, T = d["labels"].shape
        V = d["weight"].shape[0]
        return [
            (dict(loss_type=("sigmoid", "sft"), ref="head", top_k=5, min_p=0.05), None),
            (dict(loss_type="ipo", ref="given", top_p=0.7, sampler="sglang",
                  temperature=torch.rand(R, generator=g) + 0.5), None),
            (dict(loss_type="kto", ref="head", top_k=torch.randint(0, V, (R, T), generator=g),
                  mask_outside=False), None),
            (dict(loss_type="sigmoid", ref="head", pairs=True, top_p=0.8), 300),  # pairs > block
        ]  # fmt: skip

    _fused_loss_cases(rank, world, pw._inputs, pw._call, cases, ref_head=True)


def case_sampler_full_kl(rank, world):
    """full_kl(process_group=..., top_k / top_p / min_p, both samplers) against the single-process
    op on the gathered logits: the KL of the policy truncated to its kept set against the whole
    reference, a mask, ties across the slices' borders, per-row tensors, both logits' gradients
    (the policy's on the kept set only), bf16 and float64."""
    import ppo_kernels as pk
    from support.utils import GRAD_TOL, TOL, poisoned

    grp = dist.group.WORLD
    B, T, V = 3, 4, 23
    for dtype, seed in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float64, 3)):
        g = torch.Generator().manual_seed(seed)
        logits = _sampler_logits(g, B, T, V, dtype).nan_to_num(0.0)
        ref = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
        mask = torch.rand(B, T, generator=g) > 0.2
        gk = torch.randn(B, T, generator=g)
        v0, v1 = _slices(V, world, seed)[rank]
        tol = TOL.get(dtype, dict(atol=1e-10, rtol=1e-10))
        gtol = GRAD_TOL.get(dtype, dict(atol=1e-10, rtol=1e-10))
        opts_all = _sampler_options(B, T, V, g)
        for sampler in ("vllm", "sglang"):
            for i in (0, 1, 3, 4, 8) if dtype == torch.float32 else (3, 8):
                opts = opts_all[i]
                msg = f"{dtype} {sampler} {i} {sorted(opts)} rank {rank}"
                full, fref = logits.clone().requires_grad_(), ref.clone().requires_grad_()
                kl_w = pk.full_kl(full, fref, mask=mask, sampler=sampler, **opts)
                (kl_w * gk).sum().backward()
                shard = logits[..., v0:v1].clone().requires_grad_()
                rshard = ref[..., v0:v1].clone().requires_grad_()
                with poisoned():
                    kl = pk.full_kl(shard, rshard, mask=mask, sampler=sampler,
                                    process_group=grp, **opts)  # fmt: skip
                    (kl * gk).sum().backward()
                torch.testing.assert_close(kl, kl_w, **tol, msg=msg)
                torch.testing.assert_close(shard.grad.float(), full.grad[..., v0:v1].float(),
                                           **gtol, msg=msg)  # fmt: skip
                torch.testing.assert_close(rshard.grad.float(), fref.grad[..., v0:v1].float(),
                                           **gtol, msg=msg)  # fmt: skip
    x = torch.randn(2, 3, 4)
    for name, kw in (("top_k", dict(top_k=-1)), ("top_p", dict(top_p=torch.ones(3)))):
        _raises_everywhere(name, lambda: pk.full_kl(x, x, process_group=grp, **kw))


def case_sampler_compile(rank, world):
    """torch.compile (aot_eager, fullgraph=True) of the vocab-parallel token_logprobs with the
    sampler's options (and the top-k statistics) and of the plain forms with temperature tensors equals eager, forward and
    gradients: a fixed number of functional collectives and registered ops between them."""
    import ppo_kernels as pk

    torch._dynamo.reset()
    grp = dist.group.WORLD
    g = torch.Generator().manual_seed(5)
    B, T, V = 3, 4, 17
    v0, v1 = _uneven_split(V, world, 4)[rank]
    logits = _sampler_logits(g, B, T, V, torch.float32)[..., v0:v1].nan_to_num(0.0)
    ref = torch.randn(B, T, V, generator=g)[..., v0:v1]
    labels = torch.randint(0, V, (B, T), generator=g)
    temps, ks = torch.rand(B, generator=g) + 0.5, torch.tensor([3, 0, 1])
    pr = torch.rand(B, T, generator=g) * 0.5 + 0.4

    def fn(z, zr):
        out = []
        for sampler in ("vllm", "sglang"):  # (vLLM: top-k and min-p; SGLang: top-p, its ties)
            opts = dict(top_k=ks, min_p=0.02) if sampler == "vllm" else dict(top_p=pr)
            lp, ent, st = pk.token_logprobs(
                z, labels, temperature=temps, sampler=sampler, return_entropy=True,
                process_group=grp, vocab_start=v0, stats=("topk",), stats_top_k=3, **opts,
            )  # fmt: skip
            top = torch.where(st.top_logprobs.isfinite(), st.top_logprobs, 0.0)
            out += [torch.where(lp.isfinite(), lp, 0.0), ent, (top * st.top_ids).sum(-1)]
        lp, ent = pk.token_logprobs(
            z, labels, temperature=temps, return_entropy=True, process_group=grp, vocab_start=v0
        )
        kl = pk.full_kl(z, zr, temperature=temps, process_group=grp)
        return torch.stack(out + [lp, ent, kl]).sum(0)

    got, want = [], []
    inputs = [t.clone().requires_grad_() for t in (logits, ref)]
    for f, out in ((torch.compile(fn, fullgraph=True, backend="aot_eager"), got), (fn, want)):
        y = f(*inputs)
        out += [y, *torch.autograd.grad(y.sum(), inputs)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}

if __name__ == "__main__":
    main("support.dist_sampler_workers")
