"""GPU check for ppo_policy_loss, ppo_value_loss, grpo/rloo_advantages (Triton on the GPU; no CUDA
C++ kernel: a fused elementwise pass plus a tiny combine gains nothing from one): against float64
compositions of the formulas, a CUDA-graph capture (proves no host sync), and timing against the
verl-style eager compositions."""
from __future__ import annotations

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.group_advantages import reference as GR
from ppo_kernels.losses import reference as R

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _inputs(B, T, dtype=torch.float32, spread=0.3):
    g = torch.Generator(device="cuda").manual_seed(0)
    lp = -torch.rand(B, T, generator=g, device="cuda") * 3
    old = lp + torch.randn(B, T, generator=g, device="cuda") * spread
    old[:, ::97] = lp[:, ::97] - 35.0  # extreme log-ratios: clamped
    adv = torch.randn(B, T, generator=g, device="cuda")
    mask = torch.rand(B, T, generator=g, device="cuda") > 0.25
    mask[1] = False
    return lp.to(dtype), old.to(dtype), adv, mask


def _ref_policy(lp, old, adv, mask, agg, dual, scale):
    x = lp.double().requires_grad_(True)
    loss, stats, _ = R.policy_loss(x, old.double(), adv.double(), mask, 0.2, 0.28, dual, agg, 20.0, scale)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), stats, g


