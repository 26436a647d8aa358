"""The integrations' shared pieces: `compare` runs a peer function unpatched and patched on the
same inputs (gradients included); `batch` is their usual [B, T] data; `verl_loss_modules` and
`actor_config` give verl's loss modules and configs to the tests that call its policy-loss
registry and rollout correction (integrations/test_verl_losses.py, ops/test_policy_losses.py)."""

from __future__ import annotations

import contextlib
import math
import types

import torch

import ppo_kernels.integrations as pki

from .peer_stubs import import_peer

RTOL, ATOL = 1e-5, 1e-6  # float32: our ops accumulate in float32 like the peers' float32 code


def _clone(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad)
    return x


def _leaves(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [v for k in sorted(out) for v in _flat(out[k])]
    if isinstance(out, (tuple, list)):
        return [v for o in out for v in _flat(o)]
    return [out]


def _run(get, args, kwargs, grad_of):
    args = [_clone(a) for a in args]
    kwargs = {k: _clone(v) for k, v in kwargs.items()}
    out = get()(*args, **kwargs)
    grads = []
    leaves = _leaves(args) + _leaves(kwargs.values())
    if leaves:
        y = grad_of(out)
        if y is not None and y.requires_grad:
            w = torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).reshape(y.shape)
            grads = torch.autograd.grad((y * w).sum(), leaves, allow_unused=True)
    return out, grads


def compare(
    peer,
    get,
    *args,
    grad_of=lambda o: o[0] if isinstance(o, tuple) else o,
    rtol=RTOL,
    atol=ATOL,
    dtype_check=True,
    strict=True,
    expect_replaced=True,
    grads=True,
    grad_atol=None,
    **kwargs,
):
    """`get()` returns the peer function as the peer would look it up now. Runs it unpatched, then
    under `patched(peer)`, and checks outputs (tensors, floats) and input gradients agree, and that
    our op really ran (the call was replaced, not fallen back). grads=False: outputs only (where
    the peer's gradient is 0/0 = NaN and ours a documented 0). grad_atol: the gradients' absolute
    tolerance where it differs from the outputs' (a gradient summed over many rows)."""
    ref, gref = _run(get, args, kwargs, grad_of)
    with pki.patched(peer, strict=strict):
        got, ggot = _run(get, args, kwargs, grad_of)
        rep = pki.report(peer)
    replaced = sum(s["replaced"] for s in rep["functions"].values())
    if expect_replaced:
        assert replaced >= 1, f"nothing was replaced: {rep}"
    fr, fg = _flat(ref), _flat(got)
    assert len(fr) == len(fg)
    for a, b in zip(fr, fg):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor)
            assert a.shape == b.shape
            if dtype_check:
                assert a.dtype == b.dtype, (a.dtype, b.dtype)
            torch.testing.assert_close(b.double(), a.double(), rtol=rtol, atol=atol, equal_nan=True)
        elif isinstance(a, float):
            assert abs(a - b) <= atol + rtol * abs(a) or (math.isnan(a) and math.isnan(b)), (a, b)
        else:
            assert a == b
    assert len(gref) == len(ggot)
    for a, b in zip(gref, ggot) if grads else ():
        if a is None:
            assert b is None or not b.any()
        else:
            torch.testing.assert_close(
                b.double(), a.double(), rtol=rtol, atol=grad_atol or atol, equal_nan=True
            )
    return ref, got, rep


def batch(B=6, T=9, seed=0, empty_row=True, mask_dtype=torch.int64):
    """(mask, logprobs, old_logprobs, advantages, generator): a last row with no action, a first
    column of actions, and one log-ratio beyond the +-20 clamp."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(mask_dtype)
    mask[:, 0] = 1
    if empty_row:
        mask[-1] = 0
    lp = -torch.rand(B, T, generator=g) * 2
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    old[0, 1] = lp[0, 1] - 30.0
    adv = torch.randn(B, T, generator=g)
    return mask, lp, old, adv, g


class DataProtoStandIn:  # verl's DataProto needs tensordict; the helper only wraps the weights
    def __init__(self, batch):
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors):
        return cls(dict(tensors))


@contextlib.contextmanager
def verl_loss_modules():
    """core_algos, rollout_corr_helper (its DataProto stood in for), the actor and algorithm
    config modules, as a namespace (core, rch, actor, algo); skips where verl is not installed."""
    core = import_peer("verl.trainer.ppo.core_algos")
    rch = import_peer("verl.trainer.ppo.rollout_corr_helper")
    actor = import_peer("verl.workers.config.actor")
    algo = import_peer("verl.trainer.config.algorithm")
    saved = rch.DataProto
    rch.DataProto = DataProtoStandIn
    try:
        yield types.SimpleNamespace(core=core, rch=rch, actor=actor, algo=algo)
    finally:
        rch.DataProto = saved


def actor_config(verl, mode, info=None, rollout_correction=None, clip_ratio_c=3.0, **policy):
    """verl's ActorConfig for loss `mode`: clip range 0.15 / 0.28, SAPO's tau 1.0 / 1.3,
    PolicyLossConfig(**policy) (verl's defaults otherwise), `rollout_correction` a
    RolloutCorrectionConfig or its keywords, `info` the global batch info."""
    if isinstance(rollout_correction, dict):
        rollout_correction = verl.algo.RolloutCorrectionConfig(**rollout_correction)
    if rollout_correction is not None:
        policy["rollout_correction"] = rollout_correction
    return verl.actor.ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        clip_ratio_c=clip_ratio_c,
        tau_pos=1.0,
        tau_neg=1.3,
        policy_loss=verl.actor.PolicyLossConfig(loss_mode=mode, **policy),
        global_batch_info=dict(info or {}),
    )
