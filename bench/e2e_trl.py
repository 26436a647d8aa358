"""TRL's GRPOTrainer end to end on the CPU, unpatched vs patched by
`ppo_kernels.integrations.apply("trl")`, from the same seed.

    python bench/e2e_trl.py [--steps 4] [--vocab 512] [--reps 5] [--threads 1]
                            [--out bench/results/cpu_e2e_trl.md]

A tiny random-init Llama (hidden 32, 2 layers) is saved to a temporary folder with a word-level
tokenizer built here (no download), and TRL's own GRPOTrainer trains it for `--steps` optimizer
steps on 8 fixed prompts, rewarding completions made of small token ids. Every log-prob TRL 1.16
computes in training goes through its fused LM head (`model(..., fused_lm_head=True)` ->
`ChunkedLogProbFunction`): the policy's with entropy, the old policy's and the reference model's.
Configurations:
  default  GRPOConfig's defaults (loss "dapo", beta 0, one iteration per generation, temperature 1,
           gradient checkpointing), only what a CPU and a tiny model need set
  kl       beta 0.04 (a reference model), 2 iterations per generation (old log-probs, clipping),
           temperature 0.7, loss "grpo", an entropy bonus
Reports per-step losses (trainer.state.log_history), whether the sampled completions match, the
final parameter difference, the time and peak tensor memory of both runs.
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

CONFIGS = {
    "default": {},
    "kl": {
        "beta": 0.04,
        "num_iterations": 2,
        "temperature": 0.7,
        "loss_type": "grpo",
        "entropy_coef": 0.01,
    },
}
PROMPTS = 8


def tokenizer(vocab: int):
    """A word-level tokenizer over "<pad>", "<eos>", "<bos>", "t3" ... "t{vocab-1}" (ids = indices)."""
    import tokenizers
    import transformers

    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=words, unk_token="<pad>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tok.padding_side = "left"
    return tok


def tiny_llama(vocab: int, seed: int = 0, **config):
    """A tiny random-init LlamaForCausalLM (float32, hidden 32, 2 layers); `config`: more
    LlamaConfig fields (token ids). Also the model of tests/integrations/test_callers.py."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def save_model(path: str, vocab: int, seed: int = 0):
    """tiny_llama with the tokenizer's special ids, saved to `path`."""
    tiny_llama(vocab, seed, pad_token_id=0, eos_token_id=1, bos_token_id=2).save_pretrained(path)


def prompts(vocab: int):
    return [
        " ".join(f"t{3 + (7 * i + 5 * j) % (vocab - 3)}" for j in range(4)) for i in range(PROMPTS)
    ]


def grpo_config(out_dir, steps, seed, **overrides):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-3,
        seed=seed,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **overrides,
    )


