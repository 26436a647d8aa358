"""Workers of tests/ops/test_distributed_preference.py: `python
tests/support/dist_preference_workers.py CASE[,CASE...] WORLD` starts WORLD processes on gloo
(CPU) once; each runs the cases in turn, checking the vocab-parallel linear_preference_loss
against the single-process op on the unsharded head with the same seeded data; the script exits
non-zero if any rank failed (naming the case). The processes and their exit:
support/dist_workers.py's."""

import os
import sys

import torch
import torch.distributed as dist

# run by path: the checkout (ppo_kernels) and tests/ (the support package) on the path
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

from support.dist_workers import main  # noqa: E402


def _split(n, world, seed):
    """Contiguous, uneven, possibly empty slices of range(n)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
    bounds = [0] + cuts + [n]
    return [(bounds[i], bounds[i + 1]) for i in range(world)]


def _inputs(dtype, P=3, T=6, H=8, V=23, seed=41):
    g = torch.Generator().manual_seed(seed)
    R = 2 * P
    d = dict(
        hidden=torch.randn(R, T, H, generator=g).to(dtype),
        weight=(torch.randn(V, H, generator=g) * 0.7).to(dtype),
        bias=(torch.randn(V, generator=g) * 0.2).to(dtype),
        labels=torch.randint(0, V, (R, T), generator=g),
        mask=torch.rand(R, T, generator=g) > 0.15,
        ref_hidden=torch.randn(R, T, H, generator=g).to(dtype),
        ref_weight=(torch.randn(V, H, generator=g) * 0.7).to(dtype),
        desirable=torch.rand(R, generator=g) > 0.5,
    )
    d["labels"][:, 0] = -100  # the prompt
    d["ref_logps"] = (-torch.rand(R, generator=g) * 10 - 5).to(dtype)
    return d


# (name, options): types, the reference given / as a head (beside the tile or its own pass),
# first passes (a pair longer than a block, a sorted type), explicit pairs, unpaired, softcap
CASES_ = [
    ("sigmoid_sft", dict(loss_type=("sigmoid", "sft"), ref="given", max_chunk_bytes=None)),
    ("ipo_head", dict(loss_type="ipo", ref="head", temperature=0.8)),
    ("apo_down_head_own_pass", dict(loss_type="apo_down", ref="head", max_chunk_bytes=900)),
    ("aot_head", dict(loss_type="aot", ref="head", label_smoothing=0.1)),
    ("long_pairs", dict(loss_type="bco_pair", ref="given", max_chunk_bytes=300)),
    ("orpo_pairs", dict(loss_type=("orpo", "sft"), pairs=True, softcap=3.0)),
    ("kto_head", dict(loss_type="kto", ref="head", reference_point=0.2, max_chunk_bytes=300)),
]


def _call(d, opts, weight, bias, ref_weight, hidden, **kw):
    import ppo_kernels as pk

    opts = dict(opts)
    kw.setdefault("max_chunk_bytes", opts.pop("max_chunk_bytes", 2000))
    ref = opts.pop("ref", None)
    if ref == "given":
        kw["ref_logps"] = d["ref_logps"]
    elif ref == "head":
        kw.update(ref_hidden=d["ref_hidden"], ref_weight=ref_weight)
    if opts.pop("pairs", False):
        kw["pairs"] = torch.tensor([[5, 0], [1, 3], [2, 4]])
    if opts.get("loss_type") == "kto":
        kw["desirable"] = d["desirable"]
    return pk.linear_preference_loss(
        hidden, weight, d["labels"], d["mask"], bias=bias, return_entropy=True, **opts, **kw
    )


def case_vocab_parallel_preference(rank, world):
    """linear_preference_loss(..., process_group=...) against the single-process op on the
    unsharded head: loss, every statistic, per-row and per-token outputs, the hidden / weight /
    bias gradients (float32 within 1e-5, float64 1e-10), outputs NaN-poisoned; V = 23 is uneven
    over 2 and 3 ranks, world 3 has an empty slice in one case. Counts the collectives: one header
    gather, one gather per row block (per pass), one all-reduce."""
    from ppo_kernels.distributed import _comm, vocab_layout
    from support.utils import poisoned

    vocab_layout.forget_layouts()
    for dtype, names in ((torch.float32, None), (torch.float64, ("ipo_head", "long_pairs"))):
        d = _inputs(dtype)
        V = d["weight"].shape[0]
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
        for i, (name, opts) in enumerate(CASES_):
            if names is not None and name not in names:
                continue
            v0, v1 = _split(V, world, seed=5 + i)[rank]
            if world == 3 and name == "ipo_head":
                v0, v1 = ((0, 11), (11, 11), (11, V))[rank]
            hf, wf, bf = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
            loss_w, st_w = _call(d, opts, wf, bf, d["ref_weight"], hf)
            loss_w.backward()
            hs = d["hidden"].clone().requires_grad_()
            ws = d["weight"][v0:v1].clone().requires_grad_()
            bs = d["bias"][v0:v1].clone().requires_grad_()
            before = dict(_comm.CALLS)
            with poisoned():
                loss, st = _call(
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
            assert reduces == 1, (msg, reduces)
            if name == "sigmoid_sft":  # the whole batch in one row block: header + one gather
                assert gathers == 2, (msg, gathers)
        got = [torch.zeros((), dtype=dtype) for _ in range(world)]
        dist.all_gather(got, loss.detach())
        assert all(bool(x == got[0]) for x in got), got


def case_vocab_parallel_preference_partial(rank, world):
    """reduce_hidden_grad=False leaves each rank's share of the hidden gradient and runs no
    all-reduce; no grad at all; bf16 with float32 and input-dtype tiles."""
    from ppo_kernels.distributed import _comm
    from support.utils import GRAD_TOL

    d = _inputs(torch.float32, seed=5)
    V = d["weight"].shape[0]
    opts = dict(loss_type="sigmoid", ref="head")
    v0, v1 = _split(V, world, seed=9)[rank]
    hf = d["hidden"].clone().requires_grad_()
    loss_w, _ = _call(d, opts, d["weight"], d["bias"], d["ref_weight"], hf)
    loss_w.backward()
    hs = d["hidden"].clone().requires_grad_()
    before = _comm.CALLS["all_reduce"]
    loss, _ = _call(
        d, opts, d["weight"][v0:v1], d["bias"][v0:v1], d["ref_weight"][v0:v1], hs,
        process_group=dist.group.WORLD, reduce_hidden_grad=False,
    )  # fmt: skip
    loss.backward()
    assert _comm.CALLS["all_reduce"] == before
    gh = hs.grad.clone()
    dist.all_reduce(gh)
    torch.testing.assert_close(gh, hf.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss, _ = _call(
            d, opts, d["weight"][v0:v1], d["bias"][v0:v1], d["ref_weight"][v0:v1], d["hidden"],
            process_group=dist.group.WORLD,
        )  # fmt: skip
    torch.testing.assert_close(loss, loss_w.detach(), atol=1e-5, rtol=1e-5)
    d = _inputs(torch.bfloat16, seed=8)
    for ldt in ("float32", "input"):
        opts = dict(loss_type=("sigmoid", "sft"), ref="head", softcap=3.0)
        hf, wf, bf = (d[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss_w, st_w = _call(d, opts, wf, bf, d["ref_weight"], hf, logits_dtype=ldt)
        loss_w.backward()
        hs = d["hidden"].clone().requires_grad_()
        ws = d["weight"][v0:v1].clone().requires_grad_()
        bs = d["bias"][v0:v1].clone().requires_grad_()
        loss, st = _call(
            d, opts, ws, bs, d["ref_weight"][v0:v1], hs, logits_dtype=ldt,
            process_group=dist.group.WORLD,
        )  # fmt: skip
        loss.backward()
        torch.testing.assert_close(loss, loss_w, atol=1e-4, rtol=1e-4)
        for k in ("token_logprobs", "ref_token_logprobs", "logps", "rewards"):
            torch.testing.assert_close(st[k], st_w[k], atol=1e-4, rtol=1e-4)
        gt = GRAD_TOL[torch.bfloat16]

        def tol(ref):  # input tiles: the per-block products are rounded to bf16 before the sums
            return dict(gt, atol=float(ref.abs().max()) * 2**-8) if ldt == "input" else gt

        torch.testing.assert_close(hs.grad.float(), hf.grad.float(), **tol(hf.grad))
        torch.testing.assert_close(ws.grad.float(), wf.grad[v0:v1].float(), **tol(wf.grad))
        torch.testing.assert_close(bs.grad.float(), bf.grad[v0:v1].float(), **tol(bf.grad))


def case_vocab_parallel_preference_errors(rank, world):
    """Bad inputs raise a clear error naming the argument on every rank (no hang); the group
    stays usable."""
    import pytest

    d = _inputs(torch.float32, seed=6)
    V = d["weight"].shape[0]
    grp = dist.group.WORLD
    opts = dict(loss_type="sigmoid")
    v0, v1 = _split(V, world, seed=3)[rank]
    w, b = d["weight"][v0:v1], d["bias"][v0:v1]
    with pytest.raises(ValueError, match="vocab_start: the ranks' vocabulary slices"):
        _call(d, opts, w, b, None, d["hidden"], process_group=grp, vocab_start=0)
    with pytest.raises(ValueError, match="bias"):
        _call(d, opts, w, d["bias"][: v1 - v0 + 1], None, d["hidden"], process_group=grp)
    with pytest.raises(ValueError, match="ref_weight"):
        bad = dict(opts, ref="head")
        _call(d, bad, w, b, d["ref_weight"][: v1 - v0 + 1], d["hidden"], process_group=grp)
    with pytest.raises(ValueError, match="ref_logps"):
        bad = dict(opts, ref="head")
        _call(d, bad, w, b, d["ref_weight"][v0:v1], d["hidden"], process_group=grp,
              ref_logps=d["ref_logps"])  # fmt: skip
    with pytest.raises(ValueError, match="pairs"):
        _call(d, opts, w, b, None, d["hidden"], process_group=grp,
              pairs=torch.tensor([[0, 1], [2, 3], [4, 4]]))  # fmt: skip
    labels = d["labels"].clone()
    labels[1, 1] = V  # out of range of the whole vocabulary
    with pytest.raises(IndexError, match="labels"):
        _call(dict(d, labels=labels), opts, w, b, None, d["hidden"], process_group=grp)
    loss, _ = _call(d, opts, w, b, None, d["hidden"], process_group=grp)
    assert torch.isfinite(loss)


CASES = {n[5:]: f for n, f in globals().items() if n.startswith("case_")}


if __name__ == "__main__":
    main("support.dist_preference_workers")
