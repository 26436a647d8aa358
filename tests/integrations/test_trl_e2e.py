"""TRL 1.16's GRPOTrainer end to end and its GRPO loss computation, unpatched vs patched by
`ppo_kernels.integrations` (bench/e2e_trl.py holds the runs; the real trainer, a tiny random-init
Llama, a tokenizer built here, no download)."""

from __future__ import annotations

import importlib
import importlib.metadata
import tempfile

import pytest
import torch
from support.peers import trl_trainer_env

import ppo_kernels.integrations as pki

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def e2e():
    yield from trl_trainer_env("trl.trainer.grpo_trainer")


def _close(a, b, rtol=RTOL, atol=1e-8):
    return all(x == y or abs(x - y) <= atol + rtol * abs(x) for x, y in zip(a, b, strict=True))


COMPUTE_LOSS = "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss"


def _check_replaced(rep, at_least, loss_fallback=None):
    """Our ops ran: whichever TRL functions the trainer reached (the fused head's
    ChunkedLogProbFunction, or a patched caller), every call replaced, none fallen back; the
    GRPO loss computation too, or (loss_fallback: the argument) TRL's own, counted."""
    funcs = dict(rep["functions"])
    assert sum(s["replaced"] for s in funcs.values()) >= at_least, funcs
    if loss_fallback is not None:
        s = funcs.pop(COMPUTE_LOSS)
        assert s["calls"] == s["fallbacks"] >= 1 and s["replaced"] == 0, s
        assert all(r.startswith(f"{loss_fallback}:") for r in s["fallback_reasons"]), s
    assert all(s["replaced"] == s["calls"] for s in funcs.values()), funcs


# (bench/e2e_trl.py's configuration, overrides, the argument of the loss's fallback or None)
E2E_CASES = {
    "default": ("default", {}, None),
    # TRL's default use_bias_correction_kl with old log-probs (num_iterations 2): TRL's loss
    "kl": ("kl", {}, "use_bias_correction_kl"),
    "kl-fused": ("kl", {"loss_type": "bnpo", "use_bias_correction_kl": False}, None),
}


@pytest.mark.parametrize("case", list(E2E_CASES))
def test_grpo_trainer_end_to_end(e2e, case):
    """GRPOTrainer.train() for 3 steps from the same seed: the same completions sampled, per-step
    losses and gradient norms within 1e-5, final parameters within 1e-5, and our op ran."""
    name, overrides, loss_fallback = E2E_CASES[case]
    config = {**e2e.CONFIGS[name], **overrides}
    u = e2e.run(config, steps=3, vocab=256)
    p = e2e.run(config, steps=3, vocab=256, patched=True)
    assert len(u["completions"]) >= 8 and u["completions"] == p["completions"]
    assert len(u["losses"]) == 3 and _close(u["losses"], p["losses"]), (u["losses"], p["losses"])
    assert _close(u["grad_norms"], p["grad_norms"]), (u["grad_norms"], p["grad_norms"])
    assert u["moved"] > 1e-4  # the run trained
    torch.testing.assert_close(p["params"], u["params"], rtol=1e-5, atol=1e-5)
    # per step: the policy's forward (+ "kl": old, reference) and the loss
    _check_replaced(p["report"], 3, loss_fallback)
    if loss_fallback is None:
        assert p["report"]["functions"][COMPUTE_LOSS]["replaced"] >= 3


