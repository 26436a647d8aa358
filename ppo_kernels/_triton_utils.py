"""Helpers shared by the Triton kernels (Python side)."""

from __future__ import annotations


def row_indexer(t):
    """(inner, stride_outer, stride_inner) addressing the rows of a [..., V] tensor whose last dim
    is contiguous, like csrc/common/row_indexer.h; makes `t` contiguous when its leading dims do
    not collapse to two strided dims. Returns (indexer, tensor)."""
    if t.numel() == 0:  # no row is read; .contiguous() would keep any strides of an empty tensor
        return (1, 0, 0), t
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    dims = []  # (size, stride), innermost first
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if dims and dims[-1][1] * dims[-1][0] == stride:
            dims[-1] = (dims[-1][0] * size, dims[-1][1])
        else:
            dims.append((size, stride))
    if not dims:
        return (1, 0, t.shape[-1]), t
    if len(dims) == 1:
        return (dims[0][0], 0, dims[0][1]), t
    if len(dims) == 2:
        return (dims[0][0], dims[1][1], dims[0][1]), t
    return row_indexer(t.contiguous())
