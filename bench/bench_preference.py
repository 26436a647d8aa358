"""The DPO loss from the hidden states with a reference head, forward + backward, side by side:

  fused         ppo_kernels.linear_preference_loss (the reference head reduced in the same call;
                bf16: float32 and input tiles)
  liger         liger_kernel.chunked_loss.LigerFusedLinearDPOLoss with its defaults (compiled,
                chunk_size 1 pair, use_ref_model)
  materialised  the same loss on the [N, V] logits of both heads (log_softmax in float32, the
                reference under no_grad), differentiated by autograd
  4 GEMMs       the floor: the four GEMMs every fused loss here runs (bench_distill.four_gemms),
                alone (no check)

The same loss for all: sigmoid DPO, beta 0.1, summed completion log-probs, the first half of the
rows chosen. Modes interleaved per repetition; median time and peak extra tensor memory (the
gradients included); the load average before and after (`uptime` noted in the report). Loss
and gradients checked against the fused op before timing. The materialised loss is skipped when
/proc/meminfo says less memory is available than it needs (noted in the report).

    python bench/bench_preference.py [--reps 3] [--threads 2] [--sizes P,T,H,V ...]
        [--dtypes float32 bfloat16] [--out bench/results/cpu_preference.md]

`bash scripts/dev.sh bench --only preference` runs it (bench/run.py) and writes the CSV of its
tables beside the markdown.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from _common import interleaved_medians, machine, peak_extra_bytes, write_report  # noqa: E402
from bench_distill import four_gemms  # noqa: E402

import ppo_kernels as pk  # noqa: E402

BETA = 0.1
PROMPT = 32  # ignored label positions at the start of each row


def _inputs(P, T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(2 * P, T, H, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    rh = (h.float() + 0.05 * torch.randn(2 * P, T, H, generator=g)).to(dtype)
    rW = (W.float() + 0.01 * torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (2 * P, T), generator=g)
    labels[:, :PROMPT] = -100
    return dict(h=h, W=W, rh=rh, rW=rW, labels=labels)


def _leaves(x):
    return x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()


def _backward(loss, h, W):
    loss.backward()
    return loss.detach().float(), h.grad, W.grad


def fused(x, logits_dtype=None):
    h, W = _leaves(x)
    loss, _ = pk.linear_preference_loss(
        h, W, x["labels"], ref_hidden=x["rh"], ref_weight=x["rW"], beta=BETA,
        logits_dtype=logits_dtype,
    )  # fmt: skip
    return _backward(loss, h, W)


_LIGER = {}


def liger(x):
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    if "dpo" not in _LIGER:
        _LIGER["dpo"] = LigerFusedLinearDPOLoss(beta=BETA)  # its defaults otherwise
    h, W = _leaves(x)
    loss, _ = _LIGER["dpo"](W, h, x["labels"], None, x["rh"], x["rW"], None)
    return _backward(loss, h, W)


def _seq_logps(logits, labels):
    keep = labels != -100
    lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1))
    return (lp.squeeze(-1) * keep).sum(-1)


def materialised(x):
    """TRL's / Liger's DPO on the whole logits of both heads (the reference's first, no grad)."""
    h, W = _leaves(x)
    with torch.no_grad():
        ref = _seq_logps(x["rh"] @ x["rW"].T, x["labels"])
    seq = _seq_logps(h @ W.T, x["labels"])
    P = seq.shape[0] // 2
    z = BETA * ((seq[:P] - ref[:P]) - (seq[P:] - ref[P:]))
    return _backward(-F.logsigmoid(z).mean(), h, W)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def run_size(P, T, H, V, dtype, reps):
    x = _inputs(P, T, H, V, dtype)
    modes = {}
    if dtype == torch.float32:
        modes["fused"] = lambda: fused(x)
    else:
        modes["fused (float32 tiles)"] = lambda: fused(x, "float32")
        modes["fused (input tiles)"] = lambda: fused(x, "input")
    modes["liger (compiled, defaults)"] = lambda: liger(x)
    # the materialised loss holds about three float32 [N, V] tensors at its peak
    need = 3.5 * 2 * P * T * V * 4
    skipped = None
    if _available_bytes() > 1.5 * need:
        modes["materialised"] = lambda: materialised(x)
    else:
        skipped = f"materialised: skipped, {_available_bytes() / 2**30:.1f} GiB available"
    first = next(iter(modes))
    base = None
    check, peaks = {}, {}
    for name, fn in modes.items():  # the warm-up (Liger's compilation), the peak, the check
        got = []
        peaks[name] = peak_extra_bytes(lambda fn=fn, got=got: got.append(fn()))
        loss, gh, gW = got.pop()
        if base is None:
            base = (loss, gh.float(), gW.float())
        err = max(
            (gh.float() - base[1]).abs().max().item() / base[1].abs().max().item(),
            (gW.float() - base[2]).abs().max().item() / base[2].abs().max().item(),
        )
        check[name] = (abs(loss.item() - base[0].item()), err)
    floor = "4 GEMMs alone (floor)"
    flat = {"h": x["h"].flatten(0, 1), "W": x["W"], "th": x["rh"].flatten(0, 1), "tW": x["rW"]}
    modes[floor] = lambda: four_gemms(flat)
    peaks[floor] = peak_extra_bytes(modes[floor])
    check[floor] = (float("nan"), float("nan"))
    med, loads = interleaved_medians(modes, reps)
    return {n: (med[n], peaks[n], check[n]) for n in modes}, loads, first, skipped


def _uptime():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime: unavailable"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", nargs="*", default=["8,512,1024,32000", "2,1024,256,152064"])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "# The DPO loss from hidden states: fused vs Liger vs the materialised logits (CPU)",
        "",
        f"{machine()}. `python bench/bench_preference.py {' '.join(sys.argv[1:])}`",
        "",
        f"`uptime` before: {_uptime()}",
        "",
        f"sigmoid DPO (beta {BETA}) with a reference head, summed completion log-probs, "
        f"{PROMPT} prompt positions ignored per row; forward + backward (hidden and weight "
        f"gradients), median of {args.reps} interleaved repetitions; peak = extra tensor memory "
        "(gradients included); loss / grad err = absolute loss difference / max relative "
        "gradient difference against the first fused mode. Targets: at most 0.7x Liger's time at "
        "no higher peak, at most 0.5x the time and 0.2x the peak of the materialised loss.",
        "",
    ]
    for size in args.sizes:
        P, T, H, V = (int(v) for v in size.split(","))
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            res, (l0, l1), first, skipped = run_size(P, T, H, V, dtype, args.reps)
            lig = res.get("liger (compiled, defaults)")
            mat = res.get("materialised")
            lines += [
                f"## pairs={P} T={T} (N={2 * P * T}) H={H} V={V} {dt} (load {l0:.2f} -> {l1:.2f})",
                "",
                "| mode | time (ms) | vs liger | vs materialised | peak (MiB) | peak vs liger "
                "| peak vs materialised | loss err | grad err |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for name, (t, peak, (le, ge)) in res.items():

                def ratio(a, b):
                    return f"{a / b:.2f}x" if b else "-"

                lines.append(
                    f"| {name} | {t * 1e3:.0f} | {ratio(t, lig[0] if lig else 0)} | "
                    f"{ratio(t, mat[0] if mat else 0)} | {peak / 2**20:.0f} | "
                    f"{ratio(peak, lig[1] if lig else 0)} | {ratio(peak, mat[1] if mat else 0)} "
                    f"| {le:.1e} | {ge:.1e} |"
                )
            if skipped:
                lines.append(f"\n{skipped}")
            lines.append("")
            print("\n".join(lines[-len(res) - 5 :]), flush=True)
    lines.append(f"`uptime` after: {_uptime()}")
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