def reward(vocab, seen=None):
    """The share of completion tokens with a small id; appends (prompt, completion ids) to `seen`."""

    def small_ids(prompts, completion_ids, **kwargs):
        if seen is not None:
            seen.extend(zip(prompts, map(tuple, completion_ids)))
        return [sum(t < vocab // 4 for t in c) / max(len(c), 1) for c in completion_ids]

    return small_ids


def trainer(model_dir, vocab, steps=4, seed=0, seen=None, **overrides):
    """GRPOTrainer on the saved model (the reference model, when beta > 0, loads from there too);
    `overrides`: GRPOConfig fields."""
    from datasets import Dataset
    from trl import GRPOTrainer

    return GRPOTrainer(
        model=model_dir,
        reward_funcs=reward(vocab, seen),
        args=grpo_config(model_dir + "/out", steps, seed, **overrides),
        # in memory; a map-style Dataset is never .map()ped by GRPOTrainer (only iterable ones)
        train_dataset=Dataset.from_dict({"prompt": prompts(vocab)}),
        processing_class=tokenizer(vocab),
    )


def run(config="default", steps=4, vocab=512, seed=0, patched=False):
    """One training run: {losses, grad_norms, completions, params, seconds, report}.
    `config`: a name in CONFIGS or a dict of GRPOConfig overrides. `completions`: the (prompt,
    completion ids) the reward function saw, in order. Patched with strict=False: a loss
    configuration linear_policy_loss cannot express runs TRL's loss (counted in the report)."""
    seen = []
    overrides = CONFIGS[config] if isinstance(config, str) else config
    with tempfile.TemporaryDirectory() as d:
        save_model(d, vocab, seed)
        with pki.patched("trl", strict=False) if patched else contextlib.nullcontext():
            tr = trainer(d, vocab, steps, seed, seen, **overrides)
            init = _flat_params(tr.model)
            t0 = time.perf_counter()
            tr.train()
            secs = time.perf_counter() - t0
            rep = pki.report("trl") if patched else None
    logs = [h for h in tr.state.log_history if "loss" in h]
    params = _flat_params(tr.model)
    return {
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
        "completions": seen,
        "params": params,
        "moved": (params - init).abs().max().item(),  # how far training took the parameters
        "seconds": secs,
        "report": rep,
    }


def _flat_params(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def replaced(rep):
    return {k: s["replaced"] for k, s in (rep or {}).get("functions", {}).items() if s["replaced"]}


def _rel(a, b):
    return max(abs(x - y) / max(abs(x), 1e-3) for x, y in zip(a, b))


def main():
    from _common import machine, peak_extra_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    # one thread: on a small shared machine a second OpenMP thread made the tiny model's steps
    # several times slower at random (the load of other jobs), in both runs alike
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_e2e_trl.md"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import trl

    lines = [
        "# TRL GRPOTrainer end to end, unpatched vs ppo_kernels.integrations.apply('trl')",
        "",
        f"CPU: {machine()}. TRL {trl.__version__}. `python bench/e2e_trl.py --steps {a.steps} "
        f"--vocab {a.vocab} --reps {a.reps} --threads {a.threads}`: a random-init Llama (hidden 32, 2 layers, V={a.vocab}), "
        f"{PROMPTS} prompts, 2 generations of up to 8 tokens each, 4 completions per optimizer step, "
        f"AdamW lr 1e-3, float32, same seed. Time: median over {a.reps} alternated runs of "
        "`trainer.train()`; peak extra tensor memory of a whole run (model load, trainer, training; torch profiler).",
        "",
        "| config | per-step losses (unpatched) | max loss diff: abs (rel) | max grad-norm diff (rel) "
        "| completions equal | max final param diff (params moved by) | unpatched | patched | "
        "peak memory (unpatched / patched) | calls replaced |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in CONFIGS:
        kw = dict(config=config, steps=a.steps, vocab=a.vocab)
        run(**{**kw, "steps": 1})  # warm-up: imports, first calls
        run(**{**kw, "steps": 1}, patched=True)
        times = {False: [], True: []}
        for _ in range(a.reps):  # alternated: this machine's load drifts
            u = run(**kw)
            p = run(**kw, patched=True)
            times[False].append(u["seconds"])
            times[True].append(p["seconds"])
        tu, tp = statistics.median(times[False]), statistics.median(times[True])
        dl = max(abs(x - y) for x, y in zip(u["losses"], p["losses"]))
        dp = (u["params"] - p["params"]).abs().max().item()
        mu = peak_extra_bytes(lambda kw=kw: run(**kw))
        mp = peak_extra_bytes(lambda kw=kw: run(**kw, patched=True))
        rep = ", ".join(f"{k.rsplit('.', 1)[-1]}: {n}" for k, n in replaced(p["report"]).items())
        lines.append(
            f"| {config} | {', '.join(f'{x:.4g}' for x in u['losses'])} | {dl:.1e} "
            f"({_rel(u['losses'], p['losses']):.1e}) | {_rel(u['grad_norms'], p['grad_norms']):.1e}"
            f" | {u['completions'] == p['completions']} ({len(u['completions'])}) | {dp:.1e} "
            f"({u['moved']:.1e}) | {tu:.2f} s | {tp:.2f} s | "
            f"{mu / 2**20:.1f} / {mp / 2**20:.1f} MiB | {rep} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Configurations (GRPOConfig; the rest as in `grpo_config()` of the script):",
        "",
        *[f"- {c}: {o or 'TRL defaults'}" for c, o in CONFIGS.items()],
        "",
        "The default configuration's loss is 0 by construction (loss 'dapo', one iteration per "
        "generation: the ratio is 1 and the loss is minus the token-weighted mean advantage, 0 when "
        "the completions of a group have equal lengths); its gradient is not, hence the gradient-norm "
        "and parameter columns. AdamW scales an element's update by 1 / (|g| + eps): for elements "
        "whose gradient is near eps = 1e-8 it turns a float32 round-off difference of the gradient "
        "(~1e-10) into a parameter difference of up to a few 1e-3 x lr (at lr 1e-2: 2.5e-5).",
    ]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
