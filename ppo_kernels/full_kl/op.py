"""The Python side of the registered ops `ppo_kernels::full_kl` and `ppo_kernels::full_kl_backward`,
defined in C++ (csrc/ops/full_kl.cpp: schemas, checks, routing, autograd): their fake kernels and
their triton / eager implementations. The cpp backend is csrc/cpu/full_kl.cpp and
csrc/cuda/full_kl.cu. Semantics and edge cases: naive.py."""

from __future__ import annotations

import functools

import torch

from .. import _backend
from .._checks import check_devices
from .._math import acc_dtype
from ..token_logprobs import op as tl_op
from . import naive

# with top_k / top_p / min_p: the masked pass on Triton (no CUDA C++ kernel takes a kept set)
_KEPT_ON_CUDA = "with top_k / top_p / min_p: the pass with the sampler's kept set on Triton"
_backend.register_op(
    "full_kl",
    kernel="full_kl_fwd",
    triton=True,
    cuda_default="triton",
    delegates={("cpp", "cuda"): _KEPT_ON_CUDA},
)
_backend.routes_in_cpp("full_kl")


# ---- the registered ops' fake kernels and triton / eager implementations (the op's schemas) ----
# The fakes check devices as the C++ checks do: a meta tensor sends a call to its fake whatever
# the other arguments' devices.


def _check_backward_devices(grad, logits, ref_logits, mask, kl, lse_z, lse_w):
    check_devices(
        "logits", logits, grad=grad, ref_logits=ref_logits, mask=mask, kl=kl, lse_z=lse_z,
        lse_w=lse_w,
    )  # fmt: skip


@_backend.fake("full_kl")
def _(logits, ref_logits, temperature, mask):
    check_devices("logits", logits, ref_logits=ref_logits, mask=mask)
    shape, o = logits.shape[:-1], acc_dtype(logits.dtype)
    return tuple(logits.new_empty(shape, dtype=o) for _ in range(3))


@_backend.fake("full_kl_backward")
def _(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref):
    _check_backward_devices(grad, logits, ref_logits, mask, kl, lse_z, lse_w)
    return (
        torch.empty(logits.shape, dtype=logits.dtype, device=logits.device),
        torch.empty(
            ref_logits.shape if need_ref else (0,), dtype=ref_logits.dtype, device=ref_logits.device
        ),
    )


# The kernels on logits tiles, one implementation per backend with one signature (inv_temperature
# = 1 / T): the registered ops' triton / eager implementations below, and the fused policy loss on
# its reference-head tiles (as linear_logprobs runs token_logprobs' kernels).
forward = _backend.Kernel("full_kl", "forward")
backward = _backend.Kernel("full_kl", "backward")  # writes grad_logits (and grad_ref_logits)


# inv_temperatures: per-row 1 / T (float64, one per row, contiguous), or None: the scalar holds.
# cut, cut_index: the sampler's kept set of each row of logits (token_logprobs' sampler kernels'
# outputs), or None: every token. The compiled kernels take it on the CPU; on CUDA the kernels
# with a kept set are Triton's (_KEPT_ON_CUDA).


def _kept_on_triton(logits, cut):
    if cut is None or logits.device.type == "cpu":
        return False
    _backend.note_delegation("full_kl", "cpp", logits.device.type, _KEPT_ON_CUDA)
    return True


@forward.impl("cpp")
def _(logits, ref_logits, mask, inv_temperature, inv_temperatures=None, cut=None, cut_index=None):
    if cut is None:
        return _backend.cpp_ops().full_kl_fwd(
            logits, ref_logits, mask, inv_temperature, inv_temperatures
        )
    if _kept_on_triton(logits, cut):
        return forward.impls["triton"](
            logits, ref_logits, mask, inv_temperature, inv_temperatures, cut, cut_index
        )
    return _backend.cpp_ops().full_kl_kept_fwd(
        logits, ref_logits, mask, inv_temperature, inv_temperatures, cut, cut_index
    )


