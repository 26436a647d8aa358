"""The policy loss from the hidden states, forward + backward, side by side in one run:

  fused        ppo_kernels.linear_policy_loss (3 GEMMs; bf16 in both logits_dtype modes)
  composition  linear_token_logprobs + kl_penalty + ppo_policy_loss + masked_aggregate (4 GEMMs)
  liger        liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (compiled=False, and compiled
               with --liger-compiled)
  trl          TRL 1.16's fused LM head (_ChunkedLogProbFunction, as GRPOTrainer's fused_lm_head
               calls it) + TRL's loss on its log-probs
  --eager        TRL's loss on materialised logits (small sizes: where the logits are no burden)

The same loss for all: "bnpo" (TRL / Liger), clip 0.2, k3 KL to ref_logprobs with beta 0.04, no
entropy term (Liger has none; ours and TRL's compute the entropy anyway). Modes interleaved per
repetition; median time and peak extra tensor memory (the gradients included); the load average
before and after. Gradients checked against the composition before timing.

    python bench/bench_linear_policy_loss.py [--reps 3] [--threads 2] [--sizes N,H,V[,T] ...]
        [--dtypes float32 bfloat16] [--liger-compiled] [--eager]
        [--out bench/results/cpu_linear_policy_loss.md]   (T: tokens per row, default min(256, N))
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from _common import interleaved_medians, machine, peak_extra_bytes, write_report  # noqa: E402

import ppo_kernels as pk  # noqa: E402

BETA, CLIP, T = 0.04, 0.2, 256


def _inputs(N, H, V, dtype, seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    B = N // T
    h = (torch.randn(B, T, H, generator=g) * 0.5).to(dtype)
    W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        lp = pk.linear_token_logprobs(h, W, labels)
    old = lp + torch.randn(B, T, generator=g) * 0.1
    ref = lp + torch.randn(B, T, generator=g) * 0.1
    mask = torch.rand(B, T, generator=g) > 0.1
    return dict(h=h, W=W, labels=labels, adv=adv, old=old, ref=ref, mask=mask)


def _leaves(x):
    return x["h"].clone().requires_grad_(), x["W"].clone().requires_grad_()


def fused_loss(x, h, W, **kw):
    """The fused op's loss on the leaves h, W (kw: logits_dtype, ...)."""
    loss, _ = pk.linear_policy_loss(
        h,
        W,
        x["labels"],
        x["adv"],
        x["old"],
        x["mask"],
        loss_type="bnpo",
        clip_low=CLIP,
        ref_logprobs=x["ref"],
        kl_coef=BETA,
        kl_estimator="k3",
        **kw,
    )
    return loss


def composition_loss(x, h, W, **kw):
    """The same loss from our public ops (kw: linear_token_logprobs' logits_dtype, ...)."""
    lp = pk.linear_token_logprobs(h, W, x["labels"], **kw)
    loss, _ = pk.ppo_policy_loss(lp, x["old"], x["adv"], x["mask"], loss_type="bnpo", clip_low=CLIP)
    kl = pk.kl_penalty(lp, x["ref"], "k3")
    return loss + BETA * pk.masked_aggregate(kl, x["mask"], "token-mean")


