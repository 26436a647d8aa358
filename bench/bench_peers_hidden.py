"""The peers' actor forward + backward from the hidden states, unpatched vs
`ppo_kernels.integrations.apply(peer)`: a small causal LM (Llama, hidden 256, 2 layers, float32,
random init) at V = 32000 and 152064 on the CPU; median time and peak extra tensor memory (the
parameters' gradients included) of the model forward, log-probs + entropy of every token, and
the backward of `logprobs.sum() + 0.01 * entropy.sum()`.

    python bench/bench_peers_hidden.py [--tokens 512 512] [--reps 3] [--threads 2]
                                      [--out bench/results/cpu_peers.md]

verl 0.9 (FSDPEngineWithLMHead.prepare_model_inputs -> the model -> prepare_model_outputs,
remove-padding, calculate_entropy, 4 sequences packed):
  unfused                  the model's logits; verl's entropy_from_logits + logprobs_from_logits
  unfused, patched         the same with apply("verl") (one token_logprobs pass on the logits)
  fused, torch backend     use_fused_kernels=True: verl's FusedLinearForPPO (unpatched)
  fused torch / triton, patched   use_fused_kernels=True with apply("verl"): linear_token_logprobs
                           (verl's triton kernels are CUDA-only: unpatched they do not run here)
OpenRLHF 0.11 (Actor.forward(action_mask, return_output=True, return_entropy=True), 4 sequences):
  unpatched; patched on the logits (today's caller patch: one token_logprobs pass; forced by an
  LM head that is not a plain Linear); patched (the hidden states, linear_token_logprobs).
Writes (replaces) the section "## From hidden states" of the results file; bench_peers.py keeps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")):
    sys.path.insert(0, p)
from _common import machine, peak_extra_bytes  # noqa: E402
from support import peer_stubs  # noqa: E402  (tests/support/)

import ppo_kernels.integrations as pki  # noqa: E402

HEAD = "## From hidden states: the actor forward + backward of a small causal LM"
H, LAYERS, SEQS = 256, 2, 4


def _model(vocab):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return transformers.LlamaForCausalLM(cfg).float()


class _MicroBatch(dict):
    """What verl's engine reads of its TensorDict micro-batch (tensordict is cluster-only)."""

    @property
    def batch_size(self):
        return torch.Size([self["input_ids"].size(0)])


def verl_cases(vocab, tokens):
    """(mode, patched, thunk) for verl's engine forward + backward."""
    ti = __import__("verl.workers.engine.fsdp.transformer_impl", fromlist=["x"])
    tf = __import__("verl.utils.torch_functional", fromlist=["x"])
    mp = __import__("verl.models.transformers.monkey_patch", fromlist=["x"])
    model = _model(vocab)
    plain = type("BenchLlama", (type(model),), {})
    fused = {}
    for backend in ("torch", "triton"):
        fused[backend] = type(f"BenchLlama_{backend}", (type(model),), {})
        model.__class__ = fused[backend]
        mp.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    eng = object.__new__(ti.FSDPEngineWithLMHead)
    eng.engine_config = types.SimpleNamespace(
        entropy_from_logits_with_chunking=False, entropy_checkpointing=False
    )
    eng.pad_to_length, eng.pad_to_length_bucket, eng.use_ulysses_sp = False, 0, False
    eng.module = model
    g = torch.Generator().manual_seed(1)
    lens = [tokens // SEQS] * SEQS
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lens]

    def step(backend):
        def run():
            model.__class__ = plain if backend is None else fused[backend]
            model._verl_fused_kernels_backend = backend or "torch"
            eng.compute_entropy_from_logits = tf.entropy_from_logits  # as the engine holds it
            mb = _MicroBatch(
                input_ids=torch.nested.nested_tensor(ids, layout=torch.jagged),
                position_ids=torch.nested.nested_tensor(
                    [torch.arange(n) for n in lens], layout=torch.jagged
                ),
                temperature=1.0,
                calculate_entropy=True,
                use_fused_kernels=backend is not None,
            )
            model.zero_grad(set_to_none=True)
            inputs, args = eng.prepare_model_inputs(micro_batch=mb)
            raw = model(**inputs, use_cache=False)
            out = eng.prepare_model_outputs(
                output=raw, output_args=args, micro_batch=mb, logits_processor_func=None
            )
            lp, ent = out["log_probs"].values(), out["entropy"].values()
            (lp.float().sum() + 0.01 * ent.float().sum()).backward()
            model.zero_grad(set_to_none=True)

        return run

    return model, [
        ("unfused (logits)", False, step(None)),
        ("unfused (logits), patched", True, step(None)),
        ("fused, torch backend", False, step("torch")),
        ("fused, torch backend, patched", True, step("torch")),
        ("fused, triton backend, patched", True, step("triton")),
    ]


