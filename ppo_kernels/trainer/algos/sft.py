"""SFT warm-up on generated demonstrations."""

from __future__ import annotations

import math
import random

import torch

from ..config import TrainConfig
from ..models import token_logprobs
from ..ops import Ops
from .common import adamw, pairs_batch


def _cosine(step, total, warmup=20):
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def sft(cfg: TrainConfig, actor, tok, task, ops: Ops, log=print, on_step=None):
    """Warm-up on generated demonstrations (loss on action tokens only)."""
    rng = random.Random(cfg.seed + 1)
    opt = adamw(actor.parameters(), cfg.sft_lr, 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, cfg.sft_steps))
    actor.train()
    for step in range(cfg.sft_steps):
        probs = [task.sample_problem(rng) for _ in range(cfg.sft_batch)]
        b = pairs_batch(tok, probs, [task.demonstration(p, rng) for p in probs], cfg.device)
        lp = token_logprobs(ops, actor, *b.model_inputs(), only=b.action_mask)
        loss = -ops.masked_mean(lp, b.action_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.item())
        if step % 100 == 0 or step == cfg.sft_steps - 1:
            log(f"sft step {step:4d}  loss {loss.item():.4f}")
    actor.eval()
