"""What the fused losses' registered ops share in Python (linear_policy_loss,
linear_preference_loss, linear_distill_loss): the shapes of the gradients `<op>_grads` returns
(for its fake kernel), and a loop's outputs with the gradients it formed attached to the loss, as
the C++ Autograd-key kernel does (csrc/ops/fused_loss.h) -- for the fallback without the extension
and the vocab-parallel forms --, the device check of their fakes and fallbacks, and the fake
kernels of an op and its `_grads` (registered by the op's module: torch checks that module).

`Call` is the op's NamedTuple of its arguments plus need_hidden, need_weight, need_bias; a
runner(call) returns the loop's outputs followed by grad_hidden, grad_weight, grad_bias."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_devices
from .._math import acc_dtype

# a sampler op's per-row parameter tensors (`<op>_sampler`'s arguments after the plain op's)
SAMPLER_TENSORS = ("temperatures", "top_ks", "top_ps", "min_ps")


def check_on_hiddens_device(a, names: tuple) -> None:
    """The tensor arguments `names` of the call `a` (and a sampler call's per-row parameters) on
    hidden's device, as the C++ checks do (a meta tensor sends a call to its fake whatever the
    other arguments')."""
    names = names + (SAMPLER_TENSORS if hasattr(a, "temperatures") else ())
    check_devices("hidden", a.hidden, **{n: getattr(a, n) for n in names})


def fake_outside(a) -> Tensor:
    """The fake of a sampler op's `outside` flags: labels' shape, bool."""
    return a.hidden.new_empty(tuple(a.labels.shape), dtype=torch.bool)


def fake_kernels(Call, check, outputs):
    """(the fake kernel of an op, that of its `_grads`), whose arguments `Call` names (the
    latter's with need_hidden / need_weight / need_bias): check(a), then outputs(a) (and the
    gradients' shapes for _grads)."""

    def fake(*args):
        a = Call(*args, False, False, False)
        check(a)
        return outputs(a)

    def fake_grads(*args):
        a = Call(*args)
        check(a)
        return (*outputs(a), *grads_shapes(a))

    return fake, fake_grads


def grads_shapes(a) -> tuple[Tensor, Tensor, Tensor]:
    """Empty tensors shaped as `<op>_grads`' gradients of the call `a`: hidden's in its dtype,
    weight's and bias's in the accumulation dtype, each `(0,)` where not asked for."""
    hidden, weight = a.hidden, a.weight
    acc = acc_dtype(hidden.dtype)
    N, H = hidden.shape
    V = weight.shape[0]
    gh = hidden.new_empty((N, H) if a.need_hidden else (0,))
    gW = hidden.new_empty((V, H) if a.need_weight else (0,), dtype=acc)
    gb = hidden.new_empty((V,) if (a.need_bias and a.bias is not None) else (0,), dtype=acc)
    return gh, gW, gb


class _Precomputed(torch.autograd.Function):
    """A loop with its gradients attached: the backward scales the gradients formed in the
    forward (for an upstream gradient of 1) by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, runner, Call, n_out, *args):
        need = ctx.needs_input_grad[:3]
        out = runner(Call(*args, need[0], need[1], need[2] and bias is not None))
        ctx.save_for_backward(*out[n_out:])
        ctx.need, ctx.dtype, ctx.n_args = need, weight.dtype, len(args)
        ctx.mark_non_differentiable(*out[1:n_out])
        return out[:n_out]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, *_):
        gh, gW, gb = ctx.saved_tensors
        h, w, b = ctx.need
        return (
            gh * g if h else None,
            (gW * g).to(ctx.dtype) if w else None,
            (gb * g).to(ctx.dtype) if b else None,
            *(None,) * (3 + ctx.n_args),
        )


def with_grads(runner, Call, n_out: int, args) -> tuple[Tensor, ...]:
    """The op's `n_out` outputs for its arguments `args` by runner(Call), the gradients of hidden /
    weight / bias that require grad attached to the loss (the first output)."""
    a = Call(*args, False, False, False)
    if not (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (a.hidden, a.weight, a.bias))
    ):
        return runner(a)[:n_out]
    return _Precomputed.apply(a.hidden, a.weight, a.bias, runner, Call, n_out, *args)
