"""GPU check for token_logprobs: a compute-sanitizer workload for the CUDA kernels, and timings vs
eager PyTorch and peers at the issue's size (N=16384, V=152064, bf16). Correctness:
tests/cuda/test_cuda_token_logprobs.py."""

import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.token_logprobs import naive as ref

OP = "token_logprobs"


def _case(n_shape, V, dtype, strided=False, ignore=0.2):
    full = (torch.randn(*n_shape[:-1], n_shape[-1] + int(strided), V, device="cuda") * 3).to(dtype)
    logits = full[..., :-1, :] if strided else full
    labels = torch.randint(0, V, n_shape, device="cuda")
    labels[torch.rand(n_shape, device="cuda") < ignore] = -100
    return logits, labels


def sanitize_workload():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape, V, strided in [((5,), 7, False), ((3, 4), 4099, True), ((2,), 32003, False)]:
            logits, labels = _case(shape, V, dtype, strided)
            labels.view(-1)[0] = V + 3  # out of range: must not be read
            with use_backend("cpp"):
                x = logits.detach().requires_grad_(True)
                lp, ent = pk.token_logprobs(x, labels, return_entropy=True)
                (lp.nan_to_num().sum() + ent.nan_to_num().sum()).backward()
                y = logits.clone().requires_grad_(True) * 1
                pk.token_logprobs(y, labels, inplace_backward=True).nan_to_num().sum().backward()


def timing(ctx):
    from ppo_kernels import _backend

    N, V = 16384, 152064
    x = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda")
    read = N * V * 2
    case = f"N={N} V={V} bf16"

    def fused(b, ent=False):
        def f():
            with use_backend(b), torch.no_grad():
                return pk.token_logprobs(x, y, return_entropy=ent)

        return f

    fns = {}
    for b in ("cpp", "triton"):
        if _backend.available(OP, b, "cuda")[0]:
            fns[f"ppo_kernels[{b}]"] = fused(b)
            fns[f"ppo_kernels[{b}] +entropy"] = fused(b, True)
    fns["eager (upcast+log_softmax+gather)"] = lambda: ref.eager_logprobs(x, y)
    ce = torch.compile(ref.eager_logprobs)
    fns["torch.compile(eager)"] = lambda: ce(x, y)
    ctx.bench(OP, case + " forward", fns, bytes_moved=read)

    xg = x.clone().requires_grad_(True)

    def fb(b, ent=False):
        def f():
            xg.grad = None
            with use_backend(b):
                out = pk.token_logprobs(xg, y, return_entropy=ent)
            (sum(o.sum() for o in out) if ent else out.sum()).backward()

        return f

    fns = {}
    for b in ("cpp", "triton"):
        if _backend.available(OP, b, "cuda")[0]:
            fns[f"ppo_kernels[{b}]"] = fb(b)
            fns[f"ppo_kernels[{b}] +entropy"] = fb(b, True)

    def eager_fb():
        xg.grad = None
        ref.eager_logprobs(xg, y).sum().backward()

    fns["eager"] = eager_fb
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss(reduction="none")

        def liger_fb():
            xg.grad = None
            liger(xg, y).sum().backward()

        fns["liger cross_entropy"] = liger_fb
    except Exception:  # noqa: BLE001
        pass
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        def fa_fb():
            xg.grad = None
            cross_entropy_loss(xg, y)[0].sum().backward()

        fns["flash_attn cross_entropy"] = fa_fb
    except Exception:  # noqa: BLE001
        pass
    ctx.bench(OP, case + " fwd+bwd", fns, bytes_moved=read * 3)  # fwd read + bwd read + write
