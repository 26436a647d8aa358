"""The reward model's pairwise loss from a scalar head's hidden states, forward + backward on the
CPU: `reward_model_head_loss` (two GEMVs and the pairwise op, which forms its gradient in the
forward) against the eager composition (F.linear, F.logsigmoid, mean) and a hand-written
autograd function over the whole head (one node, analytic backward). Medians of interleaved
repetitions; prints a table.

    python bench/bench_reward_head.py [--threads 1] [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ppo_kernels.losses.pairwise import reward_model_head_loss


def eager(hc, hr, w):
    rc, rr = F.linear(hc, w).squeeze(-1), F.linear(hr, w).squeeze(-1)
    return -F.logsigmoid(rc - rr).mean()


def ours(hc, hr, w):
    return reward_model_head_loss(hc, hr, w)[0]


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hc, hr, w):
        wv = w.reshape(-1)
        z = torch.mv(hc, wv) - torch.mv(hr, wv)
        coef = -torch.sigmoid(-z) / z.shape[0]
        ctx.save_for_backward(hc, hr, w, coef)
        return -F.logsigmoid(z).mean()

    @staticmethod
    def backward(ctx, g):
        hc, hr, w, coef = ctx.saved_tensors
        c = coef * g
        wv = w.reshape(-1)
        return torch.outer(c, wv), torch.outer(-c, wv), (c @ hc - c @ hr).unsqueeze(0)


def function(hc, hr, w):
    return _Head.apply(hc, hr, w)


def _time(f, args, reps):
    def step():
        f(*args).backward()

    for _ in range(10):
        step()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("| B | H | eager us | ours us | ours / eager | function us | function / eager |")
    print("|---|---|---|---|---|---|---|")
    for B, H in ((8, 1024), (64, 4096)):
        hc = torch.randn(B, H, requires_grad=True)
        hr = torch.randn(B, H, requires_grad=True)
        w = torch.randn(1, H, requires_grad=True)
        t = {"eager": [], "ours": [], "function": []}
        for _ in range(3):  # interleaved
            for name, f in (("eager", eager), ("ours", ours), ("function", function)):
                t[name].append(_time(f, (hc, hr, w), a.reps))
        m = {k: statistics.median(v) * 1e6 for k, v in t.items()}
        print(f"| {B} | {H} | {m['eager']:.0f} | {m['ours']:.0f} | {m['ours'] / m['eager']:.2f}x "
              f"| {m['function']:.0f} | {m['function'] / m['eager']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
