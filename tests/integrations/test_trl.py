"""ppo_kernels.integrations for TRL 1.16.x: the real TRL functions, patched vs unpatched."""

from __future__ import annotations

import pytest
import torch
from support.integration import compare
from support.peer_stubs import import_peer
from support.skips import need

import ppo_kernels.integrations as pki


@pytest.fixture(scope="module")
def trl():
    utils = import_peer("trl.trainer.utils")
    chunked = import_peer("trl.kernels.chunked_logprob")
    yield utils, chunked
    pki.revert("trl")


def _logits(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    y = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return x, y, g


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selective_log_softmax_and_entropy(trl, temperature):
    utils, _ = trl
    x, y, g = _logits((3, 5, 40))
    x.requires_grad_(True)
    row_mask = (torch.rand(3, 5, generator=g) > 0.3).long()
    compare("trl", lambda: utils.selective_log_softmax, x, y, temperature)
    compare("trl", lambda: utils.selective_log_softmax, x, y, temperature, row_mask=row_mask)
    compare("trl", lambda: utils.entropy_from_logits, x)
    for rg in (True, False):
        compare(
            "trl",
            lambda: utils.selective_log_softmax_and_entropy,
            x,
            y,
            entropy_requires_grad=rg,
            temperature=temperature,
            row_mask=row_mask,
            grad_of=lambda o, rg=rg: o[0] + o[1] if rg else o[0],
        )


def test_float64(trl):
    utils, _ = trl
    x, y, _ = _logits((4, 30), dtype=torch.float64)
    compare("trl", lambda: utils.selective_log_softmax, x.requires_grad_(True), y)


def test_topk_index_unsupported(trl):
    utils, _ = trl
    x, y, _ = _logits((4, 30))
    k = torch.stack([y, y], -1)
    with pki.patched("trl"), pytest.raises(pki.Unsupported, match="'index'.*top-K"):
        utils.selective_log_softmax(x, k)
    ref = utils.selective_log_softmax(x, k)
    with pki.patched("trl", strict=False):
        torch.testing.assert_close(utils.selective_log_softmax(x, k), ref)
        assert (
            pki.report("trl")["functions"]["trl.trainer.utils.selective_log_softmax"]["fallbacks"]
            == 1
        )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy")])
@pytest.mark.parametrize("scale,cap", [(1.0, None), (0.5, None), (1.0, 2.0)])
def test_chunked_logprob_function(trl, bias, outputs, scale, cap):
    utils, chunked = trl
    g = torch.Generator().manual_seed(2)
    N, H, V = 13, 16, 70
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.3).requires_grad_(True)
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    get = lambda: utils._ChunkedLogProbFunction.apply
    compare(
        "trl",
        lambda: get(),
        h,
        w,
        b,
        y,
        0.8,
        32,
        cap,
        scale,
        outputs,
        grad_of=lambda o: o[0] + (o[1] if o[1] is not None else 0),
    )


def test_chunked_unsupported_outputs_and_scaled_softcap(trl):
    utils, _ = trl
    h, w, y = torch.randn(3, 4), torch.randn(10, 4), torch.randint(0, 10, (3,))
    with pki.patched("trl"):
        with pytest.raises(pki.Unsupported, match="logit_scale"):
            utils._ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 8, 30.0, 0.5, ("log_probs",))
        with pytest.raises(pki.Unsupported, match="'outputs'.*is_top1"):
            utils._ChunkedLogProbFunction.apply(
                h, w, None, y, 1.0, 8, None, 1.0, ("log_probs", "is_top1")
            )


def test_fused_lm_head_model(trl):
    """TRL's add_fused_lm_head on a tiny random-init Llama: model(..., fused_lm_head=True)."""
    utils, _ = trl
    transformers = need("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100

    def run():
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone()

    ref = run()
    with pki.patched("trl"):
        got = run()
        s = pki.report("trl")["functions"]["trl.kernels.chunked_logprob.ChunkedLogProbFunction"]
        assert s["replaced"] == 1, s
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
