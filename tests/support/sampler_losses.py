"""The fused losses from hidden states under a rollout sampler's distribution (temperature tensors,
top_k / top_p / min_p, vLLM's / SGLang's rules): the inputs, the settings and the float64
references shared by the CPU tests (tests/ops/test_linear_preference_sampler.py,
tests/ops/test_linear_distill_sampler.py, tests/ops/test_linear_policy_sampler.py) and the GPU ones
(tests/cuda/test_cuda_sampler_losses.py; tests/cuda/test_cuda_linear_preference_loss.py uses the
preference reference too), and which tokens' kept sets a float32 GEMM's logits must reproduce
(`firm_tokens`).

Inputs are CPU tensors; the references run on the CPU. Sizes are arguments: the CPU tests' tiny
heads and the GPU's larger ones come from the same builders (the weights scaled by 1/sqrt(H), so
the logits' spread does not grow with the width)."""

import math

import torch

from ppo_kernels.linear_logprobs import naive as ll_ref
from ppo_kernels.linear_policy_loss import api as policy_api
from ppo_kernels.linear_policy_loss import naive as policy_naive
from ppo_kernels.linear_policy_loss import op as policy_op
from ppo_kernels.linear_preference_loss import api as pref_api
from ppo_kernels.linear_preference_loss import naive as pref_naive
from ppo_kernels.losses import distill_naive as DN
from ppo_kernels.token_logprobs import naive as tl_ref


def cycle(values, n, dtype=None):
    """values repeated to length n (a per-row parameter for any number of rows)."""
    return torch.tensor([values[i % len(values)] for i in range(n)], dtype=dtype)


def per_token(v, default, shape, dtype):
    """A sampler parameter (None, a scalar, a per-row [B] or a per-token [B, T] tensor) as a
    [B * T] tensor."""
    t = torch.as_tensor(default if v is None else v, dtype=dtype)
    return t.reshape(tuple(t.shape) + (1,) * (len(shape) - t.dim())).expand(shape).reshape(-1)


def firm_tokens(z, temperature=None, top_k=None, top_p=None, min_p=None, sampler="vllm",
                rel=1e-5, gap=1e-5):  # fmt: skip
    """Which tokens of z [B, T, V] (float64 logits) have a kept set that float32 logits give too:
    the set does not move when p and min_p are nudged by `rel` (relative) either way, and the k-th
    largest logit stands apart from the next by more than `gap` (1 + |max|). Float32 logits are
    off by ~1e-6 (1 + |z|), their masses by a few 1e-6 relative: the margins are 5-10x that. A
    kernel may put a token closer to a boundary on either side; a test leaves such tokens out of
    its mask."""
    shape, V = tuple(z.shape[:-1]), z.shape[-1]
    z = z.reshape(-1, V).double()
    f64 = torch.float64
    inv_t = 1.0 / per_token(temperature, 1.0, shape, f64)
    k = per_token(top_k, 0, shape, torch.int64)
    p = per_token(top_p, 1.0, shape, f64)
    mp = per_token(min_p, 0.0, shape, f64)

    def kept(p_, mp_):
        return tl_ref.sampler_kept(z, inv_t, k, p_, mp_, sampler)[0]

    on = p < 1  # p = 1 is off: a nudge must not turn it on
    inner = kept(torch.where(on, p * (1 - rel), p), (mp * (1 + rel)).clamp(max=1))
    outer = kept(torch.where(on, (p * (1 + rel)).clamp(max=1), p), mp * (1 - rel))
    firm = (inner == outer).all(-1)
    s = z.sort(-1, descending=True).values
    kc = k.clamp(1, V - 1).unsqueeze(-1)
    d = (s.gather(-1, kc - 1) - s.gather(-1, kc)).squeeze(-1)
    k_on = (k > 0) & (k < V)
    firm &= ~k_on | (d > gap * (1 + s[:, 0].abs()))
    return firm.view(shape)


def _head(g, r, t, h_, v, dtype):
    """hidden [r, t, h_], weight [v, h_] (scaled by 1/sqrt(h_): the logits' spread does not grow
    with the width; 0.7 at the CPU tests' width 8), bias [v]."""
    h = (torch.randn(r, t, h_, generator=g) * 0.9).to(dtype)
    W = (torch.randn(v, h_, generator=g) * (0.7 * (8 / h_) ** 0.5)).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype)
    return h, W, b


