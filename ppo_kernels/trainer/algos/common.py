"""What the algorithms share: prompts as token ids, the optimiser, and the batches of preference
pairs (the reward model's and DPO's data)."""

from __future__ import annotations

import random

import torch

from .. import dist
from ..rollout import SeqBatch, assemble, generate, segments_to_tokens


def prompt_tokens(tok, problems):
    return [tok.encode(p.prompt, add_special_tokens=True) for p in problems]


def sample(cfg, policy, tok, task, problems, generator, rows, group=None) -> SeqBatch:
    """The responses `policy` samples for `problems` at --temperature, at most
    --max-new-tokens each (`rollout.generate`; rows=(offset, total) of this rank's rows)."""
    return generate(
        policy,
        tok,
        task,
        prompt_tokens(tok, problems),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        generator=generator,
        device=cfg.device,
        rows=rows,
        group=group,
    )


def sample_share(cfg, policy, tok, task, problems, generator, group=None):
    """This rank's share of `problems`, each repeated --group-size times, and the responses
    `policy` samples for them with the one-process run's random numbers: (batch, problems)."""
    total = len(problems) * cfg.group_size
    problems, lo = dist.share(problems, group)
    problems = [p for p in problems for _ in range(cfg.group_size)]
    rows = (lo * cfg.group_size, total)
    return sample(cfg, policy, tok, task, problems, generator, rows, group), problems


def adamw(params, lr, wd):
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad], lr=lr, weight_decay=wd, betas=(0.9, 0.95)
    )


def pairs_batch(tok, problems, segs_list, device) -> SeqBatch:
    ids, masks = zip(*(segments_to_tokens(tok, s) for s in segs_list))
    return assemble(
        prompt_tokens(tok, problems), list(ids), list(masks), tok.pad_token_id, device=device
    )


def preference_data(cfg, tok, task, n, seed):
    rng = random.Random(seed)
    problems = [task.sample_problem(rng) for _ in range(n)]
    pairs = [task.preference_pair(p, rng) for p in problems]
    return problems, pairs


def pair_batch(cfg, tok, problems, pairs, lo, hi) -> SeqBatch:
    """Pairs lo..hi as one batch: the chosen responses, then the rejected ones."""
    ps = problems[lo:hi]
    both = [c for c, _ in pairs[lo:hi]] + [r for _, r in pairs[lo:hi]]
    return pairs_batch(tok, ps + ps, both, cfg.device)
