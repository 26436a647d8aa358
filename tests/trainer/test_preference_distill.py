"""DPO, the reward model and on-policy distillation with --ops fused (losses from the hidden
states: linear_preference_loss, reward_model_head_loss, linear_distill_loss) against --ops eager
(materialised logits) on a tiny model; the distillation run end to end from a PPO checkpoint."""

import copy
import dataclasses
import json
import os

import pytest
import torch

from ppo_kernels.trainer import ConfigError, Ops, TrainConfig
from ppo_kernels.trainer.algos.distill import DistillTrainer
from ppo_kernels.trainer.algos.dpo import train_dpo
from ppo_kernels.trainer.algos.rm import train_reward_model
from ppo_kernels.trainer.checkpoint import load_teacher
from ppo_kernels.trainer.cli import main
from ppo_kernels.trainer.config import config_from_args
from ppo_kernels.trainer.models import frozen_copy, tiny_model
from ppo_kernels.trainer.task import CharTokenizer, DecimalAdditionTask, Problem

# float32 in another summation order, through two AdamW steps (as tests/trainer/test_e2e.py)
PARITY = dict(rtol=1e-4, atol=1e-5)
PROBLEMS = [Problem("0.10", "0.20"), Problem("1.25", "2.50"), Problem("3.33", "4.44"),
            Problem("9.99", "0.01")]  # fmt: skip


def _cfg(**kw):
    base = dict(vocab=64, hidden=32, layers=1, heads=2, sft_steps=0, prompts_per_step=4,
                minibatch_size=2, max_new_tokens=24, eval_prompts=4, progress=False, plot=False)  # fmt: skip
    return TrainConfig(**{**base, **kw}).validate()


def _model(cfg, seed):
    torch.manual_seed(seed)
    return tiny_model(cfg, len(CharTokenizer(cfg.vocab)))


def _assert_same_rows(eager, fused):
    assert len(eager) == len(fused)
    for e, f in zip(eager, fused):
        assert e.keys() == f.keys()
        for k in e:
            torch.testing.assert_close(
                torch.tensor(f[k]), torch.tensor(e[k]), **PARITY, msg=lambda m, k=k: f"{k}: {m}"
            )


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_dpo_fused_matches_eager(coef):
    """Two DPO steps (the second one off the Reference): every logged metric and every parameter
    the same with the one-pass fused loss as with the materialised logits."""
    cfg = _cfg(algo="dpo", steps=2, pairs=16, pref_batch=8, dpo_nll_coef=coef)
    tok, task = CharTokenizer(cfg.vocab), DecimalAdditionTask()
    actor0 = _model(cfg, 0)
    rows, params, ops = {}, {}, {}
    for mode in ("eager", "fused"):
        actor, ops[mode], rows[mode] = copy.deepcopy(actor0), Ops(mode), []
        train_dpo(cfg, actor, tok, task, ops[mode], on_step=lambda s, m, r=rows[mode]: r.append(m))
        params[mode] = _params(actor)
    _assert_same_rows(rows["eager"], rows["fused"])
    # AdamW's first step moves every element by about lr whatever its gradient's size, so an
    # element whose gradient is the cancellation of a chosen and a rejected term (rounding-sized,
    # at policy = Reference) may differ by a fraction of lr; the rest agree to PARITY
    for a, b in zip(params["eager"], params["fused"]):
        torch.testing.assert_close(b, a, rtol=PARITY["rtol"], atol=cfg.dpo_lr / 3)
    assert rows["fused"][1]["reward_margin"] != 0.0  # the policy moved off the Reference
    assert "linear_preference_loss" in ops["fused"].used and not ops["eager"].used
    assert ops["fused"].fallbacks == set()


def test_reward_model_fused_head_loss_matches_eager():
    cfg = _cfg(algo="rm", steps=2, pairs=16, pref_batch=8, eval_pairs=8)
    tok, task = CharTokenizer(cfg.vocab), DecimalAdditionTask()
    actor = _model(cfg, 0)
    rows, acc = {}, {}
    for mode in ("eager", "fused"):
        rows[mode] = []
        ops = Ops(mode)
        _, a0, a1 = train_reward_model(
            cfg, actor, tok, task, ops, 2, log=lambda *a: None,
            on_step=lambda s, m, r=rows[mode]: r.append(m),
        )  # fmt: skip
        acc[mode] = (a0, a1)
        assert ("reward_model_head_loss" in ops.used) == (mode == "fused")
    _assert_same_rows(rows["eager"], rows["fused"])
    assert acc["eager"] == acc["fused"]


