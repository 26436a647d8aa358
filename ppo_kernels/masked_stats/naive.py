"""The benchmark baseline of masked_whiten (bench/bench_gae.py) and the trainer's `--ops eager`:
verl's masked_whiten, written from its documented semantics. The op itself (op.py) is composed
of torch calls and is its own eager implementation."""

from __future__ import annotations

import torch


def verl_masked_whiten(x, mask):
    """verl's masked_whiten: unbiased masked variance, `(x - mean) * rsqrt(var + 1e-8)`; the two
    `mask_sum == 0 / 1` checks are host syncs."""
    mean = (x * mask).sum() / (mask.sum() + 1e-8)
    var = ((x - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    n = mask.sum()
    if n == 0 or n == 1:
        raise ValueError("mask: verl's masked_whiten needs at least two unmasked positions")
    var = var * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)
