"""Each per-call trick against its plain form (bench/results/cpu_overhead_tricks.md), one thread:

  env    `_dispatch.getenv` / `any_requested` read os.environ's own dict (`os.environ._data`)
         instead of `os.environ.get`; toggled in this process, A and B interleaved
  nodes  the autograd nodes csrc/ops/plain_node.h builds by hand against the ops'
         torch::autograd::Function: two builds of the extension, so two processes (--variant
         DIR: a copy of ppo_kernels/ whose _C was built with `all_plain` returning false),
         started alternately

on (a) the small calls of bench/bench_overhead.py (B x T = 2 x 8) and (b) a trainer step on the
tiny model (PPO: rollout, scoring and update of 64 prompts; RM and DPO: an optimiser step of 32
pairs), the step timed as the trainer times it (`around_step`, `_Run.step`).

    python bench/bench_overhead_tricks.py env calls [--rounds 15] [--ops reward_model,...]
    python bench/bench_overhead_tricks.py env step --algo ppo [--steps 6]
    python bench/bench_overhead_tricks.py nodes calls --variant /tmp/plain/ppo_kernels_parent
    python bench/bench_overhead_tricks.py nodes step --algo rm --variant ...

`nodes calls --variant DIR` times any two builds this way: DIR another checkout's root (its
ppo_kernels/ built in place) gives the before / after table of a restructuring.

Printed: the median of each side's rounds (or steps) with their spread (min-max), the ratio of the
medians, and for (b) how often the trick runs in one step (calls counted in the step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

NODE_OPS = ("linear_token_logprobs", "reward_model_loss", "dpo_loss", "masked_aggregate")
NODE_NAMES = (
    "LinearTokenLogprobsBackward",
    "PairwiseLogsigmoidLossBackward",
    "MaskedAggregateBackward",
)


# ---- the env trick, toggled in this process ----


@contextlib.contextmanager
def plain_env():
    """The plain form of the env trick: os.environ.get wherever getenv / any_requested run."""
    from ppo_kernels import _backend, _dispatch

    saved = (_dispatch.getenv, _backend.getenv, _backend.any_requested)

    def getenv(name, default=""):
        return os.environ.get(name, default)

    def any_requested():
        return bool(_dispatch._stack) or bool(os.environ.get("PPO_KERNELS_BACKEND"))

    _dispatch.getenv = _backend.getenv = getenv
    _backend.any_requested = any_requested
    try:
        yield
    finally:
        _dispatch.getenv, _backend.getenv, _backend.any_requested = saved


@contextlib.contextmanager
def counting_env(counts):
    """The trick as it is, each call counted."""
    from ppo_kernels import _backend, _dispatch

    saved = (_dispatch.getenv, _backend.getenv, _backend.any_requested)
    getenv0, any0 = saved[0], saved[2]

    def getenv(name, default=""):
        counts["getenv"] = counts.get("getenv", 0) + 1
        return getenv0(name, default)

    def any_requested():
        counts["any_requested"] = counts.get("any_requested", 0) + 1
        return any0()

    _dispatch.getenv = _backend.getenv = getenv
    _backend.any_requested = any_requested
    try:
        yield
    finally:
        _dispatch.getenv, _backend.getenv, _backend.any_requested = saved


# ---- (a) the per-call bench's small calls ----


def small_cases(ops):
    import bench_overhead

    out = []
    for name, ours, _ in bench_overhead.cases(2, 8):
        if ops and not any(o in name for o in ops):
            continue
        out.append((name, ours))
    return out


def time_calls(fn, reps):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def calls_env(args):
    rows = []
    for name, fn in small_cases(args.ops):
        for _ in range(max(3, args.reps // 20)):
            fn()
        counts = {}
        with counting_env(counts):
            fn()
        a, b = [], []
        for _ in range(args.rounds):
            a.append(time_calls(fn, args.reps))
            with plain_env():
                b.append(time_calls(fn, args.reps))
        rows.append((name, a, b, counts))
        print(_row(name, a, b) + f" calls per call: {counts}", flush=True)
    return rows


def calls_one(args):
    """This process's side of `nodes calls`: per-round seconds per call, as JSON."""
    out = {}
    for name, fn in small_cases(args.ops):
        for _ in range(max(3, args.reps // 20)):
            fn()
        out[name] = [time_calls(fn, args.reps) for _ in range(args.rounds)]
    print(json.dumps(out))


# ---- (b) a trainer step ----


def _trainer(algo, ops_mode="fused"):
    """(step(i) -> seconds, counters of one step) for `algo` on the default tiny model (no SFT:
    the timing, not the learning, is what is compared)."""
    from ppo_kernels.trainer import Ops, TrainConfig
    from ppo_kernels.trainer.models import ValueModel, frozen_copy, tiny_model
    from ppo_kernels.trainer.task import CharTokenizer, DecimalAdditionTask

    cfg = TrainConfig(algo=algo, sft_steps=0, progress=False, plot=False).validate()
    tok, task = CharTokenizer(cfg.vocab), DecimalAdditionTask(cfg.p_tool, cfg.p_format)
    torch.manual_seed(0)
    actor = tiny_model(cfg, len(tok))
    ops = Ops(ops_mode)
    if algo == "ppo":
        import random

        from ppo_kernels.trainer.algos.ppo import RLTrainer

        critic = ValueModel.from_causal_lm(actor)
        tr = RLTrainer(cfg, actor, frozen_copy(actor), critic, tok, task, ops)
        rng = random.Random(0)

        def step(i):
            problems = [task.sample_problem(rng) for _ in range(cfg.prompts_per_step)]
            t = time.perf_counter()
            tr.step(problems)
            return time.perf_counter() - t

        return step
    # RM / DPO: the trainer's loop, each optimiser step timed by its around_step hook, run one
    # step at a time on a generator
    from ppo_kernels.trainer.algos import dpo, rm

    box = {}

    @contextlib.contextmanager
    def around(i):
        t = time.perf_counter()
        yield
        box["seconds"] = time.perf_counter() - t

    def step(i):
        cfg_i = TrainConfig(
            algo=algo, sft_steps=0, steps=1, pairs=cfg.pref_batch, eval_pairs=1, seed=i
        ).validate()
        if algo == "rm":
            rm.train_reward_model(cfg_i, actor, tok, task, ops, 1, log=lambda *a: None,
                                  around_step=around)  # fmt: skip
        else:
            dpo.train_dpo(cfg_i, actor, tok, task, ops, around_step=around)
        return box["seconds"]

    return step


def _graph_nodes(counts):
    """Count the hand-built nodes in every graph a backward runs (torch.autograd.backward)."""
    orig = torch.autograd.backward

    def backward(tensors, *a, **k):
        seen, todo = (
            set(),
            [t.grad_fn for t in ([tensors] if torch.is_tensor(tensors) else tensors)],
        )
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if fn.name() in NODE_NAMES:
                counts[fn.name()] = counts.get(fn.name(), 0) + 1
            todo.extend(f for f, _ in fn.next_functions)
        return orig(tensors, *a, **k)

    return backward


def step_counts(step, what):
    counts = {}
    if what == "env":
        with counting_env(counts):
            step(0)
    else:
        orig = torch.autograd.backward
        torch.autograd.backward = _graph_nodes(counts)
        try:
            step(0)
        finally:
            torch.autograd.backward = orig
    return counts


def step_env(args):
    step = _trainer(args.algo)
    step(0)  # warm-up
    counts = step_counts(step, "env")
    a, b = [], []
    for i in range(args.steps):
        a.append(step(2 * i + 1))
        with plain_env():
            b.append(step(2 * i + 2))
    print(_row(f"{args.algo} step", a, b) + f" calls per step: {counts}", flush=True)
    return [(f"{args.algo} step", a, b, counts)]


def step_one(args):
    step = _trainer(args.algo)
    step(0)
    counts = step_counts(step, "nodes")
    print(json.dumps({"seconds": [step(i + 1) for i in range(args.steps)], "counts": counts}))


# ---- nodes: two builds, alternate processes ----


def _child(args, part, pythonpath):
    cmd = [sys.executable, __file__, "nodes", part, "--child", "--rounds", str(args.rounds),
           "--reps", str(args.reps), "--steps", str(args.steps), "--algo", args.algo,
           "--ops", ",".join(args.ops)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=pythonpath)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert f"package: {pythonpath}" in r.stderr, r.stderr  # the build this side means
    return json.loads(r.stdout.strip().splitlines()[-1])


def nodes(args, part):
    here = str(HERE.parent)
    a, b = {}, {}
    for _ in range(args.procs):
        for side, path in ((a, here), (b, args.variant)):
            got = _child(args, part, path)
            if part == "step":
                side.setdefault("step", []).extend(got["seconds"])
                side.setdefault("counts", got["counts"])
            else:
                for k, v in got.items():
                    side.setdefault(k, []).extend(v)
    rows = []
    if part == "step":
        rows.append((f"{args.algo} step", a["step"], b["step"], a["counts"]))
        print(_row(rows[0][0], a["step"], b["step"]) + f" nodes per step: {a['counts']}")
    else:
        for k in a:
            rows.append((k, a[k], b[k]))
            print(_row(k, a[k], b[k]), flush=True)
    return rows


# ---- output ----


def _fmt(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else (f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s")


def _side(xs):
    return f"{_fmt(statistics.median(xs))} ({_fmt(min(xs))}-{_fmt(max(xs))})"


def _row(name, a, b):
    ratio = statistics.median(b) / statistics.median(a)
    return f"| `{name}` | {_side(a)} | {_side(b)} | {ratio:.3f}x |"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("env", "nodes"))
    ap.add_argument("part", choices=("calls", "step"))
    ap.add_argument("--ops", default="", help="comma-separated substrings of case names")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=500, help="calls per round")
    ap.add_argument("--algo", default="ppo", choices=("ppo", "rm", "dpo"))
    ap.add_argument("--steps", type=int, default=4, help="steps per side (per process: nodes)")
    ap.add_argument("--procs", type=int, default=3, help="nodes: processes per side")
    ap.add_argument("--variant", default="", help="nodes: PYTHONPATH of the plain-form build")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    torch.set_num_threads(1)
    if args.child:
        import ppo_kernels  # before bench_overhead puts the checkout first on sys.path

        print(f"package: {os.path.dirname(ppo_kernels.__file__)}", file=sys.stderr)
        return calls_one(args) if args.part == "calls" else step_one(args)
    print(f"load average {os.getloadavg()[0]:.2f} at the start; A = the trick, B = plain form")
    print("| case | A: median (min-max) | B: median (min-max) | B / A |\n|---|---|---|---|")
    if args.what == "env":
        calls_env(args) if args.part == "calls" else step_env(args)
    else:
        if not args.variant:
            ap.error("nodes: --variant DIR (the PYTHONPATH of the plain-form build)")
        nodes(args, args.part)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
