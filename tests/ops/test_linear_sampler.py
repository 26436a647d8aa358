"""linear_token_logprobs with a rollout sampler's options (temperature tensor, top-k, top-p, min-p,
vLLM's / SGLang's rules) and the head's statistics, on every CPU backend, against token_logprobs'
float64 eager sampler on the materialised float64 logits."""

import pytest
import torch
from support.skips import requires_extension
from support.utils import cpu_backends, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.linear_logprobs import naive
from ppo_kernels.token_logprobs import naive as tl_ref

BACKENDS = cpu_backends("linear_token_logprobs")
B, T, H, V = 3, 4, 8, 37  # small: the Triton interpreter runs the sampler's search per element
STATS = ("outside", "sum_p2", "lse", "topk", "is_argmax")
# Budgets: the default (one block) and one that holds two rows per block (the tile and its
# gradient of 2 rows of V float32 logits, plus the per-row buffers): several row blocks.
SMALL = 2 * 2 * (V * 4 + H * 4)
ops = torch.ops.ppo_kernels


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * 0.9).to(dtype)
    W = (torch.randn(V, H, generator=g) * 0.7).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 1] = -100
    labels[2, 3] = -100
    # the least likely token of some rows: outside any truncation
    z = naive.logits(h, W, b)
    labels[1, :2] = z[1, :2].argmin(-1)
    return h, W, b, labels


def _per_token(x, labels, dtype):
    """A scalar or a leading-part tensor as a per-token tensor with labels.shape."""
    if not isinstance(x, torch.Tensor):
        return torch.full(labels.shape, x, dtype=dtype)
    return (
        x.reshape(tuple(x.shape) + (1,) * (labels.dim() - x.dim())).expand(labels.shape).to(dtype)
    )


def _logits(h, W, b, softcap=None):
    z = naive.logits(h, W, b)
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _ref(h, W, b, labels, temp, k, p, mp, sampler, stats_top_k=0, softcap=None):
    """token_logprobs' eager sampler on the float64 logits."""
    z = _logits(h, W, b, softcap)
    f64 = torch.float64
    return tl_ref.sampler_forward(
        z, labels, 1.0 / _per_token(temp, labels, f64), _per_token(k, labels, torch.int64),
        _per_token(p, labels, f64), _per_token(mp, labels, f64), sampler, -100, True, True, True,
        stats_top_k, True,
    )  # fmt: skip


def _settings():
    g = torch.Generator().manual_seed(1)
    per_row = dict(
        temperature=torch.rand(B, generator=g) + 0.5,
        top_k=torch.tensor([3, 0, 10]),
        top_p=torch.tensor([[0.9, 1.0, 0.5, 0.8]] * B),
        min_p=torch.tensor([0.0, 0.1, 0.02]),
    )
    return {
        "scalar_topk": dict(temperature=0.8, top_k=5),
        "scalar_topp": dict(temperature=1.2, top_p=0.7),
        "scalar_minp": dict(min_p=0.1),
        "scalar_all": dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05),
        "per_row": per_row,
        "temperature_tensor_only": dict(temperature=torch.rand(B, T, generator=g) + 0.5),
        "off": dict(top_k=0, top_p=1.0, min_p=0.0),
    }


SETTINGS = _settings()


def _args(opts):
    d = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    d.update({k: v for k, v in opts.items() if v is not None})
    return d["temperature"], d["top_k"], d["top_p"], d["min_p"]


def _close(ours, ref, what, atol=2e-5, rtol=2e-5):
    ref = ref.to(ours.dtype)
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(ours), inf), what
    torch.testing.assert_close(ours[~inf], ref[~inf], atol=atol, rtol=rtol, msg=what)
    assert torch.equal(ours[inf], ref[inf]), what


# (backend, budget): the Triton interpreter is slow, it runs the several-block budget only
BUDGETS = [(b, m) for b in BACKENDS for m in (None, SMALL) if b != "triton" or m is not None]
# The Triton interpreter runs the settings that hand the kernel each kind of parameter (scalars,
# per-row and per-token tensors, none); the kernel is token_logprobs' sampler, whose rules for each
# option alone tests/ops/test_sampler.py checks on it (test_kept_set_and_outputs_follow_the_rules)
TRITON_SETTINGS = ("off", "per_row", "scalar_all", "temperature_tensor_only")
RUNS = [
    (b, m, s) for b, m in BUDGETS for s in sorted(SETTINGS) if b != "triton" or s in TRITON_SETTINGS
]