def liger_module(compiled, **kw):
    """Liger's LigerFusedLinearGRPOLoss configured for the same loss."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return LigerFusedLinearGRPOLoss(
        beta=BETA,
        compiled=compiled,
        use_ref_model=True,
        epsilon_low=CLIP,
        epsilon_high=CLIP,
        loss_type="bnpo",
        **kw,
    )


def liger_loss(module, x, h, W):
    loss, _ = module(
        h,
        W,
        x["labels"],
        x["mask"].long(),
        x["adv"],
        ref_per_token_logps=x["ref"],
        old_per_token_logps=x["old"],
    )
    return loss


def trl_bnpo_loss(x, lp):
    """TRL's GRPOTrainer._compute_loss for "bnpo" with beta > 0 (k3 KL added per token) on the
    per-token log-probs of its fused head."""
    lp = lp.view(x["labels"].shape).float()
    ratio = torch.exp(lp - x["old"])
    a = x["adv"].unsqueeze(1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * a)
    d = x["ref"] - lp
    per_token = per_token + BETA * (torch.exp(d) - d - 1)
    m = x["mask"].float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def _backward(loss, h, W):
    loss.backward()
    return loss.detach(), h.grad, W.grad


def fused(x, logits_dtype=None):
    h, W = _leaves(x)
    return _backward(fused_loss(x, h, W, logits_dtype=logits_dtype), h, W)


def composition(x, logits_dtype="float32"):
    h, W = _leaves(x)
    return _backward(composition_loss(x, h, W, logits_dtype=logits_dtype), h, W)


def eager(x):
    """TRL's bnpo loss with the k3 term on materialised float32 logits (--eager: what the fused op
    replaces where the logits are no burden)."""
    h, W = _leaves(x)
    logits = (h.reshape(-1, h.shape[-1]) @ W.T).float()
    lp = torch.log_softmax(logits, -1).gather(-1, x["labels"].reshape(-1, 1))
    return _backward(trl_bnpo_loss(x, lp), h, W)


_LIGER = {}


def liger(x, compiled=False):
    if compiled not in _LIGER:
        _LIGER[compiled] = liger_module(compiled, chunk_size=1)
    h, W = _leaves(x)
    return _backward(liger_loss(_LIGER[compiled], x, h, W), h, W)


def trl(x):
    from trl.trainer import utils as tu

    h, W = _leaves(x)
    H = h.shape[-1]
    lp, *_ = tu._ChunkedLogProbFunction.apply(
        h.reshape(-1, H),
        W,
        None,
        x["labels"].reshape(-1),
        1.0,
        tu._CHUNKED_LOGPROB_CHUNK_SIZE,
        None,
        1.0,
        ("log_probs",),
    )
    return _backward(trl_bnpo_loss(x, lp), h, W)


def run_size(N, H, V, dtype, reps, liger_compiled, skip=(), T=T, with_eager=False):
    x = _inputs(N, H, V, dtype, T=T)
    modes = {}
    if dtype == torch.float32:
        modes["fused"] = lambda: fused(x)
        modes["composition"] = lambda: composition(x)
    else:
        modes["fused (float32 tiles)"] = lambda: fused(x, "float32")
        modes["fused (input tiles)"] = lambda: fused(x, "input")
        modes["composition (float32 tiles)"] = lambda: composition(x, "float32")
        modes["composition (input tiles)"] = lambda: composition(x, "input")
    modes["liger"] = lambda: liger(x)
    if liger_compiled:
        modes["liger (compiled)"] = lambda: liger(x, True)
    modes["trl fused head + loss"] = lambda: trl(x)
    if with_eager:
        modes["eager (logits)"] = lambda: eager(x)
    modes = {n: f for n, f in modes.items() if not any(s in n for s in skip)}
    # the same numbers first (the composition at float32 tiles is the yardstick); that call is
    # also the warm-up (compilation) and the peak-memory measurement
    base = composition(x)
    check, peaks = {}, {}
    for name, fn in modes.items():
        got = []
        peaks[name] = peak_extra_bytes(lambda fn=fn, got=got: got.append(fn()))
        loss, gh, gW = got.pop()
        err = max(
            (gh.float() - base[1].float()).abs().max().item() / base[1].float().abs().max().item(),
            (gW.float() - base[2].float()).abs().max().item() / base[2].float().abs().max().item(),
        )
        check[name] = (abs(loss.item() - base[0].item()), err)
    med, loads = interleaved_medians(modes, reps)
    return {n: (med[n], peaks[n], check[n]) for n in modes}, loads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", nargs="*", default=["4096,1024,32000", "1024,256,152064"])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--liger-compiled", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", nargs="*", default=[], help="leave out modes whose name has this")
    ap.add_argument("--eager", action="store_true", help="also the loss on materialised logits")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "# The policy loss from hidden states: fused vs composition vs Liger vs TRL (CPU)",
        "",
        f"{machine()}. `python bench/bench_linear_policy_loss.py {' '.join(sys.argv[1:])}`",
        "",
        f"bnpo, clip {CLIP}, k3 KL (beta {BETA}), forward + backward, median of "
        f"{args.reps} interleaved repetitions; peak = extra tensor memory (gradients included); "
        "vs composition: against the composition at the same tiles; "
        "loss / grad err = absolute loss difference / max relative gradient difference against "
        "the composition (float32 tiles).",
        "",
        'The default (`logits_dtype="auto"`) for bfloat16 on this machine: '
        f"`{pk.default_logits_dtype(torch.bfloat16, 'cpu')}` tiles "
        "(`ppo_kernels.default_logits_dtype`: input tiles where the CPU multiplies bf16 natively).",
        "",
    ]
    for size in args.sizes:
        N, H, V, *t = (int(v) for v in size.split(","))  # N,H,V[,T]
        seq = t[0] if t else min(T, N)
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            res, (l0, l1) = run_size(
                N, H, V, dtype, args.reps, args.liger_compiled, args.skip, seq, args.eager
            )
            comps = {n: v[0] for n, v in res.items() if n.startswith("composition")}

            def comp(name):
                """A mode's yardstick: the composition at the same tiles where both ran, else
                the float32-tile one, else whichever composition ran (--skip)."""
                tiles = name[name.find("(") :] if "(" in name else ""
                for n in (f"composition {tiles}", "composition", "composition (float32 tiles)"):
                    if n in comps:
                        return comps[n]
                return next(iter(comps.values()), float("nan"))

            lig = res["liger"][0] if "liger" in res else None  # --skip liger
            lines += [
                f"## N={N} (T={seq}) H={H} V={V} {dt} (load {l0:.2f} -> {l1:.2f})",
                "",
                "| mode | time (ms) | vs composition | vs liger | peak (MiB) | loss err | grad err |",
                "|---|---|---|---|---|---|---|",
            ]
            for name, (t, peak, (le, ge)) in res.items():
                ms = f"{t * 1e3:.0f}" if t >= 0.1 else f"{t * 1e3:.3g}"
                lines.append(
                    f"| {name} | {ms} | {t / comp(name):.2f}x | "
                    f"{f'{t / lig:.2f}x' if lig else '-'} | "
                    f"{peak / 2**20:.0f} | {le:.1e} | {ge:.1e} |"
                )
            lines.append("")
            print("\n".join(lines[-len(res) - 4 :]), flush=True)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
