"""causal_lm_logprobs on small random-init transformers models (built from configs, no downloads)
against the model's own logits + log_softmax, values and gradients."""

import pytest
import torch
from support.skips import need

import ppo_kernels

transformers = need("transformers")

VOCAB = 101  # odd, not a multiple of anything


def _llama_like(config_cls, model_cls, tied):
    """A tiny random Llama-style model (Llama and Qwen2 share these config fields)."""
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return model_cls(cfg)


def _llama(tied):
    return _llama_like(transformers.LlamaConfig, transformers.LlamaForCausalLM, tied)


def _qwen2(tied):
    return _llama_like(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, tied)


def _gpt2(tied):
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=24,
        n_layer=2,
        n_head=2,
        n_positions=64,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}


def _build(name, tied):
    torch.manual_seed(0)
    model = MODELS[name](tied).float().eval()
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head is emb) == tied or (head.data_ptr() == emb.data_ptr()) == tied
    return model


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def _ref(model, ids, mask, temperature):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double() / temperature
    logp = logits.log_softmax(-1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    keep = mask[:, 1:] == 1
    return lp * keep, ent * keep


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tied", [False, True])
def test_matches_model_logits_and_gradients(name, tied):
    model = _build(name, tied)
    ids, mask = _batch()
    temperature = 0.8
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g)

    ref_lp, ref_ent = _ref(model, ids, mask, temperature)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    for budget in (None, 3000):  # whole-vocabulary tiles, and vocabulary chunks
        lp, ent = ppo_kernels.causal_lm_logprobs(
            model, ids, mask, temperature=temperature, return_entropy=True, max_chunk_bytes=budget
        )
        assert lp.shape == ent.shape == (2, 10) and lp.dtype == torch.float32
        torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
        assert (lp[1, :2] == 0).all()  # targets under the padding mask are ignored
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        for n, p in model.named_parameters():
            assert p.grad is not None, n
            torch.testing.assert_close(
                p.grad, ref_grads[n].float(), atol=2e-5, rtol=1e-3, msg=lambda m: f"{n}: {m}"
            )
        model.zero_grad(set_to_none=True)


def test_labels_argument_uses_hf_convention():
    model = _build("llama", False)
    ids, mask = _batch()
    labels = ids.clone()
    labels[0, 4:7] = -100  # e.g. prompt tokens
    lp = ppo_kernels.causal_lm_logprobs(model, ids, labels=labels)
    full = ppo_kernels.causal_lm_logprobs(model, ids)
    assert (lp[0, 3:6] == 0).all()
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(lp[keep], full[keep])


def test_bias_on_the_lm_head():
    model = _build("llama", False)
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.randn(VOCAB) * 0.5)
    ids, mask = _batch()
    ref_lp, _ = _ref(model, ids, mask, 1.0)
    lp = ppo_kernels.causal_lm_logprobs(model, ids, mask)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    lp.sum().backward()
    assert head.bias.grad is not None and head.bias.grad.abs().sum() > 0


def test_final_logit_softcapping():
    """Gemma 2 soft-caps its logits: the same numbers as the model's own (capped) logits."""
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        final_logit_softcapping=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).float()
    ids, mask = _batch()
    ref_lp, _ = _ref(model, ids, mask, 0.7)
    lp = ppo_kernels.causal_lm_logprobs(model, ids, mask, temperature=0.7)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    cfg.final_logit_softcapping = None  # the cap (0.5: it matters) really was applied
    assert not torch.allclose(ppo_kernels.causal_lm_logprobs(model, ids, mask, temperature=0.7), lp)


def test_model_without_head_is_refused():
    model = _build("llama", False).model  # the bare backbone: no LM head
    ids, _ = _batch()
    with pytest.raises(ValueError, match="LM head"):
        ppo_kernels.causal_lm_logprobs(model, ids)


def test_bad_shapes():
    model = _build("gpt2", True)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="input_ids"):
        ppo_kernels.causal_lm_logprobs(model, ids[0])
    with pytest.raises(ValueError, match="attention_mask"):
        ppo_kernels.causal_lm_logprobs(model, ids, mask[:, :-1])


