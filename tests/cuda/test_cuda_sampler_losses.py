"""linear_preference_loss, linear_distill_loss and linear_policy_loss under a rollout sampler's
distribution on the GPU (per-row and per-token temperature tensors, top_k, top_p, min_p and a
combination, vLLM's and SGLang's rules): every backend that runs there (cpp: cuBLAS + the CUDA
sampler kernels; triton: cuBLAS + the Triton ones; eager) against the float64 references of the CPU
sampler tests (support/sampler_losses.py, computed on the CPU from the same inputs): the loss, the
metrics, the per-row and per-token outputs, `outside` / `num_outside` and the gradients of hidden,
weight and bias, every output NaN-poisoned. Given reference log-probs and a reference head (its own
kept set); policy loss types with sequence and row statistics and a KL term; the outside tokens
masked out of the loss (no gradient) or kept (mask_outside=False); one block and several (a pair or
a sequence longer than a block); float32 and bf16 (float32 tiles: bf16 ones round the logits, and
ties at a cut become common); V=152064 (at H=1024: the sampler's work is over the vocabulary).
Exact ties at a cut (vLLM and SGLang differ there) are the CPU tests'.

The kept set is piecewise constant in the logits: a token whose set sits within float32 rounding of
a boundary may fall either way on the GPU. Such tokens (support's firm_tokens) leave the mask of the
op and of the reference alike (the policy loss: they get the ignored label, as its per-token outputs
cover the tokens outside the mask too); a case may drop only a few."""

import pytest
import torch
from support import sampler_losses as SL
from support.gpu import DEVICE, MARKS, big, close, close_scaled, require
from support.utils import GEMM_GRAD_TOL, GEMM_TOL, poisoned

import ppo_kernels as pk
from ppo_kernels import use_backend
from ppo_kernels.linear_logprobs import naive as ll_ref

pytestmark = MARKS
BACKENDS = ["cpp", "triton", "eager"]
SAMPLERS = ["vllm", "sglang"]
SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p")


