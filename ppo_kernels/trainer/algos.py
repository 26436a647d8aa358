"""SFT warm-up, evaluation, and the PPO / GRPO / DPO / reward-model updates. Every per-token
computation goes through `Ops` (fused ppo_kernels ops or the eager references)."""

from __future__ import annotations

import contextlib
import math
import random

import torch

from . import dist
from .config import TrainConfig
from .models import ValueModel, frozen_copy, last_index, token_logprobs
from .ops import Ops
from .rollout import SeqBatch, assemble, generate, segments_to_tokens


def prompt_tokens(tok, problems):
    return [tok.encode(p.prompt, add_special_tokens=True) for p in problems]


def _adamw(params, lr, wd):
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad], lr=lr, weight_decay=wd, betas=(0.9, 0.95)
    )


def _cosine(step, total, warmup=20):
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def pairs_batch(tok, problems, segs_list, device) -> SeqBatch:
    ids, masks = zip(*(segments_to_tokens(tok, s) for s in segs_list))
    return assemble(
        prompt_tokens(tok, problems), list(ids), list(masks), tok.pad_token_id, device=device
    )


# ---------------------------------------------------------------------------------------------
# SFT and evaluation
# ---------------------------------------------------------------------------------------------
def sft(cfg: TrainConfig, actor, tok, task, ops: Ops, log=print, on_step=None):
    """Warm-up on generated demonstrations (loss on action tokens only)."""
    rng = random.Random(cfg.seed + 1)
    opt = _adamw(actor.parameters(), cfg.sft_lr, 0.0)
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


@torch.no_grad()
def evaluate(cfg: TrainConfig, actor, tok, task, problems, seed: int, chunk: int = 100):
    """Mean verifier reward of the sampled policy on held-out problems (own RNG: comparable
    before / after, and it does not disturb the training RNG)."""
    g = torch.Generator().manual_seed(seed)
    total, tool = 0.0, 0
    for i in range(0, len(problems), chunk):
        ps = problems[i : i + chunk]
        b = generate(
            actor,
            tok,
            task,
            prompt_tokens(tok, ps),
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            generator=g,
            device=cfg.device,
        )
        total += sum(task.verify(p, r) for p, r in zip(ps, b.responses))
        tool += sum(("{" in r) for r in b.responses)
    return total / len(problems), tool / len(problems)


# ---------------------------------------------------------------------------------------------
# PPO / GRPO
# ---------------------------------------------------------------------------------------------
class AdaptiveKL:
    """Ziegler et al.'s controller: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon."""

    def __init__(self, beta, target, horizon, adaptive):
        self.beta, self.target, self.horizon, self.adaptive = beta, target, horizon, adaptive

    def update(self, kl, n):
        if self.adaptive:
            err = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + err * n / self.horizon


