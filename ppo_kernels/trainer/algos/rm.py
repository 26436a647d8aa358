"""The reward model: a scalar head on the SFT Actor's backbone, trained on preference pairs
(each rank takes its equal share of every batch; the pair-mean losses averaged over the ranks are
the one-process loss), then standardised."""

from __future__ import annotations

import contextlib
import copy

import torch

from .. import dist
from ..models import ValueModel, score
from ..ops import Ops
from .common import adamw, pair_batch, preference_data


@torch.no_grad()
def rm_accuracy(cfg, rm, tok, problems, pairs, group=None):
    """Held-out pairwise accuracy (a tie counts half), over every rank's share of the pairs."""
    rm.eval()
    right, n = 0.0, 0
    for lo, hi in dist.chunks(len(problems), 64, group):
        a, z = dist.span(lo, hi, group)
        b = pair_batch(cfg, tok, problems, pairs, a, z)
        rc, rr = score(rm, *b.model_inputs()).chunk(2)
        right += ((rc > rr).float() + 0.5 * (rc == rr).float()).sum().item()
        n += z - a
    return dist.global_means({"acc": (right, n)}, group)["acc"]


def train_reward_model(
    cfg, actor, tok, task, ops: Ops, steps, log=print, on_step=None, around_step=None, group=None
):
    """Backbone (from the SFT Actor) + scalar head, pairwise loss on 'A preferred to B'.
    `around_step(step)`: a context manager around each optimiser step (timing, memory).
    Returns (the trained model, unwrapped and whole on every rank, accuracy before, after)."""
    around_step = around_step or (lambda step: contextlib.nullcontext())
    plain = ValueModel.from_causal_lm(actor)
    spare = copy.deepcopy(plain) if group is not None and cfg.dist == "fsdp2" else None
    rm = dist.wrap(plain, cfg.dist, group)
    problems, pairs = preference_data(cfg, tok, task, cfg.pairs, cfg.seed + 10)
    ev_problems, ev_pairs = preference_data(cfg, tok, task, cfg.eval_pairs, cfg.seed + 11)
    opt = adamw(rm.parameters(), cfg.pref_lr, cfg.weight_decay)  # before any forward (dist.wrap)
    acc_before = rm_accuracy(cfg, rm, tok, ev_problems, ev_pairs, group)
    # fused: the pairwise loss straight from the scalar head at the last tokens' hidden states;
    # eager: the scores, then the loss
    head_loss = ops.runs_fused("reward_model_head_loss")
    nb = cfg.pairs // cfg.pref_batch
    for step in range(steps):
        rm.train()
        start = (step % nb) * cfg.pref_batch
        lo, hi = dist.span(start, start + cfg.pref_batch, group)
        with around_step(step):
            b = pair_batch(cfg, tok, problems, pairs, lo, hi)
            if head_loss:
                loss, rc, rr = rm(*b.model_inputs(), pairwise_ops=ops)
            else:
                rc, rr = score(rm, *b.model_inputs()).chunk(2)
                loss = ops.reward_model_loss(rc, rr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(rm.parameters(), cfg.max_grad_norm)
            opt.step()
        if on_step:
            n = hi - lo
            on_step(
                step,
                dist.global_means(
                    {
                        "rm_loss": (loss.detach() * n, n),
                        "rm_grad_norm": (dist.local(gn), 1),
                        "train_pair_accuracy": ((rc > rr).sum(), n),
                    },
                    group,
                ),
            )
    rm.eval()
    acc_after = rm_accuracy(cfg, rm, tok, ev_problems, ev_pairs, group)
    log(
        f"reward model: held-out pairwise accuracy {acc_before:.3f} -> {acc_after:.3f} "
        f"({len(ev_problems)} pairs)"
    )
    if spare is not None:  # FSDP2: gather the shards into a whole copy
        spare.load_state_dict(dist.state_dict(rm, everywhere=True))
        whole = spare.eval()
    else:
        whole = dist.unwrap(rm)
    standardize_scores(cfg, whole, tok, ev_problems, ev_pairs)
    return whole, acc_before, acc_after


@torch.no_grad()
def standardize_scores(cfg, rm, tok, problems, pairs):
    """Rescale the RM's head so its scores of these responses (both of each pair) have mean 0
    and std 1. The pairwise loss fixes only score differences, at whatever scale training
    reached (about +-5 here, ten times the verifier's 0 / 1); PPO weighs its KL penalty
    (--kl-coef) against that scale, so unscaled it barely holds the policy. An affine map with a
    positive factor: the RM's preferences (pairwise accuracy) are unchanged. Every rank scores
    all the pairs with its whole copy, so all ranks get the same model."""
    batches = (
        pair_batch(cfg, tok, problems, pairs, lo, min(lo + 64, len(pairs)))
        for lo in range(0, len(pairs), 64)
    )
    s = torch.cat([score(rm, *b.model_inputs()) for b in batches])
    mean, std = s.mean(), s.std().clamp(min=1e-6)
    rm.head.weight.div_(std)
    rm.head.bias.sub_(mean).div_(std)