class _NotPlainHead(torch.nn.Linear):
    """The same weights behind a head the hidden path does not take: the logits path."""


def openrlhf_cases(vocab, tokens):
    actor_mod = __import__("openrlhf.models.actor", fromlist=["x"])
    model = _model(vocab)
    actor = actor_mod.Actor(model, temperature=1.0)
    actor.packing_samples = False
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, vocab, (SEQS, tokens // SEQS), generator=g)
    att = torch.ones_like(seq)
    am = att[:, 1:]
    head = model.lm_head
    other = _NotPlainHead(H, vocab, bias=False)
    other.weight = head.weight

    def step(lm_head):
        def run():
            model.lm_head = lm_head
            model.zero_grad(set_to_none=True)
            lp, out = actor(seq, am, att, return_output=True, return_entropy=True)
            (lp.sum() + 0.01 * out.entropy.sum()).backward()
            del out
            model.zero_grad(set_to_none=True)
            model.lm_head = head

        return run

    return model, [
        ("unpatched (logits)", False, step(head)),
        ("patched on the logits (caller patch)", True, step(other)),
        ("patched from the hidden states", True, step(head)),
    ]


def _timed(peer, patched, fn):
    if patched:
        pki.apply(peer)
    try:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    finally:
        pki.revert(peer)


def bench(peer, cases, reps):
    """Each mode once per round, `reps` rounds after a warm-up round (the modes interleaved, so
    that a shared machine's load changes hit them alike); the median per mode, then its peak."""
    times = {mode: [] for mode, _, _ in cases}
    for r in range(reps + 1):
        for mode, patched, fn in cases:
            t = _timed(peer, patched, fn)
            if r:
                times[mode].append(t)
    rows = []
    for mode, patched, fn in cases:
        if patched:
            pki.apply(peer)
        try:
            m = peak_extra_bytes(fn)
        finally:
            pki.revert(peer)
        t = statistics.median(times[mode])
        rows.append((mode, t, m))
        print(f"  {peer} {mode}: {t * 1e3:.0f} ms, {m / 2**20:.0f} MiB", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[512, 512], help="per V (32000, 152064)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--peers", nargs="+", default=["verl", "openrlhf"])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_peers.md"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    peer_stubs.install()
    load = os.getloadavg()[0]
    lines = [
        HEAD,
        "",
        f"CPU: {machine()}; load average {load:.2f} at the start. Llama (hidden {H}, {LAYERS} "
        f"layers, float32), {SEQS} sequences; forward + backward of log-probs and entropy of every",
        "token (gradients to every parameter), median of the runs (the modes interleaved); peak",
        "extra tensor memory (the parameters' gradients included: 2 x V x H float32 for the",
        "embedding and the head, most of the patched peak). Command: "
        "`python bench/bench_peers_hidden.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| peer | mode | N x V | time | peak memory | vs the first row: speed-up, memory |",
        "|---|---|---|---|---|---|",
    ]
    for vocab, tokens in zip((32000, 152064), a.tokens):
        if vocab not in a.vocab:
            continue
        for peer, make in (("verl", verl_cases), ("openrlhf", openrlhf_cases)):
            if peer not in a.peers:
                continue
            model, cases = make(vocab, tokens)
            rows = bench(peer, cases, a.reps)
            t0, m0 = rows[0][1], rows[0][2]
            for mode, t, m in rows:
                lines.append(
                    f"| {peer} | {mode} | {tokens} x {vocab} | {t * 1e3:.0f} ms | "
                    f"{m / 2**20:.0f} MiB | {t0 / t:.2f}x, {m0 / m:.2f}x less |"
                )
            del model, cases
    lines.append("")
    lines.append(f"Load average at the end: {os.getloadavg()[0]:.2f}.")
    section = "\n".join(lines) + "\n"
    old = open(a.out).read() if os.path.exists(a.out) else ""
    before, _, rest = old.partition(HEAD)
    after = rest[rest.find("\n## ") :] if "\n## " in rest else ""
    with open(a.out, "w") as f:
        f.write(before.rstrip("\n") + "\n\n" + section + after)
    print(section)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
