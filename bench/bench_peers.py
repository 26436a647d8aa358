"""Each peer's per-token path, unpatched vs `ppo_kernels.integrations.apply(peer)`: median time
and peak extra memory of forward + backward, at V = 32000 and 152064 (small N for a CPU).

    python bench/bench_peers.py [--n 256] [--reps 3] [--out bench/results/cpu_peers.md]

Paths (what each peer's trainer runs per micro-batch):
  verl      logprobs_from_logits + entropy_from_logits on the same logits (its actor forward)
  OpenRLHF  log_probs_from_logits + compute_entropy on the same logits (Actor.forward)
  TRL       selective_log_softmax_and_entropy on logits, and the fused LM head's
            ChunkedLogProbFunction from hidden states (GRPOTrainer's fused_lm_head=True path)
The peers are imported with tests/_peer_stubs.py (their cluster-only imports stubbed).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
import _peer_stubs  # noqa: E402
from _common import machine, median_seconds, peak_extra_bytes  # noqa: E402

import ppo_kernels.integrations as pki  # noqa: E402

H = 256  # hidden size of the fused-LM-head case (small: the CPU's matmuls dominate otherwise)


def _grad_step(logits, f):
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = f(x)
    (lp.float().sum() + 0.01 * ent.float().sum()).backward()
    return x.grad


def cases(n, v, dtype):
    """(peer, path name, thunk) -- each thunk looks the peer's function up at call time."""
    import importlib

    _peer_stubs.install()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, v, generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    out = []
    try:
        tf = importlib.import_module("verl.utils.torch_functional")
        out.append(
            (
                "verl",
                "logprobs_from_logits + entropy_from_logits",
                lambda: _grad_step(
                    logits,
                    lambda x: (tf.logprobs_from_logits(x, labels), tf.entropy_from_logits(x)),
                ),
            )
        )
    except ImportError:
        pass
    try:
        ou = importlib.import_module("openrlhf.models.utils")
        out.append(
            (
                "openrlhf",
                "log_probs_from_logits + compute_entropy",
                lambda: _grad_step(
                    logits.unsqueeze(0),
                    lambda x: (
                        ou.log_probs_from_logits(x, labels.unsqueeze(0)),
                        ou.compute_entropy(x),
                    ),
                ),
            )
        )
    except ImportError:
        pass
    try:
        tu = importlib.import_module("trl.trainer.utils")
        out.append(
            (
                "trl",
                "selective_log_softmax_and_entropy",
                lambda: _grad_step(
                    logits, lambda x: tu.selective_log_softmax_and_entropy(x, labels)
                ),
            )
        )
        hidden = torch.randn(n, H, generator=g).to(dtype)
        weight = (torch.randn(v, H, generator=g) / H**0.5).to(dtype)

        def fused():
            h = hidden.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            lp, ent, *_ = tu._ChunkedLogProbFunction.apply(
                h,
                w,
                None,
                labels,
                1.0,
                tu._CHUNKED_LOGPROB_CHUNK_SIZE,
                None,
                1.0,
                ("log_probs", "entropy"),
            )  # as add_fused_lm_head calls it
            (lp.sum() + 0.01 * ent.sum()).backward()
            return h.grad, w.grad

        out.append(("trl", f"fused LM head (ChunkedLogProbFunction, H={H})", fused))
    except ImportError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--n",
        type=int,
        nargs="+",
        default=[256, 64],
        help="tokens per case, one per vocabulary size (32000, 152064)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_peers.md"))
    a = ap.parse_args()
    rows = []
    for v, n in zip((32000, 152064), a.n):
        for dt in a.dtypes:
            dtype = getattr(torch, dt)
            for peer, name, fn in cases(n, v, dtype):
                res = {}
                for mode in ("unpatched", "patched"):
                    if mode == "patched":
                        pki.apply(peer)
                    try:
                        res[mode] = (median_seconds(fn, reps=a.reps), peak_extra_bytes(fn))
                    finally:
                        pki.revert(peer)
                (tu, mu), (tp, mp) = res["unpatched"], res["patched"]
                rows.append(
                    f"| {peer} | {name} | {n} x {v} | {dt} | {tu * 1e3:.0f} ms, "
                    f"{mu / 2**20:.0f} MiB | {tp * 1e3:.0f} ms, {mp / 2**20:.0f} MiB | "
                    f"{tu / tp:.2f}x |"
                )
                print(rows[-1], flush=True)
    head = [
        "# Peers' per-token paths: unpatched vs ppo_kernels.integrations.apply(peer)",
        "",
        f"CPU: {machine()}. Forward + backward (log-prob and entropy, gradient to the logits or",
        "to hidden and weight), median of the runs; peak extra memory beyond the inputs.",
        "Command: `python bench/bench_peers.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| peer | path | N x V | dtype | unpatched | patched | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    with open(a.out, "w") as f:
        f.write("\n".join(head + rows) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
