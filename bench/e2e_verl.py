"""verl's core_algos PPO / GRPO pipeline end to end on the CPU, unpatched vs patched by
`ppo_kernels.integrations.apply("verl")`, from the same seed on the same synthetic rollouts.

    python bench/e2e_verl.py [--iters 20] [--out bench/results/cpu_e2e_verl.md]

A tiny policy (embedding + 2-layer MLP + LM head, V=512) and critic are trained for `--iters`
iterations on synthetic rollouts (token sequences with a response mask and a reward that prefers
small token ids), each iteration through verl's own functions looked up as verl's trainer does:
kl_penalty -> KL-penalised rewards -> get_adv_estimator_fn("gae" | "grpo") ->
logprobs_from_logits / entropy_from_logits -> get_policy_loss_fn("vanilla") -> agg_loss ->
compute_value_loss -> Adam. Reports per-step loss differences, final parameter differences, time
and peak memory of both runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")):
    sys.path.insert(0, p)
import _peer_stubs  # noqa: E402
from _common import machine, peak_extra_bytes  # noqa: E402

import ppo_kernels.integrations as pki  # noqa: E402

V, D, B, T, G = 512, 64, 16, 24, 4  # vocab, width, rollouts per iteration, length, group size


class Cfg(dict):
    __getattr__ = dict.get


def _models(seed):
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(
        torch.nn.Embedding(V, D), torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, V)
    )
    critic = torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.Linear(D, 1))
    ref = torch.nn.Sequential(
        torch.nn.Embedding(V, D), torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, V)
    )
    ref.load_state_dict(policy.state_dict())
    return policy, critic, ref


def _rollouts(iters, seed):
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(iters):
        tokens = torch.randint(0, V, (B, T + 1), generator=g)
        lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
        mask = (torch.arange(T) < lengths[:, None]).float()
        mask[:, : T // 4] *= (torch.rand(B, T // 4, generator=g) > 0.3).float()  # tool tokens
        scores = torch.zeros(B, T)
        good = ((tokens[:, 1:] < V // 4).float() * mask).sum(-1) / mask.sum(-1)
        scores[torch.arange(B), lengths - 1] = good
        uids = np.array([f"prompt{i // G}" for i in range(B)], dtype=object)
        out.append((tokens, mask, scores, uids))
    return out


def run(algo="ppo", iters=20, seed=0, patched=False, epochs=2):
    """(per-step losses, final parameters, seconds) of one training run."""
    _peer_stubs.install()
    core = importlib.import_module("verl.trainer.ppo.core_algos")
    tf = importlib.import_module("verl.utils.torch_functional")
    policy, critic, ref = _models(seed)
    opt = torch.optim.Adam(list(policy.parameters()) + list(critic.parameters()), lr=3e-3)
    cfg = Cfg(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        global_batch_info={},
    )
    if patched:
        pki.apply("verl")
    losses, rep = [], None
    t0 = time.perf_counter()
    try:
        for tokens, mask, scores, uids in _rollouts(iters, seed):
            inp, labels = tokens[:, :-1], tokens[:, 1:]
            with torch.no_grad():
                old = tf.logprobs_from_logits(policy(inp), labels)
                ref_lp = tf.logprobs_from_logits(ref(inp), labels)
                values = critic(inp).squeeze(-1) * mask
                kld = core.kl_penalty(old, ref_lp, kl_penalty="low_var_kl") * mask
                rewards = scores - 0.05 * kld
                if algo == "ppo":
                    adv, ret = core.get_adv_estimator_fn("gae")(rewards, values, mask, 1.0, 0.95)
                else:
                    adv, ret = core.get_adv_estimator_fn("grpo")(rewards, mask, uids)
            for _ in range(epochs):
                logits = policy(inp)
                lp = tf.logprobs_from_logits(logits, labels)
                ent = tf.entropy_from_logits(logits)
                pg, _ = core.get_policy_loss_fn("vanilla")(old, lp, adv, mask, "token-mean", cfg)
                loss = pg - 1e-3 * core.agg_loss(ent, mask, "token-mean")
                if algo == "ppo":
                    vf, _ = core.compute_value_loss(critic(inp).squeeze(-1), ret, values, mask, 0.5)
                    loss = loss + 0.5 * vf
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    finally:
        if patched:
            rep = pki.report("verl")
            pki.revert("verl")
    secs = time.perf_counter() - t0
    params = torch.cat(
        [p.detach().flatten() for p in list(policy.parameters()) + list(critic.parameters())]
    )
    replaced = sum(s["replaced"] for s in rep["functions"].values()) if rep else 0
    return losses, params, secs, replaced


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_e2e_verl.md"))
    a = ap.parse_args()
    lines = [
        "# verl core_algos end to end, unpatched vs ppo_kernels.integrations.apply('verl')",
        "",
        f"CPU: {machine()}. `python bench/e2e_verl.py --iters {a.iters}`: {a.iters} iterations x "
        f"2 epochs, B={B}, T={T}, V={V}, float32, same seed and rollouts; time of the whole run, "
        "peak extra tensor memory of a 2-iteration run.",
        "",
        "| algo | max per-step loss diff: abs (rel) | max final param diff | unpatched | patched | "
        "peak memory of one run (unpatched / patched) | calls replaced |",
        "|---|---|---|---|---|---|---|",
    ]
    for algo in ("ppo", "grpo"):
        run(algo, 1)  # warm-up: imports, first calls
        run(algo, 1, patched=True)
        lu, pu, tu, _ = run(algo, a.iters)
        lp, pp, tp, nrep = run(algo, a.iters, patched=True)
        da = max(abs(x - y) for x, y in zip(lu, lp))
        dl = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(lu, lp))
        dp = (pu - pp).abs().max().item()
        mu = peak_extra_bytes(lambda algo=algo: run(algo, 2))
        mp = peak_extra_bytes(lambda algo=algo: run(algo, 2, patched=True))
        lines.append(
            f"| {algo} | {da:.1e} ({dl:.1e}) | {dp:.1e} | {tu:.2f} s | {tp:.2f} s | "
            f"{mu / 2**20:.1f} / {mp / 2**20:.1f} MiB (2 iterations) | {nrep} |"
        )
        print(lines[-1], flush=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
