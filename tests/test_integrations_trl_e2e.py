"""TRL 1.16's GRPOTrainer end to end and its GRPO loss computation, unpatched vs patched by
`ppo_kernels.integrations` (bench/e2e_trl.py holds the runs; the real trainer, a tiny random-init
Llama, a tokenizer built here, no download)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import sys
import tempfile

import pytest
import torch

import ppo_kernels.integrations as pki

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def e2e():
    for dist in ("trl", "transformers", "tokenizers", "datasets", "pandas", "pyarrow"):
        try:  # a distribution, not an importable name: tests/_peer_stubs.py may stand in for some
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(
                f"{dist} is not installed: GRPOTrainer needs it (scripts/dev.sh installs it)"
            )
    try:
        importlib.import_module("trl.trainer.grpo_trainer")
    except ImportError as e:
        pytest.skip(f"trl's GRPOTrainer does not import here: {e}")
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
    import e2e_trl
    import transformers

    transformers.logging.set_verbosity_error()  # weight-loading progress bars
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits on a shared machine
    yield e2e_trl
    torch.set_num_threads(threads)
    pki.revert("trl")


def _close(a, b, rtol=RTOL, atol=1e-8):
    return all(abs(x - y) <= atol + rtol * abs(x) for x, y in zip(a, b, strict=True))


def _check_replaced(rep, at_least):
    """Our ops ran: whichever TRL functions the trainer reached (the fused head's
    ChunkedLogProbFunction, or a patched caller), every call replaced, none fallen back."""
    funcs = rep["functions"]
    assert sum(s["replaced"] for s in funcs.values()) >= at_least, funcs
    assert all(s["replaced"] == s["calls"] for s in funcs.values()), funcs


@pytest.mark.parametrize("config", ["default", "kl"])
def test_grpo_trainer_end_to_end(e2e, config):
    """GRPOTrainer.train() for 3 steps from the same seed: the same completions sampled, per-step
    losses and gradient norms within 1e-5, final parameters within 1e-5, and our op ran."""
    u = e2e.run(config, steps=3, vocab=256)
    p = e2e.run(config, steps=3, vocab=256, patched=True)
    assert len(u["completions"]) >= 8 and u["completions"] == p["completions"]
    assert len(u["losses"]) == 3 and _close(u["losses"], p["losses"]), (u["losses"], p["losses"])
    assert _close(u["grad_norms"], p["grad_norms"]), (u["grad_norms"], p["grad_norms"])
    assert u["moved"] > 1e-4  # the run trained
    torch.testing.assert_close(p["params"], u["params"], rtol=1e-5, atol=1e-5)
    _check_replaced(p["report"], 3)  # per step: the policy's forward (+ "kl": old, reference)


def _batch(vocab, B=4, P=5, C=7, seed=3):
    """A prepared GRPO batch as _generate_and_score_completions hands it to compute_loss: prompts
    left-padded, completions ending at different lengths, an advantage per completion."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_ids[1, :2] = 0
    completion_ids = torch.randint(3, vocab, (B, C), generator=g)
    lengths = torch.tensor([C, 3, 5, 1])
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


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_grpo_loss_computation(e2e, case):
    """GRPOTrainer's own loss computation on a prepared batch: the old policy's and the reference
    model's log-probs (its _get_per_token_logps_and_entropies, without gradient), then
    compute_loss -> _compute_loss (log-probs and entropy through the fused LM head, the loss of
    `loss_type`, KL, entropy bonus, metrics). Loss, metrics and every parameter's gradient agree
    patched vs unpatched."""
    vocab = 96
    inputs, old_shift = _batch(vocab)
    with tempfile.TemporaryDirectory() as d:
        e2e.save_model(d, vocab)
        tr = e2e.trainer(d, vocab, **LOSS_CASES[case])
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # what the training loop sets before compute_loss
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].size(1)

    def loss_and_grads():
        batch = dict(inputs)
        with torch.no_grad():
            old, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, attn, C)
            batch["old_per_token_logps"] = old + old_shift  # ratios away from 1, some clipped
            if tr.ref_model is not None:
                batch["ref_per_token_logps"] = tr._get_per_token_logps_and_entropies(
                    tr.ref_model, ids, attn, C
                )[0]
        tr._metrics["train"].clear()
        tr.model.zero_grad()
        loss = tr.compute_loss(tr.model, batch)
        loss.backward()
        grads = [p.grad.clone() for p in tr.model.parameters()]
        return loss.detach(), dict(tr._metrics["train"]), grads, batch

    ref = loss_and_grads()
    with pki.patched("trl"):
        got = loss_and_grads()
        rep = pki.report("trl")
    _check_replaced(rep, 2)
    for k in ("old_per_token_logps", "ref_per_token_logps"):
        if k in ref[3]:
            torch.testing.assert_close(got[3][k], ref[3][k], rtol=RTOL, atol=ATOL)
    assert ref[0].abs() > 1e-4  # a loss that can differ
    torch.testing.assert_close(got[0], ref[0], rtol=RTOL, atol=ATOL)
    assert ref[1].keys() == got[1].keys() and "entropy" in ref[1]
    for k in ref[1]:
        assert _close(ref[1][k], got[1][k], atol=ATOL), (k, ref[1][k], got[1][k])
    assert any(g.abs().max() > 0 for g in ref[2])
    for a, b in zip(ref[2], got[2]):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
