"""The peers' callers that want both log-probs and entropy of the same logits, patched vs unpatched
on a tiny random-init Llama: verl 0.9's FSDPEngineWithLMHead.prepare_model_outputs, OpenRLHF
0.11's Actor.forward (one token_logprobs pass for both), TRL 1.16's GRPO per-token path (already
one fused LM head call). Outputs, dtypes and model gradients agree to the float32 tolerance of the
per-function tests; the caller ran one fused pass and the per-function replacements were not
called."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch
from _integration_utils import ATOL, RTOL
from _peer_stubs import import_peer

import ppo_kernels as pk
import ppo_kernels.integrations as pki

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
V = 48


def _llama(seed=0):
    pytest.importorskip("transformers")
    from e2e_trl import tiny_llama  # bench/

    return tiny_llama(V, seed)


@contextlib.contextmanager
def _passes():
    """The return_entropy flag of every ppo_kernels.token_logprobs call."""
    calls, real = [], pk.token_logprobs

    def counted(*a, **k):
        calls.append(bool(k.get("return_entropy", False)))
        return real(*a, **k)

    pk.token_logprobs = counted
    try:
        yield calls
    finally:
        pk.token_logprobs = real


def _grads(model, outs):
    model.zero_grad()
    loss = sum(
        (o.float() * torch.linspace(0.5, 1.5, o.numel()).reshape(o.shape)).sum()
        for o in outs
        if o.requires_grad
    )
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _compare(peer, model, run, *, strict=True):
    """run() -> output tensors. Unpatched, then patched: same outputs (dtype included) and model
    gradients. Returns (report, the return_entropy flags of the token_logprobs calls)."""
    ref = run()
    gref = _grads(model, ref)
    with pki.patched(peer, strict=strict), _passes() as calls:
        got = run()
        ggot = _grads(model, got)
        rep = pki.report(peer)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b.detach().double(), a.detach().double(), rtol=RTOL, atol=ATOL)
    assert len(gref) == len(ggot) > 0
    for a, b in zip(gref, ggot):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    return rep["functions"], calls


def _one_pass(fns, caller, unfused, calls):
    """The caller replaced once, one token_logprobs pass with entropy, the per-function
    replacements of the two unfused calls never reached."""
    assert fns[caller]["replaced"] == 1 and fns[caller]["fallbacks"] == 0, fns[caller]
    assert calls == [True]
    for name in unfused:
        assert fns[name]["calls"] == 0, (name, fns[name])


# ------------------------------------------------------------------ verl 0.9


class _MicroBatch(dict):
    """What verl's engine reads of its TensorDict micro-batch (tensordict is cluster-only)."""

    @property
    def batch_size(self):
        return torch.Size([self["input_ids"].size(0)])


@pytest.fixture(scope="module")
def verl_engine():
    ti = import_peer("verl.workers.engine.fsdp.transformer_impl")
    tf = import_peer("verl.utils.torch_functional")
    yield ti, tf
    pki.revert("verl")


VERL_CALLER = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs"
VERL_UNFUSED = (
    "verl.utils.torch_functional.logprobs_from_logits",
    "verl.utils.torch_functional.entropy_from_logits",
    "verl.utils.torch_functional.entropy_from_logits_with_chunking",
)


def _verl_setup(ti, tf, *, chunked=False, checkpointing=False, bucket=0):
    eng = object.__new__(ti.FSDPEngineWithLMHead)
    eng.engine_config = types.SimpleNamespace(
        entropy_from_logits_with_chunking=chunked,
        entropy_checkpointing=checkpointing,
        entropy_from_logits_chunk_size=5,
    )
    # as FSDPEngine.__init__ captures it (without torch.compile)
    eng.compute_entropy_from_logits = (
        tf.entropy_from_logits_with_chunking if chunked else tf.entropy_from_logits
    )
    eng.pad_to_length, eng.pad_to_length_bucket = bucket > 0, bucket
    eng.use_ulysses_sp = False
    eng.module = _llama()
    return eng


