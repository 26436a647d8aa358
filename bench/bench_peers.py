"""Each peer's per-token path, unpatched vs `ppo_kernels.integrations.apply(peer)`: median time
and peak extra memory of forward + backward, at V = 32000 and 152064 (small N for a CPU).

    python bench/bench_peers.py [--n 256 64] [--reps 3] [--only paths|callers]
                                [--out bench/results/cpu_peers.md]

Paths (what each peer's trainer runs per micro-batch):
  verl      logprobs_from_logits + entropy_from_logits on the same logits (its actor forward)
  OpenRLHF  log_probs_from_logits + compute_entropy on the same logits (Actor.forward)
  TRL       selective_log_softmax_and_entropy on logits, and the fused LM head's
            ChunkedLogProbFunction from hidden states (GRPOTrainer's fused_lm_head=True path)
Callers (`--only callers` reruns only their section of the results): the peers' own functions
that want both of one logits tensor, run on given logits (the model forward left out): verl 0.9's
FSDPEngineWithLMHead.prepare_model_outputs (remove-padding path, calculate_entropy) and OpenRLHF
0.11's Actor.forward(return_entropy=True), each unpatched, with only the per-function targets
patched (two passes of our op) and with the caller patched too (one pass).
The peers are imported with tests/support/peer_stubs.py (their cluster-only imports stubbed).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
from _common import machine, median_seconds, peak_extra_bytes  # noqa: E402
from support import peer_stubs  # noqa: E402  (tests/support/)

import ppo_kernels.integrations as pki  # noqa: E402

H = 256  # hidden size of the fused-LM-head case (small: the CPU's matmuls dominate otherwise)


def _grad_step(logits, f):
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = f(x)
    (lp.float().sum() + 0.01 * ent.float().sum()).backward()
    return x.grad


def _inputs(n, v, dtype):
    """The peers imported (stubs for their cluster-only imports) and seeded logits, labels."""
    peer_stubs.install()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, v, generator=g) * 2).to(dtype)
    return logits, torch.randint(0, v, (n,), generator=g), g


def cases(n, v, dtype):
    """(peer, path name, thunk) -- each thunk looks the peer's function up at call time."""
    logits, labels, g = _inputs(n, v, dtype)
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


class _MicroBatch(dict):
    """What verl's engine reads of its TensorDict micro-batch (tensordict is cluster-only)."""

    @property
    def batch_size(self):
        return torch.Size([self["input_ids"].size(0)])


