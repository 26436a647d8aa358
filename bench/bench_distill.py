"""The distillation loss from hidden states, forward + backward, side by side in one run:

  fused         ppo_kernels.linear_distill_loss (the student's and the teacher's tiles side by
                side per row block; bf16 in both logits_dtype modes)
  liger         liger_kernel.chunked_loss.LigerFusedLinearJSDLoss, its defaults (compiled,
                chunk_size 1024; --liger-eager adds compiled=False)
  materialised  both heads' [N, V] logits, float32 log_softmax, Liger's JSD + the hard-label
                cross-entropy by autograd (distill/naive.py eager_linear_distill_loss)
  4 GEMMs       the floor: the four GEMMs every fused loss here runs, alone (no check)

The same loss for all: Liger's defaults (generalised JSD, beta 0.5, temperature 1, weights 0.5 /
0.5), the teacher another head of width H over the same vocabulary. Modes interleaved per
repetition; median time and peak extra tensor memory (the student's gradients included); the load
average before and after (`uptime`'s). Loss and gradients checked against the materialised loss
before timing.

    python bench/bench_distill.py [--reps 3] [--threads 1] [--sizes N,H,V ...]
        [--dtypes float32 bfloat16] [--liger-eager] [--skip NAME ...]
        [--out bench/results/cpu_distill.md] [--csv bench/results/cpu_distill.csv]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from _common import interleaved_medians, machine, peak_extra_bytes, write_report  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels.distill.naive import eager_linear_distill_loss  # noqa: E402

BETA, W_HARD, W_SOFT, TEMPERATURE = 0.5, 0.5, 0.5, 1.0  # Liger's defaults


def _inputs(N, H, V, dtype, seed=0):
    """Student and teacher heads of width H (the teacher near the student), 10% ignored labels."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    th = (h.float() + 0.3 * torch.randn(N, H, generator=g)).to(dtype)
    tW = (W.float() + 0.3 * torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.1] = -100
    return dict(h=h, W=W, th=th, tW=tW, labels=labels)


def _leaves(x):
    return x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()


def _backward(loss, h, W):
    loss.backward()
    return loss.detach(), h.grad, W.grad


def fused(x, logits_dtype=None):
    h, W = _leaves(x)
    loss, _ = pk.linear_distill_loss(
        h, W, x["labels"], x["th"], x["tW"], beta=BETA, temperature=TEMPERATURE,
        weight_hard_loss=W_HARD, weight_soft_loss=W_SOFT, logits_dtype=logits_dtype,
    )  # fmt: skip
    return _backward(loss, h, W)


_LIGER = {}


def liger(x, compiled=True):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    if compiled not in _LIGER:
        _LIGER[compiled] = LigerFusedLinearJSDLoss(compiled=compiled)  # its defaults otherwise
    h, W = _leaves(x)
    return _backward(_LIGER[compiled](h, W, x["th"], x["tW"], x["labels"]), h, W)


def materialised(x):
    h, W = _leaves(x)
    loss = eager_linear_distill_loss(
        h, W, x["labels"], x["th"], x["tW"], beta=BETA, temperature=TEMPERATURE,
        weight_hard_loss=W_HARD, weight_soft_loss=W_SOFT,
    )  # fmt: skip
    return _backward(loss, h, W)


def four_gemms(x, rows=512):
    """The floor of every mode here: the four GEMMs a fused loss cannot avoid (the student's and
    the teacher's logits, the two gradient GEMMs), in row blocks, and nothing else."""
    h, W, th, tW = x["h"], x["W"], x["th"], x["tW"]
    gW = torch.zeros_like(W)
    for r in range(0, h.shape[0], rows):
        z = h[r : r + rows] @ W.T
        th[r : r + rows] @ tW.T
        z @ W
        gW.addmm_(z.T, h[r : r + rows])
    return gW


