"""The trainer end to end on a tiny model: eager/fused parity of one PPO update, checkpoint
resume, and a short smoke run of every algorithm through the command line (CI-sized)."""

import copy
import json
import os
import sys

import pytest
import torch
from support.skips import requires_cuda
from support.trainer_workers import dp_worker

from ppo_kernels.trainer import Ops, TrainConfig
from ppo_kernels.trainer.algos.ppo import RLTrainer
from ppo_kernels.trainer.cli import main
from ppo_kernels.trainer.job import run
from ppo_kernels.trainer.models import ValueModel, frozen_copy, tiny_model
from ppo_kernels.trainer.task import CharTokenizer, DecimalAdditionTask, Problem

TINY = [
    "--vocab",
    "64",
    "--hidden",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--sft-steps",
    "20",
    "--sft-batch",
    "16",
    "--eval-prompts",
    "8",
    "--prompts-per-step",
    "8",
    "--minibatch-size",
    "4",
    "--max-new-tokens",
    "36",
    "--no-progress",
    "--threads",
    "1",
]


def _tiny_cfg(**kw):
    base = dict(
        vocab=64,
        hidden=32,
        layers=1,
        heads=2,
        sft_steps=0,
        prompts_per_step=8,
        minibatch_size=4,
        max_new_tokens=36,
        progress=False,
        plot=False,
        ent_coef=0.01,
    )
    base.update(kw)
    return TrainConfig(**base).validate()


# Tolerance of the parity check: the fused ops accumulate in float32 like the eager code but in
# another order, so per-token values differ by ~1e-7; over two steps (2 epochs x 2 minibatches of
# AdamW each) metrics and parameters were measured within 1e-6 of each other here.
PARITY = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_eager_fused_parity_of_one_update(algo):
    """Same seed, same start: two rollout + update steps under each --ops give the same metrics."""
    tok, task = CharTokenizer(), DecimalAdditionTask()
    grpo = algo == "grpo"
    cfg = _tiny_cfg(
        algo=algo, group_size=4 if grpo else 1, prompts_per_step=4 if grpo else 8, kl_coef=0.05
    )
    torch.manual_seed(0)
    actor0 = tiny_model(cfg, len(tok))
    critic0 = ValueModel.from_causal_lm(actor0) if algo == "ppo" else None
    if critic0 is not None:
        torch.nn.init.normal_(critic0.head.weight, std=0.1)
    problems = [
        Problem("0.10", "0.20"),
        Problem("1.25", "2.50"),
        Problem("0.10", "0.70"),
        Problem("3.33", "4.44"),
        Problem("9.99", "0.01"),
        Problem("0.05", "0.05"),
        Problem("2.20", "1.10"),
        Problem("7.00", "0.35"),
    ][: cfg.prompts_per_step]
    results = {}
    for mode in ("eager", "fused"):
        actor = copy.deepcopy(actor0)
        # reward mix: make sure advantages are non-zero even for an untrained model
        tr = RLTrainer(
            cfg, actor, frozen_copy(actor0), copy.deepcopy(critic0), tok, task, Ops(mode)
        )
        tr.task = _PartialCredit()
        m1 = tr.step(problems)
        m2 = tr.step(problems)  # the second step runs with a moved policy (non-zero KL)
        results[mode] = (m1, m2, [p.detach().clone() for p in actor.parameters()])
    (e1, e2, ep), (f1, f2, fp) = results["eager"], results["fused"]
    for e, f in ((e1, f1), (e2, f2)):
        assert e.keys() == f.keys()
        for k in e:
            torch.testing.assert_close(
                torch.tensor(f[k]),
                torch.tensor(e[k]),
                **PARITY,
                msg=lambda m, k=k: f"metric {k}: {m}",
            )
    assert e1["pg_loss"] != 0.0 and e2["kl"] != 0.0
    for a, b in zip(ep, fp):
        torch.testing.assert_close(b, a, **PARITY)


class _PartialCredit(DecimalAdditionTask):
    """Dense stand-in reward for an untrained model: the fraction of digits in the response."""

    def verify(self, problem, response):
        return sum(c.isdigit() for c in response) / max(1, len(response))