def _on(kw, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _firm(z, kw, sampler):
    return SL.firm_tokens(z, **{k: kw.get(k) for k in SAMPLER_KEYS}, sampler=sampler)


def _drop_unfirm(x, firm, most):
    """x with the tokens whose kept set is not firm out of its mask (at most `most` of them)."""
    keep = x["mask"] & (x["labels"] != -100)
    dropped = int((keep & ~firm).sum())
    assert dropped <= most, f"{dropped} tokens at a kept-set boundary: change the seed"
    return dict(x, mask=x["mask"] & firm)


# the CPU dry run runs the Triton interpreter (element by element: seconds a case) on a few cases
GPU_TRITON = ["cpp", big("triton"), "eager"]


def _cases(settings, budgets, dry_triton):
    """(backend, setting, sampler, budget): every combination on the GPU, eager with one block;
    the CPU dry run runs Triton on `dry_triton` only."""
    out = []
    for backend in BACKENDS:
        for s in settings:
            for sampler in SAMPLERS:
                for budget in budgets:
                    if backend == "eager" and budget is not None:
                        continue
                    case = (backend, s, sampler, budget)
                    gpu_only = backend == "triton" and (s, sampler, budget) not in dry_triton
                    out.append(big(*case) if gpu_only else case)
    return out


# ---- linear_preference_loss ----

P, T, H, V = 2, 6, 40, 211
R = 2 * P
# two rows per block: a pair (2T rows) is longer than a block
SMALL = 2 * 2 * (V * 4 + H * 4)
PREF_SETTINGS = SL.preference_settings(R, T)


def _close_stats(st, rstats, keys):
    """The op's statistics `keys` (detached) against the reference's: flags equal, values close."""
    for k in keys:
        v = st[k]
        assert not v.requires_grad, k
        if v.dtype == torch.bool:
            assert torch.equal(v.cpu(), rstats[k].reshape(v.shape)), k
        else:
            close(v.cpu(), rstats[k].reshape(v.shape), **GEMM_TOL)


def _close_grads(grads, rgrads, dtype):
    """The hidden, weight and bias gradients (in the inputs' dtype, finite) against the
    reference's, scaled to its largest."""
    for name, g, r in zip(("hidden", "weight", "bias"), grads, rgrads):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        close_scaled(g.cpu(), r, **GEMM_GRAD_TOL[dtype])


def _pref_check(x, backend, ref="given", most=1, **kw):
    """The op on DEVICE against the float64 reference on the CPU (x: CPU tensors; the sampler's
    tensors in kw too); returns the op's stats."""
    sampler = kw.get("sampler", "vllm")
    z = ll_ref.logits(*(x[k].double() for k in ("h", "W", "b")))
    firm = _firm(z, kw, sampler)
    if ref == "head":
        firm &= _firm(x["rh"].double() @ x["rW"].double().T, kw, sampler)
    x = _drop_unfirm(x, firm, most)
    xd = _on(x, DEVICE)
    h, W, b = [xd[k].detach().requires_grad_() for k in ("h", "W", "b")]
    with use_backend(linear_preference_loss=backend), poisoned():
        loss, st = pk.linear_preference_loss(
            h, W, xd["labels"], xd["mask"], bias=b, **SL.preference_ref_kw(xd, ref),
            **_on(kw, DEVICE),
        )  # fmt: skip
        grads = torch.autograd.grad(loss, (h, W, b))
    rloss, rstats, rrows, rlp, rgrads = SL.preference_reference(
        x, **SL.preference_ref_kw(x, ref), **kw
    )
    assert loss.dtype == torch.float32 and loss.dim() == 0
    close(loss.detach().cpu(), rloss.detach(), **GEMM_TOL)
    _close_stats(st, rstats, rstats)
    for k in ("logps", "rewards", "ref_logps"):
        close(st[k].cpu(), rrows[k], **GEMM_TOL)
    close(st["token_logprobs"].cpu(), rlp, **GEMM_TOL)
    _close_grads(grads, rgrads, x["h"].dtype)
    out = st["outside"].cpu()
    assert int(st["num_outside"]) == int(out.sum()) and not (out & ~x["mask"]).any()
    neg = torch.isneginf(st["token_logprobs"].cpu())  # outside the policy's kept set
    assert torch.equal(neg, out) if ref != "head" else not (neg & ~out).any()
    if "entropy" in st:  # the truncated distribution's, as token_logprobs' sampler gives it
        lab = torch.where(x["mask"], x["labels"], -100)
        p = {k: SL.per_token(kw.get(k), d, lab.shape, dt).view(lab.shape) for k, d, dt in (
            ("temperature", 1.0, torch.float64), ("top_k", 0, torch.int64),
            ("top_p", 1.0, torch.float64), ("min_p", 0.0, torch.float64))}  # fmt: skip
        _, ent = pk.token_logprobs(z, lab, return_entropy=True, sampler=sampler, **p)
        close(st["entropy"].cpu(), ent * (lab != -100), **GEMM_TOL)
    return st


@pytest.mark.parametrize(
    "backend,setting,sampler,budget",
    _cases(sorted(PREF_SETTINGS), [None, SMALL], [("per_row", "vllm", SMALL)]),
)  # fmt: skip
def test_preference_matches_float64(backend, setting, sampler, budget):
    """Given reference log-probs; each setting, both samplers, one block and several."""
    require("linear_preference_loss", backend)
    x = SL.preference_inputs(P, T, H, V)
    st = _pref_check(x, backend, sampler=sampler, max_chunk_bytes=budget,
                     **PREF_SETTINGS[setting])  # fmt: skip
    if setting not in ("temperature_tensor_only", "topp"):
        assert int(st["num_outside"]) > 0  # the argmin labels fall outside


# (loss types, the sampler's setting): a reference head with its own kept set under per-row and
# per-token parameters, the SFT term's batch count (a first pass), an unpaired type
PREF_TYPES = {
    "sigmoid-per_row": (dict(loss_type="sigmoid"), "per_row"),
    "rpo-ld-all": (
        dict(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5), ld_alpha=0.5), "all"
    ),
    "kto-per_token_temperature": (
        dict(loss_type="kto", reference_point=0.1), "per_token_temperature"
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "backend,case,sampler,budget",
    _cases(sorted(PREF_TYPES), [None, SMALL], []),
)
def test_preference_reference_head(backend, case, sampler, budget):
    """A reference head: its own kept set, its outside labels masked out of both heads' sums;
    the entropy of the truncated distribution."""
    require("linear_preference_loss", backend)
    x = SL.preference_inputs(P, T, H, V, seed=1)
    kw, setting = PREF_TYPES[case]
    if kw["loss_type"] == "kto":
        kw = dict(kw, desirable=x["y"])
    st = _pref_check(x, backend, ref="head", sampler=sampler, max_chunk_bytes=budget,
                     return_entropy=True, **kw, **PREF_SETTINGS[setting])  # fmt: skip
    assert int(st["num_outside"]) > 0


@pytest.mark.parametrize("backend", GPU_TRITON)
def test_preference_mask_outside_off(backend):
    """mask_outside=False: the -inf enters the sequence log-probs (the sigmoid loss is +inf), the
    gradients stay finite."""
    require("linear_preference_loss", backend)
    x = SL.preference_inputs(P, T, H, V)
    st = _pref_check(x, backend, mask_outside=False, **PREF_SETTINGS["topk"])
    assert torch.isneginf(st["logps"]).any()


@pytest.mark.parametrize("backend", GPU_TRITON)
def test_preference_bf16(backend):
    """bf16 heads with float32 tiles: the reference sees the same rounded inputs."""
    require("linear_preference_loss", backend)
    x = SL.preference_inputs(P, T, H, V, dtype=torch.bfloat16, seed=2)
    _pref_check(x, backend, ref="head", sampler="sglang", logits_dtype="float32",
                max_chunk_bytes=SMALL * 2, **PREF_SETTINGS["per_row"])  # fmt: skip


# the production vocabulary: top-k on every row (a top-p cut deep in a flat 152064-token tail is
# not firm: each token there carries ~1/V of the mass), then top-p and min-p on what it keeps
BIG = lambda n: dict(  # noqa: E731
    temperature=torch.linspace(0.6, 1.4, n), top_k=SL.cycle([50, 20, 200, 1], n), top_p=0.9,
    min_p=0.02,
)  # fmt: skip


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("h_", [big(1024)])
def test_preference_production_vocabulary(backend, h_, sampler):
    """V=152064 (H=1024: the sampler's work is over the vocabulary), bf16, 2 pairs of 16 tokens,
    the default chunk budget, a reference head."""
    require("linear_preference_loss", backend)
    x = SL.preference_inputs(2, 16, h_, 152064, dtype=torch.bfloat16, seed=3)
    _pref_check(x, backend, ref="head", most=3, sampler=sampler, logits_dtype="float32",
                **BIG(4))  # fmt: skip


# ---- linear_distill_loss ----

B, DT, DH, HT, DV = 3, 6, 40, 24, 211
# two rows per block (four tiles of two rows, plus the per-row buffers): several blocks
DSMALL = 4 * 2 * (DV * 4 + DH * 4)
DISTILL_SETTINGS = SL.distill_settings(B, DT)


def _distill_check(x, backend, most=1, **kw):
    """The op on DEVICE against the float64 reference on the CPU; returns the op's stats."""
    z = (x["h"].double() @ x["W"].double().T + x["b"].double()).view(*x["labels"].shape, -1)
    x = _drop_unfirm(x, _firm(z, kw, kw.get("sampler", "vllm")), most)
    xd = _on(x, DEVICE)
    h, W, b = [xd[k].detach().requires_grad_() for k in ("h", "W", "b")]
    with use_backend(linear_distill_loss=backend), poisoned():
        loss, st = pk.linear_distill_loss(h, W, xd["labels"], xd["th"], xd["tW"], bias=b,
                                          mask=xd["mask"], **_on(kw, DEVICE))  # fmt: skip
        grads = torch.autograd.grad(loss, (h, W, b))
    rloss, rstats, rgrads = SL.distill_reference(x, **kw)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    close(loss.detach().cpu(), rloss.detach(), **GEMM_TOL)
    assert sorted(st) == sorted(rstats)
    _close_stats(st, rstats, st)
    _close_grads(grads, rgrads, x["h"].dtype)
    out = st["outside"].cpu()
    assert int(st["num_outside"]) == int(out.sum()) and not (out & ~x["mask"]).any()
    assert torch.isneginf(st["sampled_reverse_kl"].cpu()[out]).all()
    return st


@pytest.mark.parametrize(
    "backend,setting,sampler,budget",
    _cases(sorted(DISTILL_SETTINGS), [None, DSMALL], [("per_row", "sglang", DSMALL)]),
)  # fmt: skip
def test_distill_matches_float64(backend, setting, sampler, budget):
    """The options define the student's distribution; each setting (with its divergence), both
    samplers, one block and several."""
    require("linear_distill_loss", backend)
    x = SL.distill_inputs(B, DT, DH, HT, DV)
    st = _distill_check(x, backend, sampler=sampler, max_chunk_bytes=budget,
                        weight_hard_loss=0.3, **DISTILL_SETTINGS[setting])  # fmt: skip
    if setting not in ("temperature_tensor_only", "topp"):
        assert int(st["num_outside"]) > 0  # the argmin labels fall outside


@pytest.mark.parametrize("backend", GPU_TRITON)
def test_distill_bf16(backend):
    """bf16 heads with float32 tiles: the reference sees the same rounded inputs."""
    require("linear_distill_loss", backend)
    x = SL.distill_inputs(B, DT, DH, HT, DV, dtype=torch.bfloat16, seed=2)
    _distill_check(x, backend, sampler="vllm", logits_dtype="float32", max_chunk_bytes=DSMALL * 2,
                   **DISTILL_SETTINGS["all"])  # fmt: skip


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("h_", [big(1024)])
def test_distill_production_vocabulary(backend, h_, sampler):
    """V=152064 (H=1024), bf16, 4 sequences of 16 tokens, the default chunk budget."""
    require("linear_distill_loss", backend)
    x = SL.distill_inputs(4, 16, h_, h_, 152064, dtype=torch.bfloat16, seed=3)
    _distill_check(x, backend, most=3, sampler=sampler, logits_dtype="float32",
                   divergence="jsd", **BIG(4))  # fmt: skip


# ---- linear_policy_loss ----

PB, PT, PH, PV = 4, 6, 40, 211
# two rows per block (the tile and its gradient of 2 rows, plus the per-row buffers): a sequence
# longer than a block
PSMALL = 2 * 2 * (PV * 4 + PH * 4)
POLICY_SETTINGS = SL.sampler_settings(PB, PT)


def _policy_inputs(dtype=torch.float32, seed=0, **kw):
    """Labels among each token's likeliest three (most stay in the kept set), the argmin ones."""
    return SL.policy_inputs(PB, PT, PH, PV, dtype=dtype, seed=seed, top=3, **kw)


def _policy_check(x, backend, most=1, **kw):
    """The op on DEVICE against the float64 reference on the CPU (x: CPU tensors; the sampler's
    tensors in kw too): loss, every statistic, the per-token log-probs, entropies and `outside`
    flags, the gradients; returns the op's stats. A token whose kept set is not firm gets the
    ignored label (its log-prob, entropy and flag no longer depend on that set)."""
    z = ll_ref.logits(*(x[k].double() for k in ("h", "W", "b")))
    firm = _firm(z, kw, kw.get("sampler", "vllm"))
    valid = x["labels"] != -100
    assert int((valid & ~firm).sum()) <= most, "tokens at a kept-set boundary: change the seed"
    x = dict(x, labels=torch.where(firm, x["labels"], -100))
    xd = _on(x, DEVICE)
    h, W, b = [xd[k].detach().requires_grad_() for k in ("h", "W", "b")]
    with use_backend(linear_policy_loss=backend), poisoned():
        loss, st = pk.linear_policy_loss(
            h, W, xd["labels"], xd["adv"], xd["old"], xd["mask"], bias=b, **_on(kw, DEVICE)
        )
        grads = torch.autograd.grad(loss, (h, W, b))
    rloss, rstats, rgrads = SL.policy_reference(x, **kw)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    close(loss.detach().cpu(), rloss.detach(), **GEMM_TOL)
    missing = sorted(set(st) - set(rstats))
    assert not missing, missing
    _close_stats(st, rstats, st)
    _close_grads(grads, rgrads, x["h"].dtype)
    out = st["outside"].cpu()
    assert not (out & (x["labels"] == -100)).any()
    assert int(st["num_outside"]) == int((out & x["mask"]).sum())
    assert torch.equal(torch.isneginf(st["logprobs"].cpu()), out)
    if kw.get("mask_outside", True):  # outside the kept set: out of the loss, no gradient
        live = x["mask"] & (x["labels"] != -100) & ~out
        assert (grads[0].cpu()[~live] == 0).all()
    return st


@pytest.mark.parametrize(
    "backend,setting,sampler,budget",
    _cases(sorted(POLICY_SETTINGS), [None, PSMALL], [("per_token_temperature", "vllm", PSMALL)]),
)  # fmt: skip
def test_policy_matches_float64(backend, setting, sampler, budget):
    """Each setting, both samplers, one block and several; an entropy bonus."""
    require("linear_policy_loss", backend)
    x = _policy_inputs()
    st = _policy_check(x, backend, sampler=sampler, max_chunk_bytes=budget, entropy_coef=0.01,
                       **POLICY_SETTINGS[setting])  # fmt: skip
    if setting not in ("temperature_tensor_only", "topp"):
        assert int(st["num_outside"]) > 0  # the argmin labels fall outside


# (loss options, the sampler's setting): a clipped type with a KL term to given reference
# log-probs and another aggregation, a sequence-level type (a ratio over the row), a row statistic
# (per-row advantages)
POLICY_TYPES = {
    "ppo-k3-all": (
        dict(loss_type="ppo", dual_clip=3.0, agg="seq-mean-token-mean", kl_coef=0.1,
             kl_estimator="k3"), "all",
    ),
    "gspo-per_row": (dict(loss_type="gspo"), "per_row"),
    "geo_mean-per_token_temperature": (dict(loss_type="geo_mean"), "per_token_temperature"),
}  # fmt: skip


@pytest.mark.parametrize(
    "backend,case,sampler,budget",
    _cases(sorted(POLICY_TYPES), [None, PSMALL], []),
)
def test_policy_loss_types(backend, case, sampler, budget):
    """Sequence and row statistics, a KL term: all on the tokens left in the mask."""
    require("linear_policy_loss", backend)
    kw, setting = POLICY_TYPES[case]
    x = _policy_inputs(seed=1, per_row_adv=kw["loss_type"] == "geo_mean")
    if "kl_coef" in kw:
        kw = dict(kw, ref_logprobs=x["ref"])
    _policy_check(x, backend, sampler=sampler, max_chunk_bytes=budget, entropy_coef=0.02, **kw,
                  **POLICY_SETTINGS[setting])  # fmt: skip


@pytest.mark.parametrize("backend", GPU_TRITON)
def test_policy_mask_outside_off(backend):
    """mask_outside=False: the outside tokens stay in the loss with log-prob -inf (ppo's log-ratio
    clamp keeps it finite), the gradients stay finite."""
    require("linear_policy_loss", backend)
    x = _policy_inputs()
    st = _policy_check(x, backend, mask_outside=False, entropy_coef=0.01, max_chunk_bytes=PSMALL,
                       **POLICY_SETTINGS["topk"])  # fmt: skip
    assert int(st["num_outside"]) > 0


@pytest.mark.parametrize("backend", GPU_TRITON)
def test_policy_bf16(backend):
    """bf16 heads with float32 tiles: the reference sees the same rounded inputs."""
    require("linear_policy_loss", backend)
    x = _policy_inputs(dtype=torch.bfloat16, seed=2)
    _policy_check(x, backend, sampler="sglang", logits_dtype="float32", max_chunk_bytes=PSMALL * 2,
                  entropy_coef=0.01, **POLICY_SETTINGS["per_row"])  # fmt: skip


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("h_", [big(1024)])
def test_policy_production_vocabulary(backend, h_, sampler):
    """V=152064 (H=1024), bf16, 4 sequences of 16 tokens, the default chunk budget, grpo."""
    require("linear_policy_loss", backend)
    x = SL.policy_inputs(4, 16, h_, 152064, dtype=torch.bfloat16, seed=3, top=3)
    _policy_check(x, backend, most=3, sampler=sampler, logits_dtype="float32", loss_type="grpo",
                  entropy_coef=0.01, **BIG(4))  # fmt: skip
