"""verl's core_algos step for each POLICY_LOSS_REGISTRY entry, unpatched vs
`ppo_kernels.integrations.apply("verl")`, on the CPU: time (median) and peak extra tensor memory.

    python bench/bench_verl_losses.py [--batch 64] [--length 1024] [--reps 5]
                                      [--out bench/results/cpu_verl_losses.md]

The step is what verl's actor runs after the model for one micro-batch, from per-token log-probs
and entropy (leaves with gradients) and the batch's old / reference log-probs, GRPO advantages and
response mask: kl_penalty("low_var_kl") + agg_loss (the KL loss), agg_loss of the entropy,
get_policy_loss_fn(name)(...) with verl's ActorConfig, and the backward of
`pg - 0.001 * entropy + 0.001 * kl`; plus, in the trainer, compute_rollout_correction_and_rejection_mask
before it for the rows with rollout correction. Modes interleaved rep by rep (apply / revert
between them, not timed); the load average is noted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")):
    sys.path.insert(0, p)
from _common import machine, peak_extra_bytes  # noqa: E402
from support import peer_stubs  # noqa: E402  (tests/support/)

import ppo_kernels.integrations as pki  # noqa: E402

LOSSES = [
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
]
POLICY = {
    "dro": dict(dro_beta=0.1),
    "bypass_mode": dict(
        rollout_correction=dict(
            bypass_mode=True, rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1
        )
    ),
}
CORRECTION = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3")
CORRECTION["rollout_rs_threshold"] = "0.5_2.0,0.1"


def _modules():
    peer_stubs.install()
    from support.integration import actor_config, verl_loss_modules

    return verl_loss_modules, actor_config


def _data(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.1 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    ent = torch.rand(B, T, generator=g) * 5
    adv = torch.randn(B, generator=g)[:, None].expand(B, T) * mask
    return lp, old, ref, roll, ent, adv.contiguous(), mask


def step(verl, name, cfg, data, correct):
    lp, old, ref, roll, ent, adv, mask = data
    x = lp.clone().requires_grad_(True)
    e = ent.clone().requires_grad_(True)
    core = verl.core
    w = None
    if correct:  # the trainer's rollout correction (old vs rollout log-probs)
        proto, mask, _ = verl.rch.compute_rollout_correction_and_rejection_mask(
            old, roll, mask, **CORRECTION
        )
        w = proto.batch["rollout_is_weights"]
    kl = core.agg_loss(core.kl_penalty(x, ref, "low_var_kl"), mask, "token-mean")
    ent_loss = core.agg_loss(e, mask, "token-mean")
    pg, _ = core.get_policy_loss_fn(name)(old, x, adv, mask, "token-mean", cfg, w)
    (pg - 1e-3 * ent_loss + 1e-3 * kl).backward()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_verl_losses.md"))
    a = ap.parse_args()
    loss_modules, actor_config = _modules()
    data = _data(a.batch, a.length)
    load0 = os.getloadavg()[0]
    rows = []
    with loss_modules() as verl:
        for name in LOSSES:
            cfg = actor_config(verl, name, **POLICY.get(name, {}))
            for correct in (False, True) if name in ("vanilla", "gspo") else (False,):
                if name == "bypass_mode" and correct:
                    continue
                times = {False: [], True: []}
                mem = {}
                for r in range(a.reps + 1):  # the first rep of each mode: warm-up
                    for patched in (False, True):
                        if patched:
                            pki.apply("verl")
                        try:
                            t = time.perf_counter()
                            step(verl, name, cfg, data, correct)
                            if r:
                                times[patched].append(time.perf_counter() - t)
                            else:
                                mem[patched] = peak_extra_bytes(
                                    lambda: step(verl, name, cfg, data, correct)
                                )
                        finally:
                            if patched:
                                rep = pki.report("verl")
                                pki.revert("verl")
                fb = sum(s["fallbacks"] for s in rep["functions"].values())
                tu, tp = (statistics.median(times[m]) * 1e3 for m in (False, True))
                label = name + (" + rollout correction" if correct else "")
                rows.append(
                    f"| {label} | {tu:.1f} / {tp:.1f} ms | {tu / tp:.2f}x | "
                    f"{mem[False] / 2**20:.1f} / {mem[True] / 2**20:.1f} MiB | {fb} |"
                )
                print(rows[-1], flush=True)
    lines = [
        "# verl core_algos step per policy-loss registry entry, unpatched vs apply('verl')",
        "",
        f"CPU: {machine()}; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at "
        f"the end (a machine shared with other jobs). `python bench/bench_verl_losses.py "
        f"--batch {a.batch} --length {a.length} --reps {a.reps}`: float32, "
        f"{a.batch} x {a.length} tokens (random lengths, GRPO-style advantages); kl_penalty "
        "low_var_kl + agg_loss, agg_loss of the entropy, the registry loss (token-mean), backward; "
        "'+ rollout correction': the trainer's compute_rollout_correction_and_rejection_mask "
        "(token IS, token_k1 + seq_mean_k3 rejection) first and its weights into the loss. "
        f"Median of {a.reps} reps, the modes interleaved rep by rep.",
        "",
        "| policy loss | time unpatched / patched | speed-up | peak extra memory unpatched / "
        "patched | fallbacks |",
        "|---|---|---|---|---|",
        *rows,
    ]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