def _split(labels, parts=4):
    n = labels.numel()
    lens = [n // parts + (i < n % parts) for i in range(parts)]
    return list(torch.split(labels, lens))


def caller_cases(n, v, dtype):
    """(peer, caller target attr, caller name, thunk): forward + backward of the caller on given
    logits of N tokens (4 sequences), temperature 1."""
    logits, labels, _ = _inputs(n, v, dtype)
    out = []
    try:
        ti = importlib.import_module("verl.workers.engine.fsdp.transformer_impl")
        tf = importlib.import_module("verl.utils.torch_functional")
        eng = object.__new__(ti.FSDPEngineWithLMHead)
        eng.engine_config = types.SimpleNamespace(
            entropy_from_logits_with_chunking=False, entropy_checkpointing=False
        )
        eng.pad_to_length, eng.pad_to_length_bucket, eng.use_ulysses_sp = False, 0, False
        seqs = _split(labels)
        mb = _MicroBatch(
            input_ids=torch.nested.nested_tensor(seqs, layout=torch.jagged),
            position_ids=torch.nested.nested_tensor(
                [torch.arange(len(t)) for t in seqs], layout=torch.jagged
            ),
            temperature=1.0,
            calculate_entropy=True,
        )
        _, args = eng.prepare_model_inputs(micro_batch=mb)

        def verl_step():
            # as an engine built after apply holds it (VERL_USE_EXTERNAL_MODULES); no compile
            eng.compute_entropy_from_logits = tf.entropy_from_logits
            x = logits.detach().clone().requires_grad_(True)
            o = eng.prepare_model_outputs(
                output=types.SimpleNamespace(logits=x.unsqueeze(0)),
                output_args=args,
                micro_batch=mb,
                logits_processor_func=None,
            )
            (o["log_probs"].values().float().sum() + 0.01 * o["entropy"].values().sum()).backward()
            return x.grad

        out.append(
            (
                "verl",
                "FSDPEngineWithLMHead.prepare_model_outputs",
                "FSDPEngineWithLMHead.prepare_model_outputs (entropy + log-probs)",
                verl_step,
            )
        )
    except ImportError:
        pass
    try:
        actor_mod = importlib.import_module("openrlhf.models.actor")
        from transformers.modeling_outputs import CausalLMOutputWithPast

        held = {}

        class GivenLogits(torch.nn.Module):  # the model forward left out: the logits are given
            def forward(self, sequences, **kwargs):
                return CausalLMOutputWithPast(logits=held["x"])

        actor = actor_mod.Actor(GivenLogits())
        actor.packing_samples = False
        b = 4
        seq = labels[: n - n % b].view(b, -1)
        att = torch.ones_like(seq)
        am = att[:, 1:]

        def openrlhf_step():
            x = logits[: seq.numel()].view(*seq.shape, v).detach().clone().requires_grad_(True)
            held["x"] = x
            lp, o = actor(seq, am, att, return_output=True, return_entropy=True)
            (lp.sum() + 0.01 * o.entropy.sum()).backward()
            held.clear()  # no logits left over into the next measured call
            return x.grad

        out.append(
            ("openrlhf", "Actor.forward", "Actor.forward(return_entropy=True)", openrlhf_step)
        )
    except ImportError:
        pass
    return out


def _caller_off(peer, attr):
    """Leave the caller target `attr` of an applied peer unpatched (its functions stay patched)."""
    for holder, key, original, _ in pki._peer(peer).active[attr][1]:
        setattr(holder, key, original)


def bench_callers(sizes, dtypes, reps):
    rows = []
    for v, n in sizes:
        for dt in dtypes:
            for peer, attr, name, fn in caller_cases(n, v, getattr(torch, dt)):
                res = []
                for mode in ("unpatched", "functions", "caller"):
                    if mode != "unpatched":
                        pki.apply(peer)
                        if mode == "functions":
                            _caller_off(peer, attr)
                    try:
                        res.append((median_seconds(fn, reps=reps), peak_extra_bytes(fn)))
                        if mode == "caller":
                            s = pki.report(peer)["functions"]
                            assert sum(f["replaced"] for k, f in s.items() if k.endswith(attr)), s
                    finally:
                        pki.revert(peer)
                cells = [f"{t * 1e3:.0f} ms, {m / 2**20:.0f} MiB" for t, m in res]
                rows.append(
                    f"| {peer} | {name} | {n} x {v} | {dt} | {' | '.join(cells)} | "
                    f"{res[0][0] / res[2][0]:.2f}x | {res[1][0] / res[2][0]:.2f}x |"
                )
                print(rows[-1], flush=True)
    return rows


CALLERS_HEAD = "## Callers: log-probs and entropy of one logits tensor"
HIDDEN_HEAD = "## From hidden states"  # bench_peers_hidden.py writes that section


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
    ap.add_argument("--only", choices=["paths", "callers"], default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_peers.md"))
    a = ap.parse_args()
    sizes = list(zip((32000, 152064), a.n))
    rows = []
    for v, n in sizes if a.only != "callers" else ():
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
    paths, callers, hidden = "\n".join(head + rows) + "\n", "", ""
    if os.path.exists(a.out):  # keep the sections this run does not redo
        old = open(a.out).read()
        old, _, hidden = old.partition(HIDDEN_HEAD)  # bench_peers_hidden.py's section
        hidden = HIDDEN_HEAD + hidden if hidden else ""
        old_paths, _, old_callers = old.partition(CALLERS_HEAD)
        paths = old_paths if a.only == "callers" else paths
        callers = CALLERS_HEAD + old_callers if a.only == "paths" and old_callers else ""
    if a.only != "paths":
        callers = (
            "\n".join(
                [
                    CALLERS_HEAD,
                    "",
                    f"CPU: {machine()}. Forward + backward of the caller on given logits (no model",
                    "forward), temperature 1; peak extra memory beyond the inputs. Modes: unpatched;",
                    "`functions`: apply(peer) with the caller left unpatched (its two calls each run",
                    "our op: two passes); `caller`: apply(peer) (one token_logprobs pass for both).",
                    "Command: `python bench/bench_peers.py " + " ".join(sys.argv[1:]) + "`",
                    "",
                    "| peer | caller | N x V | dtype | unpatched | functions (2 passes) | "
                    "caller (1 pass) | speed-up vs unpatched | vs functions |",
                    "|---|---|---|---|---|---|---|---|---|",
                ]
                + bench_callers(sizes, a.dtypes, a.reps)
            )
            + "\n"
        )
    with open(a.out, "w") as f:
        f.write(paths.rstrip("\n") + "\n\n" + callers if callers else paths)
        if hidden:
            f.write("\n" + hidden)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
