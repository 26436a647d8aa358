"""Property-based: token_logprobs under the sampler's distribution on every CPU backend against the
documented rules (tests/support/sampler.py's token-by-token reference), on random shapes, dtypes,
strided views, per-row temperatures / top-k / top-p / min-p including the boundaries (k = 1,
k = V, p -> 0, p = 1, min_p = 1), ties, -inf entries and ignored labels; gradients against
float64 on the kernel's own kept set (budget: tests/support/prop.py)."""

import math

import pytest
import torch
from hypothesis import strategies as st
from support.prop import LOW_PRECISION, backend_ctx, embed, pads_for, run, small
from support.sampler import check_against_truth, kept_from_cut, ops
from support.utils import GRAD_TOL, cpu_backends, poisoned

import ppo_kernels as pk


@st.composite
def cases(draw, backend):
    lead = draw(st.lists(st.integers(1, small(backend, 4, 2)), min_size=1, max_size=2))
    V = draw(st.integers(1, small(backend, 90, 24)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "ties", "peaked", "holes"]))
    x = torch.randn(lead + [V], generator=g, dtype=torch.float64) * draw(
        st.sampled_from([0.1, 1.0, 3.0, 10.0])
    )
    if kind == "ties":
        x = torch.randint(-2, 3, x.shape, generator=g).double()
    elif kind == "peaked":
        x[..., 0] += 30.0
    elif kind == "holes":  # some -inf entries, never the row max
        hole = (torch.rand(x.shape, generator=g) < 0.3) & (x < x.amax(-1, keepdim=True))
        x = x.masked_fill(hole, -math.inf)
    labels = torch.randint(0, V, lead, generator=g)
    if draw(st.booleans()):
        labels = labels.masked_fill(torch.rand(lead, generator=g) < 0.3, -100)
    n = labels.numel()

    def per_row(draw_one):
        if draw(st.booleans()):
            return draw_one()
        return torch.tensor([draw_one() for _ in range(n)]).reshape(lead)

    boundary_k = [0, 1, V, V + 3, max(1, V - 1), max(1, V // 2)]
    k = per_row(lambda: draw(st.sampled_from(boundary_k + [draw(st.integers(0, V + 2))])))
    p = per_row(
        lambda: draw(st.sampled_from([1.0, 1e-6, 0.3, 0.5, 0.9, 0.99, draw(st.floats(1e-3, 1.0))]))
    )
    mp = per_row(
        lambda: draw(st.sampled_from([0.0, 0.0, 1.0, 0.05, 0.5, draw(st.floats(0.0, 1.0))]))
    )
    T = per_row(lambda: draw(st.sampled_from([1.0, 0.5, 2.0, 0.7])))
    return dict(
        x=x,
        labels=labels,
        dtype=draw(st.sampled_from(LOW_PRECISION)),
        T=T,
        k=k,
        p=p,
        mp=mp,
        sampler=draw(st.sampled_from(["vllm", "sglang"])),
        pads=pads_for(draw, len(lead) + 1),
        stats_k=draw(st.integers(0, min(V, 6))),
    )


def _split(v, dtype):
    """(scalar, tensor or None) as the registered op takes a parameter."""
    if isinstance(v, torch.Tensor):
        return None, v.to(dtype)
    return v, None


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
def test_sampler_matches_the_rules(backend):
    def body(c):
        logits = c["x"].to(c["dtype"])
        lead = list(c["labels"].shape)
        leaf, view = embed(logits, c["pads"])
        t0, ts = _split(c["T"], torch.float32)
        k0, ks = _split(c["k"], torch.int64)
        p0, ps = _split(c["p"], torch.float64)
        m0, ms = _split(c["mp"], torch.float64)
        with backend_ctx("token_logprobs", backend), poisoned():
            outs = ops.token_logprobs_sampler(
                view, c["labels"], t0 if t0 is not None else 1.0, ts,
                int(k0) if k0 is not None else 0, ks, p0 if p0 is not None else 1.0, ps,
                m0 if m0 is not None else 0.0, ms, c["sampler"], -100, True, True, True,
                c["stats_k"], True,
            )  # fmt: skip
        n = c["labels"].numel()
        V = logits.shape[-1]
        flat = [
            o if o.numel() == 0 else o.reshape(n, -1) if o.dim() > len(lead) else o.reshape(n)
            for o in outs
        ]
        check_against_truth(
            logits.reshape(n, V).float(),
            c["labels"].reshape(n),
            c["T"] if not isinstance(c["T"], torch.Tensor) else c["T"].reshape(n),
            c["k"] if not isinstance(c["k"], torch.Tensor) else c["k"].reshape(n),
            c["p"] if not isinstance(c["p"], torch.Tensor) else c["p"].reshape(n),
            c["mp"] if not isinstance(c["mp"], torch.Tensor) else c["mp"].reshape(n),
            c["sampler"],
            flat,
        )

    run(backend, cases(backend), body)


@pytest.mark.parametrize("backend", cpu_backends("token_logprobs"))
def test_sampler_gradients_on_the_kept_set(backend):
    def body(c):
        logits = c["x"].to(c["dtype"])
        n, V = c["labels"].numel(), logits.shape[-1]
        T = c["T"] if isinstance(c["T"], torch.Tensor) else torch.full(c["labels"].shape, c["T"])
        x = logits.clone().requires_grad_(True)
        with backend_ctx("token_logprobs", backend), poisoned():
            lp, ent = pk.token_logprobs(
                x, c["labels"], temperature=T, top_k=c["k"], top_p=c["p"], min_p=c["mp"],
                sampler=c["sampler"], return_entropy=True,
            )  # fmt: skip
            outs = ops.token_logprobs_sampler(
                logits, c["labels"], 1.0, T, 0, None, 1.0, None, 0.0, None, c["sampler"], -100,
                False, False, False, 0, False,
            )  # fmt: skip
            g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
            use = torch.isfinite(lp)
            (
                torch.where(use, lp, 0) * g_lp + torch.where(torch.isfinite(ent), ent, 0) * g_ent
            ).sum().backward()
        # the kept set of this call, from a second call with the same options
        with backend_ctx("token_logprobs", backend):
            o2 = ops.token_logprobs_sampler(
                logits, c["labels"], 1.0, T.float(),
                0 if isinstance(c["k"], torch.Tensor) else int(c["k"]),
                c["k"] if isinstance(c["k"], torch.Tensor) else None,
                1.0 if isinstance(c["p"], torch.Tensor) else float(c["p"]),
                c["p"].double() if isinstance(c["p"], torch.Tensor) else None,
                0.0 if isinstance(c["mp"], torch.Tensor) else float(c["mp"]),
                c["mp"].double() if isinstance(c["mp"], torch.Tensor) else None,
                c["sampler"], -100, True, False, False, 0, False,
            )  # fmt: skip
        del outs
        lead = c["labels"].shape
        kept = kept_from_cut(logits.reshape(n, V), o2[3].reshape(n), o2[4].reshape(n))
        x64 = logits.double().reshape(n, V).requires_grad_(True)
        z = x64 / T.double().reshape(n, 1)
        zk = torch.where(kept, z, torch.full_like(z, -math.inf))
        lse = torch.logsumexp(zk, -1, keepdim=True)
        logq = torch.where(kept & torch.isfinite(z), z - lse, torch.zeros_like(z))
        q = torch.where(kept, logq.exp() * (z > -math.inf), torch.zeros_like(z))
        lab = c["labels"].reshape(n)
        valid = lab != -100
        safe = lab.clamp(min=0)
        in_set = kept.gather(-1, safe.unsqueeze(-1)).squeeze(-1) & (
            z.gather(-1, safe.unsqueeze(-1)).squeeze(-1) > -math.inf
        )
        lp64 = logq.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        ent64 = -(q * logq).sum(-1)
        total = torch.where(valid & in_set, lp64, 0) * g_lp.double().reshape(n)
        total = total + torch.where(valid, ent64, 0) * g_ent.double().reshape(n)
        total.sum().backward()
        torch.testing.assert_close(
            x.grad.double().reshape(n, V), x64.grad, **GRAD_TOL[c["dtype"]], equal_nan=True
        )
        assert lead == lp.shape

    run(backend, cases(backend), body)
