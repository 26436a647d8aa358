"""Cost of batch-invariant mode on the CPU: forward + backward of each op in the default
mode and under `ppo_kernels.batch_invariant()`, timed interleaved (default, mode, default, ...;
the medians of the rounds), with the load average before and after.

    python bench/bench_batch_invariant.py [--reps 5] [--cases linear,token_logprobs,...]
        [--out bench/results/cpu_batch_invariant.md]

What the mode changes per op on the CPU: linear_token_logprobs walks the vocabulary tiles of the
default budget's plan for unbounded N (independent of N and the budget), each row chunk padded
to a multiple of 32 rows;
token_logprobs / full_kl on the cpp backend: nothing (their kernels are row-local already); the
eager backend: blocks of 64 rows on one thread; linear_policy_loss: the same tiles as
linear_token_logprobs, and each chunk's per-token math on padded inputs. `trainer`: seconds per PPO step of the trainer's
default model with and without --batch-invariant (whose update runs passes of a fixed 32
sequences: the default's one pass per minibatch of 32).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _common import machine  # noqa: E402

import ppo_kernels as pk  # noqa: E402

# name -> (op, backend, dtype, sizes)
CASES = {
    "linear": [
        ("linear_token_logprobs", "cpp", torch.float32, (64, 512, 32000)),
        ("linear_token_logprobs", "cpp", torch.float32, (257, 512, 32000)),
        ("linear_token_logprobs", "cpp", torch.float32, (2048, 512, 32000)),
        ("linear_token_logprobs", "cpp", torch.bfloat16, (2048, 512, 32000)),
        ("linear_token_logprobs", "cpp", torch.float32, (1024, 256, 152064)),
    ],
    "policy": [
        ("linear_policy_loss", "cpp", torch.float32, (257, 512, 32000)),
        ("linear_policy_loss", "cpp", torch.float32, (2048, 512, 32000)),
    ],
    "token_logprobs": [("token_logprobs", "cpp", torch.float32, (2048, 32000))],
    "full_kl": [("full_kl", "cpp", torch.float32, (1024, 32000))],
    "eager": [
        ("token_logprobs", "eager", torch.float32, (1024, 32000)),
        ("linear_token_logprobs", "eager", torch.float32, (2048, 512, 32000)),
    ],
}


def _call(op, dtype, size):
    g = torch.Generator().manual_seed(0)
    if op == "linear_token_logprobs":
        N, H, V = size
        h = torch.randn(N, H, generator=g).to(dtype).requires_grad_(True)
        W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
        labels = torch.randint(0, V, (N,), generator=g)

        def fn():
            lp, ent = pk.linear_token_logprobs(h, W, labels, return_entropy=True)
            (lp.sum() + ent.sum()).backward()

        return fn
    if op == "linear_policy_loss":  # PPO on 16-token sequences, a sampled KL and an entropy term
        N, H, V = size
        h = torch.randn(N, H, generator=g).to(dtype).requires_grad_(True)
        W = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_(True)
        rows = (-(-N // 16), 16)
        labels = torch.randint(0, V, (rows[0] * 16,), generator=g)[:N]
        adv, old = torch.randn(N, generator=g), torch.randn(N, generator=g) - 10

        def fn():
            # (N tokens as ceil(N / 16) rows: the last one padded with masked tokens)
            n = rows[0] * 16

            def grid(t, fill=0):
                return torch.cat([t, t.new_full((n - N,) + t.shape[1:], fill)]).view(
                    *rows, *t.shape[1:]
                )

            loss, _ = pk.linear_policy_loss(
                grid(h), W, grid(labels, -100), grid(adv), grid(old),
                grid(torch.ones(N, dtype=torch.bool)), ref_logprobs=grid(old + 0.1),
                kl_coef=0.05, entropy_coef=0.01,
            )  # fmt: skip
            loss.backward()

        return fn
    N, V = size
    x = torch.randn(N, V, generator=g).to(dtype).requires_grad_(True)
    if op == "token_logprobs":
        labels = torch.randint(0, V, (N,), generator=g)

        def fn():
            lp, ent = pk.token_logprobs(x, labels, return_entropy=True)
            (lp.sum() + ent.sum()).backward()

        return fn
    y = torch.randn(N, V, generator=g).to(dtype)

    def fn():
        pk.full_kl(x, y).sum().backward()

    return fn


def _trainer_rows(reps):
    """PPO on the trainer's default model (a 32,000-token head, hidden 64), no SFT, 4 steps per
    run, runs alternating default / --batch-invariant: the median of each run's seconds_per_step
    (steps 0, 2, 3; step 1 is profiled for memory)."""
    import tempfile

    from ppo_kernels.trainer import TrainConfig
    from ppo_kernels.trainer.job import run

    times = {False: [], True: []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(reps):
            for mode in (False, True):
                cfg = TrainConfig(
                    sft_steps=0, steps=4, eval_prompts=8, progress=False, plot=False,
                    checkpoint=False, batch_invariant=mode, out=f"{d}/{i}{mode}",
                ).validate()  # fmt: skip
                times[mode].append(run(cfg, log=lambda *a: None)["seconds_per_step"])
    a, b = statistics.median(times[False]), statistics.median(times[True])
    return [
        f"| trainer step (PPO, defaults, no SFT) | fused | float32 | 64 prompts x 2 epochs "
        f"| {a * 1e3:.0f} | {b * 1e3:.0f} | {b / a:.2f}x |"
    ]


def _load():
    return os.getloadavg()[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default=",".join(CASES) + ",trainer")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lines = [
        "# Batch-invariant mode: cost on the CPU",
        "",
        f"{machine()}. Forward + backward, default mode vs `batch_invariant()`, interleaved "
        f"(default, mode, ...), {args.reps} rounds; medians.",
        "",
        "| op | backend | dtype | size | default ms | invariant ms | ratio |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    loads = [_load()]
    print(lines[2], flush=True)
    for case in args.cases.split(","):
        if case == "trainer":
            for row in _trainer_rows(max(1, args.reps // 2)):
                print(row, flush=True)
                lines.append(row)
            continue
        for op, backend, dtype, size in CASES[case]:
            fn = _call(op, dtype, size)
            times = {False: [], True: []}
            with pk.use_backend(**{op: backend}):
                for mode in (False, True):  # warm-up
                    with pk.batch_invariant(mode):
                        fn()
                for _ in range(args.reps):
                    for mode in (False, True):
                        with pk.batch_invariant(mode):
                            t = time.perf_counter()
                            fn()
                            times[mode].append(time.perf_counter() - t)
            a, b = statistics.median(times[False]), statistics.median(times[True])
            shape = " x ".join(map(str, size))
            name = "N x H x V" if op.startswith("linear") else "N x V"
            row = (
                f"| {op} | {backend} | {str(dtype).replace('torch.', '')} | {name} = {shape} "
                f"| {a * 1e3:.0f} | {b * 1e3:.0f} | {b / a:.2f}x |"
            )
            print(row, flush=True)
            lines.append(row)
    loads.append(_load())
    lines += ["", f"Load average (1 min) before / after: {loads[0]:.1f} / {loads[1]:.1f}."]
    text = "\n".join(lines) + "\n"
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
