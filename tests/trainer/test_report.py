"""What the trainer's command line says and keeps, without training: the phase-time estimate
(trainer/estimate.py) and the first run's phases before it (trainer/first_run.py), the thread
default and the progress output (trainer/job.py), the --compare closing notes (trainer/report.py)
and when a checkpoint is written (trainer/checkpoint.py)."""

import copy
import io
import os
import random

import pytest
import torch
from support.skips import need

from ppo_kernels.trainer import (
    ConfigError,
    TrainConfig,
    checkpoint,
    estimate,
    first_run,
    job,
    report,
)
from ppo_kernels.trainer.models import tiny_model
from ppo_kernels.trainer.task import CharTokenizer, DecimalAdditionTask


def test_estimate_format_gives_ranges_and_a_total():
    lo, hi = estimate.SPREAD
    phases = [("SFT warm-up", 200.0), ("fused run", 100.0), ("eager run", 40.0)]
    line = estimate.format_estimate(phases, probe=0.25, sft_cached=False)
    assert line == (
        "phase times from a 3-step probe of this machine (0.25 s per SFT step now): "
        f"SFT warm-up {200 * lo / 60:.1f}-{200 * hi / 60:.1f} min (cached for later runs), "
        f"fused run {100 * lo / 60:.1f}-{100 * hi / 60:.1f} min, "
        f"eager run {40 * lo:.0f}-{40 * hi:.0f} s; in all "
        f"{340 * lo / 60:.1f}-{340 * hi / 60:.1f} min"
    )
    assert (lo, hi) == (0.8, 1.5)  # the line above spells out these numbers
    line = estimate.format_estimate([("eager run", 3000.0)], probe=1.0, sft_cached=True)
    assert line.endswith(": SFT warm-up: cached, eager run 40-75 min; in all 40-75 min")


def test_estimate_notes_a_busy_machine(monkeypatch):
    line = estimate.format_estimate([("fused run", 50.0)], probe=0.2, sft_cached=True, note="busy")
    assert line.endswith("; in all 40-75 s\nbusy")
    monkeypatch.setattr(first_run, "cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.44, 2.0, 1.0))
    assert first_run.load_note() == (
        "note: this machine is busy (load average 3.4 on 2 cores): the times move with the load"
    )
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4, 2.0, 1.0))
    assert first_run.load_note() == ""