def _batch(vocab, B=4, P=5, C=7, seed=3, equal=False):
    """A prepared GRPO batch as _generate_and_score_completions hands it to compute_loss: prompts
    left-padded, completions ending at different lengths (equal: all C long), an advantage per
    completion."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_ids[1, :2] = 0
    completion_ids = torch.randint(3, vocab, (B, C), generator=g)
    lengths = torch.full((B,), C) if equal else torch.tensor([C, 3, 5, 1])
    completion_mask = (torch.arange(C) < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = 0
    completion_ids[torch.arange(B), lengths - 1] = 1  # eos
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }, 0.3 * torch.randn(B, C, generator=g)


# GRPOConfig overrides; the TRL defaults that matter: loss "dapo", beta 0, use_bias_correction_kl
LOSS_CASES = {
    "dapo": {},
    "grpo-kl-entropy": {"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01},
    "bnpo": {"loss_type": "bnpo", "temperature": 0.7},
    "dr_grpo-kl": {"loss_type": "dr_grpo", "beta": 0.1},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.2},
    "sapo": {"loss_type": "sapo"},
    "gspo": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "top-entropy": {"top_entropy_quantile": 0.5, "entropy_coef": 0.02},
}
# where TRL's GRPOTrainer._compute_loss keeps its own code (the argument the fallback names)
LOSS_FALLBACKS = {
    "grpo-kl-entropy": "use_bias_correction_kl",  # the KL times the ratio, with old log-probs
    "dr_grpo-kl": "use_bias_correction_kl",
}
# more configurations: (GRPOConfig overrides, how the batch and the call are set up)
MORE_LOSS_CASES = {
    "grpo-kl": ({"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False}, {}),
    "grpo-entropy-accum": ({"loss_type": "grpo", "entropy_coef": 0.05}, {"accum": 2}),
    "grpo-kl-entropy-equal": (
        {"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01, "use_bias_correction_kl": False},
        {"equal": True},
    ),
    "grpo-kl-entropy-on-policy": (  # bias-corrected KL on-policy: k3's value, k2's gradient
        {"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01},
        {"equal": True, "on_policy": True},
    ),
    "bnpo-kl-entropy": (
        {"loss_type": "bnpo", "beta": 0.1, "entropy_coef": 0.03, "use_bias_correction_kl": False},
        {},
    ),
    "dr_grpo-kl-entropy-on-policy": (
        {"loss_type": "dr_grpo", "beta": 0.1, "entropy_coef": 0.03},
        {"on_policy": True},
    ),
    "dapo-entropy-accum": ({"entropy_coef": 0.05}, {"accum": 2}),
    "dapo-on-policy": ({}, {"on_policy": True}),
    "sapo-on-policy-entropy": ({"loss_type": "sapo", "entropy_coef": 0.02}, {"on_policy": True}),
    "cispo-on-policy": ({"loss_type": "cispo", "epsilon_high": 0.9}, {"on_policy": True}),
    "cispo-sequence": ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, {}),
    "gspo-on-policy": (
        {"importance_sampling_level": "sequence", "loss_type": "grpo"},
        {"on_policy": True},
    ),
    "luspo-sequence-entropy": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "entropy_coef": 0.02},
        {},
    ),
    "luspo-token-kl": ({"loss_type": "luspo", "beta": 0.1, "use_bias_correction_kl": False}, {}),
    "grpo-delta": ({"loss_type": "grpo", "delta": 1.1, "epsilon_high": 0.1}, {}),
    "bnpo-vllm-is-token-eval": ({"loss_type": "bnpo"}, {"is_ratio": "token", "eval": True}),
    "grpo-vllm-is-sequence-entropy": (
        {"loss_type": "grpo", "entropy_coef": 0.02},
        {"is_ratio": "sequence"},
    ),
    "top-entropy-grpo": ({"loss_type": "grpo", "top_entropy_quantile": 0.6}, {}),
    "grpo-kl-compact": (
        {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
        {"compact": True},
    ),
    "sapo-entropy-on-policy-compact": (
        {"loss_type": "sapo", "entropy_coef": 0.02},
        {"compact": True, "on_policy": True},
    ),
    "adaptive-entropy": (
        {"use_adaptive_entropy": True, "entropy_coef": 0.02, "entropy_target": 10.0},
        {"accum": 2},
    ),
    # TRL's own code (the argument the fallback names)
    "vespo": ({"loss_type": "vespo"}, {"fallback": "loss_type"}),
    "off-policy-mask": (
        {"off_policy_mask_threshold": 0.5},
        {"fallback": "off_policy_mask_threshold"},
    ),
    "grpo-kl-entropy-unequal": (
        {"loss_type": "grpo", "beta": 0.04, "entropy_coef": 0.01, "use_bias_correction_kl": False},
        {"fallback": "entropy_coef"},
    ),
    "top-entropy-sequence": (
        {"top_entropy_quantile": 0.5, "importance_sampling_level": "sequence"},
        {"fallback": "top_entropy_quantile"},
    ),
    "gspo-kl-on-policy": (
        {"importance_sampling_level": "sequence", "beta": 0.04},
        {"on_policy": True, "fallback": "use_bias_correction_kl"},
    ),
}


def _loss_trainer(e2e, vocab, config, accum=1, is_ratio=None):
    with tempfile.TemporaryDirectory() as d:
        e2e.save_model(d, vocab)
        tr = e2e.trainer(d, vocab, **config)
    tr.model.train()
    tr.current_gradient_accumulation_steps = accum  # what the training loop sets first
    if is_ratio:  # what a vLLM-generated batch brings (no vLLM here: the flags set by hand)
        tr.use_vllm = tr.vllm_importance_sampling_correction = True
    return tr


def _compare_loss(e2e, config, *, compact=False, **opts):
    """_compare_loss_once; compact: with TRL's fused head scoring only the completion positions
    (what it does on Triton devices: `hidden_states[mask]`), the rows our capture maps back."""
    if not compact:
        return _compare_loss_once(e2e, config, **opts)
    utils = importlib.import_module("trl.trainer.utils")
    use_triton = utils._use_triton
    utils._use_triton = lambda device: True
    try:
        return _compare_loss_once(e2e, config, **opts)
    finally:
        utils._use_triton = use_triton


def _compare_loss_once(
    e2e, config, *, fallback=None, on_policy=False, equal=False, accum=1, eval=False, is_ratio=None
):
    """GRPOTrainer's own loss computation on a prepared batch: the old policy's and the reference
    model's log-probs (its _get_per_token_logps_and_entropies, without gradient), then
    compute_loss -> _compute_loss (log-probs and entropy through the fused LM head, the loss of
    `loss_type`, KL, entropy bonus, metrics). Loss, metrics and every parameter's gradient agree
    patched vs unpatched; patched, _compute_loss ran linear_policy_loss (or, `fallback`, TRL's own
    code, counted with the argument it names; strict raises naming it)."""
    vocab = 96
    inputs, old_shift = _batch(vocab, equal=equal)
    tr = _loss_trainer(e2e, vocab, config, accum, is_ratio)
    if eval:
        tr.model.eval()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].size(1)
    if is_ratio:
        g = torch.Generator().manual_seed(5)
        shape = (4, C) if is_ratio == "token" else (4, 1)
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=g)

    def loss_and_grads():
        batch = dict(inputs)
        with torch.no_grad():
            if not on_policy:
                old, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, attn, C)
                batch["old_per_token_logps"] = old + old_shift  # ratios away from 1, some clipped
            if tr.ref_model is not None:
                ref = tr._get_per_token_logps_and_entropies(tr.ref_model, ids, attn, C)[0]
                batch["ref_per_token_logps"] = ref + 0.2 * old_shift.flip(0)  # a KL away from 0
        tr._metrics["train"].clear()
        tr._metrics["eval"].clear()
        tr.model.zero_grad()
        state = (tr.entropy_coef, tr._last_world_entropy)
        loss = tr.compute_loss(tr.model, batch)
        loss.backward()
        after = (tr.entropy_coef, tr._last_world_entropy)
        tr.entropy_coef, tr._last_world_entropy = state  # the adaptive update, undone
        tr._entropy_window_stats = None
        grads = [p.grad.clone() for p in tr.model.parameters()]
        return loss.detach(), {**tr._metrics["train"], **tr._metrics["eval"]}, grads, batch, after

    ref = loss_and_grads()
    with pki.patched("trl", strict=fallback is None):
        got = loss_and_grads()
        rep = pki.report("trl")
    s = rep["functions"]["trl.trainer.grpo_trainer.GRPOTrainer._compute_loss"]
    _check_replaced(rep, 2, fallback)
    if fallback is None:
        assert s["calls"] == s["replaced"] == 1, s
    else:
        assert s["calls"] == 1, s
        with pki.patched("trl"), pytest.raises(pki.Unsupported, match=f"'{fallback}'"):
            loss_and_grads()
    for k in ("old_per_token_logps", "ref_per_token_logps"):
        if k in ref[3]:
            torch.testing.assert_close(got[3][k], ref[3][k], rtol=RTOL, atol=ATOL)
    assert ref[0].abs() > 1e-4  # a loss that can differ
    torch.testing.assert_close(got[0], ref[0], rtol=RTOL, atol=ATOL)
    assert ref[1].keys() == got[1].keys() and "entropy" in ref[1]
    for k in ref[1]:
        assert _close(ref[1][k], got[1][k], atol=ATOL), (k, ref[1][k], got[1][k])
    assert _close(ref[4], got[4], atol=ATOL), (ref[4], got[4])
    assert any(g.abs().max() > 0 for g in ref[2])
    for a, b in zip(ref[2], got[2]):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    return rep


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_grpo_loss_computation(e2e, case):
    """The 8 configurations: TRL's compute_loss unpatched vs patched (see _compare_loss)."""
    _compare_loss(e2e, LOSS_CASES[case], fallback=LOSS_FALLBACKS.get(case))


