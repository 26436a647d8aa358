"""On-policy distillation: the student (the SFT Actor) samples responses to the task's prompts,
a frozen teacher (a saved Actor, `--teacher`) reads them, and the student takes one optimiser
step on the token mean, over its sampled action tokens, of the full-vocabulary reverse KL
KL(student || teacher) of each next-token distribution. Its one-sample estimate at the sampled
token, log p_student - log p_teacher, is on-policy distillation's per-token signal; the
full-vocabulary sum is its expectation at that prefix, with a lower-variance gradient.

Fused ops: one `linear_distill_loss` pass from both models' last hidden states and LM heads,
the teacher's logits tile beside the student's (no gradient); eager: both logits materialised.
Data-parallel: each rank samples its share of the prompts and weights its token mean by its
share of all ranks' tokens, so the reduced gradient is the one-process one. The teacher is
frozen and held whole on every rank (under FSDP2 too: its head tile is read outside any
wrapped forward)."""

from __future__ import annotations

import torch

from ...linear_logprobs import hf
from .. import dist
from ..config import ConfigError
from ..models import head_from_hidden, hidden_states
from ..ops import Ops
from .common import adamw, sample_share


class DistillTrainer:
    def __init__(self, cfg, student, teacher, tok, task, ops: Ops, group=None):
        self.cfg, self.teacher, self.tok, self.task, self.group = cfg, teacher, tok, task, group
        self.policy = dist.wrap(dist.Policy(student, ops), cfg.dist, group)
        self.opt = adamw(self.policy.parameters(), cfg.actor_lr, cfg.weight_decay)
        self.teacher_head = head_from_hidden(teacher, "the teacher's distillation term")
        v_s = head_from_hidden(student, "the distillation loss")[0].shape[0]
        if self.teacher_head[0].shape[0] != v_s:
            raise ConfigError(
                f"--teacher: its LM head has {self.teacher_head[0].shape[0]} tokens, the "
                f"student's {v_s}: distillation needs one vocabulary"
            )
        self.sample_gen = torch.Generator().manual_seed(cfg.seed + 2)

    @torch.no_grad()
    def teacher_hidden(self, b):
        """The teacher's last hidden states at the student's action tokens, packed: [N, H_t]."""
        keep = b.action_mask > 0
        h = hidden_states(hf.backbone(self.teacher), *b.model_inputs())[:, :-1]
        return h[keep]

    def step(self, problems) -> dict:
        cfg, group = self.cfg, self.group
        b, problems = sample_share(
            cfg, self.policy, self.tok, self.task, problems, self.sample_gen, group
        )
        mask = b.action_mask
        th = self.teacher_hidden(b)
        n_tok = mask.sum().double()
        scale = (n_tok * dist.world(group) / dist.all_sum(n_tok, group).to(n_tok)).float()
        self.policy.train()
        loss = self.policy(
            *b.model_inputs(),
            distill_loss=dict(
                only=mask,
                teacher_hidden=th,
                teacher_head=self.teacher_head,
                temperature=cfg.temperature,
            ),
        )
        self.opt.zero_grad(set_to_none=True)
        (loss * scale).backward()
        gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
        self.opt.step()
        self.policy.eval()
        n = len(b)
        scores = [self.task.verify(p, r) for p, r in zip(problems, b.responses)]
        return dist.global_means(
            {
                # per token over every rank's tokens; the rest per sequence
                "distill_kl": (loss.detach().double() * n_tok, n_tok),
                "grad_norm": (dist.local(gn), 1),
                "score": (sum(scores), n),
                "response_tokens": (mask.sum(), n),
                "tool_call_frac": (sum("{" in r for r in b.responses), n),
                "truncated_frac": (b.truncated.sum(), n),
            },
            group,
        )