def _tree(tmp_path, built: bool):
    for d in ("csrc", "csrc/cpu", "csrc/ops", "csrc/common", "csrc/cuda", "ppo_kernels"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    for f in (
        "csrc/a.cpp",
        "csrc/cpu/b.cpp",
        "csrc/ops/c.cpp",
        "csrc/common/h.h",
        "csrc/cuda/k.cu",
    ):
        (tmp_path / f).write_text("")
        os.utime(tmp_path / f, (1000, 1000))
    if built:
        (tmp_path / "ppo_kernels" / "_C.cpython-311-x86_64-linux-gnu.so").write_text("")
        os.utime(tmp_path / "ppo_kernels" / "_C.cpython-311-x86_64-linux-gnu.so", (2000, 2000))
    venv = tmp_path / "venv"
    venv.mkdir()
    return str(tmp_path), str(venv)


def test_first_run_phases_are_the_installs_and_the_compiling_that_apply(tmp_path, monkeypatch):
    monkeypatch.setattr(first_run, "cores", lambda: 2)
    root, venv = _tree(tmp_path, built=False)
    ph = first_run.phases(root, venv, "torch==2.13.0 ninja", jobs=2, cuda=False)
    c_lo, c_hi = first_run.CPP_FILE
    assert ph == [
        ("installing torch and the dependencies", first_run.INSTALL_CPU),
        ("compiling the extension (3 C++ files, 2 at a time)", (3 * c_lo / 2, 3 * c_hi / 2)),
    ]
    line = first_run.describe(ph)
    assert line.startswith("before training (first run): installing torch and the dependencies")
    assert "dependencies 10 s-3 min, compiling" in line
    assert line.endswith("; in all 28 s-4 min")
    # installed and built: nothing runs first
    with open(os.path.join(venv, ".ppo_deps"), "w") as f:
        f.write("torch==2.13.0 ninja\n")
    root, _ = _tree(tmp_path / "b", built=True)
    assert first_run.phases(root, venv, "torch==2.13.0 ninja", jobs=2, cuda=False) == []
    assert first_run.describe([]) == ""
    # one source changed since the build: that one; a header: every source (and the CUDA ones)
    os.utime(os.path.join(root, "csrc/cpu/b.cpp"), (3000, 3000))
    ((name, _),) = first_run.phases(root, venv, "torch==2.13.0 ninja", jobs=1, cuda=False)
    assert name == "compiling the extension (1 C++ files, 1 at a time)"
    os.utime(os.path.join(root, "csrc/common/h.h"), (3000, 3000))
    ((name, _),) = first_run.phases(root, venv, "torch==2.13.0 ninja", jobs=4, cuda=True)
    assert name == "compiling the extension (3 C++ + 1 CUDA files, 2 at a time)"


def test_thread_default_leaves_the_busy_cores_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 3.0, 3.0))
    assert job.auto_threads() == (1, "2 cores, load average 3.4")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.3, 0.3))
    assert job.auto_threads()[0] == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (0.7, 0.3, 0.3))
    assert job.auto_threads()[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # torchrun's or the user's choice stands
    assert job.auto_threads() == (2, "OMP_NUM_THREADS")
    with pytest.raises(ConfigError, match="--threads"):
        TrainConfig(threads=-1).validate()


def test_progress_bars_only_on_a_terminal(monkeypatch):
    need("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    cfg = TrainConfig().validate()
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert job._progress(cfg, 10, "sft") is None  # a log file: lines, no carriage returns
    monkeypatch.setattr("sys.stdout", Tty())
    bar = job._progress(cfg, 10, "sft")
    assert bar is not None
    bar.close()
    assert job._progress(TrainConfig(progress=False).validate(), 10, "sft") is None


def test_estimate_phases_scale_with_the_probe_and_the_config():
    cfg = TrainConfig().validate()  # the defaults: 800 SFT steps, 100 steps of 64, 200 eval
    ref = estimate.REF
    probe = 2 * ref["sft_step"]["fused"]  # a machine twice as slow as the reference one
    got = dict(estimate.phase_seconds(cfg, probe, ["fused", "eager"], sft_to_run=True))
    assert got["SFT warm-up"] == pytest.approx(probe * 800)
    for ops in ("fused", "eager"):
        assert got[f"{ops} run"] == pytest.approx(2 * (100 * ref["rl_step"][ops] + 2 * ref["eval"]))
    # half the responses per step and eval prompts: half the run; a cached SFT: no SFT phase
    small = TrainConfig(prompts_per_step=32, eval_prompts=100).validate()
    got2 = dict(estimate.phase_seconds(small, probe, ["fused"], sft_to_run=False))
    assert list(got2) == ["fused run"]
    assert got2["fused run"] == pytest.approx(got["fused run"] / 2)
    # an eager run's probe is an eager SFT step: the same machine gives the same RL estimate
    eager = TrainConfig(ops="eager").validate()
    probe_e = 2 * ref["sft_step"]["eager"]
    got3 = dict(estimate.phase_seconds(eager, probe_e, ["eager"], sft_to_run=False))
    assert got3["eager run"] == pytest.approx(got["eager run"])


def test_estimate_probe_leaves_the_model_and_random_state_alone():
    cfg = TrainConfig(vocab=64, hidden=32, layers=1, heads=2, sft_batch=4).validate()
    tok, task = CharTokenizer(64), DecimalAdditionTask()
    actor = tiny_model(cfg, len(tok))
    before = copy.deepcopy(actor.state_dict())

    def draws():
        return torch.rand(3), random.random()

    torch.manual_seed(5)
    random.seed(5)
    want = draws()
    torch.manual_seed(5)
    random.seed(5)
    line = estimate.estimate(cfg, actor, tok, task, ["fused", "eager"], sft_to_run=True)
    got = draws()
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    for k, v in actor.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert line.startswith("phase times from a 3-step probe") and "eager run" in line
    assert estimate.probe_sft_step(cfg, actor, tok, task, "eager") > 0


def _summary(ops, t, cpu, mem, before, after, tool=(0.5, 0.8)):
    return {
        "ops": ops,
        "algo": "ppo",
        "seconds_per_step": t,
        "cpu_seconds_per_step": cpu,
        "peak_memory_bytes": mem,
        "peak_memory_kind": "tensor peak",
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_tool_use_before": tool[0],
        "eval_tool_use_after": tool[1],
        "config": {
            "algo": "ppo",
            "steps": 3,
            "prompts_per_step": 64,
            "group_size": 1,
            "eval_prompts": 200,
            "reward": "verifier",
        },
    }


def _rows(scores):
    keys = ("response_tokens", "tool_call_frac", "truncated_frac")
    return [{"step": i, "score": s, **{k: 1.0 for k in keys}} for i, s in enumerate(scores)]


def test_first_divergence_is_the_first_step_whose_rollouts_differ():
    a = _rows([0.1, 0.2, 0.3])
    assert report.first_divergence(a, _rows([0.1, 0.2, 0.3])) is None
    assert report.first_divergence(a, _rows([0.1, 0.2, 0.4])) == 2
    b = _rows([0.1, 0.2, 0.3])
    b[1]["response_tokens"] = 2.0
    b[1]["kl"] = 5.0  # not a rollout statistic
    assert report.first_divergence(a, b) == 1


def test_closing_notes_say_what_the_numbers_mean():
    fused = _summary("fused", 2.0, 1.9, 100 * 2**20, 0.305, 0.505, (0.52, 0.81))
    eager = _summary("eager", 4.0, 4.2, 400 * 2**20, 0.305, 0.650)
    text = report.closing_notes(eager, fused, _rows([0.1, 0.2, 0.4]), _rows([0.1, 0.2, 0.3]))
    flat = " ".join(text.split())
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "the same 3 PPO steps (64 responses each)" in flat
    assert "the actor loss (clipped policy term) in the same pass; fused KL-penalised" in flat
    assert "Reward is the verifier's mean score on 200 held-out sums" in flat
    assert (
        "Fused: reward 0.305 -> 0.505, tool use 0.52 -> 0.81; eager: reward 0.305 -> 0.650" in flat
    )
    assert "Time per step: 0.50x (2.00 s vs 4.00 s; CPU time 0.45x, the steadier" in flat
    assert "Peak tensor memory: 0.25x;" in flat
    assert "identical for steps 0-1 and first differed at step 2" in flat
    same = report.closing_notes(fused, eager, _rows([0.1] * 3), _rows([0.1] * 3))
    assert "identical for every one of the 3 steps" in " ".join(same.split())
    # GRPO: the KL is a loss term (in the fused actor loss), no Critic, group advantages
    grpo = [{**s, "config": {**s["config"], "algo": "grpo"}} for s in (fused, eager)]
    g = " ".join(report.closing_notes(*grpo, _rows([0.1]), _rows([0.1])).split())
    assert "the same 3 GRPO steps" in g and "GAE" not in g
    assert "(clipped policy term and KL to the Reference) in the same pass" in g
    # DPO / RM runs compare no rollouts: no notes
    dpo = {**fused, "config": {**fused["config"], "algo": "dpo"}}
    assert report.closing_notes(dpo, eager, [], []) == ""


def test_compare_table_has_tool_use():
    fused = _summary("fused", 2.0, 1.9, 100 * 2**20, 0.305, 0.505, (0.52, 0.81))
    table = report.compare_table(_summary("eager", 4.0, 4.2, 400 * 2**20, 0.3, 0.6), fused)
    assert "eval tool use after" in table and "0.81" in table and "0.50x" in table


@pytest.mark.parametrize(
    "kw, due",
    [
        (dict(steps=5), [4]),
        (dict(steps=5, save_every=2), [1, 3, 4]),
        (dict(steps=5, save_every=2, checkpoint=False), []),
        (dict(steps=5, checkpoint=False), []),
    ],
)
def test_checkpoint_is_written_at_the_end_and_every_save_every(kw, due):
    cfg = TrainConfig(**kw).validate()
    assert [s for s in range(cfg.steps) if checkpoint.due(cfg, s)] == due