def _verl_batch(temperature, **flags):
    g = torch.Generator().manual_seed(3)
    lens = [5, 9, 3]
    ids = [torch.randint(0, V, (n,), generator=g) for n in lens]
    nested = torch.nested.nested_tensor(ids, layout=torch.jagged)
    pos = torch.nested.nested_tensor([torch.arange(n) for n in lens], layout=torch.jagged)
    return _MicroBatch(
        input_ids=nested, position_ids=pos, temperature=temperature, calculate_entropy=True, **flags
    )


def _verl_run(eng, mb):
    """verl's FSDPEngineWithLMHead.forward_step without the FSDP / autocast / loss plumbing."""

    def run():
        inputs, args = eng.prepare_model_inputs(micro_batch=mb)
        raw = eng.module(**inputs, use_cache=False)
        out = eng.prepare_model_outputs(
            output=raw, output_args=args, micro_batch=mb, logits_processor_func=None
        )
        return [out[k].values() for k in ("log_probs", "entropy") if k in out]

    return run


@pytest.mark.parametrize("temperature", [1.0, 0.7, "per-sample"])
@pytest.mark.parametrize("chunked", [False, True])
def test_verl_prepare_model_outputs(verl_engine, temperature, chunked):
    ti, tf = verl_engine
    if temperature == "per-sample":
        temperature = torch.tensor([0.6, 1.0, 1.3])
    eng = _verl_setup(ti, tf, chunked=chunked, bucket=8)  # a packed-length pad of 7 tokens
    fns, calls = _compare("verl", eng.module, _verl_run(eng, _verl_batch(temperature)))
    _one_pass(fns, VERL_CALLER, VERL_UNFUSED, calls)
    assert eng.compute_entropy_from_logits in (
        tf.entropy_from_logits,
        tf.entropy_from_logits_with_chunking,
    )  # the engine's own attribute is back


def test_verl_nothing_to_fuse(verl_engine):
    """calculate_entropy=False: verl's code runs (its log-prob call still on our op)."""
    ti, tf = verl_engine
    eng = _verl_setup(ti, tf)
    mb = _verl_batch(0.8)
    mb["calculate_entropy"] = False
    fns, calls = _compare("verl", eng.module, _verl_run(eng, mb))
    assert fns[VERL_CALLER]["passed"] == 1 and fns[VERL_CALLER]["replaced"] == 0
    assert fns["verl.utils.torch_functional.logprobs_from_logits"]["replaced"] == 1
    assert calls == [False]


def test_verl_fallbacks(verl_engine):
    ti, tf = verl_engine
    eng = _verl_setup(ti, tf, checkpointing=True)
    mb = _verl_batch(0.8)
    run = _verl_run(eng, mb)
    with pki.patched("verl"), pytest.raises(pki.Unsupported, match="entropy_checkpointing"):
        run()
    fns, calls = _compare("verl", eng.module, run, strict=False)
    s = fns[VERL_CALLER]
    assert s["fallbacks"] == 1 and s["replaced"] == 0
    assert "entropy_checkpointing" in next(iter(s["fallback_reasons"]))
    assert fns["verl.utils.torch_functional.logprobs_from_logits"]["replaced"] == 1
    eng = _verl_setup(ti, tf)
    mb["use_remove_padding"] = False
    with pki.patched("verl"), pytest.raises(pki.Unsupported, match="'use_remove_padding'"):
        _verl_run(eng, mb)()


# ------------------------------------------------------------------ OpenRLHF 0.11

ORL_CALLER = "openrlhf.models.actor.Actor.forward"
ORL_UNFUSED = (
    "openrlhf.models.utils.log_probs_from_logits",
    "openrlhf.models.utils.compute_entropy",
)


@pytest.fixture(scope="module")
def orl_actor():
    mod = import_peer("openrlhf.models.actor")
    yield mod
    pki.revert("openrlhf")


def _actor(mod, temperature, packing=False):
    actor = mod.Actor(_llama(1), temperature=temperature)
    actor.packing_samples = packing  # Actor.__init__ sets it only when it loads the model itself
    return actor


def _orl_batch(B=3, S=10, A=6):
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, V, (B, S), generator=g)
    att = torch.ones(B, S, dtype=torch.long)
    att[1, :3] = 0  # left padding of a shorter prompt
    att[2, -2:] = 0  # right padding of a shorter response
    am = att[:, -A:].clone()
    return seq, att, am


