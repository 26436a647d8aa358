"""PPO / GRPO: one step is a rollout, its scoring in batch (old and Reference log-probs, Critic
values, rewards, advantages), then `ppo_epochs` passes over shuffled minibatches."""

from __future__ import annotations

import torch

from .. import dist
from ..config import TrainConfig
from ..models import last_index, score
from ..ops import Ops
from ..rollout import SeqBatch
from .common import adamw, sample_share

# Sequences per forward / backward pass of the update under --batch-invariant, whatever
# --micro-batch says: the passes, hence the order in which the gradient is summed, are the mode's.
# The default mode's default pass (a minibatch of 32): the same passes at the same cost (fewer
# sequences per pass cost several times more per step: bench/results/cpu_batch_invariant.md);
# --micro-batch does not bound the update's activations in the mode. A pass's rows are computed
# as in any other batch (the model is batch-invariant), so the first update's ratio stays 1.
INVARIANT_PASS_ROWS = 32


def _by_rows(b: SeqBatch, size: int, fn):
    """fn(rows) of the batch's rows in passes of `size` rows (0: one pass), joined."""
    if not size or size >= len(b):
        return fn(b)
    dev = b.input_ids.device
    parts = [
        fn(b.rows(torch.arange(lo, min(len(b), lo + size), device=dev)))
        for lo in range(0, len(b), size)
    ]
    return torch.cat(parts)


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
        same models and generators from the same seed and takes its share of each step. The
        models are wrapped here (`dist.wrap`, --dist): copy them before, never after."""
        self.group, self.cfg, self.tok, self.task, self.ops = group, cfg, tok, task, ops
        self.actor, self.ref = actor, ref  # the modules (FSDP2 shards them in place)

        def wrap(m):
            return dist.wrap(m, cfg.dist, group) if m is not None else None

        # every call of the Actor / Reference goes through `policy` / `ref_policy`
        self.policy, self.ref_policy = wrap(dist.Policy(actor, ops)), wrap(dist.Policy(ref, ops))
        self.critic, self.reward_model = wrap(critic), wrap(reward_model)
        self.actor_opt = adamw(self.policy.parameters(), cfg.actor_lr, cfg.weight_decay)
        self.critic_opt = (
            adamw(self.critic.parameters(), cfg.critic_lr, cfg.weight_decay)
            if critic is not None
            else None
        )
        self.kl_ctl = AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon, cfg.adaptive_kl)
        self.sample_gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 3)

    # -- state for checkpoints (under FSDP2 a collective: every rank calls it, rank 0 gets it) --
    def state_dict(self):
        c = self.critic is not None
        return {
            "actor": dist.state_dict(self.actor),
            "ref": dist.state_dict(self.ref),
            "critic": dist.state_dict(self.critic) if c else None,
            "actor_opt": dist.optim_state_dict(self.actor, self.actor_opt),
            "critic_opt": dist.optim_state_dict(self.critic, self.critic_opt) if c else None,
            "beta": self.kl_ctl.beta,
            "sample_gen": self.sample_gen.get_state(),
            "shuffle_gen": self.shuffle_gen.get_state(),
        }

    def load_state_dict(self, sd):
        dist.load_state_dict(self.actor, sd["actor"])
        dist.load_state_dict(self.ref, sd["ref"])
        if self.critic is not None:
            dist.load_state_dict(self.critic, sd["critic"])
            dist.load_optim_state_dict(self.critic, self.critic_opt, sd["critic_opt"])
        dist.load_optim_state_dict(self.actor, self.actor_opt, sd["actor_opt"])
        self.kl_ctl.beta = sd["beta"]
        self.sample_gen.set_state(sd["sample_gen"])
        self.shuffle_gen.set_state(sd["shuffle_gen"])

    # -- pieces (also used directly by the tests) ---------------------------------------------
    def rollout(self, problems) -> tuple[SeqBatch, torch.Tensor]:
        cfg = self.cfg
        b, problems = sample_share(
            cfg, self.policy, self.tok, self.task, problems, self.sample_gen, self.group
        )
        if self.reward_model is not None:
            with torch.no_grad():
                scores = score(self.reward_model, *b.model_inputs())
        else:
            scores = torch.tensor(
                [self.task.verify(p, r) for p, r in zip(problems, b.responses)],
                dtype=torch.float32,
                device=cfg.device,
            )
        return b, scores

    @torch.no_grad()
    def score_batch(self, b: SeqBatch, scores: torch.Tensor) -> dict:
        """Old and Reference log-probs, values, rewards and advantages, in batch (the forward
        passes in --logprob-micro-batch rows)."""
        cfg, ops = self.cfg, self.ops
        mask = b.action_mask
        size = cfg.logprob_micro_batch

        def logprobs(model):
            return _by_rows(
                b,
                size,
                lambda mb: model(
                    *mb.model_inputs(),
                    logprobs=dict(temperature=cfg.temperature, only=mb.action_mask),
                ),
            )

        old_lp = logprobs(self.policy)
        ref_lp = logprobs(self.ref_policy)
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
        v = _by_rows(b, size, lambda mb: self.critic(*mb.model_inputs()))
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

    def minibatches(self, n: int) -> list[torch.Tensor]:
        """This rank's rows (local indices) of each minibatch of every epoch: the one-process
        run's minibatches (a shuffle of all ranks' rows), so a rank may hold any number of a
        minibatch's rows, none included."""
        w, lo = dist.world(self.group), dist.rank(self.group) * n
        out = []
        for _ in range(self.cfg.ppo_epochs):
            perm = torch.randperm(n * w, generator=self.shuffle_gen)
            for s in range(0, n * w, self.cfg.minibatch_size):
                rows = perm[s : s + self.cfg.minibatch_size]
                out.append(rows[(rows >= lo) & (rows < lo + n)] - lo)
        return out

    def update(self, b: SeqBatch, d: dict) -> dict:
        """The optimiser steps of one rollout batch. Data-parallel: the token-mean losses are
        scaled by (this rank's tokens x world / the minibatch's tokens), so the gradient that
        DDP / FSDP2 average over the ranks is the one-process gradient of the minibatch; a rank
        without rows in a minibatch runs one row with weight 0 (every rank joins every
        collective). Metrics: token-weighted means over all ranks' tokens of each minibatch,
        then averaged over the minibatches like the one-process run."""
        cfg, ops = self.cfg, self.ops
        self.policy.train()
        if self.critic is not None:
            self.critic.train()
        mbs = self.minibatches(len(b))
        dev = b.input_ids.device
        tokens = torch.stack([b.action_mask[i.to(dev)].sum() for i in mbs]).double()
        scales = tokens * dist.world(self.group) / dist.all_sum(tokens, self.group).to(tokens)
        rows = []
        first = None  # max |log ratio| over the first minibatch, before any step of this batch
        for idx, n_tok, scale in zip(mbs, tokens, scales.float()):
            at = (idx if len(idx) else torch.zeros(1, dtype=torch.long)).to(dev)
            mb = b.rows(at)
            mask = mb.action_mask

            kl_coef = cfg.kl_coef if cfg.algo == "grpo" else 0.0

            def actor_forward(part, at):
                # fused ops: the loss from the hidden states in one linear_policy_loss pass (its
                # log-probs are linear_token_logprobs' bitwise under --batch-invariant too)
                return self.policy(
                    *part.model_inputs(),
                    actor_loss=dict(
                        temperature=cfg.temperature,
                        only=part.action_mask,
                        old_logprobs=d["old_logprobs"][at],
                        advantages=d["advantages"][at],
                        mask=part.action_mask,
                        ref_logprobs=d["ref_logprobs"][at] if kl_coef > 0 else None,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        dual_clip=cfg.dual_clip,
                        ent_coef=cfg.ent_coef,
                        kl_coef=kl_coef,
                        kl_estimator=cfg.kl_estimator,
                    ),
                )

            def actor_loss(outs, at, mask):
                if len(outs) == 3:  # computed with the forward (linear_policy_loss)
                    loss, st = outs[2]
                    stats = {"clipfrac": st["clip_frac"], "approx_kl": st["approx_kl"]}
                    return loss, {"pg_loss": st["pg_loss"], "entropy": st["entropy_mean"], **stats}
                lp, ent = outs
                pg, st = ops.ppo_policy_loss(
                    lp,
                    d["old_logprobs"][at],
                    d["advantages"][at],
                    mask,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    dual_clip=cfg.dual_clip,
                )
                ent_mean = ops.masked_mean(ent, mask)
                loss = pg - cfg.ent_coef * ent_mean
                if kl_coef > 0:
                    kl = ops.masked_mean(
                        ops.kl_penalty(lp, d["ref_logprobs"][at], cfg.kl_estimator), mask
                    )
                    loss = loss + kl_coef * kl
                return loss, {"pg_loss": pg, "entropy": ent_mean, **st}

            self.actor_opt.zero_grad(set_to_none=True)
            per_token, (lp, *_) = self._accumulate(
                actor_forward, actor_loss, mb, at, mask, n_tok, scale
            )
            if first is None:
                dev_lp = (lp.detach() - d["old_logprobs"][at]).abs() * (mask > 0)
                first = dev_lp.amax() if len(idx) else dev_lp.new_zeros(())
            gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
            self.actor_opt.step()
            per_step = {"actor_grad_norm": dist.local(gn)}
            if self.critic is not None:

                def critic_forward(part, at):
                    return (self.critic(*part.model_inputs())[:, :-1],)

                def critic_loss(outs, at, mask):
                    vl, vst = ops.ppo_value_loss(
                        outs[0], d["values"][at], d["returns"][at], mask, clip=cfg.value_clip
                    )
                    return cfg.vf_coef * vl, {"vf_loss": vl, **vst}

                self.critic_opt.zero_grad(set_to_none=True)
                vstats, _ = self._accumulate(
                    critic_forward, critic_loss, mb, at, mask, n_tok, scale
                )
                cgn = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.critic_opt.step()
                per_token.update(vstats)
                per_step["critic_grad_norm"] = dist.local(cgn)
            one = torch.ones((), dtype=torch.float64)
            rows.append(
                {k: (v.detach().double() * n_tok, n_tok) for k, v in per_token.items()}
                # the same on every rank (the gradients are reduced): averaged over the ranks
                | {k: (v.detach().double(), one) for k, v in per_step.items()}
            )
        self.policy.eval()
        if self.critic is not None:
            self.critic.eval()
        keys = list(rows[0])
        sums = torch.stack([torch.stack([r[k][0].cpu() for k in keys]) for r in rows])
        counts = torch.stack([torch.stack([r[k][1].cpu() for k in keys]) for r in rows])
        means = dist.global_ratio(sums, counts, self.group).mean(0)
        out = dict(zip(keys, means.tolist()))
        # the first minibatch is on-policy: 0 exactly when the update's log-probs equal the
        # scoring pass's bitwise (--batch-invariant), however the two were batched
        out["first_logratio_max"] = float(dist.global_max(first, self.group))
        return out

    def _units(self, n: int) -> list[slice]:
        """The forward / backward passes of a minibatch of n rows: INVARIANT_PASS_ROWS rows each
        under --batch-invariant (a gradient summed in an order that no micro-batch size changes),
        else --micro-batch rows each (0: one pass)."""
        size = INVARIANT_PASS_ROWS if self.cfg.batch_invariant else (self.cfg.micro_batch or n)
        return [slice(lo, min(n, lo + size)) for lo in range(0, n, size)]

    def _accumulate(self, forward, loss_fn, mb: SeqBatch, at, mask, n_tok, scale):
        """The backward of a minibatch's token-mean loss, in the passes of `_units`: each pass's
        loss weighted by its share of the minibatch's tokens (the gradients add up in .grad).
        Returns the minibatch's statistics (of its one pass, or recomputed from the joined
        per-token outputs: the same whatever the passes) and the per-token outputs."""
        units = self._units(len(at))
        if len(units) == 1:
            outs = forward(mb, at)
            loss, stats = loss_fn(outs, at, mask)
            (loss * scale).backward()
            return stats, outs
        pieces = []
        for u in units:
            part = mb.rows(torch.arange(u.start, u.stop, device=at.device))
            outs = forward(part, at[u])
            n = part.action_mask.sum()
            if n > 0:  # a pass without action tokens adds no gradient
                loss, _ = loss_fn(outs, at[u], part.action_mask)
                (loss * (n / n_tok).float() * scale).backward()
            # the per-token outputs (a loss computed with the forward is the pass's own)
            pieces.append(tuple(o.detach() for o in outs[:2]))
        outs = tuple(torch.cat(p) for p in zip(*pieces))
        with torch.no_grad():
            _, stats = loss_fn(outs, at, mask)
        return stats, outs

    def step(self, problems) -> dict:
        b, scores = self.rollout(problems)
        d = self.score_batch(b, scores)
        m = self.update(b, d)
        mask, n = b.action_mask, len(b)
        # per-sequence means over every rank's rows; value_mean over every rank's tokens
        pairs = {
            "score": (scores.sum(), n),
            "kl": ((d["kl"].sum(1) / mask.sum(1).clamp(min=1)).sum(), n),
            "response_tokens": (mask.sum(), n),
            "tool_call_frac": (sum("{" in r for r in b.responses), n),
            "truncated_frac": (b.truncated.sum(), n),
        }
        if "values" in d:
            pairs["value_mean"] = ((d["values"] * mask).sum(), mask.sum())
        m.update(dist.global_means(pairs, self.group), beta=self.kl_ctl.beta)
        self.kl_ctl.update(m["kl"], n * dist.world(self.group))
        return m
