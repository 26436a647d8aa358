"""GPU check for token_logprobs: CUDA (cpp) and Triton kernels vs the float64 reference, a
compute-sanitizer workload, CUDA-graph capture, and timings vs eager PyTorch and peers at the
issue's size (N=16384, V=152064, bf16)."""
import torch

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.token_logprobs import reference as ref

OP = "token_logprobs"
TOL = dict(atol=5e-5, rtol=2e-5)
GRAD_TOL = {torch.float32: dict(atol=1e-6, rtol=1e-4), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
            torch.float16: dict(atol=1e-6, rtol=2e-3)}


def _case(n_shape, V, dtype, strided=False, ignore=0.2):
    full = (torch.randn(*n_shape[:-1], n_shape[-1] + int(strided), V, device="cuda") * 3).to(dtype)
    logits = full[..., :-1, :] if strided else full
    labels = torch.randint(0, V, n_shape, device="cuda")
    labels[torch.rand(n_shape, device="cuda") < ignore] = -100
    return logits, labels


class _poisoned:
    """NaN-fill every output the kernels allocate (see tests/_utils.poisoned)."""
    def __enter__(self):
        from ppo_kernels import _backend
        self.old = _backend.set_poison(True)

    def __exit__(self, *exc):
        from ppo_kernels import _backend
        _backend.set_poison(self.old)


def correctness(ctx):
    from ppo_kernels import _backend
    cases = [((4, 33), 7), ((8, 17), 4099), ((64,), 32000), ((2, 9), 152064), ((3,), 1)]
    for backend in ("cpp", "triton"):
        if not _backend.available(OP, backend, "cuda")[0]:
            ctx.fail(OP, "availability", backend, _backend.available(OP, backend, "cuda")[1])
            continue
        for shape, V in cases:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for strided in (False, True):
                    T = 0.7
                    logits, labels = _case(shape, V, dtype, strided)
                    name = f"N={shape} V={V} {str(dtype)[6:]}{' strided' if strided else ''}"
                    x = logits.detach().requires_grad_(True)
                    with use_backend(backend), _poisoned():
                        lp, ent = pk.token_logprobs(x, labels, temperature=T, return_entropy=True)
                        g1, g2 = torch.randn_like(lp), torch.randn_like(ent)
                        (lp * g1 + ent * g2).sum().backward()
                    x64 = logits.double().requires_grad_(True)
                    lp64, ent64, _ = ref.forward(x64, labels, T)
                    (lp64 * g1.double() + ent64 * g2.double()).sum().backward()
                    ctx.compare(OP, name + " logprob", backend, lp, lp64, **TOL)
                    ctx.compare(OP, name + " entropy", backend, ent, ent64, **TOL)
                    ctx.compare(OP, name + " grad", backend, x.grad, x64.grad, **GRAD_TOL[dtype])
        # out-of-range labels: NaN rows, no crash
        logits, labels = _case((16,), 1000, torch.bfloat16, ignore=0.0)
        labels[3], labels[7] = 1000, -5
        with use_backend(backend):
            lp = pk.token_logprobs(logits, labels)
        want = ref.forward(logits.double(), labels)[0]
        ctx.compare(OP, "out-of-range labels give NaN", backend, lp, want, **TOL)
        # CUDA graph capture (no host sync on the path)
        try:
            logits, labels = _case((64,), 5000, torch.bfloat16)
            with use_backend(backend):
                pk.token_logprobs(logits, labels)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = pk.token_logprobs(logits, labels)
                logits.copy_(torch.randn_like(logits))
                g.replay()
            ctx.compare(OP, "CUDA graph replay", backend, out, ref.forward(logits.double(), labels)[0], **TOL)
        except Exception as e:  # noqa: BLE001
            ctx.fail(OP, "CUDA graph capture", backend, f"{type(e).__name__}: {e}")


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