@forward.impl("triton")
def _(logits, ref_logits, mask, inv_temperature, inv_temperatures=None, cut=None, cut_index=None):
    from . import triton_kernels

    return triton_kernels.forward(
        logits, ref_logits, mask, inv_temperature, inv_temperatures, cut, cut_index
    )


def _eager_forward(logits, ref_logits, temperature, mask, cut=None, cut_index=None):
    kl, lz, lw = _backend.invariant_rows(
        naive.forward, logits.shape[:-1], logits, ref_logits, temperature, mask, cut, cut_index
    )
    o = acc_dtype(logits.dtype)
    return kl.to(o), lz.to(o), lw.to(o)


def _eager_temperature(logits, inv_temperature, inv_temperatures):
    """The temperature as the eager math takes it: a number, or per row [..., 1]."""
    if inv_temperatures is None:
        return 1.0 / inv_temperature
    return (1.0 / inv_temperatures).reshape(tuple(logits.shape[:-1]) + (1,))


@forward.impl("eager")
def _(logits, ref_logits, mask, inv_temperature, inv_temperatures=None, cut=None, cut_index=None):
    t = _eager_temperature(logits, inv_temperature, inv_temperatures)
    return _eager_forward(logits, ref_logits, t, mask, cut, cut_index)


@backward.impl("cpp")
def _(logits, grad, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref,
      inv_temperatures=None, cut=None, cut_index=None):  # fmt: skip
    args = (grad, logits, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits,
            grad_ref, inv_temperatures)  # fmt: skip
    if cut is None:
        _backend.cpp_ops().full_kl_bwd(*args)
    elif _kept_on_triton(logits, cut):
        backward.impls["triton"](logits, *args[:1], *args[2:], cut, cut_index)
    else:
        _backend.cpp_ops().full_kl_kept_bwd(*args, cut, cut_index)


@backward.impl("triton")
def _(logits, grad, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref,
      inv_temperatures=None, cut=None, cut_index=None):  # fmt: skip
    from . import triton_kernels

    triton_kernels.backward(
        grad, logits, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref,
        inv_temperatures, cut, cut_index,
    )  # fmt: skip


@backward.impl("eager")
def _(logits, grad, ref_logits, mask, kl, lse_z, lse_w, inv_temperature, grad_logits, grad_ref,
      inv_temperatures=None, cut=None, cut_index=None):  # fmt: skip
    gz, gw = _backend.invariant_rows(
        naive.backward,
        logits.shape[:-1],
        grad,
        logits,
        ref_logits,
        kl,
        lse_z,
        lse_w,
        _eager_temperature(logits, inv_temperature, inv_temperatures),
        mask,
        grad_ref is not None,
        cut,
        cut_index,
    )
    grad_logits.copy_(gz)
    if grad_ref is not None:
        grad_ref.copy_(gw)


@_backend.impl("full_kl", "triton")
def _(logits, ref_logits, temperature, mask):
    return forward.impls["triton"](logits, ref_logits, mask, 1.0 / temperature)


_backend.impl("full_kl", "eager")(_eager_forward)  # the temperature as given (no 1 / (1 / T))


def _grad_buffers(logits, ref_logits, need_ref):
    gz = _backend.new_output(logits.shape, logits.dtype, logits.device)
    if not need_ref:
        return gz, ref_logits.new_empty(0)
    return gz, _backend.new_output(ref_logits.shape, ref_logits.dtype, ref_logits.device)


def _backward_op(backend):
    def run(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref):
        gz, gw = _grad_buffers(logits, ref_logits, need_ref)
        backward.impls[backend](logits, grad, ref_logits, mask, kl, lse_z, lse_w,
                                1.0 / temperature, gz, gw if need_ref else None)  # fmt: skip
        return gz, gw

    return run


_backend.impl("full_kl_backward", "triton")(_backward_op("triton"))
_backend.impl("full_kl_backward", "eager")(_backward_op("eager"))


