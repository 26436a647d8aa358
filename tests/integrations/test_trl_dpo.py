"""TRL 1.16's DPOTrainer loss computation, unpatched vs patched by `ppo_kernels.integrations`:
the real trainer on a tiny random-init Llama (bench/e2e_trl.py's model and tokenizer, no
download), its `_compute_loss` on a prepared batch of chosen / rejected rows. Patched, the loss
is one linear_preference_loss pass over the captured hidden states of the policy and the
reference model; the loss, every logged metric and every parameter's gradient must agree."""

from __future__ import annotations

import tempfile

import pytest
import torch
from support.peers import trl_trainer_env

import ppo_kernels.integrations as pki

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 96
COMPUTE_LOSS = "trl.trainer.dpo_trainer.DPOTrainer._compute_loss"


@pytest.fixture(scope="module")
def e2e():
    yield from trl_trainer_env("trl.trainer.dpo_trainer")


def _trainer(e2e, **overrides):
    """DPOTrainer on the saved tiny model (its reference model: a copy TRL loads), a 2-pair
    dataset it tokenizes (never iterated: the batch below is handed to _compute_loss)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = {
        "prompt": ["t3 t4 t5", "t6 t7 t8"],
        "chosen": [" t9 t10", " t11 t12 t13"],
        "rejected": [" t14", " t15 t16"],
    }
    with tempfile.TemporaryDirectory() as d:
        e2e.save_model(d, VOCAB)
        args = DPOConfig(
            output_dir=d + "/out",
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=2,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            **overrides,
        )
        tr = DPOTrainer(
            model=d,
            args=args,
            train_dataset=Dataset.from_dict(data),
            processing_class=e2e.tokenizer(VOCAB),
        )
    tr.model.train()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # the policy away from its reference: rewards and margins not 0
        for p in tr.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return tr


def _batch(P=3, prompt=4, C=6, seed=3):
    """A collated DPO batch: P chosen rows then P rejected rows, each a prompt and a completion
    of its own length, right-padded; completion_mask marks the completion tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([C, 2, 4, 5, 1, C])[: 2 * P]
    L = prompt + C
    ids = torch.randint(3, VOCAB, (2 * P, L), generator=g)
    pos = torch.arange(L)
    attn = (pos < prompt + lengths[:, None]).long()
    comp = ((pos >= prompt) & (attn == 1)).long()
    ids = ids.masked_fill(attn == 0, 0)
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp}


def _loss_metrics_grads(tr, inputs):
    tr._metrics["train"].clear()
    tr._metrics["eval"].clear()
    tr._total_train_tokens = 0  # a running count the metrics report
    tr.model.zero_grad()
    loss = tr._compute_loss(tr.model, dict(inputs), False)
    loss.backward()
    grads = [p.grad.clone() for p in tr.model.parameters()]
    return loss.detach(), {**tr._metrics["train"], **tr._metrics["eval"]}, grads


def _close(a, b, rtol=RTOL, atol=ATOL):
    return all(x == y or abs(x - y) <= atol + rtol * abs(x) for x, y in zip(a, b, strict=True))


def _compare(tr, inputs, fallback=None):
    """Unpatched vs patched (strict unless a fallback is expected): loss, metrics, gradients; the
    report shows our op ran (or TRL's own code, counted with the argument it names)."""
    ref = _loss_metrics_grads(tr, inputs)
    with pki.patched("trl", strict=fallback is None):
        got = _loss_metrics_grads(tr, inputs)
        rep = pki.report("trl")
    s = rep["functions"][COMPUTE_LOSS]
    assert s["calls"] == 1, s
    if fallback is None:
        assert s["replaced"] == 1, s
    else:
        assert s["fallbacks"] == 1 and all(
            r.startswith(f"{fallback}:") for r in s["fallback_reasons"]
        ), s
        with pki.patched("trl"), pytest.raises(pki.Unsupported, match=f"'{fallback}'"):
            _loss_metrics_grads(tr, inputs)
    assert ref[0].abs() > 1e-4  # a loss that can differ
    assert abs(ref[1]["rewards/margins"][0]) > 1e-4  # the policy is not its reference
    torch.testing.assert_close(got[0], ref[0], rtol=RTOL, atol=ATOL)
    assert ref[1].keys() == got[1].keys() and "mean_token_accuracy" in ref[1]
    for k in ref[1]:
        assert _close(ref[1][k], got[1][k]), (k, ref[1][k], got[1][k])
    assert any(g.abs().max() > 0 for g in ref[2])
    for a, b in zip(ref[2], got[2], strict=True):  # (atol at the scale of the loss's gradients)
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL * max(1.0, a.abs().max().item()))
    return rep


# DPOConfig overrides: every loss type TRL 1.16 offers, weighted combinations, the f-divergences
CASES = {
    "sigmoid": {},
    "hinge": {"loss_type": ["hinge"], "beta": 0.5},
    "ipo": {"loss_type": ["ipo"]},
    "exo_pair": {"loss_type": ["exo_pair"], "label_smoothing": 0.1},
    "nca_pair": {"loss_type": ["nca_pair"]},
    "robust": {"loss_type": ["robust"], "label_smoothing": 0.2},
    "bco_pair": {"loss_type": ["bco_pair"]},
    "sppo_hard": {"loss_type": ["sppo_hard"]},
    "aot": {"loss_type": ["aot"], "label_smoothing": 0.1},
    "aot_unpaired": {"loss_type": ["aot_unpaired"]},
    "apo_zero": {"loss_type": ["apo_zero"]},
    "apo_down": {"loss_type": ["apo_down"]},
    "discopop": {"loss_type": ["discopop"], "discopop_tau": 0.1},
    "sigmoid_norm": {"loss_type": ["sigmoid_norm"]},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js_divergence": {"f_divergence_type": "js_divergence", "loss_type": ["hinge"]},
    "alpha_divergence": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
    "ld_alpha": {"ld_alpha": 0.5},
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_loss_computation(e2e, case):
    tr = _trainer(e2e, **CASES[case])
    _compare(tr, _batch())


def test_dpo_precomputed_reference(e2e):
    """precompute_ref_log_probs: the batch brings the reference's sequence log-probs."""
    tr = _trainer(e2e, precompute_ref_log_probs=True)
    inputs = _batch()
    g = torch.Generator().manual_seed(7)
    inputs["ref_chosen_logps"] = -20 + torch.randn(3, generator=g)
    inputs["ref_rejected_logps"] = -20 + torch.randn(3, generator=g)
    _compare(tr, inputs)


def test_dpo_eval_mode(e2e):
    tr = _trainer(e2e, loss_type=["sigmoid", "sft"])
    tr.model.eval()
    _compare(tr, _batch())


def test_dpo_weighting_falls_back(e2e):
    """WPO's weights need log sum_v p_v^2 per token: TRL's own code, named."""
    tr = _trainer(e2e, use_weighting=True)
    _compare(tr, _batch(), fallback="use_weighting")
