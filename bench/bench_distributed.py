"""Bytes per token that the distributed forms' one collective moves, against the naive
alternative (all-gather the sharded logits / the time slices, then run the single-device op),
and the time per call, on 2 gloo processes on this CPU. Not a test: `python
bench/bench_distributed.py` writes bench/results/cpu_distributed.md.

Bytes = what one rank contributes to the all-gather (it receives world - 1 times as much),
including, on the CPU, the tiny all-gather of sizes that checks shapes across ranks before a
gather whose size depends on them (8 bytes per call; dense GAE and the vocab-parallel forms)."""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _time(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def _worker(rank, world, init, q):
    import ppo_kernels as pk
    from ppo_kernels.distributed import _comm

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = []
    g = dist.group.WORLD
    # vocab-parallel token_logprobs: N tokens, V = 32000 split in halves, bf16 logits
    N, V = 1024, 32000
    Vr = V // world
    x = torch.randn(N, Vr).to(torch.bfloat16)
    y = torch.randint(0, V, (N,))
    _comm.SENT_BYTES[0] = 0
    pk.token_logprobs(x, y, return_entropy=True, process_group=g, vocab_start=rank * Vr)
    ours = _comm.SENT_BYTES[0] / N
    naive = Vr * 2  # all-gather the bf16 logits slice of each token
    t_ours = _time(
        lambda: pk.token_logprobs(x, y, return_entropy=True, process_group=g, vocab_start=rank * Vr)
    )

    def naive_fn():
        full = torch.empty(world * N * Vr, dtype=x.dtype)
        dist.all_gather_into_tensor(full, x.reshape(-1).contiguous(), group=g)
        full = full.view(world, N, Vr).permute(1, 0, 2).reshape(N, V)
        return pk.token_logprobs(full, y, return_entropy=True)

    rows.append(
        (
            "token_logprobs (vocab-parallel)",
            f"N={N}, V={V}, bf16",
            ours,
            naive,
            t_ours,
            _time(naive_fn),
        )
    )
    # vocab-parallel linear_token_logprobs: H = 256
    H = 256
    h = torch.randn(N, H)
    w = torch.randn(Vr, H) * 0.05
    _comm.SENT_BYTES[0] = 0
    pk.linear_token_logprobs(h, w, y, process_group=g, vocab_start=rank * Vr)
    rows.append(
        (
            "linear_token_logprobs (vocab-parallel)",
            f"N={N}, V={V}, H={H}, fp32",
            _comm.SENT_BYTES[0] / N,
            Vr * 4,
            _time(
                lambda: pk.linear_token_logprobs(h, w, y, process_group=g, vocab_start=rank * Vr)
            ),
            float("nan"),
        )
    )
    # sequence-parallel GAE: B rows, T split in halves
    B, T = 64, 8192
    Tr = T // world
    r, v = torch.randn(B, Tr), torch.randn(B, Tr)
    m = torch.rand(B, Tr) > 0.2
    _comm.SENT_BYTES[0] = 0
    pk.gae(r, v, m, gamma=0.99, lam=0.95, process_group=g)
    ours = _comm.SENT_BYTES[0] / (B * Tr)
    naive = 4 + 4 + 1  # rewards, values (fp32), mask (bool) of every token

    def naive_gae():
        parts = [torch.empty(world * B * Tr) for _ in range(2)]
        dist.all_gather_into_tensor(parts[0], r.reshape(-1).contiguous(), group=g)
        dist.all_gather_into_tensor(parts[1], v.reshape(-1).contiguous(), group=g)
        mm = torch.empty(world * B * Tr, dtype=torch.uint8)
        dist.all_gather_into_tensor(mm, m.reshape(-1).to(torch.uint8), group=g)
        rr, vv = (p.view(world, B, Tr).permute(1, 0, 2).reshape(B, T) for p in parts)
        return pk.gae(
            rr, vv, mm.view(world, B, Tr).permute(1, 0, 2).reshape(B, T) != 0, gamma=0.99, lam=0.95
        )

    rows.append(
        (
            "gae (sequence-parallel)",
            f"B={B}, T={T}",
            ours,
            naive,
            _time(lambda: pk.gae(r, v, m, gamma=0.99, lam=0.95, process_group=g)),
            _time(naive_gae),
        )
    )
    # sequence-parallel GAE on packed rows: one stream of rows (~500 tokens each) split in halves,
    # rows crossing the border
    Ntot = B * T
    lens = torch.randint(1, 1000, (2 * Ntot // 500,), generator=torch.Generator().manual_seed(0))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    cu = torch.cat([cu[cu < Ntot], torch.tensor([Ntot])]).to(torch.int32)
    Nr = Ntot // world
    t0 = rank * Nr
    rf, vf, mf = r.reshape(-1), v.reshape(-1), m.reshape(-1)  # this rank's Nr = B * Tr tokens
    cu_local = cu - t0
    _comm.SENT_BYTES[0] = 0
    pk.gae(rf, vf, mf, gamma=0.99, lam=0.95, cu_seqlens=cu_local, process_group=g)
    ours = _comm.SENT_BYTES[0] / Nr

    def naive_packed():
        parts = [torch.empty(world * Nr) for _ in range(2)]
        dist.all_gather_into_tensor(parts[0], rf.contiguous(), group=g)
        dist.all_gather_into_tensor(parts[1], vf.contiguous(), group=g)
        mm = torch.empty(world * Nr, dtype=torch.uint8)
        dist.all_gather_into_tensor(mm, mf.to(torch.uint8), group=g)
        adv, ret = pk.gae(parts[0], parts[1], mm != 0, gamma=0.99, lam=0.95, cu_seqlens=cu)
        return adv[t0 : t0 + Nr], ret[t0 : t0 + Nr]

    rows.append(
        (
            "gae (sequence-parallel, packed rows)",
            f"{Ntot} tokens, {cu.numel() - 1} rows",
            ours,
            naive,
            _time(
                lambda: pk.gae(
                    rf, vf, mf, gamma=0.99, lam=0.95, cu_seqlens=cu_local, process_group=g
                )
            ),
            _time(naive_packed),
        )
    )
    # data-parallel masked_whiten
    a = torch.randn(64, 4096)
    _comm.SENT_BYTES[0] = 0
    pk.masked_whiten(a, m[:, :4096], process_group=g)
    rows.append(
        (
            "masked_whiten (data-parallel)",
            "64 x 4096 per rank",
            _comm.SENT_BYTES[0] / a.numel(),
            4 + 1,
            _time(lambda: pk.masked_whiten(a, m[:, :4096], process_group=g)),
            float("nan"),
        )
    )
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    world = 2
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.start_processes(
            _worker, args=(world, os.path.join(d, "init"), q), nprocs=world, start_method="spawn"
        )
        rows = q.get()
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from _common import machine

    lines = [
        f"# Distributed forms: bytes per token of the one collective ({world} gloo processes)",
        "",
        f"Machine: {machine()} (1 thread per process). Bytes = what one rank "
        "contributes to the collective per token of its data; naive = all-gather the "
        "sharded inputs and run the single-device op.",
        "",
        "| op | case | ours B/token | naive B/token | ratio | ours ms | naive ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, case, ours, naive, t_o, t_n in rows:
        tn = "-" if t_n != t_n else f"{t_n * 1e3:.1f}"
        lines.append(
            f"| {name} | {case} | {ours:.3g} | {naive:.3g} | {naive / ours:.0f}x | "
            f"{t_o * 1e3:.1f} | {tn} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = os.path.join(ROOT, "bench", "results", "cpu_distributed.md")
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