def correctness(ctx):
    B, T = 37, 3001
    for dtype in (torch.float32, torch.bfloat16):
        lp, old, adv, mask = _inputs(B, T, dtype)
        for agg in AGGS:
            for dual in (None, 3.0):
                scale = 1.0 / T if agg.endswith("norm") else 1.0
                want, wst, wg = _ref_policy(lp, old, adv, mask, agg, dual, scale)
                for backend in ("triton", "eager"):
                    x = lp.clone().requires_grad_(True)
                    with use_backend(ppo_policy_loss=backend):
                        loss, st = pk.ppo_policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                                      dual_clip=dual, agg=agg)
                        (g,) = torch.autograd.grad(loss, x)
                    case = f"{str(dtype)[6:]} {agg} dual={dual}"
                    ctx.compare("ppo_policy_loss", case, backend, loss, want, 2e-6, 2e-5)
                    ctx.compare("ppo_policy_loss", case + " stats", backend, torch.stack(list(st.values())), wst,
                                2e-6, 2e-5)
                    gt = (1e-7, 1e-5) if dtype == torch.float32 else (1e-7, 8e-3)
                    ctx.compare("ppo_policy_loss", case + " grad", backend, g, wg.to(dtype), *gt)
        v, vo, ret = lp.float(), old.float().clamp(-10, 10), adv
        for agg in AGGS:
            scale = 1.0 / T if agg.endswith("norm") else 1.0
            y = v.double().requires_grad_(True)
            want, wst, _ = R.value_loss(y, vo.double(), ret.double(), mask, 0.2, agg, scale)
            (wg,) = torch.autograd.grad(want, y)
            for backend in ("triton", "eager"):
                x = v.clone().requires_grad_(True)
                with use_backend(ppo_value_loss=backend):
                    loss, st = pk.ppo_value_loss(x, vo, ret, mask, clip=0.2, agg=agg)
                    (g,) = torch.autograd.grad(loss, x)
                ctx.compare("ppo_value_loss", f"{agg}", backend, loss, want.detach(), 2e-6, 2e-5)
                ctx.compare("ppo_value_loss", f"{agg} clip_frac", backend, st["clip_frac"], wst[0], 2e-6, 2e-5)
                ctx.compare("ppo_value_loss", f"{agg} grad", backend, g, wg, 1e-7, 1e-5)
    # group advantages, by index (O(B^2) tile loop) and by group size
    g = torch.Generator(device="cuda").manual_seed(1)
    for Bg in (1000, 8192):
        s = torch.randn(Bg, generator=g, device="cuda")
        s[:64] = 1.0
        idx = torch.randint(0, Bg // 6, (Bg,), generator=g, device="cuda")
        mask = torch.rand(Bg, 33, generator=g, device="cuda") > 0.3
        for backend in ("triton", "eager"):
            with use_backend(group_advantages=backend):
                ctx.compare("grpo_advantages", f"B={Bg} index", backend, pk.grpo_advantages(s, idx),
                            GR.group_advantages(s, idx), 1e-6, 1e-5)
                ctx.compare("grpo_advantages", f"B={Bg} group_size=8 mask", backend,
                            pk.grpo_advantages(s, group_size=8, mask=mask),
                            GR.group_advantages(s, None, 8, mask=mask), 1e-6, 1e-5)
                ctx.compare("rloo_advantages", f"B={Bg} index", backend, pk.rloo_advantages(s, idx),
                            GR.group_advantages(s, idx, kind="rloo"), 1e-6, 1e-5)
    _cuda_graph(ctx)


def _cuda_graph(ctx):
    """Capture forward + backward of the policy loss (with an all-reduced-style token count on the
    device) in a CUDA graph: any host sync would make the capture fail."""
    lp, old, adv, mask = _inputs(16, 1024)
    ntok = mask.sum().float()
    nseq = torch.tensor(15.0, device="cuda")  # created outside the capture
    x = lp.clone().requires_grad_(True)

    def step():
        loss, st = pk.ppo_policy_loss(x, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-mean",
                                      global_batch_size=nseq)
        loss2, _ = pk.ppo_policy_loss(x, old, adv, mask, global_num_tokens=ntok, dp_size=2)
        (gx,) = torch.autograd.grad(loss + loss2, x)
        return loss, st["clip_frac"], gx

    with use_backend(ppo_policy_loss="triton"):
        want = step()
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()  # warm-up (Triton compiles) outside the capture
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            graph.replay()
            torch.cuda.synchronize()
            for name, a, b in zip(("loss", "clip_frac", "grad"), out, want):
                ctx.compare("ppo_policy_loss", f"CUDA graph replay {name}", "triton", a, b, 0, 0)
        except Exception as e:  # noqa: BLE001
            ctx.fail("ppo_policy_loss", "CUDA graph capture", "triton", f"{type(e).__name__}: {e}")


def timing(ctx):
    B, T = 256, 8192
    lp, old, adv, mask = _inputs(B, T)
    m = mask.float()
    x = lp.clone().requires_grad_(True)
    tok = B * T
    for agg in ("token-mean", "seq-mean-token-mean"):
        fns = {"triton": lambda: torch.autograd.grad(
                   pk.ppo_policy_loss(x, old, adv, mask, dual_clip=3.0, agg=agg)[0], x),
               "eager (verl-style, 3 .item())": lambda: torch.autograd.grad(
                   R.eager_policy_loss_verl_style(x, old, adv, m, 0.2, 0.2, 3.0, agg)[0], x),
               "eager (no .item())": lambda: torch.autograd.grad(
                   R.eager_policy_loss_verl_style(x, old, adv, m, 0.2, 0.2, 3.0, agg, sync=False)[0], x)}
        # forward reads lp, old, adv (4 B) + mask (1 B); backward reads them again and writes the grad
        ctx.bench("ppo_policy_loss", f"B={B} T={T} f32 {agg} fwd+bwd", fns, bytes_moved=tok * (13 + 13 + 4))
    fv = {"triton": lambda: torch.autograd.grad(pk.ppo_value_loss(x, old, adv, mask, clip=0.2)[0], x),
          "eager (verl-style)": lambda: torch.autograd.grad(R.eager_value_loss_verl_style(x, old, adv, m, 0.2)[0], x)}
    ctx.bench("ppo_value_loss", f"B={B} T={T} f32 fwd+bwd", fv, bytes_moved=tok * (13 + 13 + 4))
    g = torch.Generator(device="cuda").manual_seed(0)
    for Bg in (1024, 8192):
        s = torch.randint(0, 2, (Bg,), generator=g, device="cuda").float()
        idx = torch.arange(Bg, device="cuda") // 8
        fg = {"triton (group_size)": lambda: pk.grpo_advantages(s, group_size=8),
              "triton (group_index)": lambda: pk.grpo_advantages(s, idx),
              "eager (scatter, float64)": lambda: GR.group_advantages(s, idx).float()}
        if Bg <= 1024:
            fg["eager (verl-style loop)"] = lambda: GR.eager_grpo_verl_style(s, idx)
        ctx.bench("grpo_advantages", f"B={Bg} groups of 8", fg)