@pytest.mark.parametrize("case", list(MORE_LOSS_CASES))
def test_grpo_loss_computation_more(e2e, case):
    """Aggregations with and without the entropy bonus, gradient accumulation, eval mode,
    on-policy (old_per_token_logps None: ratio 1), the bias-corrected KL, vLLM importance
    sampling, the entropy mask, the adaptive entropy coefficient; and the fallbacks."""
    config, opts = MORE_LOSS_CASES[case]
    _compare_loss(e2e, config, **opts)


def test_grpo_loss_head_not_captured(e2e):
    """A head the op cannot express (TRL's fused head scaling its logits before a soft-cap),
    found only in the forward: TRL's loss runs the forward again and is counted as a fallback
    (the head's own call too); strict raises naming the head's argument."""
    utils = importlib.import_module("trl.trainer.utils")
    vocab = 96
    inputs, old_shift = _batch(vocab)
    tr = _loss_trainer(e2e, vocab, {"loss_type": "bnpo"})
    tr.model.config.final_logit_softcapping, tr.model.config.logit_scale = 3.0, 0.5
    utils.add_fused_lm_head(tr.model, temperature=tr.temperature, outputs=("log_probs", "entropy"))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        old, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, attn, 7)
    inputs["old_per_token_logps"] = old + old_shift

    def loss_and_grads():
        tr.model.zero_grad()
        loss = tr.compute_loss(tr.model, dict(inputs))
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in tr.model.parameters()]

    ref = loss_and_grads()
    with pki.patched("trl", strict=False):
        got = loss_and_grads()
        fns = pki.report("trl")["functions"]
    s = fns[COMPUTE_LOSS]
    assert s["fallbacks"] == 1 and "not captured (logit_scale:" in next(iter(s["fallback_reasons"]))
    assert fns["trl.kernels.chunked_logprob.ChunkedLogProbFunction"]["fallbacks"] == 2
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    with pki.patched("trl"), pytest.raises(pki.Unsupported, match="'logit_scale'"):
        loss_and_grads()
