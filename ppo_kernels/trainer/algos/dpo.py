"""Offline DPO on preference pairs (each rank takes its equal share of every batch of pairs; the
pair-mean losses averaged over the ranks are the one-process loss); the Reference is the frozen
SFT Actor.

With fused ops the step's loss is one `linear_preference_loss` pass from the Actor's last hidden
states and LM head (`models.preference_loss`), the Reference given as its own hidden states and
head (its logits tile computed beside the policy's, no gradient): neither model's logits are
built. Under FSDP2 the Reference's head is sharded outside its forward, so there it gives its
sequence log-prob sums instead (`linear_token_logprobs` in its wrapped forward; recorded in
`Ops.fallbacks`). With eager ops: the sequence log-probs from the materialised logits, then the
loss, as trainers run it today."""

from __future__ import annotations

import contextlib

import torch

from ...linear_logprobs.hf import logit_transform
from .. import dist
from ..models import frozen_copy, lm_head
from ..ops import Ops
from ..rollout import SeqBatch
from .common import adamw, pair_batch, preference_data


def seq_logprob_sums(policy, b: SeqBatch):
    """(sum, token count) of each row's action log-probs; `policy` a `dist.Policy` (or its
    wrapper)."""
    lp = policy(*b.model_inputs(), logprobs=dict(only=b.action_mask))
    return (lp * b.action_mask).sum(1), b.action_mask.sum(1)


def _materialised_step(cfg, policy, ref, b: SeqBatch, group):
    """(loss, per-pair reward margins, chosen NLL) from the sequence log-prob sums (through
    `Ops.logprobs_from_hidden`: the materialised logits with eager ops)."""
    ops = dist.unwrap(policy).ops
    with torch.no_grad():
        rc, rr = seq_logprob_sums(ref, b)[0].chunk(2)
    sums, n_tok = seq_logprob_sums(policy, b)
    pc, pr = sums.chunk(2)
    loss = ops.dpo_loss(pc, pr, rc, rr, beta=cfg.dpo_beta)
    # RPO: the chosen responses' NLL per token (a pair mean, like the DPO loss)
    nll = -(pc / n_tok[: len(pc)].clamp(min=1)).mean()
    if cfg.dpo_nll_coef:
        loss = loss + cfg.dpo_nll_coef * nll
    return loss, cfg.dpo_beta * ((pc - rc) - (pr - rr)).detach(), nll.detach()


def _fused_step(cfg, policy, ref, b: SeqBatch, group):
    """The same (loss, margins, chosen NLL) from one `linear_preference_loss` pass."""
    inputs, only = b.model_inputs(), b.action_mask
    with torch.no_grad():
        if group is not None and cfg.dist == "fsdp2":
            reference = dict(ref_logps=seq_logprob_sums(ref, b)[0])
        else:  # the frozen Reference is not wrapped (dist.wrap): its head is whole here
            reference = dict(
                ref_hidden=ref(*inputs, action_hidden=dict(only=only)),
                ref_head=lm_head(dist.unwrap(ref).actor),
            )
    nll_term = cfg.dpo_nll_coef != 0
    loss, st, nll = policy(
        *inputs,
        preference_loss=dict(only=only, beta=cfg.dpo_beta, nll=nll_term, **reference),
    )
    if nll is None:  # the metric only: the same quantity from the op's sequence log-probs
        P = len(b) // 2
        nll = -(st["chosen_logps"] / only[:P].sum(1).clamp(min=1)).mean()
    else:
        loss = loss + cfg.dpo_nll_coef * nll
    return loss, st["chosen_rewards"] - st["rejected_rewards"], nll.detach()


def train_dpo(cfg, actor, tok, task, ops: Ops, on_step=None, around_step=None, group=None):
    """Offline DPO on the preference pairs; the Reference is the frozen SFT Actor.
    `around_step(step)`: a context manager around each optimiser step (timing, memory).
    Returns the trained Actor behind its (data-parallel) `dist.Policy`, for evaluation."""
    around_step = around_step or (lambda step: contextlib.nullcontext())
    ref = dist.wrap(dist.Policy(frozen_copy(actor), ops), cfg.dist, group)
    policy = dist.wrap(dist.Policy(actor, ops), cfg.dist, group)
    problems, pairs = preference_data(cfg, tok, task, cfg.pairs, cfg.seed + 10)
    opt = adamw(policy.parameters(), cfg.dpo_lr, cfg.weight_decay)
    step_fn = _materialised_step
    if logit_transform(actor) is None and ops.runs_fused("linear_preference_loss"):
        step_fn = _fused_step
        if group is not None and cfg.dist == "fsdp2":
            ops.fallbacks.add("linear_preference_loss reference head (fsdp2: reference log-probs)")
    nb = cfg.pairs // cfg.pref_batch
    for step in range(cfg.steps):
        policy.train()
        start = (step % nb) * cfg.pref_batch
        lo, hi = dist.span(start, start + cfg.pref_batch, group)
        with around_step(step):
            b = pair_batch(cfg, tok, problems, pairs, lo, hi)
            loss, margin, nll = step_fn(cfg, policy, ref, b, group)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            opt.step()
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
                        "chosen_nll": (nll * n, n),
                    },
                    group,
                ),
            )
    policy.eval()
    return policy
