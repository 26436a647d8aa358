"""The whole per-token step of a PPO update -- rewards with the KL penalty, GAE, whitening, the
policy and value losses and their backward -- as one traceable, capturable unit:

  * under `torch.compile(fullgraph=True)` (aot_eager, static and dynamic shapes): no graph break,
    the same loss, statistics and gradients as eager;
  * with no host synchronisation and no tensor made from Python numbers inside the step: our
    Python code calling `.item()` / `bool()` / `float()` / `.tolist()` / `.cpu()` / `.nonzero()`,
    indexing with a boolean tensor, or `torch.tensor(...)` / `torch.as_tensor(...)` fails the test
    (on a GPU each is a sync, or a pageable host-to-device copy that a CUDA graph cannot capture).
    The guard trips only on calls made from ppo_kernels' own modules (not torch's, not Triton's
    interpreter), so it checks every backend that runs here.

The real CUDA-graph capture of this step is tests/cuda/test_cuda_losses.py::test_ppo_step_cuda_graph.
"""

import contextlib
import sys

import pytest
import torch
from support.skips import need_backend
from support.step import make_inputs, ppo_step, run_step

import ppo_kernels as pk
from ppo_kernels import use_backend


@pytest.mark.parametrize("dynamic", [False, True])
def test_step_compiles_fullgraph(dynamic):
    """One graph for the whole forward (fullgraph=True); AOTAutograd's backward gives the eager
    gradients; with dynamic shapes a second size reuses it."""
    torch._dynamo.reset()
    compiled = torch.compile(ppo_step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for B, T in ((4, 16), (3, 24)) if dynamic else ((4, 16),):
        x = make_inputs(B, T)
        for got, want in zip(run_step(compiled, x), run_step(ppo_step, x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


_PKG = pk.__name__ + "."


def _from_package(depth=2):
    """Whether the frame `depth` levels up (the guarded call's caller) is ppo_kernels' code."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == pk.__name__ or name.startswith(_PKG)


def _is_bool_index(idx):
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


@contextlib.contextmanager
def no_sync_no_python_tensors():
    """Fail on host syncs and on tensors made from Python values, called from ppo_kernels."""
    found = []

    def refuse(owner, name, when=None):
        orig = getattr(owner, name)

        def guarded(*args, **kwargs):
            if _from_package() and (when is None or when(*args, **kwargs)):
                found.append(f"{getattr(owner, '__name__', owner)}.{name}")
                raise AssertionError(f"{name} called inside the step (host sync / host tensor)")
            return orig(*args, **kwargs)

        return owner, name, orig, guarded

    T = torch.Tensor
    patches = [
        refuse(T, n)
        for n in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy", "nonzero")
    ]
    patches += [refuse(torch, n) for n in ("tensor", "as_tensor", "nonzero", "masked_select")]
    patches += [
        refuse(T, "masked_select"),
        refuse(T, "__getitem__", lambda self, idx: _is_bool_index(idx)),
        refuse(T, "__setitem__", lambda self, idx, v: _is_bool_index(idx)),
    ]
    for owner, name, _, guarded in patches:
        setattr(owner, name, guarded)
    try:
        yield found
    finally:
        for owner, name, orig, _ in patches:
            setattr(owner, name, orig)


def test_the_guard_trips():
    """The check itself: a sync in ppo_kernels' code is caught, the test's own calls are not."""
    x = torch.ones(3)
    with no_sync_no_python_tensors() as found:
        assert bool(x.sum() == 3)  # this test's frame: allowed
        with pytest.raises(AssertionError, match="__bool__"):  # reads the labels: a sync
            pk._checks.check_labels_in_range(torch.zeros(2, dtype=torch.long), 5, -100)
    assert found == ["Tensor.__bool__"]


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_step_has_no_host_sync(backend):
    """Forward and backward of the step, on the CPU backends (the C++ kernels by default, or the
    Triton kernels through the interpreter), with the guard above active."""
    if backend == "triton":
        need_backend("ppo_policy_loss", "triton")
    x = make_inputs()
    want = run_step(ppo_step, x)
    ctx = use_backend("triton") if backend == "triton" else contextlib.nullcontext()
    with ctx, no_sync_no_python_tensors() as found:
        got = run_step(ppo_step, x)
    assert not found, found
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


LOSS_TYPE_CASES = [
    dict(loss_type="grpo"),  # TRL: every row counts, global_batch_size = B (a Python number)
    dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", global_num_tokens=37),
    dict(loss_type="gspo"),
    dict(loss_type="sapo"),
    dict(loss_type="cispo", clip_low=1.0, clip_high=3.0),
    dict(loss_type="dro", dro_beta=0.3),
    dict(loss_type="geo_mean"),
    dict(loss_type="kl_cov", kl_cov_ratio=0.5),
    dict(loss_type="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=0.05),
    dict(loss_type="ppo", importance_sampling_level="sequence"),
    dict(
        rollout_is="sequence", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.3_3,2.0"
    ),
    dict(
        loss_type="gpg",
        bypass_mode=True,
        rollout_is="token",
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2",
    ),
]


@pytest.mark.parametrize("opts", LOSS_TYPE_CASES, ids=lambda o: "-".join(map(str, o.values())))
def test_loss_types_have_no_host_sync(opts):
    """The other loss types (the shared two-stage math) and rollout correction through the public
    API, forward and backward, under the same guard: no sync, no tensor from a Python number
    (e.g. TRL's default global_batch_size, a Python int, becomes a fill on the device)."""
    x = make_inputs()
    lp = x["logprobs"].clone().requires_grad_(True)
    kw = dict(opts)
    if "rollout_is" in kw and not kw.get("bypass_mode"):
        kw["rollout_logprobs"] = x["old_logprobs"] - 0.1
    if kw.get("loss_type") == "clip_cov":
        kw["generator"] = torch.Generator().manual_seed(0)
    with no_sync_no_python_tensors() as found:
        loss, stats = pk.ppo_policy_loss(lp, x["old_logprobs"], x["scores"], x["mask"], **kw)
        torch.autograd.grad(loss, lp)
    assert not found, found
    assert torch.isfinite(loss)
