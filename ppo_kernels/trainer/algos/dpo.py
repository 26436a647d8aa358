"""Offline DPO on preference pairs (each rank takes its equal share of every batch of pairs; the
pair-mean losses averaged over the ranks are the one-process loss); the Reference is the frozen
SFT Actor."""

from __future__ import annotations

import contextlib

import torch

from .. import dist
from ..models import frozen_copy
from ..ops import Ops
from ..rollout import SeqBatch
from .common import adamw, pair_batch, preference_data


def seq_logprob_sums(policy, b: SeqBatch):
    """(sum, token count) of each row's action log-probs; `policy` a `dist.Policy` (or its
    wrapper)."""
    lp = policy(*b.model_inputs(), logprobs=dict(only=b.action_mask))
    return (lp * b.action_mask).sum(1), b.action_mask.sum(1)


def train_dpo(cfg, actor, tok, task, ops: Ops, on_step=None, around_step=None, group=None):
    """Offline DPO on the preference pairs; the Reference is the frozen SFT Actor.
    `around_step(step)`: a context manager around each optimiser step (timing, memory).
    Returns the trained Actor behind its (data-parallel) `dist.Policy`, for evaluation."""
    around_step = around_step or (lambda step: contextlib.nullcontext())
    ref = dist.wrap(dist.Policy(frozen_copy(actor), ops), cfg.dist, group)
    policy = dist.wrap(dist.Policy(actor, ops), cfg.dist, group)
    problems, pairs = preference_data(cfg, tok, task, cfg.pairs, cfg.seed + 10)
    opt = adamw(policy.parameters(), cfg.dpo_lr, cfg.weight_decay)
    nb = cfg.pairs // cfg.pref_batch
    for step in range(cfg.steps):
        policy.train()
        start = (step % nb) * cfg.pref_batch
        lo, hi = dist.span(start, start + cfg.pref_batch, group)
        with around_step(step):
            b = pair_batch(cfg, tok, problems, pairs, lo, hi)
            with torch.no_grad():
                rc, rr = seq_logprob_sums(ref, b)[0].chunk(2)
            sums, n_tok = seq_logprob_sums(policy, b)
            pc, pr = sums.chunk(2)
            loss = ops.dpo_loss(pc, pr, rc, rr, beta=cfg.dpo_beta)
            # RPO: the chosen responses' NLL per token (a pair mean, like the DPO loss)
            nll = -(pc / n_tok[: len(pc)].clamp(min=1)).mean()
            if cfg.dpo_nll_coef:
                loss = loss + cfg.dpo_nll_coef * nll
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            opt.step()
        margin = cfg.dpo_beta * ((pc - rc) - (pr - rr)).detach()
        if on_step:
            n = hi - lo
            on_step(
                step,
                dist.global_means(
                    {
                        "dpo_loss": (loss.detach() * n, n),
                        "grad_norm": (dist.local(gn), 1),
                        "reward_margin": (margin.sum(), n),
                        "reward_accuracy": ((margin > 0).sum(), n),
                        "chosen_nll": (nll.detach() * n, n),
                    },
                    group,
                ),
            )
    policy.eval()
    return policy
