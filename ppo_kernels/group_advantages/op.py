"""The Python side of the registered op `ppo_kernels::group_advantages` (GRPO / RLOO), defined in
C++ (csrc/ops/group_advantages.cpp: schema, checks, routing, a backward that refuses): its fake
kernel and its triton / eager implementations. The cpp backend is csrc/cpu/losses.cpp's
group_advantages (CPU); Triton is the GPU default. Semantics: naive.py."""

from __future__ import annotations

from .. import _backend, _modes
from .._checks import check_devices
from .._math import acc_dtype
from . import naive

_backend.register_op(
    "group_advantages",
    kernel="group_advantages",
    triton=True,
    cuda_default="triton",
    public=("grpo_advantages", "rloo_advantages"),
)
_backend.routes_in_cpp("group_advantages")


# The fake and the fallback check devices as the C++ checks do (a meta tensor sends a call to its
# fake whatever the other arguments' devices).
@_backend.fake("group_advantages")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    check_devices("scores", scores, group_index=group_index, mask=mask)
    shape = (scores.shape[0],) if mask is None else tuple(mask.shape)
    return scores.new_empty(shape, dtype=acc_dtype(scores.dtype))


@_backend.impl("group_advantages", "triton")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    from . import triton_kernels

    kind_index = _modes.index("kind", _modes.GROUP_ADVANTAGES, kind)
    return triton_kernels.group_advantages(
        scores.contiguous(),
        None if group_index is None else group_index.contiguous(),
        group_size,
        eps,
        norm_by_std,
        kind_index,
        None if mask is None else mask.contiguous(),
    )


@_backend.impl("group_advantages", "eager")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    size = group_size if group_index is None else None
    adv = naive.group_advantages(scores, group_index, size, eps, norm_by_std, mask, kind)
    return adv.to(acc_dtype(scores.dtype))


# Without the compiled extension: the eager implementation on detached scores (no gradient).
@_backend.fallback("group_advantages")
def _(scores, group_index, group_size, eps, norm_by_std, kind, mask):
    check_devices("scores", scores, group_index=group_index, mask=mask)
    eager = _backend.python_impl("group_advantages", "eager")
    return eager(scores.detach(), group_index, group_size, eps, norm_by_std, kind, mask)