def test_checkpoint_resume_gives_the_same_continuation(tmp_path):
    args = dict(
        vocab=64,
        hidden=32,
        layers=1,
        heads=2,
        sft_steps=10,
        sft_batch=8,
        eval_prompts=4,
        prompts_per_step=8,
        minibatch_size=4,
        max_new_tokens=36,
        progress=False,
        plot=False,
        sft_cache=str(tmp_path / "sft"),
        threads=1,
    )
    full = run(
        TrainConfig(**args, steps=3, out=str(tmp_path / "full")).validate(), log=lambda *a: None
    )
    run(TrainConfig(**args, steps=1, out=str(tmp_path / "part")).validate(), log=lambda *a: None)
    resumed = run(
        TrainConfig(
            **args, steps=3, out=str(tmp_path / "part"), resume=str(tmp_path / "part")
        ).validate(),
        log=lambda *a: None,
    )

    def rows(d):
        with open(tmp_path / d / "metrics.jsonl") as f:
            return [json.loads(x) for x in f]

    a, b = rows("full"), rows("part")
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        ra.pop("seconds"), rb.pop("seconds")
        assert ra == rb
    assert resumed["eval_reward_after"] == full["eval_reward_after"]
    ca = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["trainer"]["actor"]
    cb = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["trainer"]["actor"]
    for k in ca:
        torch.testing.assert_close(ca[k], cb[k], rtol=0, atol=0)
    # the footprint: one checkpoint file (no temporary left) holding what the resume above
    # needed -- Actor and Reference, Critic, and the two AdamW states (2 moments each) -- and
    # nothing else of size (pickle overhead aside)
    assert sorted(p.name for p in (tmp_path / "part").glob("checkpoint*")) == ["checkpoint.pt"]
    actor = sum(v.numel() * v.element_size() for v in ca.values())
    critic = ValueModel.from_causal_lm(tiny_model(TrainConfig(**args), 64))
    critic = sum(p.numel() * p.element_size() for p in critic.parameters())
    size = (tmp_path / "part" / "checkpoint.pt").stat().st_size
    assert 4 * actor + 3 * critic <= size <= 1.1 * (4 * actor + 3 * critic) + 200_000, size


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("ppo", ["--steps", "2", "--ops", "fused", "--no-checkpoint"]),
        (
            "grpo",
            [
                "--steps",
                "1",
                "--group-size",
                "4",
                "--prompts-per-step",
                "2",
                "--group-advantage",
                "rloo",
            ],
        ),
        ("dpo", ["--steps", "2", "--pairs", "16", "--pref-batch", "8"]),
        ("rm", ["--steps", "2", "--pairs", "16", "--pref-batch", "8", "--eval-pairs", "8"]),
    ],
)
def test_cli_smoke(tmp_path, algo, extra):
    out = tmp_path / algo
    assert (
        main(
            ["--algo", algo, "--out", str(out), "--sft-cache", str(tmp_path / "sft"), *TINY, *extra]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    for k in ("eval_reward_before", "eval_reward_after", "seconds_per_step", "peak_memory_bytes"):
        assert summary[k] is not None, k
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = int(extra[extra.index("--steps") + 1])
    assert len(lines) == steps and all(json.loads(x)["phase"] == algo for x in lines)
    assert (out / "curves.png").stat().st_size > 1000
    assert len((out / "metrics.csv").read_text().splitlines()) == steps + 1
    if algo == "rm":
        assert os.path.exists(out / "reward_model.pt")
    # PPO / GRPO checkpoint unless --no-checkpoint (the ppo case); DPO / RM never do
    assert (out / "checkpoint.pt").exists() == (algo == "grpo")


def test_ppo_with_reward_model_and_critic_from_it(tmp_path):
    rm_out = tmp_path / "rm"
    common = ["--sft-cache", str(tmp_path / "sft"), *TINY]
    assert (
        main(
            [
                "--algo",
                "rm",
                "--out",
                str(rm_out),
                "--steps",
                "2",
                "--pairs",
                "16",
                "--pref-batch",
                "8",
                "--eval-pairs",
                "8",
                *common,
            ]
        )
        == 0
    )
    out = tmp_path / "ppo_rm"
    assert (
        main(
            [
                "--algo",
                "ppo",
                "--reward",
                "rm",
                "--rm-path",
                str(rm_out / "reward_model.pt"),
                "--out",
                str(out),
                "--steps",
                "1",
                *common,
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["reward"] == "rm"


def test_local_hf_model_path(tmp_path):
    """--model PATH: a transformers causal LM and tokenizer saved on disk (here a tiny Qwen2 with
    a character-level fast tokenizer), trained on the embedded task."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = CharTokenizer().vocab[2:]  # "$" (the task's end marker) and the task's characters
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    path = tmp_path / "hf"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    out = tmp_path / "out"
    assert main(["--model", str(path), "--out", str(out), "--steps", "1", *TINY]) == 0
    assert json.loads((out / "summary.json").read_text())["eval_reward_after"] is not None


@requires_cuda
@pytest.mark.parametrize("ops", ["fused", "eager"])
def test_cuda_smoke(tmp_path, ops):
    out = tmp_path / ops
    assert (
        main(
            [
                "--device",
                "cuda",
                "--ops",
                ops,
                "--out",
                str(out),
                "--steps",
                "2",
                "--sft-cache",
                str(tmp_path / "sft"),
                *TINY,
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["peak_memory_kind"] == "cuda_max_memory_allocated" and s["peak_memory_bytes"] > 0


def test_compare_prints_the_table_and_overlays_the_plot(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "--out",
                str(out),
                "--steps",
                "2",
                "--compare",
                "--sft-cache",
                str(tmp_path / "sft"),
                *TINY,
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "fused/eager" in text and "peak tensor memory" in text, text
    assert text.startswith("phase times from a 3-step probe of this machine"), text
    # the table, the plot, then the closing notes (also in compare.txt, after the table)
    table, notes = text.split(f"plot: {out / 'curves.png'}\n\n")
    assert notes.startswith("What was compared: the same 2 PPO steps"), notes
    assert "Why the rewards part after the first steps" in notes
    assert (out / "compare.txt").read_text().replace(notes.strip(), "").strip() in table
    for run_dir in (out, out / "compare_eager"):
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["peak_memory_bytes"] > 0 and s["seconds_per_step"] > 0
    # the first run's checkpoint (what --compare --resume uses), none for the second
    assert (out / "checkpoint.pt").exists()
    assert not list((out / "compare_eager").glob("checkpoint*"))


def _torchrun(args, nproc=2):
    import subprocess

    from support import ROOT as root

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "-m", "ppo_kernels", "train", *args]
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# One process vs two with the same global batch and seed. Rollouts: each rank samples its rows
# with the uniforms those rows draw in the one-process run, so the responses are the same and the
# per-sequence metrics agree to float64 rounding of their means (EXACT). The update: the same
# minibatches as the one-process run (a rank may hold any number of a minibatch's rows), losses
# weighted so that the reduced gradient is the one-process gradient; it differs only in float32
# summation order (each rank sums its rows, the all-reduce adds the sums), ~1e-7 relative, which
# Adam's normalisation can raise for near-zero gradient entries. Measured (unrounded, this
# config): step-0 metrics within 3e-6 relative of the one-process run under DDP and FSDP2, and
# equal after metrics.jsonl's rounding to 6 decimals; CLOSE is that rounding (abs 1e-6) or 1e-4
# relative, a 30x margin. Step 1 (after 4 more optimiser steps) is held to 1e-3.
EXACT = dict(rel=1e-9, abs=1e-9)
CLOSE = dict(rel=1e-4, abs=1e-6)
PER_SEQUENCE = ("score", "response_tokens", "tool_call_frac", "truncated_frac")
DP_ARGS = ["--algo", "ppo", *TINY, "--ent-coef", "0.05", "--eval-prompts", "9", "--no-plot"]


@pytest.fixture(scope="module")
def one_process_ppo(tmp_path_factory):
    """The one-process reference: 2 PPO steps, 2 epochs x 2 minibatches of 4 sequences."""
    tmp = tmp_path_factory.mktemp("dp")
    common = [*DP_ARGS, "--sft-cache", str(tmp / "sft")]
    assert main([*common, "--out", str(tmp / "one"), "--steps", "2"]) == 0
    return tmp, common, _rows(tmp / "one"), json.loads((tmp / "one" / "summary.json").read_text())


def _assert_follows(rows_one, rows_two):
    assert [r["step"] for r in rows_two] == [0, 1]
    a, b = rows_one[0], rows_two[0]
    assert a.keys() == b.keys()
    for k in a:
        if k not in ("seconds", "phase", "step"):
            assert b[k] == pytest.approx(a[k], **(EXACT if k in PER_SEQUENCE else CLOSE)), k
    assert a["actor_grad_norm"] > 0
    a, b = rows_one[1], rows_two[1]  # after one update: same responses, metrics close
    assert a["pg_loss"] != 0 and a["kl"] != 0 and a["vf_loss"] != 0
    for k in PER_SEQUENCE:
        assert b[k] == pytest.approx(a[k], **EXACT), k
    for k in ("kl", "pg_loss", "vf_loss", "entropy", "value_mean"):
        assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), k


def test_ddp_two_processes_match_one_and_resume(one_process_ppo):
    """torchrun --nproc_per_node 2 --dist ddp (gloo): rank 0 alone writes the outputs, a resume
    under two processes continues the run, and every metric follows the one-process run: step 0
    within CLOSE, step 1 (from the resumed run) the same responses and metrics within 1e-3."""
    tmp, common, rows_one, s_one = one_process_ppo
    two = tmp / "ddp"
    out = _torchrun([*common, "--dist", "ddp", "--out", str(two), "--steps", "1"]).stdout
    assert out.count('"eval_reward_after"') == 1  # one rank reports
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["dist"] == "ddp"
    # the held-out eval (9 prompts split 4 / 5) samples what the one-process run samples
    assert summary["eval_reward_before"] == s_one["eval_reward_before"]
    assert summary["eval_tool_use_before"] == s_one["eval_tool_use_before"]
    assert (two / "checkpoint.pt").exists()
    _torchrun([*common, "--dist", "ddp", "--out", str(two), "--steps", "2", "--resume", str(two)])
    _assert_follows(rows_one, _rows(two))


def test_fsdp2_two_processes_match_one(one_process_ppo):
    """--dist fsdp2 (fully_shard per decoder layer, gloo on the CPU): the same run; the
    checkpoint holds the whole (gathered) models, and resuming it in one process continues."""
    tmp, common, rows_one, _ = one_process_ppo
    two = tmp / "fsdp2"
    _torchrun([*common, "--dist", "fsdp2", "--out", str(two), "--steps", "2"])
    _assert_follows(rows_one, _rows(two))
    ck = torch.load(two / "checkpoint.pt", weights_only=False)["trainer"]
    ref = torch.load(tmp / "one" / "checkpoint.pt", weights_only=False)["trainer"]
    assert ck["actor"].keys() == ref["actor"].keys()
    for k in ref["actor"]:
        assert not hasattr(ck["actor"][k], "full_tensor"), k  # plain, whole tensors
        torch.testing.assert_close(ck["actor"][k], ref["actor"][k], rtol=1e-3, atol=1e-5)
    # a sharded run's checkpoint resumes anywhere (here: one process, one more step)
    assert main([*common, "--out", str(two), "--steps", "3", "--resume", str(two)]) == 0
    assert [r["step"] for r in _rows(two)] == [0, 1, 2]


@pytest.mark.parametrize("algo", ["dpo", "rm"])
def test_preference_training_two_processes_match_one(tmp_path, algo):
    """DPO / reward model under torchrun: each rank takes half of every batch of pairs; the
    loss, gradient norm and accuracies of each step are the one-process ones (float32 summation
    order aside), and so is the held-out result."""
    common = ["--algo", algo, *TINY, "--sft-cache", str(tmp_path / "sft"), "--no-plot"]
    common += ["--steps", "2", "--pairs", "16", "--pref-batch", "8", "--eval-pairs", "9"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    dist_mode = "fsdp2" if algo == "rm" else "ddp"
    _torchrun([*common, "--dist", dist_mode, "--out", str(tmp_path / "two")])
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(rows_two) == 2
    for a, b in zip(rows_one, rows_two):
        for k in a:
            if k not in ("seconds", "phase", "step"):
                assert b[k] == pytest.approx(a[k], **CLOSE), (a["step"], k)
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert s2["eval_reward_after"] == pytest.approx(s1["eval_reward_after"], abs=1e-9)
    if algo == "rm":
        assert (tmp_path / "two" / "reward_model.pt").exists()


def test_data_parallel_helpers_two_ranks(tmp_path):
    """DDP and FSDP2 (dist.wrap) give every rank the gradient of the mean of the ranks' losses
    (the one-process gradient of the whole batch for equal shares), FSDP2's gathered state dict
    is the whole one; global_means divides summed sums by summed counts (not a mean of means);
    shares, spans and eval chunks are contiguous and leave no rank empty."""
    torch.multiprocessing.spawn(
        dp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    (model(x[0]).square().mean() + model(x[1]).square().mean()).div(2).backward()
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt", weights_only=False)
        for mode, grads in got["grads"].items():
            for g, p in zip(grads, model.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7, msg=mode)
        for k, v in torch.nn.Linear(3, 2).state_dict().items():
            assert got["state"][k].shape == v.shape
        assert got["means"] == {"a": 0.5, "w": pytest.approx(3.0 / 4)}
        assert got["share"] == ([[0, 1, 2], [3, 4, 5]][r], 3 * r)
        assert got["span"] == [[(0, 1), (1, 2)][r], [(0, 2), (2, 5)][r]]
        assert got["chunks"] == [(0, 100), (100, 201)]  # the 1-row tail joins the chunk before
        assert got["any"] == (True, False)
