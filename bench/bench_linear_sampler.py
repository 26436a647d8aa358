"""linear_token_logprobs (from hidden states) under the rollout engine's distribution: each
sampler option and the head's statistics against the plain pass, and against the eager way
(materialise the logits with F.linear, then vLLM's sort-and-cumsum on them:
ppo_kernels/token_logprobs/naive.py, eager_sampled_logprobs). CPU, forward (rollout scoring),
interleaved medians; plus forward + backward for the plain pass and top-k + top-p.

    python bench/bench_linear_sampler.py [--n 4096] [--h 1024] [--v 152064] [--n-eager 256]
                                         [--n-grad 1024] [--reps 3] [--dtypes float32,bfloat16]
                                         [--out bench/results/cpu_linear_sampler.md]

Inputs: hidden randn, weight randn * 2 / sqrt(H) (logits about randn * 2: flat rows, where
top-p 0.9 keeps ~20% of the vocabulary, the costly case for a selection), labels uniform,
temperatures uniform in [0.6, 1.4].
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _common import interleaved_medians, machine, write_report  # noqa: E402
from bench_sampler import eager_lines, ratio_lines  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.token_logprobs import naive  # noqa: E402

VARIANTS = {
    "plain": {},
    "temperature tensor": {"temperature": "t"},
    "stats sum_p2+lse+is_argmax": {"stats": ("sum_p2", "lse", "is_argmax")},
    "top_k=50": {"top_k": 50},
    "min_p=0.05": {"min_p": 0.05},
    "top_p=0.9": {"top_p": 0.9},
    "top_k=50 top_p=0.95": {"top_k": 50, "top_p": 0.95},
}
EAGER = ("top_k=50", "top_p=0.9", "top_k=50 top_p=0.95")
GRAD = ("plain", "top_k=50 top_p=0.95")


def inputs(n, h, v, dtype, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_(grad)
    w = (torch.randn(v, h, generator=g) * (2 / h**0.5)).to(dtype).requires_grad_(grad)
    y = torch.randint(0, v, (n,), generator=g)
    t = torch.rand(n, generator=g) * 0.8 + 0.6
    return x, w, y, t


def call(x, w, y, t, kw):
    kw = {k: (t if val == "t" else val) for k, val in kw.items()}
    return pk.linear_token_logprobs(x, w, y, **kw)


def backward(out):
    lp = out[0] if isinstance(out, tuple) else out
    lp.sum().backward()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--v", type=int, default=152064)
    ap.add_argument("--n-eager", type=int, default=256)
    ap.add_argument("--n-grad", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out")
    a = ap.parse_args()
    lines = [
        "# linear_token_logprobs with the sampler's options and the head's statistics (CPU)",
        "",
        f"Machine: {machine()}. cpp backend, default `max_chunk_bytes` and `logits_dtype`; "
        f"interleaved medians of {a.reps} repetitions; load average (1 min) before / after each "
        "table in its title.",
        "Inputs: hidden randn, weight randn * 2 / sqrt(H) (logits about randn * 2: flat rows, "
        "top-p 0.9 keeps ~20% of the vocabulary), labels uniform, temperatures in [0.6, 1.4].",
        "",
    ]

    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        with torch.no_grad(), pk.use_backend("cpp"):
            x, w, y, t = inputs(a.n, a.h, a.v, dtype)
            modes = {name: (lambda kw=kw: call(x, w, y, t, kw)) for name, kw in VARIANTS.items()}
            med, load = interleaved_medians(modes, a.reps, warmup=True)
            lines += ratio_lines(
                f"## N={a.n} H={a.h} V={a.v} {dname}, forward: each option vs the plain pass "
                f"(load {load[0]:.1f} / {load[1]:.1f})",
                med,
                "plain",
                digits=0,
            )
            x = w = y = t = modes = None  # free before the next table

            x, w, y, t = inputs(a.n_eager, a.h, a.v, dtype)
            modes = {}
            for name in EAGER:
                kw = VARIANTS[name]
                modes[f"fused {name}"] = lambda kw=kw: call(x, w, y, t, kw)
                modes[f"eager {name}"] = lambda kw=kw: naive.eager_sampled_logprobs(
                    F.linear(x, w), y, **kw
                )
            med, load = interleaved_medians(modes, a.reps, warmup=True)
            lines += eager_lines(
                f"## N={a.n_eager} H={a.h} V={a.v} {dname}, forward: fused vs F.linear + eager "
                f"sort-and-cumsum (load {load[0]:.1f} / {load[1]:.1f})",
                modes,
                med,
                EAGER,
                digits=0,
            )[0]
            x = w = y = t = modes = None  # free before the next table

        with pk.use_backend("cpp"):
            x, w, y, t = inputs(a.n_grad, a.h, a.v, dtype, grad=True)
            modes = {
                name: (lambda kw=VARIANTS[name]: backward(call(x, w, y, t, kw))) for name in GRAD
            }
            med, load = interleaved_medians(modes, a.reps, warmup=True)
            lines += ratio_lines(
                f"## N={a.n_grad} H={a.h} V={a.v} {dname}, forward + backward (load "
                f"{load[0]:.1f} / {load[1]:.1f})",
                med,
                "plain",
                digits=0,
            )
            x = w = y = t = modes = None  # free before the next table
    write_report(lines, a.out)


if __name__ == "__main__":
    main()