# ---- linear_preference_loss ----


def preference_inputs(p, t, h_, v, dtype=torch.float32, seed=0):
    """2p completions of t tokens (t >= 4; the first half chosen): labels among each token's
    likeliest three, the least likely token at [1, :2] and [2, 3] (outside any truncation), an
    ignored label, a masked token, a reference head near the policy, given reference log-probs
    near the policy's, each row's desirability (unpaired types)."""
    g = torch.Generator().manual_seed(seed)
    R = 2 * p
    w_scale = (8 / h_) ** 0.5  # 1 at the CPU tests' width
    h, W, b = _head(g, R, t, h_, v, dtype)
    rh = (h.double() + 0.3 * torch.randn(R, t, h_, generator=g, dtype=torch.float64)).to(dtype)
    noise = torch.randn(v, h_, generator=g, dtype=torch.float64)
    rW = (W.double() + (0.1 * w_scale) * noise).to(dtype)
    z = ll_ref.logits(h.double(), W.double(), b.double())
    top3 = z.topk(3, -1).indices
    labels = top3.gather(-1, torch.randint(0, 3, (R, t, 1), generator=g)).squeeze(-1)
    labels[1, :2] = z[1, :2].argmin(-1)
    labels[2, 3] = z[2, 3].argmin(-1)
    labels[0, 0] = -100
    mask = torch.ones(R, t, dtype=torch.bool)
    mask[3, 3] = False
    with torch.no_grad():
        lp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ref = (lp.clamp(min=-4) * mask).sum(-1) + torch.randn(R, generator=g, dtype=torch.float64)
    y = torch.arange(R) % 2 == 0
    return dict(h=h, W=W, b=b, labels=labels, mask=mask, rh=rh, rW=rW, ref=ref.float(), y=y)


def preference_settings(R, T):
    """The sampler's options by name, for R completions of T tokens: scalars, per-row tensors
    (k = 0 and p = 1 among them: off on those rows), per-token temperatures."""
    g = torch.Generator().manual_seed(1)
    return {
        "topk": dict(temperature=0.8, top_k=5),
        "topp": dict(temperature=1.2, top_p=0.7),
        "minp": dict(min_p=0.1),
        "all": dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
        "per_row": dict(
            temperature=torch.rand(R, generator=g) + 0.5,
            top_k=cycle([3, 0, 10, 4], R),
            top_p=cycle([0.9, 1.0, 0.5, 0.8], R),
            min_p=cycle([0.0, 0.1, 0.02, 0.0], R),
        ),
        "per_token_temperature": dict(temperature=torch.rand(R, T, generator=g) + 0.5, top_p=0.8),
        "temperature_tensor_only": dict(temperature=torch.rand(R, generator=g) + 0.5),
    }


def preference_ref_kw(x, ref):
    """The reference as the call gives it: a head, given sequence log-probs, or none."""
    if ref == "head":
        return dict(ref_hidden=x["rh"], ref_weight=x["rW"])
    if ref == "given":
        return dict(ref_logps=x["ref"])
    return {}


def preference_reference(x, **kw):
    """(loss, stats, rows, token log-probs, grads of h / W / b -- the bias's where x["b"] is not
    None) of the float64 reference (linear_preference_loss/naive.py) on the call's arguments (CPU
    tensors); input-dtype tiles of a bf16 / fp16 head: the reference rounds its logits as they
    are."""
    call, _ = pref_api.arguments(x["h"], x["W"], x["labels"], x["mask"], bias=x["b"], **kw)
    keep = call.logits_dtype == "input" and x["h"].dtype in (torch.bfloat16, torch.float16)
    up = (lambda t: t) if keep else (lambda t: t.double())  # noqa: E731

    def d(t):
        return None if t is None else up(t)

    leaves = [
        d(x[k].detach()).requires_grad_() if x[k] is not None else None for k in ("h", "W", "b")
    ]
    h, W, b = leaves
    call = call._replace(
        hidden=h.reshape(-1, h.shape[-1]), weight=W, bias=b, ref_hidden=d(call.ref_hidden),
        ref_weight=d(call.ref_weight),
        ref_logps=None if call.ref_logps is None else call.ref_logps.double(),
        reference_point=None if call.reference_point is None else call.reference_point.double(),
    )  # fmt: skip
    loss, stats, rows, lp = pref_naive.linear_preference_loss(call)
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None], allow_unused=True)
    return loss, stats, rows, lp, grads