@pytest.mark.parametrize("name,tied", [("llama", False), ("gpt2", True)])
def test_input_logits_dtype_matches_the_bf16_models_own_logits(name, tied):
    """logits_dtype="input" on a bf16 model: the LM head runs in bf16 as the model's own logits
    do, so log-probs, entropy and every parameter gradient match model(...).logits + token_logprobs."""
    torch.manual_seed(0)
    model = MODELS[name](tied).bfloat16().eval()
    ids, mask = _batch()
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g)
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    assert logits.dtype == torch.bfloat16
    ref_lp, ref_ent = ppo_kernels.token_logprobs(
        logits, target, temperature=0.8, return_entropy=True
    )
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    for budget in (None, 3000):  # whole-vocabulary tiles, and vocabulary chunks
        lp, ent = ppo_kernels.causal_lm_logprobs(
            model,
            ids,
            mask,
            temperature=0.8,
            return_entropy=True,
            max_chunk_bytes=budget,
            logits_dtype="input",
        )
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=2e-5)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        for n, p in model.named_parameters():
            # bf16 partial sums per chunk are the only difference in the head (see
            # test_linear_logprobs); the bf16 backbone's backward then carries it a few ulps on
            scale = ref_grads[n].float().abs().max().item()
            torch.testing.assert_close(
                p.grad.float(),
                ref_grads[n].float(),
                rtol=0,
                atol=8 * torch.finfo(torch.bfloat16).eps * scale,
                msg=lambda m: f"{n}: {m}",
            )
        model.zero_grad(set_to_none=True)


SAMPLER_CASES = {
    # per-sequence temperatures and top-k under vLLM's rules
    "rows-topk-vllm": lambda g: dict(
        temperature=torch.tensor([0.7, 1.3]), top_k=5, sampler="vllm", stats=("outside",)
    ),
    # per-position temperatures, per-row top-p, min-p under SGLang's rules, the head's statistics
    "tokens-topp-minp-sglang": lambda g: dict(
        temperature=torch.rand(2, 10, generator=g) + 0.5,
        top_p=torch.tensor([0.8, 0.95]),
        min_p=0.02,
        sampler="sglang",
        stats=("outside", "lse", "topk"),
        stats_top_k=3,
    ),
}


@pytest.mark.parametrize("case", sorted(SAMPLER_CASES))
def test_sampler_options_match_token_logprobs_on_the_models_logits(case):
    """The sampler's options through the LM head: what token_logprobs gives with the same options
    on model(input_ids).logits[:, :-1] -- values, statistics and every parameter gradient."""
    model = _build("llama", False)
    ids, mask = _batch()
    g = torch.Generator().manual_seed(5)
    opts = SAMPLER_CASES[case](g)
    g_lp, g_ent = torch.randn(2, 10, generator=g), torch.randn(2, 10, generator=g)
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    def loss(lp, ent):  # a label outside the kept set has log-prob -inf and no gradient
        return (torch.where(lp.isfinite(), lp, 0.0) * g_lp).sum() + (ent * g_ent).sum()

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    ref_lp, ref_ent, ref_st = ppo_kernels.token_logprobs(
        logits, target, return_entropy=True, **opts
    )
    loss(ref_lp, ref_ent).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    lp, ent, st = ppo_kernels.causal_lm_logprobs(model, ids, mask, return_entropy=True, **opts)
    assert ref_st.num_outside > 0 or case != "rows-topk-vllm"  # the truncation bites
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    for name in ("outside", "num_outside", "lse", "top_ids", "top_logprobs"):
        a, b = getattr(st, name), getattr(ref_st, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    loss(lp, ent).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad, ref_grads[n], atol=2e-5, rtol=1e-3, msg=lambda m: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(temperature=torch.ones(2, 11)), "temperature"),  # [B, T]: ambiguous alignment
        (dict(temperature=torch.tensor([1.0, 0.0])), "temperature"),
        (dict(top_k=torch.ones(3, dtype=torch.long)), "top_k"),
        (dict(top_p=torch.tensor([0.5, 1.5])), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(top_k=2, sampler="hf"), "sampler"),
        (dict(stats=("entropy",)), "stats"),
        (dict(stats_top_k=2), "stats_top_k"),
    ],
)
def test_sampler_arguments_are_checked_before_the_backbone(kwargs, arg):
    model = _build("gpt2", True)
    ids, mask = _batch()

    def refuse(*a, **k):
        raise AssertionError("the backbone ran before the arguments were checked")

    model.transformer.forward = refuse
    with pytest.raises(ValueError, match=arg):
        ppo_kernels.causal_lm_logprobs(model, ids, mask, **kwargs)