@pytest.mark.parametrize("backend,budget,setting", RUNS)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
def test_forward_matches_the_float64_sampler(backend, sampler, setting, budget):
    h, W, b, labels = _inputs()
    opts = SETTINGS[setting]
    with use_backend(linear_token_logprobs=backend), poisoned():
        lp, ent, st = pk.linear_token_logprobs(
            h, W, labels, bias=b, return_entropy=True, max_chunk_bytes=budget, sampler=sampler,
            stats=STATS, stats_top_k=3, **opts,
        )  # fmt: skip
    r = _ref(h.double(), W.double(), b.double(), labels, *_args(opts), sampler, stats_top_k=3)
    _close(lp, r[0], "logprobs")
    _close(ent, r[1], "entropy")
    assert torch.equal(st.outside, r[5])
    assert int(st.num_outside) == int(r[5].sum())
    if setting not in ("off", "temperature_tensor_only", "scalar_topp"):
        assert int(st.num_outside) > 0  # the argmin labels fall outside
    assert torch.isneginf(lp[st.outside]).all()
    _close(st.sum_p2, r[6], "sum_p2")
    _close(st.lse, r[7], "lse")
    assert torch.equal(st.top_ids, r[8])
    _close(st.top_logprobs, r[9], "top_logprobs")
    assert torch.equal(st.is_argmax, r[10])
    assert lp.shape == labels.shape and st.top_ids.shape == (*labels.shape, 3)