# ---- linear_policy_loss ----


def sampler_settings(B, T):
    """The sampler's options by name, for B sequences of T tokens (the policy loss's settings, and
    the distillation's with a divergence each): scalars, per-row tensors (k = 0 and p = 1 among
    them: off on those rows) with a per-token top_p, per-token temperatures."""
    g = torch.Generator().manual_seed(1)
    return {
        "topk": dict(temperature=0.8, top_k=5),
        "topp": dict(temperature=1.2, top_p=0.7),
        "minp": dict(min_p=0.1),
        "all": dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
        "per_row": dict(
            temperature=torch.rand(B, generator=g) + 0.5,
            top_k=cycle([3, 0, 10], B),
            top_p=cycle([0.9, 1.0, 0.5, 0.8], T).expand(B, T).clone(),  # per token
            min_p=cycle([0.0, 0.1, 0.02], B),
        ),
        "per_token_temperature": dict(temperature=torch.rand(B, T, generator=g) + 0.5, top_p=0.8),
        "temperature_tensor_only": dict(temperature=torch.rand(B, generator=g) + 0.5),
    }


def policy_inputs(b_, t, h_, v, dtype=torch.float32, seed=0, per_row_adv=False, top=None):
    """b_ sequences of t tokens (b_ >= 3, t >= 4): labels at random (top=n: among each token's n
    likeliest, so that most stay in a truncation of a large vocabulary), the least likely token at
    [1, :2] and [2, 3] (outside any truncation), an ignored label, two masked tokens, old and
    reference log-probs near the untruncated policy's, advantages per token (per row:
    per_row_adv)."""
    g = torch.Generator().manual_seed(seed)
    h, W, b = _head(g, b_, t, h_, v, dtype)
    z = ll_ref.logits(h.double(), W.double(), b.double())
    if top is None:
        labels = torch.randint(0, v, (b_, t), generator=g)
    else:
        pick = torch.randint(0, top, (b_, t, 1), generator=g)
        labels = z.topk(top, -1).indices.gather(-1, pick).squeeze(-1)
    labels[0, 1] = -100
    labels[1, :2] = z[1, :2].argmin(-1)
    labels[2, 3] = z[2, 3].argmin(-1)
    with torch.no_grad():
        lp = torch.log_softmax(z, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = lp.clamp(min=-8.0)  # ratios near 1
    old = (lp + torch.randn(b_, t, generator=g, dtype=torch.float64) * 0.3).float()
    ref = (lp + torch.randn(b_, t, generator=g, dtype=torch.float64) * 0.3).float()
    adv = torch.randn((b_,) if per_row_adv else (b_, t), generator=g)
    mask = torch.ones(b_, t, dtype=torch.bool)
    mask[0, 3] = False
    mask[2, 0] = False
    return dict(h=h, W=W, b=b, labels=labels, adv=adv, old=old, ref=ref, mask=mask)


def policy_reference(x, **kw):
    """(loss, stats, grads of h / W / b) of the float64 reference (linear_policy_loss/naive.py:
    token_logprobs' sampler on the materialised logits, the labels outside the kept set masked
    out) on the call's arguments (CPU tensors)."""
    h, W, b = [x[k].detach().double().requires_grad_() for k in ("h", "W", "b")]
    call, pre, _ = policy_api.arguments(
        h, W, x["labels"], x["adv"], x["old"], x["mask"], bias=b, **kw
    )
    assert isinstance(call, policy_op.SamplerCall)
    call = call._replace(hidden=h.reshape(-1, h.shape[-1]))
    loss, stats = policy_naive.linear_policy_loss(call, call.generator)
    stats.update(pre)
    return loss, stats, torch.autograd.grad(loss, (h, W, b))


# ---- linear_distill_loss ----


def distill_inputs(b_, t, h_, ht, v, dtype=torch.float32, seed=0):
    """b_ sequences of t tokens (b_ >= 3, t >= 4): a student head and a teacher head, random
    labels, the least likely token at [1, :2] and [2, 3] (outside any truncation), an ignored
    label, two masked tokens."""
    g = torch.Generator().manual_seed(seed)
    h, W, b = _head(g, b_, t, h_, v, dtype)
    th = (torch.randn(b_, t, ht, generator=g) * 0.9).to(dtype)
    tW = (torch.randn(v, ht, generator=g) * (0.7 * (6 / ht) ** 0.5)).to(dtype)
    labels = torch.randint(0, v, (b_, t), generator=g)
    labels[0, 1] = -100
    z = h.double() @ W.double().T + b.double()
    labels[1, :2] = z[1, :2].argmin(-1)
    labels[2, 3] = z[2, 3].argmin(-1)
    mask = torch.ones(b_, t, dtype=torch.bool)
    mask[0, 3] = False
    mask[2, 0] = False
    return dict(h=h, W=W, b=b, th=th, tW=tW, labels=labels, mask=mask)


# forward_kl only without truncation (it is infinite otherwise)
DIVERGENCES = {
    "topk": dict(divergence="reverse_kl"),
    "topp": dict(divergence="tv"),
    "minp": dict(divergence="jsd", beta=0.3),
    "all": dict(divergence="jsd"),
    "per_row": dict(divergence="jsd", beta=1.0),
    "per_token_temperature": dict(divergence="tv"),
    "temperature_tensor_only": dict(divergence="forward_kl"),
}


def distill_settings(B, T):
    """The sampler's options (the student's distribution) and a divergence each, by name, for B
    sequences of T tokens."""
    return {k: dict(v, **DIVERGENCES[k]) for k, v in sampler_settings(B, T).items()}


def distill_reference(x, temperature=1.0, top_k=None, top_p=None, min_p=None, sampler="vllm",
                      divergence="jsd", beta=0.5, weight_soft_loss=0.5, weight_hard_loss=0.5,
                      **_):  # fmt: skip
    """(loss, stats, grads of h / W / b) in float64 from the documented semantics: both heads'
    logits materialised, the student's kept set from token_logprobs' float64 sampler reference,
    p_K renormalised on it, the teacher's q whole, the divergence of the two, the hard-label term
    at temperature 1."""
    shape, V = tuple(x["labels"].shape), x["W"].shape[0]
    h, W, b = [x[k].detach().double().requires_grad_() for k in ("h", "W", "b")]
    z = (h @ W.T + b).reshape(-1, V)
    zt = (x["th"].double() @ x["tW"].double().T).reshape(-1, V)
    t = per_token(temperature, 1.0, shape, torch.float64)
    k = per_token(top_k, 0, shape, torch.int64)
    p = per_token(top_p, 1.0, shape, torch.float64)
    mp = per_token(min_p, 0.0, shape, torch.float64)
    kept = tl_ref.sampler_kept(z.detach(), 1.0 / t, k, p, mp, sampler)[0]
    lp = torch.where(kept, z / t.unsqueeze(1), -math.inf).log_softmax(-1)
    lq = (zt / t.unsqueeze(1)).log_softmax(-1)
    D = DN.divergence_from_logprobs(lp, lq, divergence, beta)
    y = x["labels"].reshape(-1)
    keep = (y != -100) & x["mask"].reshape(-1)
    ys = y.clamp(min=0).unsqueeze(1)
    hard = z.log_softmax(-1).gather(1, ys).squeeze(1)
    n = keep.sum().clamp(min=1)
    soft_loss = torch.where(keep, D, 0.0).sum() / n
    hard_loss = -torch.where(keep, hard, 0.0).sum() / n
    loss = weight_soft_loss * soft_loss + weight_hard_loss * hard_loss
    with torch.no_grad():
        srk = lp.gather(1, ys).squeeze(1) - lq.gather(1, ys).squeeze(1)
        outside = keep & ~kept.gather(1, ys).squeeze(1)
    zero = torch.zeros((), dtype=torch.float64)
    stats = dict(
        soft_loss=soft_loss.detach(), hard_loss=hard_loss.detach(),
        divergence=torch.where(keep, D.detach(), zero), hard_logprobs=torch.where(keep, hard, zero),
        sampled_reverse_kl=torch.where(keep, srk, zero), outside=outside,
        num_outside=outside.sum().double(),
    )  # fmt: skip
    return loss, stats, torch.autograd.grad(loss, (h, W, b))
