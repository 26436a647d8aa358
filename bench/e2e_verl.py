"""verl's PPO / GRPO step end to end on the CPU, unpatched vs patched by
`ppo_kernels.integrations.apply("verl")`, from the same seed.

    python bench/e2e_verl.py [--iters 20] [--out bench/results/cpu_e2e_verl.md]

A tiny policy (embedding + MLP to hidden states, an LM head without bias, V=512), a reference copy
and a critic. Each iteration samples its rollouts from the current policy (token by token, a
generator of its own: the same sampled data in both runs while the parameters agree), scores them
(a reward for small token ids) and trains through verl's own functions, looked up as verl's
trainer does: log-probs and entropy from the logits (`logprobs_from_logits` /
`entropy_from_logits`) or, with `use_fused_kernels`, from the hidden states
(`FusedLinearForPPO`, verl's torch backend, as verl's fused model forward calls it) ->
kl_penalty -> KL-penalised rewards -> get_adv_estimator_fn("gae" | "grpo") ->
get_policy_loss_fn(loss) with verl's ActorConfig -> agg_loss -> compute_value_loss -> Adam.
Reports per-step loss differences, whether every sampled batch was the same, the final parameter
difference (max and relative to the parameters' norm), time and peak memory of both runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import NamedTuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")):
    sys.path.insert(0, p)
from _common import machine, peak_extra_bytes  # noqa: E402
from support import peer_stubs  # noqa: E402  (tests/support/)

import ppo_kernels.integrations as pki  # noqa: E402

V, D, B, T, G = 512, 64, 16, 24, 4  # vocab, width, rollouts per iteration, length, group size
# clip_cov drops every candidate token (clip_cov_ratio 1): with fewer drawn than there are
# candidates verl's draw (a permutation from torch's generator) and ours (uniform keys) pick
# different tokens (README), which an exact comparison cannot allow
POLICY = {"clip_cov": dict(clip_cov_ratio=1.0)}
AGG = {"gspo": "seq-mean-token-mean"}  # verl's recommended mode for it


class Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Embedding(V, D), torch.nn.Linear(D, D), torch.nn.Tanh()
        )
        self.head = torch.nn.Linear(D, V, bias=False)  # verl's fused kernels take its weight

    def forward(self, x):
        return self.head(self.body(x))


class Run(NamedTuple):
    losses: list  # per optimizer step
    params: torch.Tensor  # final, flattened
    samples: list  # per iteration: the sampled tokens
    seconds: float
    replaced: int  # calls of verl's functions that ran our ops
    fallbacks: int


def _models(seed):
    torch.manual_seed(seed)
    policy = Policy()
    critic = torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.Linear(D, 1))
    ref = Policy()
    ref.load_state_dict(policy.state_dict())
    return policy, critic, ref


@torch.no_grad()
def _rollouts(policy, g):
    """B responses of T tokens sampled from the policy after one prompt token per group of G, a
    response mask (random lengths, some masked tool tokens) and a final-token score."""
    prompts = torch.randint(0, V, (B // G, 1), generator=g).repeat_interleave(G, 0)
    tokens = prompts
    for _ in range(T):
        probs = torch.softmax(policy(tokens[:, -1]), -1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], 1)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    mask[:, : T // 4] *= (torch.rand(B, T // 4, generator=g) > 0.3).float()  # tool tokens
    scores = torch.zeros(B, T)
    good = ((tokens[:, 1:] < V // 4).float() * mask).sum(-1) / mask.sum(-1)
    scores[torch.arange(B), lengths - 1] = good
    uids = np.array([f"prompt{i // G}" for i in range(B)], dtype=object)
    return tokens, mask, scores, uids


def _config(loss):
    actor = importlib.import_module("verl.workers.config.actor")
    return actor.ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=G,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        policy_loss=actor.PolicyLossConfig(loss_mode=loss, **POLICY.get(loss, {})),
        global_batch_info={},
    )


def run(algo="ppo", iters=20, seed=0, patched=False, epochs=2, loss="vanilla", fused=False):
    """One training run: a `Run` (per-step losses, final parameters, sampled tokens, seconds,
    calls replaced and fallen back)."""
    peer_stubs.install()
    core = importlib.import_module("verl.trainer.ppo.core_algos")
    tf = importlib.import_module("verl.utils.torch_functional")
    exp = importlib.import_module("verl.utils.experimental.torch_functional")
    policy, critic, ref = _models(seed)
    opt = torch.optim.Adam(list(policy.parameters()) + list(critic.parameters()), lr=3e-3)
    cfg, agg = _config(loss), AGG.get(loss, "token-mean")
    g = torch.Generator().manual_seed(seed + 1)

    def logprobs_entropy(model, inp, labels):
        if fused:  # use_fused_kernels: verl's torch backend from the hidden states
            return exp.FusedLinearForPPO(impl_backend="torch")(
                model.body(inp), model.head.weight, labels, temperature=1.0
            )
        logits = model(inp)
        return tf.logprobs_from_logits(logits, labels), tf.entropy_from_logits(logits)

    if patched:
        pki.apply("verl")
    losses, samples, rep = [], [], None
    t0 = time.perf_counter()
    try:
        for _ in range(iters):
            tokens, mask, scores, uids = _rollouts(policy, g)
            samples.append(tokens)
            inp, labels = tokens[:, :-1], tokens[:, 1:]
            with torch.no_grad():
                old = logprobs_entropy(policy, inp, labels)[0]
                ref_lp = logprobs_entropy(ref, inp, labels)[0]
                values = critic(inp).squeeze(-1) * mask
                kld = core.kl_penalty(old, ref_lp, kl_penalty="low_var_kl") * mask
                rewards = scores - 0.05 * kld
                if algo == "ppo":
                    adv, ret = core.get_adv_estimator_fn("gae")(rewards, values, mask, 1.0, 0.95)
                else:
                    adv, ret = core.get_adv_estimator_fn("grpo")(rewards, mask, uids)
            for _ in range(epochs):
                lp, ent = logprobs_entropy(policy, inp, labels)
                pg, _ = core.get_policy_loss_fn(loss)(old, lp, adv, mask, agg, cfg)
                total = pg - 1e-3 * core.agg_loss(ent, mask, "token-mean")
                if algo == "ppo":
                    vf, _ = core.compute_value_loss(critic(inp).squeeze(-1), ret, values, mask, 0.5)
                    total = total + 0.5 * vf
                opt.zero_grad()
                total.backward()
                opt.step()
                losses.append(total.item())
    finally:
        if patched:
            rep = pki.report("verl")
            pki.revert("verl")
    secs = time.perf_counter() - t0
    params = torch.cat(
        [p.detach().flatten() for p in list(policy.parameters()) + list(critic.parameters())]
    )
    fns = rep["functions"].values() if rep else ()
    return Run(
        losses,
        params,
        samples,
        secs,
        sum(s["replaced"] for s in fns),
        sum(s["fallbacks"] for s in fns),
    )


def compare(u: Run, p: Run) -> dict:
    """The differences the README reports (and tests/integrations/test_verl.py bounds)."""
    d = (u.params - p.params).abs()
    return {
        "loss_abs": max(abs(x - y) for x, y in zip(u.losses, p.losses)),
        "loss_rel": max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(u.losses, p.losses)),
        "same_samples": len(u.samples) == len(p.samples)
        and all(torch.equal(a, b) for a, b in zip(u.samples, p.samples)),
        "param_max": d.max().item(),
        "param_rel": (d.norm() / u.params.norm()).item(),
    }


CONFIGS = [  # (algo, loss, use_fused_kernels)
    ("ppo", "vanilla", False),
    ("ppo", "vanilla", True),
    ("ppo", "gspo", True),
    ("ppo", "clip_cov", True),
    ("ppo", "cispo", True),
    ("grpo", "vanilla", False),
    ("grpo", "vanilla", True),
    ("grpo", "gspo", True),
    ("grpo", "clip_cov", True),
    ("grpo", "cispo", True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_e2e_verl.md"))
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    for algo, loss, fused in CONFIGS:
        kw = dict(algo=algo, loss=loss, fused=fused)
        run(iters=1, **kw)  # warm-up: imports, first calls
        run(iters=1, patched=True, **kw)
        u = run(iters=a.iters, **kw)
        p = run(iters=a.iters, patched=True, **kw)
        c = compare(u, p)
        mu = peak_extra_bytes(lambda kw=kw: run(iters=2, **kw))
        mp = peak_extra_bytes(lambda kw=kw: run(iters=2, patched=True, **kw))
        rows.append(
            f"| {algo} | {loss} | {'hidden states' if fused else 'logits'} | "
            f"{c['loss_abs']:.1e} ({c['loss_rel']:.1e}) | {'yes' if c['same_samples'] else 'NO'} "
            f"| {c['param_max']:.1e} ({c['param_rel']:.1e}) | {u.seconds:.2f} s | "
            f"{p.seconds:.2f} s | {mu / 2**20:.1f} / {mp / 2**20:.1f} MiB | {p.replaced} "
            f"({p.fallbacks} fallbacks) |"
        )
        print(rows[-1], flush=True)
    lines = [
        "# verl PPO / GRPO end to end, unpatched vs ppo_kernels.integrations.apply('verl')",
        "",
        f"CPU: {machine()}; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at "
        f"the end (a machine shared with other jobs: times vary). `python bench/e2e_verl.py "
        f"--iters {a.iters}`: {a.iters} iterations x 2 epochs, B={B} sampled responses of T={T} "
        f"tokens, V={V}, float32, Adam lr 3e-3, same seed; time of the whole run, peak extra "
        "tensor memory of a 2-iteration run. Log-probs from the logits or, with "
        "use_fused_kernels, from the hidden states (verl's FusedLinearForPPO, torch backend).",
        "",
        "| algo | policy loss | log-probs from | max per-step loss diff: abs (rel) | same "
        "sampled data | final params: max diff (norm-relative) | unpatched | patched | peak "
        "memory (unpatched / patched) | calls replaced |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
