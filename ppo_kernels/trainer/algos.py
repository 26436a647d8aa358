"""SFT warm-up, evaluation, and the PPO / GRPO / DPO / reward-model updates. Every per-token
computation goes through `Ops` (fused ppo_kernels ops or the eager implementations)."""

from __future__ import annotations

import contextlib
import copy
import math
import random

import torch

from . import dist
from .config import TrainConfig
from .models import ValueModel, frozen_copy, last_index, score, token_logprobs
from .ops import Ops
from .rollout import SeqBatch, assemble, generate, segments_to_tokens

# Sequences per forward / backward pass of the update under --batch-invariant, whatever
# --micro-batch says: the passes, hence the order in which the gradient is summed, are the mode's.
# The default mode's default pass (a minibatch of 32): the same passes at the same cost (fewer
# sequences per pass cost several times more per step: bench/results/cpu_batch_invariant.md);
# --micro-batch does not bound the update's activations in the mode. A pass's rows are computed
# as in any other batch (the model is batch-invariant), so the first update's ratio stays 1.
INVARIANT_PASS_ROWS = 32


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
        b = generate(
            actor,
            tok,
            task,
            prompt_tokens(tok, ps),
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            generator=g,
            device=cfg.device,
            rows=(a - lo, hi - lo),
            group=group,
        )
        total += sum(task.verify(p, r) for p, r in zip(ps, b.responses))
        tool += sum(("{" in r) for r in b.responses)
        n += len(ps)
    m = dist.global_means({"reward": (total, n), "tool": (tool, n)}, group)
    return m["reward"], m["tool"]


# ---------------------------------------------------------------------------------------------
# PPO / GRPO
# ---------------------------------------------------------------------------------------------
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
        self.actor_opt = _adamw(self.policy.parameters(), cfg.actor_lr, cfg.weight_decay)
        self.critic_opt = (
            _adamw(self.critic.parameters(), cfg.critic_lr, cfg.weight_decay)
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
        total = len(problems) * cfg.group_size
        problems, lo = dist.share(problems, self.group)
        problems = [p for p in problems for _ in range(cfg.group_size)]
        b = generate(
            self.policy,
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


# ---------------------------------------------------------------------------------------------
# Reward model and DPO (preference pairs): each rank takes its equal share of every batch of
# pairs; the pair-mean losses averaged over the ranks are the one-process loss
# ---------------------------------------------------------------------------------------------
def preference_data(cfg, tok, task, n, seed):
    rng = random.Random(seed)
    problems = [task.sample_problem(rng) for _ in range(n)]
    pairs = [task.preference_pair(p, rng) for p in problems]
    return problems, pairs


def _pair_batch(cfg, tok, problems, pairs, lo, hi) -> SeqBatch:
    """Pairs lo..hi as one batch: the chosen responses, then the rejected ones."""
    ps = problems[lo:hi]
    both = [c for c, _ in pairs[lo:hi]] + [r for _, r in pairs[lo:hi]]
    return pairs_batch(tok, ps + ps, both, cfg.device)


@torch.no_grad()
def rm_accuracy(cfg, rm, tok, problems, pairs, group=None):
    """Held-out pairwise accuracy (a tie counts half), over every rank's share of the pairs."""
    rm.eval()
    right, n = 0.0, 0
    for lo, hi in dist.chunks(len(problems), 64, group):
        a, z = dist.span(lo, hi, group)
        b = _pair_batch(cfg, tok, problems, pairs, a, z)
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
    opt = _adamw(rm.parameters(), cfg.pref_lr, cfg.weight_decay)  # before any forward (dist.wrap)
    acc_before = rm_accuracy(cfg, rm, tok, ev_problems, ev_pairs, group)
    nb = cfg.pairs // cfg.pref_batch
    for step in range(steps):
        rm.train()
        start = (step % nb) * cfg.pref_batch
        lo, hi = dist.span(start, start + cfg.pref_batch, group)
        with around_step(step):
            b = _pair_batch(cfg, tok, problems, pairs, lo, hi)
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
        _pair_batch(cfg, tok, problems, pairs, lo, min(lo + 64, len(pairs)))
        for lo in range(0, len(pairs), 64)
    )
    s = torch.cat([score(rm, *b.model_inputs()) for b in batches])
    mean, std = s.mean(), s.std().clamp(min=1e-6)
    rm.head.weight.div_(std)
    rm.head.bias.sub_(mean).div_(std)


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
    opt = _adamw(policy.parameters(), cfg.dpo_lr, cfg.weight_decay)
    nb = cfg.pairs // cfg.pref_batch
    for step in range(cfg.steps):
        policy.train()
        start = (step % nb) * cfg.pref_batch
        lo, hi = dist.span(start, start + cfg.pref_batch, group)
        with around_step(step):
            b = _pair_batch(cfg, tok, problems, pairs, lo, hi)
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
