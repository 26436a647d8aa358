"""linear_token_logprobs: the semantics, and the eager tile kernels of the `eager` backend.

Semantics: `linear_token_logprobs(hidden, weight, labels, bias=b, ...)` equals
`token_logprobs(hidden @ weight.T + b, labels, ...)` with the logits computed in float32 (float64
for float64 inputs) -- every edge case of ppo_kernels/token_logprobs/naive.py carries over
(ignore_index rows give 0 and no gradient; labels outside [0, V): IndexError on the CPU, NaN on
the GPU; NaN / inf logits give NaN). Gradients flow to hidden, weight and bias.

`forward` / `backward` below materialise the logits: they are the float64 test reference and the
benchmark baseline, never the op. The chunk loop (chunks.py) walks [rows, vocab_chunk] tiles of the logits;
`tile_stats_` and `tile_bwd_` are the eager versions of the per-tile kernels (C++:
csrc/cpu/linear_logprobs.cpp, Triton: triton_kernels.py) and define what they must compute.
"""

from __future__ import annotations

import torch

from ..token_logprobs import naive as tl_ref


def logits(hidden, weight, bias=None, dtype=None):
    """The materialised logits (float64 by default: the reference)."""
    dtype = dtype or torch.float64
    z = hidden.to(dtype) @ weight.to(dtype).T
    return z + bias.to(dtype) if bias is not None else z


def forward(
    hidden, weight, labels, bias=None, temperature=1.0, ignore_index=-100, with_entropy=True
):
    """(logprobs, entropy, lse) in float64 from the materialised float64 logits."""
    return tl_ref.forward(
        logits(hidden, weight, bias), labels, temperature, ignore_index, with_entropy
    )


def eager_logprobs(hidden, weight, labels, bias=None, temperature=1.0, return_entropy=False):
    """What trainers do today (the benchmark baseline and the trainer's `--ops eager`): the LM
    head materialises the logits in the input dtype, then upcast, log_softmax, gather (and the
    entropy of the full distribution); see token_logprobs/naive.eager_logprobs."""
    z = torch.nn.functional.linear(hidden, weight, bias)
    return tl_ref.eager_logprobs(z, labels, temperature, return_entropy)


# ---- eager tile kernels (the `eager` backend; also the spec of the C++ and Triton ones) ----


def tile_stats_(tile, labels, v_start, inv_t, ignore_index, state, zlabel):
    """Merge the softmax stats of z = tile * inv_t (one vocabulary chunk starting at v_start) into
    state = (m, s, u) [3, rows] (see csrc/common/softmax_stats.h), and set zlabel[r] = z[r, label -
    v_start] where the label lies in this chunk. Rows with label == ignore_index are left alone."""
    z = tile * inv_t
    m_t = z.amax(-1) if z.shape[-1] else torch.full_like(state[0], float("-inf"))
    m_t = torch.where(z.isnan().any(-1), torch.full_like(m_t, float("nan")), m_t)
    m_old, s_old, u_old = state[0], state[1], state[2]
    m_new = torch.maximum(m_old, m_t)  # propagates NaN
    m_safe = torch.where(m_new.isinf() & (m_new < 0), torch.zeros_like(m_new), m_new)
    d = z - m_safe.unsqueeze(-1)
    e = d.exp()
    floor = torch.finfo(z.dtype).min
    s_t = e.sum(-1)
    u_t = (e * d.clamp_min(floor)).sum(-1)
    # rescale the old state to the new max (an empty old state, s == 0, contributes nothing)
    d_old = m_old - m_safe
    f = torch.where(s_old == 0, torch.zeros_like(d_old), d_old.exp())
    u_resc = torch.where(
        s_old == 0, torch.zeros_like(u_old), f * (u_old + d_old.clamp_min(floor) * s_old)
    )
    s_new = f * s_old + s_t
    u_new = u_resc + u_t
    keep = labels == ignore_index
    state[0] = torch.where(keep, m_old, m_new)
    state[1] = torch.where(keep, s_old, s_new)
    state[2] = torch.where(keep, u_old, u_new)
    k = labels.long() - v_start
    inside = (k >= 0) & (k < z.shape[-1]) & ~keep
    if z.shape[-1]:
        zk = z.gather(-1, k.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        zlabel.copy_(torch.where(inside, zk, zlabel))


def finalize(state, zlabel, labels, V, ignore_index):
    """(logprobs, entropy, lse) from the merged state; zlabel must start NaN so that a label that
    no chunk contained (out of range) gives NaN."""
    m, s, u = state[0], state[1], state[2]
    bad = m.isinf() & (m > 0)  # +inf logit: undefined, NaN like token_logprobs
    nan = torch.full_like(m, float("nan"))
    lse = torch.where(bad, nan, m + s.log())
    ent = torch.where(bad, nan, s.log() - u / s)
    ignored = labels == ignore_index
    valid = (labels >= 0) & (labels < V) & ~ignored
    lp = torch.where(valid, zlabel - lse, nan).masked_fill(ignored, 0.0)
    ent = torch.where(valid, ent, nan).masked_fill(ignored, 0.0)
    return lp, ent, lse.masked_fill(ignored, 0.0)


def tile_bwd_(
    tile, labels, v_start, lse, entropy, grad_logprobs, grad_entropy, inv_t, ignore_index, V
):
    """Overwrite the tile with d/d(logits) of sum(g_lp * logprobs + g_ent * entropy) over this
    vocabulary chunk: inv_t * (g_lp * (onehot - p) - g_ent * p * (log p + H)). Rows with
    label == ignore_index get 0; rows with a label outside [0, V) get NaN."""
    z = tile * inv_t
    lse = lse.to(z.dtype).unsqueeze(-1)
    logp = z - lse
    p = logp.exp()
    glp = grad_logprobs.to(z.dtype).unsqueeze(-1)
    g = -glp * p
    if grad_entropy is not None and grad_entropy.numel() > 0:
        t = torch.where(p > 0, p * (logp + entropy.to(z.dtype).unsqueeze(-1)), torch.zeros_like(p))
        g = g - grad_entropy.to(z.dtype).unsqueeze(-1) * t
    k = labels.long() - v_start
    inside = (k >= 0) & (k < z.shape[-1])
    if z.shape[-1]:
        onehot = torch.zeros_like(g).scatter_(-1, k.clamp(0, z.shape[-1] - 1).unsqueeze(-1), 1.0)
        g = g + onehot * (glp * inside.unsqueeze(-1))
    g = g * inv_t
    ignored = labels == ignore_index
    valid = (labels >= 0) & (labels < V) & ~ignored
    g = torch.where(valid.unsqueeze(-1), g, torch.full_like(g, float("nan")))
    tile.copy_(g.masked_fill(ignored.unsqueeze(-1), 0.0))
