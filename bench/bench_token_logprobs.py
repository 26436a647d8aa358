"""token_logprobs: fused kernels vs eager PyTorch (upcast + log_softmax + gather), torch.compile of
that, and peers where installed (TRL's selective_log_softmax). CPU: pytest-benchmark
    pytest bench/bench_token_logprobs.py --benchmark-only
or the side-by-side table of `python bench/run.py`. GPU numbers come from bench/gpu_check.py.
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
from ppo_kernels import use_backend  # noqa: E402
from ppo_kernels.token_logprobs import naive as ref  # noqa: E402

N, V = 4096, 32000  # the CPU target size: a 4k-token batch at a 32k vocabulary


def make_inputs(n=N, v=V, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, v, generator=g) * 2).to(dtype).requires_grad_(requires_grad)
    labels = torch.randint(0, v, (n,), generator=g)
    return logits, labels


def _trl():
    try:
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax
    except Exception:  # noqa: BLE001 - any import problem means "not installed"
        return None


_compiled = {}


def impls(entropy=False):
    """name -> f(logits, labels) returning what must be differentiated/summed."""

    def fused(x, y):
        with use_backend("cpp" if pk.HAS_EXTENSION else "eager"):
            return pk.token_logprobs(x, y, return_entropy=entropy)

    def eager(x, y):
        return ref.eager_logprobs(x, y, return_entropy=entropy)

    def compiled(x, y):
        if entropy not in _compiled:
            _compiled[entropy] = torch.compile(eager)
        return _compiled[entropy](x, y)

    out = {"ppo_kernels": fused, "eager": eager, "torch.compile(eager)": compiled}
    trl = _trl()
    if trl is not None and not entropy:
        out["trl.selective_log_softmax"] = lambda x, y: trl(x, y)
    return out


def _total(out):
    return sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()


def run_forward(fn, x, y):
    with torch.no_grad():
        return fn(x, y)


def run_fwd_bwd(fn, x, y):
    x.grad = None
    _total(fn(x, y)).backward()
    return x.grad


CASES = [(dtype, entropy) for dtype in (torch.float32, torch.bfloat16) for entropy in (False, True)]


def table_rows(n=N, v=V, reps=5):
    """Rows for bench/run.py: median seconds and peak extra memory, forward and fwd+bwd."""
    from _common import median_seconds

    rows = []
    for dtype, entropy in CASES:
        x, y = make_inputs(n, v, dtype, requires_grad=True)
        for name, fn in impls(entropy).items():
            for mode, runner in (("forward", run_forward), ("fwd+bwd", run_fwd_bwd)):
                call = functools.partial(runner, fn, x, y)
                try:
                    sec = median_seconds(call, warmup=1 if "compile" not in name else 2, reps=reps)
                    mem = peak_extra_bytes(call)
                except Exception as e:  # noqa: BLE001
                    sec, mem = float("nan"), float("nan")
                    name = f"{name} ({type(e).__name__})"
                rows.append(
                    dict(
                        op="token_logprobs",
                        case=f"N={n} V={v} {str(dtype)[6:]}{' +entropy' if entropy else ''} {mode}",
                        impl=name,
                        seconds=sec,
                        peak_extra_mb=mem / 2**20,
                    )
                )
        del x, y
    return rows


@pytest.mark.parametrize(
    "dtype,entropy", CASES, ids=[f"{str(d)[6:]}-{'ent' if e else 'noent'}" for d, e in CASES]
)
@pytest.mark.parametrize("impl", ["ppo_kernels", "eager", "torch.compile(eager)"])
@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
def test_token_logprobs(benchmark, impl, dtype, entropy, mode):
    x, y = make_inputs(dtype=dtype, requires_grad=True)
    fn = impls(entropy)[impl]
    runner = run_forward if mode == "forward" else run_fwd_bwd
    benchmark.group = f"token_logprobs {str(dtype)[6:]} entropy={entropy} {mode}"
    benchmark.extra_info["peak_extra_mb"] = peak_extra_bytes(lambda: runner(fn, x, y)) / 2**20
    benchmark.pedantic(runner, args=(fn, x, y), rounds=5, warmup_rounds=1)
