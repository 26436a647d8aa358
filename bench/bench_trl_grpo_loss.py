"""TRL 1.16's GRPOTrainer.compute_loss forward + backward on a prepared batch, three ways:
unpatched (TRL's fused head, then its loss), `apply("trl")` with only the fused head on ours
(`linear_token_logprobs`, TRL's loss code; what apply("trl") ran before its loss target), and
`apply("trl")` whole (the loss on `linear_policy_loss`: one pass from the hidden states).

    python bench/bench_trl_grpo_loss.py [--loss-types dapo grpo] [--reps 8] [--threads 1]
                                        [--out bench/results/cpu_trl_grpo_loss.md]

A random-init 1-layer Llama (hidden 256, V=32000), 8 completions of up to 128 tokens after
16-token prompts, float32, beta 0.04 (k3 KL without the bias correction), old log-probs given.
The time includes the model's one layer. Runs alternate; medians after one warm-up each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.join(HERE, "..")):
    if p not in sys.path:
        sys.path.insert(0, p)
import ppo_kernels.integrations as pki  # noqa: E402

V, H, B, P, C = 32000, 256, 8, 16, 128


def setup(loss_type):
    import e2e_trl
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        tr = e2e_trl.trainer(
            d,
            64,
            loss_type=loss_type,
            beta=0.04,
            use_bias_correction_kl=False,
            gradient_checkpointing=False,
        )
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(C // 2, C + 1, (B,), generator=g)
    cm = (torch.arange(C) < lengths[:, None]).long()
    inputs = dict(
        prompt_ids=torch.randint(3, V, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        completion_ids=torch.randint(3, V, (B, C), generator=g),
        completion_mask=cm,
        advantages=torch.randn(B, generator=g),
        num_items_in_batch=cm.sum(),
        old_per_token_logps=-5 - torch.rand(B, C, generator=g),
        ref_per_token_logps=-5 - torch.rand(B, C, generator=g),
    )
    return tr, inputs


def measure(loss_type, reps):
    from trl.trainer import grpo_trainer

    tr, inputs = setup(loss_type)
    cls = grpo_trainer.GRPOTrainer
    original = cls._compute_loss

    def step(mode):
        tr.model.zero_grad()
        tr._metrics["train"].clear()
        with pki.patched("trl") if mode != "unpatched" else contextlib.nullcontext():
            if mode == "fused head":
                cls._compute_loss = original  # TRL's loss on the patched head
            t = time.perf_counter()
            tr.compute_loss(tr.model, dict(inputs)).backward()
            secs = time.perf_counter() - t
        cls._compute_loss = original
        return secs

    modes = ("unpatched", "fused head", "fused loss")
    times = {m: [] for m in modes}
    for r in range(reps + 1):  # alternated: the machine's load drifts
        for m in modes:
            s = step(m)
            if r:
                times[m].append(s)
    return {m: statistics.median(v) for m, v in times.items()}


def main():
    from _common import machine

    ap = argparse.ArgumentParser()
    ap.add_argument("--loss-types", nargs="+", default=["dapo", "grpo"])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_trl_grpo_loss.md"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import trl

    lines = [
        "# TRL GRPOTrainer.compute_loss forward + backward: unpatched, fused head, fused loss",
        "",
        f"CPU: {machine()}. TRL {trl.__version__}. `python bench/bench_trl_grpo_loss.py "
        f"--reps {a.reps} --threads {a.threads}`: 1-layer Llama, H={H}, V={V}, {B} completions "
        f"of up to {C} tokens, float32, beta 0.04; median of {a.reps} alternated runs.",
        "",
        "| loss_type | unpatched | apply('trl'), TRL's loss on our fused head | apply('trl'), "
        "the loss on linear_policy_loss | fused loss / fused head |",
        "|---|---|---|---|---|",
    ]
    for t in a.loss_types:
        m = measure(t, a.reps)
        lines.append(
            f"| {t} | {m['unpatched'] * 1e3:.0f} ms | {m['fused head'] * 1e3:.0f} ms | "
            f"{m['fused loss'] * 1e3:.0f} ms | {m['fused loss'] / m['fused head']:.2f}x |"
        )
        print(lines[-1], flush=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