class RLTrainer:
    """One step = rollout, batched scoring (old / Reference log-probs, Critic values, reward),
    advantages, then `ppo_epochs` passes over shuffled minibatches."""

    def __init__(
        self,
        cfg: TrainConfig,
        actor,
        ref,
        critic,
        tok,
        task,
        ops: Ops,
        reward_model=None,
        group=None,
    ):
        """group: the data-parallel process group (None: one process); every rank builds the
        same models and generators from the same seed and takes its share of each step."""
        self.group = group
        self.cfg, self.actor, self.ref, self.critic = cfg, actor, ref, critic
        self.tok, self.task, self.ops, self.reward_model = tok, task, ops, reward_model
        self.actor_opt = _adamw(actor.parameters(), cfg.actor_lr, cfg.weight_decay)
        self.critic_opt = (
            _adamw(critic.parameters(), cfg.critic_lr, cfg.weight_decay)
            if critic is not None
            else None
        )
        self.kl_ctl = AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon, cfg.adaptive_kl)
        self.sample_gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 3)

    # -- state for checkpoints ----------------------------------------------------------------
    def state_dict(self):
        return {
            "actor": self.actor.state_dict(),
            "ref": self.ref.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict() if self.critic_opt else None,
            "beta": self.kl_ctl.beta,
            "sample_gen": self.sample_gen.get_state(),
            "shuffle_gen": self.shuffle_gen.get_state(),
        }

    def load_state_dict(self, sd):
        self.actor.load_state_dict(sd["actor"])
        self.ref.load_state_dict(sd["ref"])
        if self.critic is not None:
            self.critic.load_state_dict(sd["critic"])
            self.critic_opt.load_state_dict(sd["critic_opt"])
        self.actor_opt.load_state_dict(sd["actor_opt"])
        self.kl_ctl.beta = sd["beta"]
        self.sample_gen.set_state(sd["sample_gen"])
        self.shuffle_gen.set_state(sd["shuffle_gen"])

    # -- pieces (also used directly by the tests) ---------------------------------------------
    def rollout(self, problems) -> tuple[SeqBatch, torch.Tensor]:
        cfg = self.cfg
        total = len(problems) * cfg.group_size
        problems, lo = dist.share(problems, self.group)
        problems = [p for p in problems for _ in range(cfg.group_size)]
        b = generate(
            self.actor,
            self.tok,
            self.task,
            prompt_tokens(self.tok, problems),
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            generator=self.sample_gen,
            device=cfg.device,
            rows=(lo * cfg.group_size, total),
            group=self.group,
        )
        if self.reward_model is not None:
            with torch.no_grad():
                scores = self.reward_model.score(*b.model_inputs())
        else:
            scores = torch.tensor(
                [self.task.verify(p, r) for p, r in zip(problems, b.responses)],
                dtype=torch.float32,
                device=cfg.device,
            )
        return b, scores

    @torch.no_grad()
    def score_batch(self, b: SeqBatch, scores: torch.Tensor) -> dict:
        """Old and Reference log-probs, values, rewards and advantages, in batch."""
        cfg, ops = self.cfg, self.ops
        inputs = b.model_inputs()
        mask = b.action_mask
        old_lp = token_logprobs(ops, self.actor, *inputs, temperature=cfg.temperature, only=mask)
        ref_lp = token_logprobs(ops, self.ref, *inputs, temperature=cfg.temperature, only=mask)
        out = {"old_logprobs": old_lp, "ref_logprobs": ref_lp, "scores": scores}
        if cfg.algo == "grpo":
            seq_adv = (
                ops.rloo_advantages(scores, cfg.group_size)
                if cfg.group_advantage == "rloo"
                else ops.grpo_advantages(scores, cfg.group_size)
            )
            out["advantages"] = seq_adv[:, None] * mask
            out["kl"] = ops.kl_penalty(old_lp, ref_lp, cfg.kl_estimator) * mask
            return out
        # a truncated row has no final answer to score: its future comes from the Critic's
        # bootstrap value instead (for the verifier its score is 0 anyway)
        scores = scores * ~b.truncated
        out["scores"] = scores
        v = self.critic(*inputs)
        values = v[:, :-1] * mask
        # truncated rows: the future after the last token still has value -> bootstrap from V
        bootstrap = v.gather(1, last_index(b.attention_mask)[:, None]).squeeze(1) * b.truncated
        rewards, kl, _ = ops.kl_penalized_rewards(
            scores, old_lp, ref_lp, mask, beta=self.kl_ctl.beta, estimator=cfg.kl_estimator
        )
        adv, returns = ops.gae(
            rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam, bootstrap_value=bootstrap
        )
        if cfg.whiten_advantages:
            adv = ops.masked_whiten(adv, mask, process_group=self.group)
        out.update(
            values=values,
            rewards=rewards,
            kl=kl,
            advantages=adv,
            returns=returns,
            bootstrap=bootstrap,
        )
        return out

    def update(self, b: SeqBatch, d: dict) -> dict:
        cfg, ops = self.cfg, self.ops
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        acc: dict[str, list] = {}
        n, mbs = len(b), cfg.minibatch_size // dist.world(self.group)
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle_gen)
            for s in range(0, n, mbs):
                idx = perm[s : s + mbs].to(b.input_ids.device)
                mb = b.rows(idx)
                mask = mb.action_mask
                lp, ent = token_logprobs(
                    ops,
                    self.actor,
                    *mb.model_inputs(),
                    temperature=cfg.temperature,
                    return_entropy=True,
                    only=mask,
                )
                pg, st = ops.ppo_policy_loss(
                    lp,
                    d["old_logprobs"][idx],
                    d["advantages"][idx],
                    mask,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    dual_clip=cfg.dual_clip,
                )
                ent_mean = ops.masked_mean(ent, mask)
                loss = pg - cfg.ent_coef * ent_mean
                if cfg.algo == "grpo" and cfg.kl_coef > 0:
                    kl = ops.masked_mean(
                        ops.kl_penalty(lp, d["ref_logprobs"][idx], cfg.kl_estimator), mask
                    )
                    loss = loss + cfg.kl_coef * kl
                self.actor_opt.zero_grad(set_to_none=True)
                loss.backward()
                dist.average_grads(self.actor.parameters(), self.group)
                gn = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
                self.actor_opt.step()
                rec = {"pg_loss": pg, "entropy": ent_mean, "actor_grad_norm": gn, **st}
                if self.critic is not None:
                    v = self.critic(*mb.model_inputs())[:, :-1]
                    vl, vst = ops.ppo_value_loss(
                        v, d["values"][idx], d["returns"][idx], mask, clip=cfg.value_clip
                    )
                    self.critic_opt.zero_grad(set_to_none=True)
                    (cfg.vf_coef * vl).backward()
                    dist.average_grads(self.critic.parameters(), self.group)
                    cgn = torch.nn.utils.clip_grad_norm_(
                        self.critic.parameters(), cfg.max_grad_norm
                    )
                    self.critic_opt.step()
                    rec.update(vf_loss=vl, critic_grad_norm=cgn, **vst)
                for k, val in rec.items():
                    acc.setdefault(k, []).append(val.detach())
        self.actor.eval()
        if self.critic is not None:
            self.critic.eval()
        return {k: torch.stack(v).float().mean().item() for k, v in acc.items()}

    def step(self, problems) -> dict:
        b, scores = self.rollout(problems)
        d = self.score_batch(b, scores)
        m = self.update(b, d)
        mask = b.action_mask
        seq_kl = (d["kl"].sum(1) / mask.sum(1).clamp(min=1)).mean().item()
        m.update(
            score=scores.mean().item(),
            kl=seq_kl,
            beta=self.kl_ctl.beta,
            response_tokens=mask.sum(1).mean().item(),
            tool_call_frac=sum("{" in r for r in b.responses) / len(b),
            truncated_frac=b.truncated.float().mean().item(),
        )
        if "values" in d:
            m["value_mean"] = self.ops.masked_mean(d["values"], mask).item()
        m = dist.mean_metrics(m, self.group)
        self.kl_ctl.update(m["kl"], len(b) * dist.world(self.group))
        return m


