"""The public API of the group advantages: `grpo_advantages`, `rloo_advantages` and `group_ids`
(labels to ids). Tensor checks (dtype, shape, device, CPU group ids) run once, in the registered
op (csrc/ops/group_advantages.cpp); this layer checks the Python scalars and the group layout and
routes `process_group=` to the data-parallel form."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .._checks import check_bool, check_float, check_int
from . import op  # noqa: F401  (registers the op's Python side)

_op = _backend.op("group_advantages")


def group_ids(labels, device=None) -> Tensor:
    """int64 group ids in [0, number of distinct labels) from any per-response labels: a numpy
    array or a sequence of hashables (verl passes prompt uid strings as a numpy object array).
    Equal labels share an id; ids follow the sorted order of the labels (numpy's unique)."""
    import numpy as np

    arr = np.asarray(labels, dtype=object) if not isinstance(labels, np.ndarray) else labels
    if arr.ndim != 1:
        raise ValueError(
            f"group_index: expected one label per response (1-D), got shape {arr.shape}"
        )
    try:
        inv = np.unique(arr, return_inverse=True)[1]
    except TypeError:  # unorderable mixture: first-appearance order
        first = {}
        inv = np.array([first.setdefault(x, len(first)) for x in arr.tolist()], dtype=np.int64)
    return torch.from_numpy(np.asarray(inv, dtype=np.int64).reshape(-1)).to(device)


def _check_ids_on_host(group_index: Tensor, B: int):
    """Group ids on the GPU, read on the host (a sync) under strict_checks(); the op checks CPU
    ids itself."""
    bad = (group_index < 0) | (group_index >= B)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        raise IndexError(
            f"group_index: value {int(group_index[pos])} at position {pos} is outside "
            f"[0, B) = [0, {B}); pass e.g. torch.unique(ids, return_inverse=True)[1]"
        )


def _group_advantages(kind, scores, group_index, group_size, eps, norm_by_std, mask, group):
    if not isinstance(scores, Tensor):
        raise TypeError(f"scores: expected a torch.Tensor, got {type(scores).__name__}")
    if group_index is not None and not isinstance(group_index, Tensor):
        if group is not None:
            raise ValueError(
                "group_index: labels are numbered per rank; with process_group pass "
                "global integer group ids"
            )
        group_index = group_ids(group_index, scores.device)
    if (group_index is None) == (group_size is None):
        raise ValueError(
            "pass exactly one of group_index (a group id per response) and group_size "
            "(contiguous groups of that many responses)"
        )
    gs = 0
    if group_size is not None:
        gs = check_int("group_size", group_size, min_value=1)
    eps = check_float("eps", eps, nonneg=True)
    norm_by_std = check_bool("norm_by_std", norm_by_std)
    if group is not None:
        from ..distributed.data_parallel import group_advantages_global

        args = (scores.detach(), group_index, gs, eps, norm_by_std, kind, mask)
        return group_advantages_global(*args, group)
    if gs and scores.dim() == 1 and scores.shape[0] % gs != 0:
        raise ValueError(f"group_size: {gs} does not divide the batch size {scores.shape[0]}")
    if (
        _backend.strict()
        and group_index is not None
        and group_index.device.type != "cpu"
        and not torch.compiler.is_compiling()
    ):
        _check_ids_on_host(group_index, scores.shape[0])  # a host sync, by request
    # no gradient: the op refuses one, so the scores are detached (only when they need one)
    scores = scores.detach() if scores.requires_grad else scores
    return _op(scores, group_index, gs, eps, norm_by_std, kind, mask)


def grpo_advantages(
    scores: Tensor,
    group_index: Tensor | None = None,
    group_size: int | None = None,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    mask: Tensor | None = None,
    process_group=None,
) -> Tensor:
    """GRPO outcome advantages, per group of responses to one prompt, with no Python loop.

    `A_i = (R_i - mean_g) / (std_g + eps)`, with the mean and unbiased std of response i's group
    g. With `norm_by_std=False` (Dr. GRPO), `A_i = R_i - mean_g`. A group of one uses mean 0 and
    std 1, so `A_i = R_i / (1 + eps)`; a group of equal scores gives 0.

    Args:
        scores (Tensor): `[B]`, any float dtype. One score per response (sum token-level rewards
            first). No gradient flows.
        group_index (Tensor, optional): `[B]`, int32 / int64: each response's group id, in
            [0, B). Or any labels: a numpy array of uid strings, a list of hashables (numbered
            in sorted order). Give exactly one of group_index and group_size. Default None.
        group_size (int, optional): the responses come in contiguous groups of this size; it
            divides B. Default None.
        eps (float): added to the std; non-negative. Default 1e-6.
        norm_by_std (bool): divide by the group's std. Default True.
        mask (Tensor, optional): `[B, T]`, the action mask. The result is then
            `A[:, None] * mask`. Default None.
        process_group (ProcessGroup, optional): groups over the responses of every rank of this
            group, in rank order (every rank holds B responses). One all-gather of the scores and
            group ids; ids are then global, in [0, world * B), and a group may span ranks. Each
            rank gets the advantages of its own responses; labels are not accepted. Default None.

    Returns:
        Tensor: `[B]`, or `[B, T]` with a mask; float32 (float64 for float64 scores). No gradient.

    Why: verl's `compute_grpo_outcome_advantage` loops over the batch in Python and reads every
    score on the host. This is one kernel over the batch, with verl's values. Formulas:
    docs/ppo-math.md ("Advantage post-processing").
    """
    return _group_advantages(
        "grpo", scores, group_index, group_size, eps, norm_by_std, mask, process_group
    )


def rloo_advantages(
    scores: Tensor,
    group_index: Tensor | None = None,
    group_size: int | None = None,
    *,
    mask: Tensor | None = None,
    singleton: str = "score",
    process_group=None,
) -> Tensor:
    """RLOO advantages: each response's score minus the mean of the other members of its group.

    `A_i = R_i - mean_{j != i} R_j = n / (n - 1) * (R_i - mean_g)` for a group of n responses.
    The layout of the groups and the result are those of `grpo_advantages`.

    Args:
        scores (Tensor): `[B]`, any float dtype. One score per response. No gradient flows.
        group_index (Tensor, optional): `[B]`, int32 / int64 group ids in [0, B), or any labels,
            as in `grpo_advantages`. Give exactly one of group_index and group_size.
            Default None.
        group_size (int, optional): contiguous groups of this size; it divides B. Default None.
        mask (Tensor, optional): `[B, T]`, the action mask. The result is then
            `A[:, None] * mask`. Default None.
        singleton (str): a group of one. "score": `A_i = R_i`, as verl's `rloo`. "zero": 0, as
            verl's `rloo_vectorized` (not with process_group). Default "score".
        process_group (ProcessGroup, optional): groups over every rank's responses, as in
            `grpo_advantages`. Default None.

    Returns:
        Tensor: `[B]`, or `[B, T]` with a mask; float32 (float64 for float64 scores). No gradient.

    Why: verl's `compute_rloo_outcome_advantage` is a Python loop; this is the GRPO kernel with
    the leave-one-out mean. Formulas: docs/ppo-math.md ("Advantage post-processing").
    """
    if singleton not in ("score", "zero"):
        raise ValueError(f"singleton: expected 'score' or 'zero', got {singleton!r}")
    if singleton == "zero" and process_group is not None:
        raise ValueError("singleton: 'zero' needs the global group sizes; not with process_group")
    if group_index is not None and not isinstance(group_index, Tensor):
        group_index = group_ids(group_index, scores.device)
    adv = _group_advantages(
        "rloo", scores, group_index, group_size, 0.0, False, mask, process_group
    )
    if singleton == "zero":
        if group_index is None:
            keep = torch.full((scores.shape[0],), group_size > 1, device=scores.device)
        else:
            keep = (
                torch.bincount(group_index.long(), minlength=scores.shape[0])[group_index.long()]
                > 1
            )
        adv = adv * (keep.unsqueeze(-1) if adv.dim() == 2 else keep).to(adv.dtype)
    return adv