# Without the compiled extension: the reference itself (differentiable by autograd), and the
# backward op's eager implementation (the vocab-parallel form's backward calls it).
@_backend.fallback("full_kl")
def _(logits, ref_logits, temperature, mask):
    check_devices("logits", logits, ref_logits=ref_logits, mask=mask)
    return _backend.python_impl("full_kl", "eager")(logits, ref_logits, temperature, mask)


@_backend.fallback("full_kl_backward")
def _(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref):
    _check_backward_devices(grad, logits, ref_logits, mask, kl, lse_z, lse_w)
    eager = _backend.python_impl("full_kl_backward", "eager")
    return eager(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperature, need_ref)


# ---- full_kl with per-row temperatures: ppo_kernels::full_kl_row_temperature (+ backward) ------


def _row_inverse(logits, temperatures):
    """1 / T per row of logits (float64, contiguous): the kernels' per-row parameter."""
    t = temperatures.to(torch.float64)
    t = t.reshape(tuple(t.shape) + (1,) * (logits.dim() - 1 - t.dim()))
    return (1.0 / t).expand(logits.shape[:-1]).reshape(-1).contiguous()


@_backend.fake("full_kl_row_temperature")
def _(logits, ref_logits, temperatures, mask):
    check_devices("logits", logits, ref_logits=ref_logits, temperatures=temperatures, mask=mask)
    shape, o = logits.shape[:-1], acc_dtype(logits.dtype)
    return tuple(logits.new_empty(shape, dtype=o) for _ in range(3))


@_backend.fake("full_kl_row_temperature_backward")
def _(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperatures, need_ref):
    _check_backward_devices(grad, logits, ref_logits, mask, kl, lse_z, lse_w)
    check_devices("logits", logits, temperatures=temperatures)
    return (
        torch.empty(logits.shape, dtype=logits.dtype, device=logits.device),
        torch.empty(
            ref_logits.shape if need_ref else (0,), dtype=ref_logits.dtype, device=ref_logits.device
        ),
    )


def _register_rows(backend):
    @_backend.impl("full_kl_row_temperature", backend)
    def _(logits, ref_logits, temperatures, mask):
        return forward.impls[backend](logits, ref_logits, mask, 1.0,
                                      _row_inverse(logits, temperatures))  # fmt: skip

    @_backend.impl("full_kl_row_temperature_backward", backend)
    def _(grad, logits, ref_logits, mask, kl, lse_z, lse_w, temperatures, need_ref):
        gz, gw = _grad_buffers(logits, ref_logits, need_ref)
        backward.impls[backend](logits, grad, ref_logits, mask, kl, lse_z, lse_w, 1.0, gz,
                                gw if need_ref else None,
                                _row_inverse(logits, temperatures))  # fmt: skip
        return gz, gw


_register_rows("triton")
_register_rows("eager")


@_backend.fallback("full_kl_row_temperature")
def _(logits, ref_logits, temperatures, mask):
    check_devices("logits", logits, ref_logits=ref_logits, temperatures=temperatures, mask=mask)
    t = temperatures.reshape(tuple(temperatures.shape) + (1,) * (logits.dim() - temperatures.dim()))
    return _eager_forward(logits, ref_logits, t, mask)


# ---- full_kl under the sampler's distribution: ppo_kernels::full_kl_sampler (+ backward) -------
# (csrc/ops/full_kl.cpp). Each backend: token_logprobs' sampler kernels find each row's kept set
# on the policy's logits (cut, cut_index), then the full-KL kernels run with the tokens outside it
# dropped. Semantics: naive.py and docs/ppo-math.md.


