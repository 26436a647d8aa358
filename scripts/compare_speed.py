"""Time the same public calls at two checkouts, interleaved: the before / after table of a change.

    python scripts/compare_speed.py BEFORE_DIR AFTER_DIR [--rounds 15] [--only SUBSTR,...]
        [--out FILE.md]

Each checkout runs in a worker process of its own (its `ppo_kernels`, its compiled extension,
one torch thread). The driver alternates the two workers round by round (before, after, before,
...), so a machine whose load drifts slows both sides alike; each cell is the median of the
rounds. The calls: every `ppo_kernels` case of each checkout's own bench/bench_overhead.py
(matched by name; a case only one side has is left out) and the fused losses from hidden states
at sizes where the kernels' time shows (FUSED below, public API only). Outputs are not compared
here: scripts/compare_outputs.py does that, bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name: (setup source, call source); run by the worker with `torch` and `pk` in scope.
FUSED = {
    "linear_token_logprobs N=2048 H=512 V=32000 fwd+bwd": (
        "g = torch.Generator().manual_seed(0)\n"
        "h = torch.randn(2048, 512, generator=g, requires_grad=True)\n"
        "w = (torch.randn(32000, 512, generator=g) / 512 ** 0.5).requires_grad_()\n"
        "y = torch.randint(0, 32000, (2048,), generator=g)\n",
        "lp, ent = pk.linear_token_logprobs(h, w, y, return_entropy=True)\n"
        "(lp.sum() + ent.sum()).backward()\n",
    ),
    "linear_policy_loss 4x512 H=512 V=32000 k3 fwd+bwd": (
        "g = torch.Generator().manual_seed(0)\n"
        "h = torch.randn(4, 512, 512, generator=g, requires_grad=True)\n"
        "w = (torch.randn(32000, 512, generator=g) / 512 ** 0.5).requires_grad_()\n"
        "y = torch.randint(0, 32000, (4, 512), generator=g)\n"
        "adv = torch.randn(4, 512, generator=g)\n"
        "old = -torch.rand(4, 512, generator=g) * 5\n"
        "ref = old + 0.1 * torch.randn(4, 512, generator=g)\n"
        "mask = torch.rand(4, 512, generator=g) > 0.1\n",
        "out = pk.linear_policy_loss(h, w, y, adv, old, mask, ref_logprobs=ref, kl_coef=0.04,\n"
        "                            kl_estimator='k3', entropy_coef=0.01)\n"
        "out[0].backward()\n",
    ),
}

_WORKER = r"""
import json, os, statistics, sys, time
import torch
torch.set_num_threads(1)
sys.path[:0] = [os.path.join(ROOT, "bench"), ROOT]
import ppo_kernels as pk
import bench_overhead as bo
calls = {}
for size, (B, T) in bo.SIZES.items():
    for name, ours, _ in bo.cases(B, T):
        calls[f"{name} | {B} x {T}"] = ours
for name, (setup, call) in FUSED.items():
    env = {"torch": torch, "pk": pk}
    exec(setup, env)
    calls[name] = (lambda env, call: lambda: exec(call, env))(env, compile(call, name, "exec"))
print(json.dumps(sorted(calls)), flush=True)
for line in sys.stdin:
    name, reps = line.rsplit(" ", 1)
    f = calls[name]
    t = time.perf_counter()
    for _ in range(int(reps)):
        f()
    print((time.perf_counter() - t) / int(reps), flush=True)
"""


class Worker:
    def __init__(self, root: str):
        code = f"ROOT = {os.path.abspath(root)!r}\nFUSED = {FUSED!r}\n" + _WORKER
        env = dict(os.environ, PYTHONPATH=os.path.abspath(root), OMP_NUM_THREADS="1")
        self.p = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=root,
        )  # fmt: skip
        self.names = set(json.loads(self.p.stdout.readline()))

    def time(self, name: str, reps: int) -> float:
        self.p.stdin.write(f"{name} {reps}\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def _reps(a: Worker, name: str) -> int:
    """Calls per round: about 0.1 s of calls, at least one."""
    t = a.time(name, 1)
    return max(1, min(2000, int(0.1 / max(t, 1e-7))))


def fmt(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rev = {d: subprocess.run(["git", "-C", d, "rev-parse", "--short", "HEAD"], text=True,
                             capture_output=True).stdout.strip() for d in (args.before, args.after)}  # fmt: skip
    a, b = Worker(args.before), Worker(args.after)
    names = sorted(a.names & b.names)
    if args.only:
        names = [n for n in names if any(o in n for o in args.only.split(","))]
    load = os.getloadavg()
    lines = [
        f"before: {args.before} ({rev[args.before]}); after: {args.after} ({rev[args.after]}); "
        f"one torch thread; {args.rounds} interleaved rounds, medians; load average at the start "
        f"{load[0]:.2f}",
        "",
        "| call | before | after | after / before |",
        "|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name in names:
        reps = _reps(a, name)
        for w in (a, b):  # warm-up
            w.time(name, reps)
        ta, tb = [], []
        for _ in range(args.rounds):
            ta.append(a.time(name, reps))
            tb.append(b.time(name, reps))
        ma, mb = statistics.median(ta), statistics.median(tb)
        row = f"| `{name}` | {fmt(ma)} | {fmt(mb)} | {mb / ma:.2f}x |"
        print(row, flush=True)
        lines.append(row)
    lines.append("")
    lines.append(f"load average at the end {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d')}")
    a.close()
    b.close()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