def _autograd_ref(h, W, b, labels, temp, k, p, mp, sampler, softcap=None):
    """(log-probs, entropy) in float64 through autograd: the kept set from the eager sampler
    (fixed: its selection has no derivative), the renormalised softmax on it written out."""
    z = _logits(h, W, b, softcap)
    r = _ref(h.detach(), W.detach(), b.detach(), labels, temp, k, p, mp, sampler, softcap=softcap)
    j = torch.arange(V)
    kept = (z.detach() > r[3].unsqueeze(-1)) | (
        (z.detach() == r[3].unsqueeze(-1)) & (j <= r[4].unsqueeze(-1))
    )
    zt = z / _per_token(temp, labels, torch.float64).unsqueeze(-1)
    lse = torch.logsumexp(torch.where(kept, zt, -torch.inf), -1, keepdim=True)
    logq = torch.where(kept, zt - lse, 0)
    q = torch.where(kept, logq.exp(), 0)
    ent = -(q * logq).sum(-1)
    valid = labels != -100
    safe = torch.where(valid, labels, 0).unsqueeze(-1)
    in_set = kept.gather(-1, safe).squeeze(-1)
    lp = torch.where(valid & in_set, logq.gather(-1, safe).squeeze(-1), 0)
    lp = torch.where(valid & ~in_set, -torch.inf, lp)
    ent = torch.where(valid, ent, 0)
    torch.testing.assert_close(lp, r[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, r[1], atol=1e-12, rtol=1e-12)
    return lp, ent


def _loss_weights(labels):
    g = torch.Generator().manual_seed(2)
    return torch.randn(labels.shape, generator=g, dtype=torch.float64), torch.randn(
        labels.shape, generator=g, dtype=torch.float64
    )


def _loss(lp, ent, wl, we):
    """A loss on the finite log-probs (a label outside the kept set has none) and the entropy."""
    fin = torch.isfinite(lp)
    return (torch.where(fin, lp, 0).double() * wl).sum() + (ent.double() * we).sum()


@pytest.mark.parametrize("backend,budget", BUDGETS)
@pytest.mark.parametrize("sampler", ["vllm", "sglang"])
@pytest.mark.parametrize("setting", ["scalar_all", "per_row"])
def test_gradients_match_the_float64_autograd(backend, sampler, setting, budget):
    h, W, b, labels = _inputs()
    opts = SETTINGS[setting]
    wl, we = _loss_weights(labels)
    leaves = [t.clone().requires_grad_() for t in (h, W, b)]
    with use_backend(linear_token_logprobs=backend), poisoned():
        lp, ent = pk.linear_token_logprobs(
            leaves[0], leaves[1], labels, bias=leaves[2], return_entropy=True,
            max_chunk_bytes=budget, sampler=sampler, **opts,
        )  # fmt: skip
        _loss(lp, ent, wl, we).backward()
    refs = [t.double().requires_grad_() for t in (h, W, b)]
    _loss(*_autograd_ref(*refs, labels, *_args(opts), sampler), wl, we).backward()
    for name, ours, ref in zip(("hidden", "weight", "bias"), leaves, refs):
        assert torch.isfinite(ours.grad).all(), name
        torch.testing.assert_close(ours.grad.double(), ref.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    n, hd, v = 4, 3, 9
    h = torch.randn(n, hd, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(v, hd, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 8])
    temps = torch.tensor([0.7, 1.0, 1.3, 0.9], dtype=torch.float64)

    def f(h, W, b):
        lp, ent = pk.linear_token_logprobs(
            h, W, labels, bias=b, temperature=temps, top_k=6, top_p=0.95, return_entropy=True,
            max_chunk_bytes=2 * 2 * (v * 8 + hd * 8),
        )  # fmt: skip
        return torch.where(torch.isfinite(lp), lp, 0), ent

    assert torch.autograd.gradcheck(f, (h, W, b))


@requires_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    # the Triton interpreter: the fake-vs-real check only (the registration, autograd and
    # dispatch checks do not depend on the backend, and cost the interpreter seconds each)
    only = dict(test_utils=("test_schema", "test_faketensor")) if backend == "triton" else {}
    h, W, b, labels = _inputs()
    h, y = h.reshape(-1, H), labels.reshape(-1)
    N = y.numel()
    temps = torch.rand(N) + 0.5
    ks = torch.randint(0, 12, (N,))
    with use_backend(linear_token_logprobs=backend):
        # (the Triton interpreter is slow: one budget there, several row blocks)
        for budget in (SMALL,) if backend == "triton" else (0, SMALL):
            args = (
                h.clone().requires_grad_(), W.clone().requires_grad_(), y,
                b.clone().requires_grad_(), 1.0, temps, 0, ks, 0.9, None, 0.02, None, "sglang",
                -100, True, True, True, 2, True, budget, "float32", None,
            )  # fmt: skip
            torch.library.opcheck(torch.ops.ppo_kernels.linear_token_logprobs_sampler, args, **only)
        outs = ops.linear_token_logprobs_sampler(
            h, W, y, b, 1.0, temps, 0, ks, 0.9, None, 0.0, None, "vllm", -100, True, False,
            False, 0, False, SMALL, "float32", None,
        )  # fmt: skip
        lp, ent, lse, cut, cut_index = outs[:5]
        torch.library.opcheck(
            torch.ops.ppo_kernels.linear_token_logprobs_sampler_backward.default,
            (torch.randn_like(lp), torch.randn_like(ent), h, W, y, b, lse, ent, cut, cut_index,
             1.0, temps, -100, SMALL, True, True, True, "float32", None),
            **only,
        )  # fmt: skip


@requires_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_without_options_the_plain_path_runs(backend):
    """No sampler option: the plain op's outputs and gradients, bit for bit."""
    h, W, b, labels = _inputs()
    h2, y = h.reshape(-1, H), labels.reshape(-1)
    with use_backend(linear_token_logprobs=backend):
        for budget in (None, SMALL):
            outs = []
            for public in (True, False):
                leaves = [t.clone().requires_grad_() for t in (h2, W, b)]
                if public:
                    lp, ent = pk.linear_token_logprobs(
                        *leaves[:2], y, bias=leaves[2], temperature=0.9, return_entropy=True,
                        max_chunk_bytes=budget,
                    )  # fmt: skip
                else:
                    lp, ent, _ = ops.linear_token_logprobs(
                        *leaves[:2], y, leaves[2], 0.9, -100, True, budget or 0
                    )
                (lp.sum() + 0.5 * ent.sum()).backward()
                outs.append([lp, ent] + [t.grad for t in leaves])
            for a, c in zip(*outs):
                assert torch.equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_off_agree_with_the_plain_path(backend):
    h, W, b, labels = _inputs()
    with use_backend(linear_token_logprobs=backend):
        plain = pk.linear_token_logprobs(h, W, labels, bias=b, temperature=0.8)
        off = pk.linear_token_logprobs(h, W, labels, bias=b, temperature=0.8, top_k=0, top_p=1.0)
        per_row = pk.linear_token_logprobs(h, W, labels, bias=b, temperature=torch.full((B,), 0.8))
    torch.testing.assert_close(off, plain, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(per_row, plain, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    h, W, b, labels = _inputs(dtype)
    lp, ent = pk.linear_token_logprobs(
        h, W, labels, bias=b, top_k=6, top_p=0.9, return_entropy=True, max_chunk_bytes=8 * SMALL
    )
    r = _ref(h.double(), W.double(), b.double(), labels, 1.0, 6, 0.9, 0.0, "vllm")
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.bfloat16 else dict(atol=1e-12, rtol=1e-12)
    _close(lp, r[0], "logprobs", **tol)
    _close(ent, r[1], "entropy", **tol)


def test_a_forward_without_backward_takes_the_whole_budget():
    """No backward can follow (no_grad, or no input requires grad): the logits tile takes the
    whole budget, not half of it beside a gradient tile. A budget that holds one row's tile but
    not its gradient tile too then suffices, with the same values."""
    h, W, b, labels = _inputs()
    kw = dict(bias=b, top_k=6, top_p=0.9)
    full = pk.linear_token_logprobs(h, W, labels, max_chunk_bytes=8 * SMALL, **kw)
    with torch.no_grad():
        lp = pk.linear_token_logprobs(h, W, labels, max_chunk_bytes=SMALL // 4, **kw)
    torch.testing.assert_close(lp, full, atol=2e-6, rtol=2e-6)
    frozen = pk.linear_token_logprobs(h, W, labels, max_chunk_bytes=SMALL // 4, **kw)
    torch.testing.assert_close(frozen, full, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        pk.linear_token_logprobs(
            h.clone().requires_grad_(), W, labels, max_chunk_bytes=SMALL // 4, **kw
        )


BAD = [
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=torch.tensor([1, -2, 3])), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=torch.tensor([0.5, 1.2, 0.9])), ValueError, "top_p"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(temperature=torch.ones(5)), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, 0.0, 1.0])), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, -1.0, 1.0])), ValueError, "temperature"),
    (dict(top_k=3, sampler="hf"), ValueError, "sampler"),
    (dict(top_k=3, max_chunk_bytes=64), ValueError, "max_chunk_bytes"),
    (dict(stats=("topk",)), ValueError, "stats_top_k"),
    (dict(stats=("nope",)), ValueError, "stats"),
    # (the vocab-parallel form takes the options: it needs torch.distributed first)
    (dict(top_k=3, process_group=object()), RuntimeError, "process_group"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs_name_the_argument(backend, case):
    kw, exc, name = BAD[case]
    h, W, b, labels = _inputs()
    with use_backend(linear_token_logprobs=backend), pytest.raises(exc, match=name):
        pk.linear_token_logprobs(h, W, labels, bias=b, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_and_batch_invariant_mode(backend):
    h, W, b, labels = _inputs()
    opts = SETTINGS["per_row"]
    wl, we = _loss_weights(labels)
    for invariant in (False, True):
        leaves = [t.clone().requires_grad_() for t in (h, W, b)]
        with use_backend(linear_token_logprobs=backend), pk.batch_invariant(invariant):
            lp, ent = pk.linear_token_logprobs(
                leaves[0], leaves[1], labels, bias=leaves[2], return_entropy=True, softcap=2.5,
                max_chunk_bytes=SMALL, **opts,
            )  # fmt: skip
            _loss(lp, ent, wl, we).backward()
        refs = [t.double().requires_grad_() for t in (h, W, b)]
        rlp, rent = _autograd_ref(*refs, labels, *_args(opts), "vllm", softcap=2.5)
        _close(lp, rlp, "logprobs")
        _close(ent, rent, "entropy")
        _loss(rlp, rent, wl, we).backward()
        for name, ours, ref in zip(("hidden", "weight", "bias"), leaves, refs):
            torch.testing.assert_close(ours.grad.double(), ref.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows(backend):
    h = torch.randn(0, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    with use_backend(linear_token_logprobs=backend):
        lp, ent, st = pk.linear_token_logprobs(
            h, W, torch.zeros(0, dtype=torch.long), top_k=3, return_entropy=True,
            stats=("outside",),
        )  # fmt: skip
        (lp.sum() + ent.sum()).backward()
    assert lp.shape == (0,) and int(st.num_outside) == 0
    assert h.grad.shape == (0, H) and torch.equal(W.grad, torch.zeros(V, H))
