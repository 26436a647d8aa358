"""Evaluation: the sampled policy's verifier reward and tool use on held-out problems."""

from __future__ import annotations

import torch

from .. import dist
from ..config import TrainConfig
from .common import sample


@torch.no_grad()
def evaluate(cfg: TrainConfig, actor, tok, task, problems, seed: int, chunk=100, group=None):
    """(mean verifier reward, tool-call fraction) of the sampled policy on held-out problems (own
    RNG: comparable before / after, and it does not disturb the training RNG). Data-parallel
    (`group`): each rank samples its part of each chunk with the one-process run's uniforms, and
    the counts are summed over the ranks."""
    g = torch.Generator().manual_seed(seed)
    total, tool, n = 0.0, 0, 0
    for lo, hi in dist.chunks(len(problems), chunk, group):
        a, z = dist.span(lo, hi, group)
        ps = problems[a:z]
        b = sample(cfg, actor, tok, task, ps, g, (a - lo, hi - lo), group)
        total += sum(task.verify(p, r) for p, r in zip(ps, b.responses))
        tool += sum(("{" in r) for r in b.responses)
        n += len(ps)
    m = dist.global_means({"reward": (total, n), "tool": (tool, n)}, group)
    return m["reward"], m["tool"]
