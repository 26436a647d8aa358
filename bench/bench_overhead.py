"""Per-call cost of every public op against the eager code it replaces, one CPU thread: at a tiny
size (B x T = 2 x 8: what the call itself costs: argument checks, dispatch, autograd glue) and at
64 x 4096 (where the kernel's own speed shows). The eager side is the peers' composition each op
replaces (`eager_*` / `verl_*` in the ops' naive.py, or the one-liner named in the table).

    python bench/bench_overhead.py [--reps 2000] [--sizes small,large] [--ops kl_penalty,...]
        [--out bench/results/cpu_overhead.md]

Each pair is timed interleaved (ours, eager, ours, eager, ... in rounds of many calls), and the
medians of the rounds are reported: a busy machine slows both sides of a round alike. The load
average is printed first; quote numbers only from a quiet machine (load well below its cores).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _common import machine  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.gae import naive as gref  # noqa: E402
from ppo_kernels.group_advantages import naive as garef  # noqa: E402
from ppo_kernels.kl import naive as kref  # noqa: E402
from ppo_kernels.losses import naive as lref  # noqa: E402
from ppo_kernels.masked_stats import naive as mref  # noqa: E402
from ppo_kernels.token_logprobs import naive as tref  # noqa: E402

SIZES = {"small": (2, 8), "large": (64, 4096)}


def _inputs(B, T, grad=False):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(B, T, generator=g) * 5).requires_grad_(grad)
    old = lp.detach() + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    return dict(
        lp=lp,
        old=old,
        ref=old + 0.2 * torch.randn(B, T, generator=g),
        adv=adv,
        mask=mask,
        fmask=mask.float(),
        scores=torch.randn(B, generator=g),
        values=torch.randn(B, T, generator=g).requires_grad_(grad),
        old_values=torch.randn(B, T, generator=g),
        returns=torch.randn(B, T, generator=g),
        rewards=torch.randn(B, T, generator=g) * 0.1,
        group=torch.arange(B) // 2,
    )


def _verl_masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def _verl_agg_seq_mean_token_mean(x, m):
    """verl's agg_loss, "seq-mean-token-mean" (masked_mean per row, then the mean of the rows)."""
    return ((x * m).sum(-1) / (m.sum(-1) + 1e-8)).mean()


def _backward(fn):
    def run():
        loss = fn()
        loss.backward()

    return run


