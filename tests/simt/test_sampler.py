"""The sampler's CUDA kernels (csrc/cuda/token_logprobs_sampler.cuh) and full_kl's per-row
temperatures (csrc/cuda/full_kl.cuh) run on the CPU by the SIMT emulator, through the public ops,
against the documented rules and the float64 values on their kept set, outputs NaN-poisoned:
every option, both samplers, ties (SGLang's split tie group: the serial tie scan), strided rows
and more rows than blocks (the shared scratch reused across rows)."""

import pytest
import torch
from support.sampler import SIMT_SETTINGS, check_against_truth, kl64, sampler_op, simt_case
from support.simt import MARKS, SEEDS, emulated
from support.utils import GRAD_TOL

import ppo_kernels as pk

pytestmark = MARKS


# A dtype per case, the seeds in turn; float32 with every setting, the 16-bit dtypes (their
# loads and gradient stores, the same in every setting) with half of them each: the emulator runs
# a checked row's block in about a second.
@pytest.mark.parametrize(
    "dtype,seed,settings",
    [
        (torch.float32, SEEDS[0], SIMT_SETTINGS),
        (torch.bfloat16, SEEDS[1], SIMT_SETTINGS[0::2]),
        (torch.float16, SEEDS[0], SIMT_SETTINGS[1::2]),
    ],
    ids=["float32", "bfloat16", "float16"],
)
def test_sampler(dtype, seed, settings):
    simt_case(seed, dtype, 4, 300, settings)  # (rows 1 and 2 checked, 0 and 3 ignored)


@pytest.mark.parametrize("seed", SEEDS[:1])  # (the emulator's serial tie scan: slow)
def test_sampler_ties_strided_grid_stride(seed):
    """Tied logits (SGLang's split tie group: the serial tie scan), strided rows, and more rows
    than blocks (the shared scratch reused across rows)."""
    N, V = 7, 41
    logits = torch.randint(-3, 4, (N, 2, V)).float()[:, 1]
    labels = torch.randint(0, V, (N,))
    for k, p, mp, sampler in [(3, 1.0, 0.0, "sglang"), (0, 0.5, 0.0, "sglang"),
                              (4, 0.7, 0.1, "vllm")]:  # fmt: skip
        with emulated(seed, max_row_blocks=3, token_logprobs="cpp"):
            outs = sampler_op(logits, labels, 1.0, k, p, mp, sampler, stats_top_k=8)
        check_against_truth(logits, labels, 1.0, k, p, mp, sampler, outs)
    simt_case(seed, torch.float32, 5, 70, SIMT_SETTINGS[:2], strided=True, max_row_blocks=2)


@pytest.mark.parametrize("seed", SEEDS)
def test_full_kl_per_row_temperature(seed):
    x, y = torch.randn(5, 2, 90)[:, 0] * 2, torch.randn(5, 90) * 2
    temps = torch.rand(5) + 0.5
    xg = x.clone().requires_grad_(True)
    with emulated(seed, max_row_blocks=2, full_kl="cpp"):
        kl = pk.full_kl(xg, y, temperature=temps)
        kl.sum().backward()
    x64 = x.double().requires_grad_(True)
    want = kl64(x64, y, temps.double().unsqueeze(-1))
    want.sum().backward()
    torch.testing.assert_close(kl.double(), want.detach(), atol=5e-5, rtol=2e-5)
    torch.testing.assert_close(xg.grad.double(), x64.grad, **GRAD_TOL[torch.float32])
