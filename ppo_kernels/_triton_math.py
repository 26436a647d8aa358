"""Triton device functions shared by the Triton kernels: the Triton side of csrc/common
(softmax_stats.h, kl_stats.h). Imported only by the triton_kernels modules (lazily)."""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
SERIES_BOUND = tl.constexpr(0.25)  # kl_stats.h kSeriesBound


@triton.jit
def softmax_stats_update(m, s, u, z):
    """Merge a block z of scaled logits (-inf for padding) into the row state (m, s, u):
    s = sum exp(z - m), u = sum exp(z - m) (z - m), as in softmax_stats.h."""
    m_new = tl.maximum(m, tl.max(z, 0))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no inf - inf
    d_old = m - m_safe
    f = tl.where(s == 0.0, 0.0, tl.exp(d_old))
    d = z - m_safe
    e = tl.exp(d)
    u = tl.where(s == 0.0, 0.0, f * (u + tl.maximum(d_old, -FLT_MAX) * s)) + tl.sum(
        e * tl.maximum(d, -FLT_MAX), 0
    )
    s = f * s + tl.sum(e, 0)
    return m_new, s, u


@triton.jit
def softmax_grad_coefs(GLP, GENT, ENT, LSE, row, inv_t, WITH_ENT: tl.constexpr):
    """One row's (lse, a, b, c) for softmax_grad: a = g_logprob / T, b = g_entropy / T (0 without
    an entropy gradient), c = H - lse."""
    lse = tl.load(LSE + row)
    a = tl.load(GLP + row).to(tl.float32) * inv_t
    if WITH_ENT:
        b = tl.load(GENT + row).to(tl.float32) * inv_t
        c = tl.load(ENT + row) - lse
    else:
        b = 0.0
        c = -lse
    return lse, a, b, c


@triton.jit
def softmax_grad(z, lse, a, b, c):
    """d/dz of a * logprob + b * entropy without the onehot term: -a p - b p (z + c), with
    c = H - lse and p (z + c) taken as 0 where p = 0 (z = -inf)."""
    p = tl.exp(z - lse)
    return -a * p - b * (p * tl.maximum(z + c, -FLT_MAX))


@triton.jit
def expm1_minus_x_series(x):
    """exp(x) - 1 - x for |x| < SERIES_BOUND without cancellation (kl_stats.h)."""
    t = x * (1.0 / 40320.0) + (1.0 / 5040.0)
    t = x * t + (1.0 / 720.0)
    t = x * t + (1.0 / 120.0)
    t = x * t + (1.0 / 24.0)
    t = x * t + (1.0 / 6.0)
    t = x * t + 0.5
    return x * x * t