def _unpad(sequences, attention_mask, ring_attn_group):
    """flash_attn's unpad_input in torch (no ring group): OpenRLHF's packed layout."""
    idx = attention_mask.flatten().nonzero().squeeze(-1)
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return tuple(t.flatten()[idx].unsqueeze(0) for t in (sequences, pos, rolled)) + (0, idx)


def _pad(t, group, pad_len, indices, batch, seqlen):
    out = t.new_zeros(batch * seqlen).index_put((indices,), t.reshape(-1))
    return out.view(batch, seqlen)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("action_mask", [True, False])
def test_openrlhf_actor_forward(orl_actor, monkeypatch, temperature, packing, action_mask):
    mod = orl_actor
    if packing:  # flash_attn's padding helpers (GPU-only package) in torch
        monkeypatch.setattr(mod, "unpad_and_slice_tensor", _unpad)
        monkeypatch.setattr(mod, "gather_and_pad_tensor", _pad)
    actor = _actor(mod, temperature, packing)
    seq, att, am = _orl_batch()

    def run():
        kw = {"action_mask": am} if action_mask else {"return_logprobs": True}
        lp, out = actor(seq, attention_mask=att, return_output=True, return_entropy=True, **kw)
        return [lp, out.entropy]

    fns, calls = _compare("openrlhf", actor.model, run)
    _one_pass(fns, ORL_CALLER, ORL_UNFUSED, calls)
    utils = import_peer("openrlhf.models.utils")
    assert mod.compute_entropy is utils.compute_entropy  # the call's swaps and apply reverted
    assert mod.log_probs_from_logits is utils.log_probs_from_logits


def test_openrlhf_nothing_to_fuse_and_fallbacks(orl_actor):
    mod = orl_actor
    actor = _actor(mod, 0.9)
    seq, att, am = _orl_batch()
    fns, calls = _compare("openrlhf", actor.model, lambda: [actor(seq, am, att)])
    assert fns[ORL_CALLER]["passed"] == 1 and calls == [False]  # log-probs only: our op, once
    with pki.patched("openrlhf"), pytest.raises(pki.Unsupported, match="'sequences'"):
        actor(seq[None], am, att, return_output=True, return_entropy=True)

    class Strided(torch.nn.Module):  # logits whose vocabulary dimension is not contiguous
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *a, **k):
            out = self.m(*a, **k)
            out["logits"] = out["logits"].transpose(1, 2).contiguous().transpose(1, 2)
            return out

    actor.model = Strided(actor.model)
    run = lambda: list(actor(seq, am, att, return_output=True, return_entropy=True)[:1])  # noqa: E731
    fns, calls = _compare("openrlhf", actor.model, run, strict=False)
    s = fns[ORL_CALLER]
    assert s["fallbacks"] == 1 and "did not share" in next(iter(s["fallback_reasons"]))


# ------------------------------------------------------------------ TRL 1.16


def test_trl_grpo_per_token_path_is_one_fused_call():
    """GRPOTrainer._get_per_token_logps_and_entropies: TRL 1.16 computes both from the hidden
    states in one fused LM head call per chunk (no logits), which apply("trl") maps to one
    linear_token_logprobs pass; selective_log_softmax / entropy_from_logits are never called."""
    utils = import_peer("trl.trainer.utils")
    grpo = import_peer("trl.trainer.grpo_trainer")
    model = _llama(2)
    utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    trainer = object.__new__(grpo.GRPOTrainer)
    trainer.accelerator = types.SimpleNamespace(
        autocast=contextlib.nullcontext, is_main_process=True
    )
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (4, 11), generator=g)
    att = torch.ones_like(ids)
    att[0, :2] = 0
    att[3, -3:] = 0

    def run():
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, att, 6, batch_size=2, compute_entropy=True
        )
        return [lp, ent]

    try:
        fns, _ = _compare("trl", model, run)
    finally:
        pki.revert("trl")
    assert fns["trl.kernels.chunked_logprob.ChunkedLogProbFunction"]["replaced"] == 2  # 2 chunks
    for n in ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy"):
        assert fns[f"trl.trainer.utils.{n}"]["calls"] == 0