def _distill_runs(cfg, steps, modes):
    tok, task = CharTokenizer(cfg.vocab), DecimalAdditionTask()
    student0, teacher = _model(cfg, 0), frozen_copy(_model(cfg, 1))
    with torch.no_grad():  # a confident teacher: random-init heads are near uniform
        teacher.lm_head.weight.mul_(10.0)
    out = {}
    for mode in modes:
        tr = DistillTrainer(cfg, copy.deepcopy(student0), teacher, tok, task, Ops(mode))
        out[mode] = [tr.step(PROBLEMS) for _ in range(steps)]
    return out


def test_distill_fused_matches_eager_and_kl_decreases():
    """Two steps give the same metrics (loss = token-mean reverse KL, gradient norm, the sampled
    responses' scores) either way; over a few more steps on the same prompts the student's
    reverse KL to a different (random) teacher goes down."""
    cfg = _cfg(algo="distill", teacher=".", actor_lr=1e-2)
    runs = _distill_runs(cfg, 2, ("eager", "fused"))
    _assert_same_rows(runs["eager"], runs["fused"])
    kl = [m["distill_kl"] for m in _distill_runs(cfg, 8, ("fused",))["fused"]]
    assert kl[0] > 0.5
    assert kl[-1] < 0.7 * kl[0], kl


def _save_checkpoint(path, cfg, model):
    os.makedirs(path, exist_ok=True)
    torch.save(
        {"cfg": dataclasses.asdict(cfg), "trainer": {"actor": model.state_dict()}},
        os.path.join(path, "checkpoint.pt"),
    )


def test_teacher_loads_from_a_checkpoint(tmp_path):
    cfg = _cfg(algo="ppo")
    model = _model(cfg, 3)
    _save_checkpoint(tmp_path / "run", cfg, model)
    state = torch.random.get_rng_state()
    teacher, vocab = load_teacher(str(tmp_path / "run"), "cpu")
    assert torch.equal(state, torch.random.get_rng_state())  # the run's random stream untouched
    assert vocab == cfg.vocab and not any(p.requires_grad for p in teacher.parameters())
    for a, b in zip(teacher.parameters(), model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="--teacher: no checkpoint"):
        load_teacher(str(tmp_path), "cpu")
    torch.save({"step": 1}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="--teacher: .* holds no Actor"):
        load_teacher(str(tmp_path / "other.pt"), "cpu")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--algo", "distill"], "--teacher: --algo distill needs a teacher"),
        (["--algo", "ppo", "--teacher", "."], "--teacher: only --algo distill"),
        (["--algo", "distill", "--teacher", "/nonexistent/run"], "--teacher: .* does not exist"),
        (["--algo", "distill", "--teacher", ".", "--resume", "."], "--resume"),
    ],
)
def test_bad_distill_configs_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_args(argv)


TINY = ["--vocab", "64", "--hidden", "32", "--layers", "1", "--heads", "2", "--sft-steps", "20",
        "--sft-batch", "16", "--eval-prompts", "8", "--prompts-per-step", "8",
        "--minibatch-size", "4", "--max-new-tokens", "36", "--no-progress", "--threads", "1",
        "--no-plot"]  # fmt: skip


def test_distill_recipe_from_a_ppo_checkpoint(tmp_path, capsys):
    """docs/trainer.md's two commands: PPO saves its checkpoint, distill reads it as the
    teacher; a teacher of another vocabulary is refused, naming --teacher."""
    sft = ["--sft-cache", str(tmp_path / "sft")]
    assert main(["--algo", "ppo", "--steps", "1", "--out", str(tmp_path / "ppo"), *sft, *TINY]) == 0
    out = tmp_path / "distill"
    argv = ["--algo", "distill", "--teacher", str(tmp_path / "ppo"), "--steps", "2"]
    assert main([*argv, "--out", str(out), *sft, *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for k in ("eval_reward_teacher", "eval_reward_before", "eval_reward_after"):
        assert summary[k] is not None, k
    assert "linear_distill_loss" in summary["ops_fused"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["distill", "distill"] and "distill_kl" in rows[0]
    assert not (out / "checkpoint.pt").exists()
    _save_checkpoint(tmp_path / "wide", _cfg(algo="ppo", vocab=80), _model(_cfg(vocab=80), 0))
    argv[3] = str(tmp_path / "wide")
    assert main([*argv, "--out", str(tmp_path / "bad"), *sft, *TINY]) == 2
    assert "--teacher: its tokenizer has 80 tokens" in capsys.readouterr().err