# ---------------------------------------------------------------------------------------------
# Reward model and DPO (preference pairs)
# ---------------------------------------------------------------------------------------------
def preference_data(cfg, tok, task, n, seed):
    rng = random.Random(seed)
    problems = [task.sample_problem(rng) for _ in range(n)]
    pairs = [task.preference_pair(p, rng) for p in problems]
    return problems, pairs


def _pair_batches(cfg, tok, problems, pairs, lo, hi):
    ps = problems[lo:hi]
    ch = pairs_batch(tok, ps, [c for c, _ in pairs[lo:hi]], cfg.device)
    rj = pairs_batch(tok, ps, [r for _, r in pairs[lo:hi]], cfg.device)
    return ch, rj


@torch.no_grad()
def rm_accuracy(cfg, rm, tok, problems, pairs):
    rm.eval()
    right = 0
    for lo in range(0, len(problems), 64):
        ch, rj = _pair_batches(cfg, tok, problems, pairs, lo, lo + 64)
        rc, rr = rm.score(*ch.model_inputs()), rm.score(*rj.model_inputs())
        right += ((rc > rr).float() + 0.5 * (rc == rr).float()).sum().item()  # a tie: a coin flip
    return right / len(problems)


def train_reward_model(
    cfg, actor, tok, task, ops: Ops, steps, log=print, on_step=None, around_step=None
):
    """Backbone (from the SFT Actor) + scalar head, pairwise loss on 'A preferred to B'.
    `around_step(step)`: a context manager around each optimiser step (timing, memory)."""
    around_step = around_step or (lambda step: contextlib.nullcontext())
    rm = ValueModel.from_causal_lm(actor)
    problems, pairs = preference_data(cfg, tok, task, cfg.pairs, cfg.seed + 10)
    ev_problems, ev_pairs = preference_data(cfg, tok, task, cfg.eval_pairs, cfg.seed + 11)
    acc_before = rm_accuracy(cfg, rm, tok, ev_problems, ev_pairs)
    opt = _adamw(rm.parameters(), cfg.pref_lr, cfg.weight_decay)
    nb = cfg.pairs // cfg.pref_batch
    for step in range(steps):
        rm.train()
        lo = (step % nb) * cfg.pref_batch
        with around_step(step):
            ch, rj = _pair_batches(cfg, tok, problems, pairs, lo, lo + cfg.pref_batch)
            rc, rr = rm.score(*ch.model_inputs()), rm.score(*rj.model_inputs())
            loss = ops.reward_model_loss(rc, rr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(rm.parameters(), cfg.max_grad_norm)
            opt.step()
        if on_step:
            on_step(
                step,
                {
                    "rm_loss": loss.item(),
                    "rm_grad_norm": gn.item(),
                    "train_pair_accuracy": (rc > rr).float().mean().item(),
                },
            )
    rm.eval()
    acc_after = rm_accuracy(cfg, rm, tok, ev_problems, ev_pairs)
    log(
        f"reward model: held-out pairwise accuracy {acc_before:.3f} -> {acc_after:.3f} "
        f"({len(ev_problems)} pairs)"
    )
    return rm, acc_before, acc_after


def seq_logprob_sums(ops, model, b: SeqBatch):
    lp = token_logprobs(ops, model, *b.model_inputs(), only=b.action_mask)
    return (lp * b.action_mask).sum(1)


def train_dpo(cfg, actor, tok, task, ops: Ops, on_step=None, around_step=None):
    """Offline DPO on the preference pairs; the Reference is the frozen SFT Actor.
    `around_step(step)`: a context manager around each optimiser step (timing, memory)."""
    around_step = around_step or (lambda step: contextlib.nullcontext())
    ref = frozen_copy(actor)
    problems, pairs = preference_data(cfg, tok, task, cfg.pairs, cfg.seed + 10)
    opt = _adamw(actor.parameters(), cfg.dpo_lr, cfg.weight_decay)
    nb = cfg.pairs // cfg.pref_batch
    for step in range(cfg.steps):
        actor.train()
        lo = (step % nb) * cfg.pref_batch
        with around_step(step):
            ch, rj = _pair_batches(cfg, tok, problems, pairs, lo, lo + cfg.pref_batch)
            with torch.no_grad():
                rc, rr = seq_logprob_sums(ops, ref, ch), seq_logprob_sums(ops, ref, rj)
            pc, pr = seq_logprob_sums(ops, actor, ch), seq_logprob_sums(ops, actor, rj)
            loss = ops.dpo_loss(pc, pr, rc, rr, beta=cfg.dpo_beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(actor.parameters(), cfg.max_grad_norm)
            opt.step()
        margin = cfg.dpo_beta * ((pc - rc) - (pr - rr)).detach()
        if on_step:
            on_step(
                step,
                {
                    "dpo_loss": loss.item(),
                    "grad_norm": gn.item(),
                    "reward_margin": margin.mean().item(),
                    "reward_accuracy": (margin > 0).float().mean().item(),
                },
            )
    actor.eval()