def _sampler_labels(logits, mask):
    """The labels the sampler's kernels score (any id in range: only the kept set is used), and
    ignore_index (-100) on masked rows, which the sampler's kernels then skip (cut -inf)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return labels if mask is None else labels.masked_fill(mask == 0, -100)


def _sampler_fake_rows(logits, n, dtypes):
    shape = logits.shape[:-1]
    return tuple(logits.new_empty(shape, dtype=d) for d in dtypes[:n])


@_backend.fake("full_kl_sampler")
def _(logits, ref_logits, temperature, temperatures, top_k, top_ks, top_p, top_ps, min_p, min_ps,
      sampler, mask):  # fmt: skip
    check_devices("logits", logits, ref_logits=ref_logits, temperatures=temperatures,
                  top_ks=top_ks, top_ps=top_ps, min_ps=min_ps, mask=mask)  # fmt: skip
    o = acc_dtype(logits.dtype)
    return _sampler_fake_rows(logits, 5, (o, o, o, o, torch.int64))


@_backend.fake("full_kl_sampler_backward")
def _(grad, logits, ref_logits, mask, kl, lse_z, lse_w, cut, cut_index, temperature, temperatures,
      need_ref):  # fmt: skip
    _check_backward_devices(grad, logits, ref_logits, mask, kl, lse_z, lse_w)
    check_devices("logits", logits, cut=cut, cut_index=cut_index, temperatures=temperatures)
    return (
        torch.empty(logits.shape, dtype=logits.dtype, device=logits.device),
        torch.empty(
            ref_logits.shape if need_ref else (0,), dtype=ref_logits.dtype, device=ref_logits.device
        ),
    )


def _sampler_kl_forward(backend, logits, ref_logits, temperature, temperatures, top_k, top_ks,
                        top_p, top_ps, min_p, min_ps, sampler, mask):  # fmt: skip
    labels = _sampler_labels(logits, mask)
    inv, inv_ts, ks, ps, mps = tl_op.sampler_kernel_args(
        labels, temperature, temperatures, top_ks, top_ps, min_ps
    )
    outs = tl_op.sampler_forward.impls[backend](
        logits, labels, inv, inv_ts, top_k, ks, top_p, ps, min_p, mps, sampler, -100, False,
        False, False, 0, False,
    )  # fmt: skip
    cut, cut_index = outs[3], outs[4]
    kl, lz, lw = forward.impls[backend](logits, ref_logits, mask, inv, inv_ts, cut, cut_index)
    return kl, lz, lw, cut, cut_index


def _sampler_kl_backward(backend, grad, logits, ref_logits, mask, kl, lse_z, lse_w, cut, cut_index,
                         temperature, temperatures, need_ref):  # fmt: skip
    gz, gw = _grad_buffers(logits, ref_logits, need_ref)
    inv_ts = None if temperatures is None else _row_inverse(logits, temperatures)
    backward.impls[backend](logits, grad, ref_logits, mask, kl, lse_z, lse_w, 1.0 / temperature,
                            gz, gw if need_ref else None, inv_ts, cut, cut_index)  # fmt: skip
    return gz, gw


def _register_sampler_kl(backend):
    _backend.impl("full_kl_sampler", backend)(functools.partial(_sampler_kl_forward, backend))
    _backend.impl("full_kl_sampler_backward", backend)(
        functools.partial(_sampler_kl_backward, backend)
    )


for _b in ("cpp", "triton", "eager"):
    _register_sampler_kl(_b)


class _SamplerKLFallback(torch.autograd.Function):
    """Without the compiled extension: the eager forward and backward with autograd."""

    @staticmethod
    def forward(ctx, logits, ref_logits, args):
        outs = _sampler_kl_forward("eager", logits, ref_logits, *args)
        ctx.save_for_backward(logits, ref_logits, *outs)
        ctx.args = args
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    def backward(ctx, grad, *_):
        logits, ref_logits, kl, lz, lw, cut, cut_index = ctx.saved_tensors
        a = ctx.args
        gz, gw = _sampler_kl_backward("eager", grad, logits, ref_logits, a[9], kl, lz, lw, cut,
                                      cut_index, a[0], a[1], ctx.needs_input_grad[1])  # fmt: skip
        return gz, gw if ctx.needs_input_grad[1] else None, None


@_backend.fallback("full_kl_sampler")
def _(logits, ref_logits, *args):
    check_devices("logits", logits, ref_logits=ref_logits, temperatures=args[1], top_ks=args[3],
                  top_ps=args[5], min_ps=args[7], mask=args[9])  # fmt: skip
    return _SamplerKLFallback.apply(logits, ref_logits, args)
