"""Eager PyTorch implementation for GRPO / RLOO group advantages: the semantics, the `eager` backend and
the benchmark baseline. Group statistics are scatter reductions (index_add_), no Python loop over
groups; they are accumulated in float64 whatever the input dtype, so a group of equal scores has an
exact mean and gets an advantage of exactly 0.

Semantics (verl's `compute_grpo_outcome_advantage` and `compute_rloo_outcome_advantage`):
  GRPO  A_i = (R_i - mean_g) / (std_g + eps), std the UNBIASED standard deviation of the group
        (torch.std); `norm_by_std=False` gives R_i - mean_g (Dr. GRPO).
  RLOO  A_i = R_i - mean of the other members = n / (n - 1) * (R_i - mean_g).
Documented edge cases:
  * a group of one (singleton): GRPO uses mean 0 and std 1, so A_i = R_i / (1 + eps) (R_i without
    std normalisation), exactly as verl; RLOO keeps A_i = R_i (no other member to form a baseline;
    verl's `rloo` does the same, its `rloo_vectorized` gives 0 instead).
  * a group of equal scores: A_i = 0 for GRPO (0 / (0 + eps); also with eps = 0, where it would
    be 0 / 0) and RLOO. Scores are accumulated in float64, so float32 scores have an exact mean.
  * with `mask` [B, T] the advantage is broadcast over the row's tokens: A_i * mask[i, t]
    (verl's `scores.unsqueeze(-1) * response_mask`).
  * group_index values must lie in [0, B) (e.g. the prompt's position in the batch, or
    torch.unique(..., return_inverse=True)[1]); the CPU raises IndexError otherwise, the GPU
    kernels give NaN for such rows (no host sync) and `strict_checks()` raises.
"""

from __future__ import annotations

import torch

from .._modes import GROUP_ADVANTAGES as KINDS


def group_ids(B, group_index=None, group_size=None, device=None):
    if group_index is not None:
        return group_index.reshape(-1).long()
    return torch.arange(B, device=device) // group_size


def group_advantages(
    scores, group_index=None, group_size=None, eps=1e-6, norm_by_std=True, mask=None, kind="grpo"
):
    """Advantages in float64 ([B], or [B, T] with a mask)."""
    x = scores.reshape(-1).to(torch.float64)
    B = x.numel()
    gid = group_ids(B, group_index, group_size, x.device)
    cnt = torch.zeros(B, dtype=torch.float64, device=x.device).index_add_(
        0, gid, torch.ones_like(x)
    )
    mean = torch.zeros_like(cnt).index_add_(0, gid, x) / cnt.clamp_min(1.0)
    c = x - mean[gid]
    n = cnt[gid]
    single = n <= 1
    if kind == "grpo":
        ss = torch.zeros_like(cnt).index_add_(0, gid, c * c)
        std = (ss[gid] / (n - 1).clamp_min(1.0)).sqrt()
        if norm_by_std:
            den = std + eps  # eps = 0 on equal scores: 0 (c is exactly 0 there), not 0 / 0
            adv = torch.where(single, x / (1.0 + eps), torch.where(den > 0, c / den, 0.0))
        else:
            adv = torch.where(single, x, c)
    elif kind == "rloo":
        adv = torch.where(single, x, c * n / (n - 1).clamp_min(1.0))
    else:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if mask is not None:
        adv = adv[:, None] * mask.to(torch.float64)
    return adv


def eager_grpo_verl_style(scores, index, eps=1e-6, norm_by_std=True):
    """The benchmark baseline: what trainers run today (a Python loop over groups with per-group
    torch.mean / torch.std and one tensor op per element), written from verl's documented
    semantics."""
    from collections import defaultdict

    scores = scores.clone()
    by_group = defaultdict(list)
    for i in range(scores.shape[0]):
        by_group[int(index[i])].append(scores[i])
    mean, std = {}, {}
    for g, v in by_group.items():
        if len(v) == 1:
            mean[g], std[g] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            t = torch.stack(v)
            mean[g], std[g] = t.mean(), t.std()
    for i in range(scores.shape[0]):
        g = int(index[i])
        scores[i] = (scores[i] - mean[g]) / (std[g] + eps) if norm_by_std else scores[i] - mean[g]
    return scores
