"""linear_token_logprobs (logits never built) vs materialised logits + eager log_softmax and
materialised logits + our fused token_logprobs, forward and forward+backward (gradients to hidden
and weight), time and peak extra memory. CPU: pytest-benchmark
    pytest bench/bench_linear_logprobs.py --benchmark-only
or the table of `python bench/run.py --ops linear_logprobs`. GPU: bench/gpu_checks/linear_logprobs.py.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import peak_extra_bytes  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.linear_logprobs import naive as ll_ref  # noqa: E402

N, H, V = 1024, 256, 32000  # CPU size: the fp32 logits are 125 MiB


def make_inputs(n=N, h=H, v=V, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g)).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


INPUT = "linear_token_logprobs (logits_dtype=input)"


def impls(entropy=False, dtype=None):
    """name -> f(hidden, weight, labels) returning the output(s). The logits_dtype="input" mode
    (bf16/fp16 matmuls, as the materialised path) only for bf16/fp16 (dtype None: all names)."""

    def linear(budget, logits_dtype="float32"):
        def f(x, w, y):
            return pk.linear_token_logprobs(
                x, w, y, return_entropy=entropy, max_chunk_bytes=budget, logits_dtype=logits_dtype
            )

        return f

    def mat_eager(x, w, y):
        return ll_ref.eager_logprobs(x, w, y, return_entropy=entropy)

    def mat_fused(x, w, y):
        return pk.token_logprobs(x @ w.T, y, return_entropy=entropy)

    out = {
        "linear_token_logprobs": linear(None),
        "linear_token_logprobs (16 MiB chunks)": linear(16 << 20),
    }
    if dtype is None or dtype in (torch.bfloat16, torch.float16):
        out[INPUT] = linear(None, "input")
    out.update({"eager: logits + log_softmax": mat_eager, "logits + token_logprobs": mat_fused})
    return out


def _total(out):
    return sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()


def run_forward(fn, x, w, y):
    with torch.no_grad():
        return fn(x, w, y)


def run_fwd_bwd(fn, x, w, y):
    x.grad = w.grad = None
    _total(fn(x, w, y)).backward()
    return x.grad, w.grad


CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]


def table_rows(n=N, h=H, v=V, reps=3):
    from _common import median_seconds

    rows = []
    for dtype, entropy in CASES:
        x, w, y = make_inputs(n, h, v, dtype)
        for name, fn in impls(entropy, dtype).items():
            for mode, runner in (("forward", run_forward), ("fwd+bwd", run_fwd_bwd)):
                call = functools.partial(runner, fn, x, w, y)
                try:
                    sec = median_seconds(call, warmup=1, reps=reps)
                    mem = peak_extra_bytes(call)
                except Exception as e:  # noqa: BLE001
                    sec, mem = float("nan"), float("nan")
                    name = f"{name} ({type(e).__name__})"
                rows.append(
                    dict(
                        op="linear_token_logprobs",
                        case=f"N={n} H={h} V={v} {str(dtype)[6:]}"
                        f"{' +entropy' if entropy else ''} {mode}",
                        impl=name,
                        seconds=sec,
                        peak_extra_mb=mem / 2**20,
                    )
                )
        del x, w, y
    return rows


@pytest.mark.parametrize(
    "dtype,entropy", CASES, ids=[f"{str(d)[6:]}-{'ent' if e else 'noent'}" for d, e in CASES]
)
@pytest.mark.parametrize("impl", list(impls()))
@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
def test_linear_token_logprobs(benchmark, impl, dtype, entropy, mode):
    if impl not in impls(entropy, dtype):
        pytest.skip(f"{impl}: bf16/fp16 only")
    x, w, y = make_inputs(dtype=dtype)
    fn = impls(entropy, dtype)[impl]
    runner = run_forward if mode == "forward" else run_fwd_bwd
    benchmark.group = f"linear_token_logprobs {str(dtype)[6:]} entropy={entropy} {mode}"
    benchmark.extra_info["peak_extra_mb"] = peak_extra_bytes(lambda: runner(fn, x, w, y)) / 2**20
    benchmark.pedantic(runner, args=(fn, x, w, y), rounds=3, warmup_rounds=1)


if __name__ == "__main__":
    from _common import machine

    print(machine())
    print("| case | impl | median ms | peak extra MiB |\n|---|---|---|---|")
    for r in table_rows():
        print(
            f"| {r['case']} | {r['impl']} | {1e3 * r['seconds']:.1f} | {r['peak_extra_mb']:.1f} |",
            flush=True,
        )