def run_size(N, H, V, dtype, reps, liger_eager, skip=()):
    x = _inputs(N, H, V, dtype)
    modes = {}
    if dtype == torch.float32:
        modes["fused"] = lambda: fused(x)
    else:
        modes["fused (float32 tiles)"] = lambda: fused(x, "float32")
        modes["fused (input tiles)"] = lambda: fused(x, "input")
    modes["liger (compiled)"] = lambda: liger(x, True)
    if liger_eager:
        modes["liger (compiled=False)"] = lambda: liger(x, False)
    modes["materialised"] = lambda: materialised(x)
    modes = {n: f for n, f in modes.items() if not any(s in n for s in skip)}
    # the materialised loss is the yardstick of the numbers (the first mode's, when it is left
    # out: its [N, V] tensors can exceed the machine's memory); each mode's first call is its
    # warm-up (Liger's compilation) and its peak-memory measurement
    base = materialised(x) if "materialised" in modes else None
    check, peaks = {}, {}
    for name, fn in modes.items():
        got = []
        peaks[name] = peak_extra_bytes(lambda fn=fn, got=got: got.append(fn()))
        loss, gh, gW = got.pop()
        if base is None:
            base = (loss, gh, gW)
        err = max(
            (gh.float() - base[1].float()).abs().max().item() / base[1].float().abs().max().item(),
            (gW.float() - base[2].float()).abs().max().item() / base[2].float().abs().max().item(),
        )
        check[name] = (abs(loss.item() - base[0].item()), err)
    if not any(s in "4 GEMMs alone (floor)" for s in skip):
        modes["4 GEMMs alone (floor)"] = lambda: four_gemms(x)
        peaks["4 GEMMs alone (floor)"] = peak_extra_bytes(modes["4 GEMMs alone (floor)"])
        check["4 GEMMs alone (floor)"] = (float("nan"), float("nan"))
    med, loads = interleaved_medians(modes, reps)
    return {n: (med[n], peaks[n], check[n]) for n in modes}, loads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", nargs="*", default=["4096,1024,32000", "2048,256,152064"])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--liger-eager", action="store_true", help="also Liger with compiled=False")
    ap.add_argument("--skip", nargs="*", default=[], help="leave out modes whose name has this")
    ap.add_argument("--out", default=None)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "# The distillation loss from hidden states: fused vs Liger vs materialised logits (CPU)",
        "",
        f"{machine()}. `python bench/bench_distill.py {' '.join(sys.argv[1:])}`",
        "",
        f"Liger's defaults: jsd beta {BETA}, temperature {TEMPERATURE}, weight_hard "
        f"{W_HARD}, weight_soft {W_SOFT}; forward + backward, median of {args.reps} interleaved "
        "repetitions; peak = extra tensor memory (the student's gradients included); loss / grad "
        "err = absolute loss difference / max relative gradient difference against the "
        "materialised loss (against the first mode where it is left out).",
        "",
        'The default (`logits_dtype="auto"`) for bfloat16 on this machine: '
        f"`{pk.default_logits_dtype(torch.bfloat16, 'cpu')}` tiles.",
        "",
    ]
    rows = []
    for size in args.sizes:
        N, H, V = (int(v) for v in size.split(","))
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            res, (l0, l1) = run_size(N, H, V, dtype, args.reps, args.liger_eager, args.skip)
            lig = res.get("liger (compiled)", (None,))[0]
            mat = res.get("materialised", (None,))[0]
            mat_peak = res.get("materialised", (0, None))[1]
            lig_peak = res.get("liger (compiled)", (0, None))[1]
            lines += [
                f"## N={N} H={H} V={V} {dt} (load {l0:.2f} -> {l1:.2f})",
                "",
                "| mode | time (ms) | vs liger | vs materialised | peak (MiB) | peak vs liger | "
                "peak vs materialised | loss err | grad err |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for name, (t, peak, (le, ge)) in res.items():

                def ratio(a, b):
                    return f"{a / b:.2f}x" if b else "-"

                lines.append(
                    f"| {name} | {t * 1e3:.0f} | {ratio(t, lig)} | {ratio(t, mat)} | "
                    f"{peak / 2**20:.0f} | {ratio(peak, lig_peak)} | {ratio(peak, mat_peak)} | "
                    f"{le:.1e} | {ge:.1e} |"
                )
                rows.append(dict(N=N, H=H, V=V, dtype=dt, mode=name, ms=round(t * 1e3, 1),
                                 peak_mib=round(peak / 2**20, 1), loss_err=le, grad_err=ge,
                                 load_before=l0, load_after=l1))  # fmt: skip
            lines.append("")
            print("\n".join(lines[-len(res) - 4 :]), flush=True)
    write_report(lines, args.out)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
