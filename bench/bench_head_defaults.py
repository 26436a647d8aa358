"""linear_token_logprobs with its *default* settings against TRL 1.16's fused LM head
(`_ChunkedLogProbFunction`, as GRPOTrainer's fused_lm_head calls it): log-probs + entropy from the
hidden states, forward + backward (gradients to hidden and weight), float32 and bfloat16. What a
user who changes nothing gets: `logits_dtype="auto"` picks the tiles per machine
(`ppo_kernels.default_logits_dtype`), so the bf16 rows also time both explicit modes.

    python bench/bench_head_defaults.py [--reps 3] [--threads 1] [--sizes 512,256,32000 ...]
        [--out bench/results/cpu_head_defaults.md]

Modes interleaved per repetition; medians; the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from _common import interleaved_medians, machine, write_report  # noqa: E402

import ppo_kernels as pk  # noqa: E402


def _inputs(N, H, V, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, labels


def ours(x, **kw):
    hidden, weight, labels = x
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = pk.linear_token_logprobs(h, w, labels, return_entropy=True, **kw)
    (lp.sum() + 0.01 * ent.sum()).backward()
    return lp.detach(), h.grad, w.grad


def trl(x):
    from trl.trainer import utils as tu

    hidden, weight, labels = x
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent, *_ = tu._ChunkedLogProbFunction.apply(
        h, w, None, labels, 1.0, tu._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
    )
    (lp.sum() + 0.01 * ent.sum()).backward()
    return lp.detach().float(), h.grad, w.grad


def run(N, H, V, dtype, reps):
    x = _inputs(N, H, V, dtype)
    modes = {"ppo_kernels (defaults)": lambda: ours(x)}
    if dtype != torch.float32:
        modes["ppo_kernels (float32 tiles)"] = lambda: ours(x, logits_dtype="float32")
        modes["ppo_kernels (input tiles)"] = lambda: ours(x, logits_dtype="input")
    modes["trl fused LM head"] = lambda: trl(x)
    base = ours(x, logits_dtype="float32")  # the yardstick (and the warm-up)
    errs = {}
    for name, fn in modes.items():
        lp, gh, gw = fn()
        errs[name] = max(
            (lp - base[0]).abs().max().item(),
            (gw.float() - base[2].float()).abs().max().item() / base[2].float().abs().max().item(),
        )
    med, loads = interleaved_medians(modes, reps)
    return {n: (t, errs[n]) for n, t in med.items()}, loads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", nargs="*", default=["512,256,32000", "1024,1024,32000"])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "# linear_token_logprobs with its defaults vs TRL's fused LM head (CPU)",
        "",
        f"{machine()}. `python bench/bench_head_defaults.py {' '.join(sys.argv[1:])}`",
        "",
        "Log-probs + entropy, forward + backward, median of interleaved repetitions; err = max of "
        "the log-prob difference and the relative weight-gradient difference against float32 "
        "tiles. Default bf16 tiles here: "
        f"`{pk.default_logits_dtype(torch.bfloat16, 'cpu')}`.",
        "",
    ]
    for size in args.sizes:
        N, H, V = (int(v) for v in size.split(","))
        for dt in args.dtypes:
            res, (l0, l1) = run(N, H, V, getattr(torch, dt), args.reps)
            peer = res["trl fused LM head"][0]
            lines += [
                f"## N={N} H={H} V={V} {dt} (load {l0:.2f} -> {l1:.2f})",
                "",
                "| mode | time (ms) | vs TRL | err |",
                "|---|---|---|---|",
            ]
            for name, (t, e) in res.items():
                lines.append(f"| {name} | {t * 1e3:.0f} | {t / peer:.2f}x | {e:.1e} |")
            lines.append("")
            print("\n".join(lines[-len(res) - 4 :]), flush=True)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