def cases(B, T):
    """(name, ours, eager) per op: zero-argument callables on fixed inputs."""
    x = _inputs(B, T)
    xg = _inputs(B, T, grad=True)
    V = 64  # the per-token vocabulary ops at a tiny vocabulary: their per-call cost
    logits = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    logits_g = logits.clone().requires_grad_(True)
    ref_logits = torch.randn(B, T, V)
    H = 16
    hidden = torch.randn(B * T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    lab_flat = labels.reshape(-1)
    pl = dict(clip_low=0.2, dual_clip=None, agg="token-mean")
    out = [
        (
            "kl_penalty k1",
            lambda: pk.kl_penalty(x["lp"], x["ref"], "k1"),
            lambda: kref.eager_kl_penalty_verl(x["lp"], x["ref"], "k1"),
        ),
        (
            "kl_penalty k3",
            lambda: pk.kl_penalty(x["lp"], x["ref"], "k3"),
            lambda: kref.eager_kl_penalty_verl(x["lp"], x["ref"], "k3"),
        ),
        (
            "kl_penalized_rewards",
            lambda: pk.kl_penalized_rewards(x["scores"], x["lp"], x["ref"], x["mask"], beta=0.05),
            lambda: kref.eager_kl_rewards(x["scores"], x["lp"], x["ref"], x["mask"], 0.05),
        ),
        (
            "gae",
            lambda: pk.gae(x["rewards"], x["values"].detach(), x["mask"], gamma=1.0, lam=0.95),
            lambda: gref.verl_gae_loop(x["rewards"], x["values"].detach(), x["fmask"], 1.0, 0.95),
        ),
        (
            "masked_mean",
            lambda: pk.masked_mean(x["adv"], x["fmask"]),
            lambda: _verl_masked_mean(x["adv"], x["fmask"]),
        ),
        (
            "masked_whiten",
            lambda: pk.masked_whiten(x["adv"], x["fmask"]),
            lambda: mref.verl_masked_whiten(x["adv"], x["fmask"]),
        ),
        (
            "grpo_advantages",
            lambda: pk.grpo_advantages(x["scores"], x["group"]),
            lambda: garef.eager_grpo_verl_style(x["scores"], x["group"]),
        ),
        (
            "ppo_policy_loss fwd+bwd",
            _backward(lambda: pk.ppo_policy_loss(xg["lp"], x["old"], x["adv"], x["mask"], **pl)[0]),
            _backward(
                lambda: lref.eager_policy_loss_verl_style(
                    xg["lp"], x["old"], x["adv"], x["fmask"], dual_clip=None, sync=False
                )[0]
            ),
        ),
        (
            "ppo_policy_loss grpo fwd+bwd",
            _backward(
                lambda: pk.ppo_policy_loss(
                    xg["lp"], x["old"], x["adv"], x["mask"], loss_type="grpo"
                )[0]
            ),
            _backward(
                lambda: lref.eager_policy_loss_trl_style(
                    xg["lp"], x["old"], x["adv"], x["mask"], "grpo"
                )[0]
            ),
        ),
        (
            "ppo_value_loss fwd+bwd",
            _backward(
                lambda: pk.ppo_value_loss(
                    xg["values"], x["old_values"], x["returns"], x["mask"], clip=0.2
                )[0]
            ),
            _backward(
                lambda: lref.eager_value_loss_verl_style(
                    xg["values"], x["old_values"], x["returns"], x["fmask"]
                )[0]
            ),
        ),
        (
            "reward_model_loss fwd+bwd",
            _backward(lambda: pk.reward_model_loss(xg["values"][:, 0], x["returns"][:, 0])),
            _backward(
                lambda: (
                    -torch.nn.functional.logsigmoid(xg["values"][:, 0] - x["returns"][:, 0]).mean()
                )
            ),
        ),
        (
            "dpo_loss fwd+bwd",
            _backward(
                lambda: pk.dpo_loss(
                    xg["values"][:, 0], x["returns"][:, 0], x["old"][:, 0], x["ref"][:, 0], beta=0.1
                )
            ),
            _backward(
                lambda: (
                    -torch.nn.functional.logsigmoid(
                        0.1
                        * (
                            (xg["values"][:, 0] - x["old"][:, 0])
                            - (x["returns"][:, 0] - x["ref"][:, 0])
                        )
                    ).mean()
                )
            ),
        ),
        (
            "masked_aggregate seq-mean-token-mean fwd+bwd",
            _backward(lambda: pk.masked_aggregate(xg["values"], x["mask"], "seq-mean-token-mean")),
            _backward(lambda: _verl_agg_seq_mean_token_mean(xg["values"], x["fmask"])),
        ),
    ]
    if B * T <= 4096:  # the vocabulary ops' per-call cost (their speed at size: their benches)
        out += [
            (
                f"token_logprobs V={V}",
                lambda: pk.token_logprobs(logits, labels),
                lambda: tref.eager_logprobs(logits, labels),
            ),
            (
                f"token_logprobs V={V} +entropy fwd+bwd",
                _backward(
                    lambda: sum(pk.token_logprobs(logits_g, labels, return_entropy=True)).sum()
                ),
                _backward(
                    lambda: sum(tref.eager_logprobs(logits_g, labels, return_entropy=True)).sum()
                ),
            ),
            (
                f"full_kl V={V}",
                lambda: pk.full_kl(logits, ref_logits),
                lambda: (
                    torch.softmax(logits, -1)
                    * (torch.log_softmax(logits, -1) - torch.log_softmax(ref_logits, -1))
                ).sum(-1),
            ),
            (
                f"linear_token_logprobs H={H} V={V} fwd+bwd",
                _backward(lambda: pk.linear_token_logprobs(hidden, weight, lab_flat).sum()),
                _backward(
                    lambda: (
                        torch.log_softmax((hidden @ weight.T).float(), -1)
                        .gather(-1, lab_flat[:, None])
                        .sum()
                    )
                ),
            ),
            (
                f"linear_policy_loss H={H} V={V} bnpo+k3 fwd+bwd",
                _backward(
                    lambda: pk.linear_policy_loss(
                        hidden.view(B, T, H),
                        weight,
                        labels,
                        x["adv"],
                        x["old"],
                        x["mask"],
                        loss_type="bnpo",
                        ref_logprobs=x["ref"],
                        kl_coef=0.04,
                        kl_estimator="k3",
                    )[0]
                ),
                _backward(lambda: _eager_linear_bnpo(hidden, weight, labels, x)),
            ),
        ]
    return out


def _eager_linear_bnpo(hidden, weight, labels, x):
    """TRL's GRPOTrainer bnpo loss (+ its clip statistics) with beta's k3 term, on materialised
    logits: what linear_policy_loss replaces at a size where the logits are no burden."""
    B, T = labels.shape
    logits = (hidden @ weight.T).float()
    lp = torch.log_softmax(logits, -1).gather(-1, labels.reshape(-1, 1)).view(B, T)
    loss, _ = lref.eager_policy_loss_trl_style(lp, x["old"], x["adv"], x["mask"], "bnpo")
    d = x["ref"] - lp
    m = x["mask"].float()
    return loss + 0.04 * ((torch.exp(d) - d - 1) * m).sum() / m.sum().clamp(min=1.0)


def time_pair(a, b, reps, rounds=15):
    """Medians (seconds per call) of `rounds` interleaved rounds of `reps` calls each."""
    for f in (a, b):
        for _ in range(max(3, reps // 20)):
            f()
    ta, tb = [], []
    for _ in range(rounds):
        for f, acc in ((a, ta), (b, tb)):
            t = time.perf_counter()
            for _ in range(reps):
                f()
            acc.append((time.perf_counter() - t) / reps)
    return statistics.median(ta), statistics.median(tb)


def fmt(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=0, help="calls per round (default: by size)")
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--ops", default="", help="comma-separated substrings of case names")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    head = f"machine: {machine()}; load average {load:.2f} at the start"
    print(head)
    lines = [
        "| op | B x T | ppo_kernels | eager | ratio |",
        "|---|---|---|---|---|",
    ]
    for size in args.sizes.split(","):
        B, T = SIZES[size]
        for name, ours, eager in cases(B, T):
            if args.ops and not any(o in name for o in args.ops.split(",")):
                continue
            reps = args.reps or (500 if B * T <= 4096 else 5)
            if name == "gae" and B * T > 4096:
                reps = 1  # verl's loop over 4096 time steps
            a, b = time_pair(ours, eager, reps)
            row = f"| `{name}` | {B} x {T} | {fmt(a)} | {fmt(b)} | {a / b:.2f}x |"
            print(row, flush=True)
            lines.append(row)
    if args.out:
        text = (
            "# Per-call cost on the CPU, one thread (bench/bench_overhead.py)\n\n"
            f"{head}; interleaved rounds, medians.\n\n" + "\n".join(lines) + "\n"
        )
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
