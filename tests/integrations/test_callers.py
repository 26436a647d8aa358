"""The peers' callers that want both log-probs and entropy of the same logits, patched vs unpatched
on a tiny random-init Llama: verl 0.9's FSDPEngineWithLMHead.prepare_model_outputs, OpenRLHF
0.11's Actor.forward (one token_logprobs pass for both), TRL 1.16's GRPO per-token path (already
one fused LM head call). Outputs, dtypes and model gradients agree to the float32 tolerance of the
per-function tests; the caller ran one fused pass and the per-function replacements were not
called."""

from __future__ import annotations

import contextlib
import math
import sys
import types

import numpy as np
import pytest
import torch
from support import BENCH
from support.integration import ATOL, RTOL, actor_config, verl_loss_modules
from support.peer_stubs import import_peer
from support.skips import need

import ppo_kernels as pk
import ppo_kernels.integrations as pki
from ppo_kernels.token_logprobs import naive

sys.path.insert(0, BENCH)
V = 48


def _llama(seed=0):
    need("transformers")
    from e2e_trl import tiny_llama  # bench/

    return tiny_llama(V, seed)


@contextlib.contextmanager
def _passes():
    """The passes of our ops: ("logits", return_entropy) per ppo_kernels.token_logprobs call,
    ("hidden", return_entropy) per linear_token_logprobs call."""
    calls, real = [], (pk.token_logprobs, pk.linear_token_logprobs)

    def counted(kind, fn):
        def run(*a, **k):
            calls.append((kind, bool(k.get("return_entropy", False))))
            return fn(*a, **k)

        return run

    pk.token_logprobs = counted("logits", real[0])
    pk.linear_token_logprobs = counted("hidden", real[1])
    try:
        yield calls
    finally:
        pk.token_logprobs, pk.linear_token_logprobs = real


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


def _one_pass(fns, caller, unfused, calls, kind="logits", entropy=True):
    """The caller replaced once, one pass of our op (token_logprobs on the logits or
    linear_token_logprobs on the hidden states), the per-function replacements of the two
    unfused calls never reached."""
    assert fns[caller]["replaced"] == 1 and fns[caller]["fallbacks"] == 0, fns[caller]
    assert calls == [(kind, entropy)]
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


VERL_LENS = (5, 9, 3)


def _verl_batch(temperature, **flags):
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, V, (n,), generator=g) for n in VERL_LENS]
    nested = torch.nested.nested_tensor(ids, layout=torch.jagged)
    pos = torch.nested.nested_tensor([torch.arange(n) for n in VERL_LENS], layout=torch.jagged)
    return _MicroBatch(
        input_ids=nested, position_ids=pos, temperature=temperature, calculate_entropy=True, **flags
    )


def _verl_run(eng, mb, keys=("log_probs", "entropy")):
    """verl's FSDPEngineWithLMHead.forward_step without the FSDP / autocast / loss plumbing."""

    def run():
        inputs, args = eng.prepare_model_inputs(micro_batch=mb)
        raw = eng.module(**inputs, use_cache=False)
        out = eng.prepare_model_outputs(
            output=raw, output_args=args, micro_batch=mb, logits_processor_func=None
        )
        return [out[k].values() for k in keys if k in out]

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
    assert calls == [("logits", False)]


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


# ------------------------------------------------------------------ verl 0.9, use_fused_kernels

VERL_KERNELS = {
    "torch": "verl.utils.experimental.torch_functional.FusedLinearForPPO.forward",
    "liger": "verl.utils.experimental.torch_functional.FusedLinearForPPO.forward",
    "triton": "verl.utils.kernel.linear_cross_entropy.linear_cross_entropy",
}


def _verl_fused_engine(ti, tf, backend, **kw):
    """The engine with its model's forward replaced by verl's fused-kernel forward for `backend`
    (verl's own monkey patch, on a subclass so that other Llamas keep theirs)."""
    mp = import_peer("verl.models.transformers.monkey_patch")
    eng = _verl_setup(ti, tf, **kw)
    eng.module.__class__ = type("TinyLlamaForPPO", (type(eng.module),), {})
    mp.patch_forward_with_backends(
        eng.module, use_fused_kernels=True, fused_kernels_backend=backend
    )
    return eng


def _verl_fused_run(eng, temperature, remove_padding=True, fused=True):
    mb = _verl_batch(temperature, use_fused_kernels=fused, use_remove_padding=remove_padding)
    return _verl_run(eng, mb)


def _outputs_and_grads(model, run):
    out = run()
    return [o.detach() for o in out], _grads(model, out)


def _assert_close(ref, got):
    for a, b in zip(ref[0] + ref[1], got[0] + got[1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(b.double(), a.double(), rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton", "liger"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_verl_fused_kernels_forward(verl_engine, backend, temperature):
    """use_fused_kernels=True through verl's engine (prepare_model_inputs, the model's fused
    forward from verl.models.transformers.dense_common, prepare_model_outputs), each backend
    patched: the same log-probs, entropy and model gradients as verl's own torch backend
    unpatched (triton's kernels are CUDA-only) and as its unfused path; one linear_token_logprobs
    pass, the logits never built (the forward has none to return)."""
    ti, tf = verl_engine
    ref_eng = _verl_fused_engine(ti, tf, "torch", bucket=8)
    ref = _outputs_and_grads(ref_eng.module, _verl_fused_run(ref_eng, temperature))
    plain = _verl_setup(ti, tf, bucket=8)  # the same weights, the Llama's own forward (logits)
    unfused = _outputs_and_grads(plain.module, _verl_fused_run(plain, temperature, fused=False))
    _assert_close(ref, unfused)
    eng = _verl_fused_engine(ti, tf, backend, bucket=8)
    with pki.patched("verl"), _passes() as calls:
        got = _outputs_and_grads(eng.module, _verl_fused_run(eng, temperature))
        fns = pki.report("verl")["functions"]
    _assert_close(ref, got)
    assert fns[VERL_KERNELS[backend]]["replaced"] == 1 and calls == [("hidden", True)]
    assert fns[VERL_CALLER]["passed"] == 1  # the logits caller: nothing to fuse
    for name in VERL_UNFUSED:
        assert fns[name]["calls"] == 0


def test_verl_fused_kernels_padded(verl_engine):
    """use_remove_padding=False with fused kernels: [batch, seqlen] hidden states, the labels
    rolled inside verl's forward."""
    ti, tf = verl_engine
    eng = _verl_fused_engine(ti, tf, "torch")
    run = _verl_fused_run(eng, 0.8, remove_padding=False)
    fns, calls = _compare("verl", eng.module, run)
    assert fns[VERL_KERNELS["torch"]]["replaced"] == 1 and calls == [("hidden", True)]


# ------------------------------------------------------------------ verl 0.9, what its fused kernels refuse

VERL_INPUTS = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_inputs"
PER_SAMPLE = (0.6, 1.0, 1.3)
STATS = ("log_probs", "entropy", "sum_pi_squared")


def _verl_stats_run(eng, temperature, *, fused=True, remove_padding=True, sum_p2=False):
    """The engine's outputs, packed; without remove-padding, without each sequence's last token:
    verl's padded fused forward rolls the labels within each padded row, its unfused
    path across the packed batch, so that one token's label differs between verl's own paths."""
    if temperature == "per-sample":
        temperature = torch.tensor(PER_SAMPLE)
    mb = _verl_batch(
        temperature,
        use_fused_kernels=fused,
        use_remove_padding=remove_padding,
        calculate_sum_pi_squared=sum_p2,
    )
    run = _verl_run(eng, mb, STATS)
    if remove_padding:
        return run
    keep = torch.ones(sum(VERL_LENS), dtype=torch.bool)
    keep[torch.tensor(VERL_LENS).cumsum(0) - 1] = False
    return lambda: [o[keep] for o in run()]


@pytest.mark.parametrize(
    "backend, remove_padding",
    [("torch", True), ("triton", True), ("liger", True), ("torch", False)],
)
def test_verl_fused_per_sample_temperature(verl_engine, backend, remove_padding):
    """A per-sample temperature with use_fused_kernels (verl asserts a number): the patched
    prepare_model_inputs hands the fused forward verl's per-token temperatures, the patched fused
    kernel takes them per row; the same log-probs, entropy and model gradients as verl's unfused
    path (logits / temperature per token), in one linear_token_logprobs pass."""
    ti, tf = verl_engine
    eng = _verl_fused_engine(ti, tf, backend, bucket=8 if remove_padding else 0)
    with pytest.raises(AssertionError, match="per sample temperature"):  # verl's own
        _verl_stats_run(eng, "per-sample", remove_padding=remove_padding)()
    plain = _verl_setup(ti, tf, bucket=8 if remove_padding else 0)
    run = _verl_stats_run(plain, "per-sample", fused=False, remove_padding=remove_padding)
    ref = _outputs_and_grads(plain.module, run)
    with pki.patched("verl"), _passes() as calls:
        run = _verl_stats_run(eng, "per-sample", remove_padding=remove_padding)
        got = _outputs_and_grads(eng.module, run)
        fns = pki.report("verl")["functions"]
    _assert_close(ref, got)
    assert fns[VERL_INPUTS]["replaced"] == 1 and fns[VERL_KERNELS[backend]]["replaced"] == 1
    assert calls == [("hidden", True)]


@pytest.mark.parametrize(
    "temperature, remove_padding", [("per-sample", True), (0.7, True), ("per-sample", False)]
)
def test_verl_fused_sum_pi_squared(verl_engine, temperature, remove_padding):
    """calculate_sum_pi_squared with use_fused_kernels (verl raises: no logits): Σπ² from the
    fused kernel's one pass, against verl's eager path (calculate_sum_pi_squared_from_logits on
    the materialised logits / temperature per token), and verl's optimal-token-baseline
    advantages from either equal. Float32 throughout: Σπ² and the log-probs within 1e-5 relative
    + 1e-6 absolute (one softmax's round-off), the advantages and returns the same (the baseline's
    weights W sum about 20 terms of those)."""
    ti, tf = verl_engine
    core = import_peer("verl.trainer.ppo.core_algos")
    bucket = 8 if remove_padding else 0
    eng = _verl_fused_engine(ti, tf, "torch", bucket=bucket)
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):  # verl's own
        _verl_stats_run(eng, 0.7, remove_padding=remove_padding, sum_p2=True)()
    plain = _verl_setup(ti, tf, bucket=bucket)
    run = _verl_stats_run(
        plain, temperature, fused=False, remove_padding=remove_padding, sum_p2=True
    )
    with torch.no_grad():
        ref = run()
        with pki.patched("verl"), _passes() as calls:
            run = _verl_stats_run(eng, temperature, remove_padding=remove_padding, sum_p2=True)
            got = run()
            fns = pki.report("verl")["functions"]
    assert len(got) == len(ref) == 3 and calls == [("hidden", True)]
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert fns[VERL_CALLER]["replaced"] == 1 and fns[VERL_CALLER]["notes"]
    assert fns[VERL_KERNELS["torch"]]["replaced"] == 1
    assert fns[VERL_INPUTS]["replaced" if temperature == "per-sample" else "passed"] == 1

    # the optimal-token baseline over the three sequences as one prompt's group, every token
    # but the last (no next token: see _verl_stats_run) a response token with a reward
    lens = torch.tensor(VERL_LENS) - (0 if remove_padding else 1)
    mask = (torch.arange(max(VERL_LENS)) < lens.unsqueeze(1)).float()
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5)) * mask

    def otb(lp, sp):
        pad = torch.zeros(mask.shape)
        return core.compute_optimal_token_baseline_advantage(
            rewards,
            mask,
            np.zeros(3, dtype=np.int64),
            pad.masked_scatter(mask.bool(), lp),
            pad.masked_scatter(mask.bool(), sp),
        )

    want, have = otb(ref[0], ref[2]), otb(got[0], got[2])
    assert want[0].abs().max() > 0.1  # a baseline that varies per token, not zero advantages
    for a, b in zip(want, have):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_verl_fused_refusals_kept(verl_engine):
    """What the patch cannot lift keeps verl's error: Σπ² asked of prepare_model_outputs whose
    fused forward did not run a patched kernel asked for it, and a temperature tensor that is not
    per sample (strict: Unsupported naming the argument)."""
    ti, tf = verl_engine
    eng = _verl_fused_engine(ti, tf, "torch")
    mb = _verl_batch(0.7, use_fused_kernels=True, calculate_sum_pi_squared=True)
    raw = types.SimpleNamespace(log_probs=torch.zeros(1, 17), entropy=torch.zeros(1, 17))
    outputs = {"output": raw, "output_args": {}, "micro_batch": mb, "logits_processor_func": None}
    with pki.patched("verl"), pytest.raises(pki.Unsupported, match="'calculate_sum_pi_squared'"):
        eng.prepare_model_outputs(**outputs)
    with pki.patched("verl", strict=False):
        with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):  # verl's
            eng.prepare_model_outputs(**outputs)
        assert pki.report("verl")["functions"][VERL_CALLER]["fallbacks"] == 1
    mb = _verl_batch(torch.ones(3, 1), use_fused_kernels=True)
    with pki.patched("verl"), pytest.raises(pki.Unsupported, match="'temperature'"):
        eng.prepare_model_inputs(micro_batch=mb)
    with pki.patched("verl", strict=False), pytest.raises(AssertionError, match="per sample"):
        eng.prepare_model_inputs(micro_batch=mb)
    # VeOmni's engine overrides prepare_model_inputs (super() first): its fused forward is its own
    eng.__class__ = type("Overriding", (type(eng),), {"prepare_model_inputs": lambda s, **k: 0})
    mb = _verl_batch(torch.ones(3), use_fused_kernels=True)
    with pki.patched("verl"), pytest.raises(pki.Unsupported, match="'self'.*Overriding"):
        ti.FSDPEngineWithLMHead.prepare_model_inputs(eng, micro_batch=mb)


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


def _orl_run(actor, seq, att, am, action_mask=True, entropy=True, holder=None):
    def run():
        kw = {"action_mask": am} if action_mask else {"return_logprobs": True}
        lp, out = actor(seq, attention_mask=att, return_output=True, return_entropy=entropy, **kw)
        if holder is not None:
            holder.append(out)
        return [lp, out.entropy] if entropy else [lp]

    return run


class _NotPlainHead(torch.nn.Linear):
    """An LM head the hidden path does not take (as a LoRA-wrapped head): the logits path."""


def _logits_path(actor):
    """The actor with the same weights behind a head that sends the patch to the logits path."""
    plain = actor.model.lm_head
    head = _NotPlainHead(plain.in_features, plain.out_features, bias=False)
    head.weight = plain.weight
    actor.model.lm_head = head
    return plain


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("action_mask", [True, False])
def test_openrlhf_actor_forward(orl_actor, monkeypatch, temperature, packing, action_mask):
    """Log-probs and entropy asked for: from the hidden states (one linear_token_logprobs pass,
    the logits never built: the returned output's logits have an empty vocabulary), the same
    outputs and model gradients as unpatched and as the logits path (FusedPair) of the patch."""
    mod = orl_actor
    if packing:  # flash_attn's padding helpers (GPU-only package) in torch
        monkeypatch.setattr(mod, "unpad_and_slice_tensor", _unpad)
        monkeypatch.setattr(mod, "gather_and_pad_tensor", _pad)
    actor = _actor(mod, temperature, packing)
    seq, att, am = _orl_batch()
    outs = []
    run = _orl_run(actor, seq, att, am, action_mask, holder=outs)
    fns, calls = _compare("openrlhf", actor.model, run)
    _one_pass(fns, ORL_CALLER, ORL_UNFUSED, calls, kind="hidden")
    assert outs[0].logits.shape[-1] == V and outs[1].logits.shape[-1] == 0
    hidden = _outputs_and_grads(actor.model, lambda: (pki.apply("openrlhf"), run())[1])
    plain = _logits_path(actor)
    with _passes() as calls:
        logits = _outputs_and_grads(actor.model, run)
        fns = pki.report("openrlhf")["functions"]
    pki.revert("openrlhf")
    actor.model.lm_head = plain
    assert calls == [("logits", True)] and "the logits path" in next(iter(fns[ORL_CALLER]["notes"]))
    _assert_close(logits, hidden)  # today's patched path (one token_logprobs pass on the logits)
    utils = import_peer("openrlhf.models.utils")
    assert mod.compute_entropy is utils.compute_entropy  # the call's swaps and apply reverted
    assert mod.log_probs_from_logits is utils.log_probs_from_logits
    assert "forward" not in vars(actor.model.lm_head)  # the head's own forward is back


@pytest.mark.parametrize("packing", [False, True])
def test_openrlhf_logprobs_only(orl_actor, monkeypatch, packing):
    """Log-probs only (the experience maker's call, no output): one linear_token_logprobs pass
    without entropy; under no_grad too."""
    mod = orl_actor
    if packing:
        monkeypatch.setattr(mod, "unpad_and_slice_tensor", _unpad)
        monkeypatch.setattr(mod, "gather_and_pad_tensor", _pad)
    actor = _actor(mod, 0.9, packing)
    seq, att, am = _orl_batch()
    fns, calls = _compare("openrlhf", actor.model, lambda: [actor(seq, am, att)])
    assert fns[ORL_CALLER]["replaced"] == 1 and calls == [("hidden", False)]
    with torch.no_grad():
        ref = actor(seq, am, att)
        with pki.patched("openrlhf"):
            got = actor(seq, am, att)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)


def test_openrlhf_nothing_to_fuse_and_fallbacks(orl_actor):
    mod = orl_actor
    actor = _actor(mod, 0.9)
    seq, att, am = _orl_batch()
    run = lambda: [actor(seq, attention_mask=att, return_output=True)["logits"]]  # noqa: E731
    fns, calls = _compare("openrlhf", actor.model, run)
    assert fns[ORL_CALLER]["passed"] == 1 and calls == []  # the logits asked for: OpenRLHF's
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

    actor.model = Strided(actor.model)  # no get_output_embeddings: the logits path
    run = lambda: list(actor(seq, am, att, return_output=True, return_entropy=True)[:1])  # noqa: E731
    fns, calls = _compare("openrlhf", actor.model, run, strict=False)
    s = fns[ORL_CALLER]
    assert s["fallbacks"] == 1 and "did not share" in next(iter(s["fallback_reasons"]))


def test_openrlhf_model_changing_its_logits(orl_actor):
    """A model whose output is not its head's (here: it halves the logits) and says so nowhere in
    its config: the patch sees it, runs the model again with its own head and leaves the calls to
    OpenRLHF's functions (a fallback, the numbers right)."""
    mod = orl_actor

    class Halved(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def get_output_embeddings(self):
            return self.m.get_output_embeddings()

        def forward(self, *a, **k):
            out = self.m(*a, **k)
            out["logits"] = out["logits"] * 0.5
            return out

    actor = _actor(mod, 1.0)
    actor.model = Halved(actor.model)
    seq, att, am = _orl_batch()
    fns, calls = _compare("openrlhf", actor.model, _orl_run(actor, seq, att, am), strict=False)
    s = fns[ORL_CALLER]
    assert s["fallbacks"] == 1 and "changes its logits" in next(iter(s["fallback_reasons"]))
    assert calls == [("logits", True), ("logits", False)]  # OpenRLHF's two calls, each our op


def test_openrlhf_config_scaled_logits(orl_actor):
    """config.logit_scale (Cohere-style scaling after the head): the logits path, noted."""
    mod = orl_actor
    actor = _actor(mod, 1.0)
    actor.model.config.logit_scale = 0.5  # read by the patch only; the Llama ignores it
    seq, att, am = _orl_batch()
    fns, calls = _compare("openrlhf", actor.model, _orl_run(actor, seq, att, am))
    assert calls == [("logits", True)]
    assert "config.logit_scale" in next(iter(fns[ORL_CALLER]["notes"]))


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


# ------------------------------------------------------------------ verl 0.9, the rollout's truncation


@pytest.fixture(scope="module")
def verl_rc():
    with verl_loss_modules() as v:
        yield v


ROLLOUT = {"top_k": 6, "top_p": 0.9}  # the rollout config's values the tests sample with
PROMPT = 2  # prompt tokens per sequence (random); the rest sampled from the truncated policy


def _per_row(temperature, n):
    t = torch.tensor(PER_SAMPLE) if temperature == "per-sample" else torch.tensor([temperature] * 3)
    return t.repeat_interleave(torch.tensor(VERL_LENS)) if n else t


def _rollout_batch(model, temperature, **flags):
    """verl's micro-batch of three sequences whose response tokens were sampled, token by token,
    from the model's packed forward (as the engine runs it) under the rollout's temperature,
    top-k and top-p (the float64 reference's kept set), with verl's response layout (prompts,
    responses, response_mask) for its slicing."""
    g = torch.Generator().manual_seed(7)
    temps = _per_row(temperature, 0)
    seqs = [torch.randint(0, V, (PROMPT,), generator=g) for _ in VERL_LENS]
    pos = torch.cat([torch.arange(n) for n in VERL_LENS]).unsqueeze(0)
    with torch.no_grad():
        for b, n in enumerate(VERL_LENS):
            while seqs[b].numel() < n:
                ids = torch.cat(seqs[: b + 1]).unsqueeze(0)
                x = model(input_ids=ids, position_ids=pos[:, : ids.shape[1]], use_cache=False)
                x = x.logits[0, -1:]
                kept = naive.sampler_kept(
                    x.double(), 1 / temps[b : b + 1].double(), *_rollout_params(1)
                )[0]
                z = torch.where(kept, x.double() / temps[b], -torch.inf)
                nxt = torch.multinomial(torch.softmax(z, -1), 1, generator=g)
                seqs[b] = torch.cat([seqs[b], nxt[0]])
    nest = lambda ts: torch.nested.nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    resp = [n - PROMPT for n in VERL_LENS]
    mb = _MicroBatch(
        input_ids=nest(seqs),
        position_ids=nest([torch.arange(n) for n in VERL_LENS]),
        temperature=temps if temperature == "per-sample" else temperature,
        calculate_entropy=True,
        prompts=nest([s[:PROMPT] for s in seqs]),
        responses=nest([s[PROMPT:] for s in seqs]),
        response_mask=(torch.arange(max(resp)) < torch.tensor(resp).unsqueeze(1)).long(),
        max_response_len=max(resp),
        **flags,
    )
    return mb


def _rollout_params(n, top_k=ROLLOUT["top_k"], top_p=ROLLOUT["top_p"]):
    return torch.full((n,), top_k), torch.full((n,), top_p, dtype=torch.float64), torch.zeros(n)


def _materialised(eng, mb):
    """The engine's packed logits (its model's own forward) and labels, unpatched."""
    inputs, args = eng.prepare_model_inputs(micro_batch=mb)
    with torch.no_grad():
        logits = eng.module(**inputs, use_cache=False).logits[0]
    return logits, args["input_ids_rmpad_rolled"]


def _nested_like(values, mb):
    return torch.nested.nested_tensor_from_jagged(values, mb["input_ids"].offsets())


@pytest.mark.parametrize(
    "path, temperature",
    [("logits", 0.8), ("logits", "per-sample"), ("fused", 0.8), ("fused", "per-sample")],
)
def test_verl_rollout_sampling(verl_engine, verl_rc, path, temperature):
    """apply("verl", sampling=rollout's top_k / top_p): the actor's log-probs and entropy are
    token_logprobs(logits, labels, temperature, top_k, top_p) on the engine's materialised
    logits (float32: 1e-5 relative + 1e-5 absolute; the fused path's logits come from another
    matmul order), not the untruncated ones; fed to verl's rollout correction with rollout
    log-probs simulated as vLLM's processed_logprobs (the float64 reference on the same logits,
    rounded to float32) they give IS weights of 1 within 1e-4 on every response token, where the
    untruncated log-probs give weights far from 1. report() shows the truncation ran."""
    ti, tf = verl_engine
    pad = import_peer("verl.workers.utils.padding")
    plain = _verl_setup(ti, tf)
    fused = path == "fused"
    eng = _verl_fused_engine(ti, tf, "torch") if fused else plain
    mb = _rollout_batch(plain.module, temperature, use_fused_kernels=fused)
    logits, labels = _materialised(plain, _rollout_batch(plain.module, temperature))
    t = _per_row(temperature, 1).unsqueeze(-1)
    want_lp, want_ent = pk.token_logprobs(logits / t, labels, return_entropy=True, **ROLLOUT)
    vllm = naive.sampler_forward(logits.double(), labels, 1 / t.squeeze(-1).double(),
                                 *_rollout_params(labels.numel()))[0].float()  # fmt: skip
    keys = ("log_probs", "entropy")
    untruncated = _verl_run(plain, _rollout_batch(plain.module, temperature), keys)()

    with pki.patched("verl", sampling=ROLLOUT), _passes() as calls:
        got = _verl_run(eng, mb, keys)()
        rep = pki.report("verl")
    assert calls == [("hidden" if fused else "logits", True)]
    for a, b in zip((want_lp, want_ent), got):
        torch.testing.assert_close(b.detach(), a, rtol=RTOL, atol=1e-5)
    assert torch.isneginf(got[0]).any()  # prompt labels the rollout never sampled
    r = rep["sampling"]
    assert (r["top_k"], r["top_p"], r["actor_calls"]) == (6, 0.9, 1)
    assert (r["response_tokens"], r["outside"]) == (sum(VERL_LENS) - 3 * PROMPT, 0)
    assert rep["functions"][VERL_CALLER]["notes"]

    def weights(lp):
        w, mask, _ = verl_rc.rch.compute_rollout_correction_and_rejection_mask(
            pad.no_padding_2_padding(_nested_like(lp.detach(), mb), mb),
            pad.no_padding_2_padding(_nested_like(vllm, mb), mb),
            mb["response_mask"],
            rollout_is="token",
            rollout_is_threshold=2.0,
        )
        return w.batch["rollout_is_weights"][mask.bool()]

    ones = weights(got[0])
    torch.testing.assert_close(ones, torch.ones_like(ones), rtol=0, atol=1e-4)
    assert (weights(untruncated[0]) - 1).abs().max() > 0.2


def test_verl_rollout_sampling_outside(verl_engine, verl_rc):
    """Response tokens outside the trainer's kept set (its top_k smaller than the rollout's): their
    log-probs are -inf (never NaN), counted in report(); verl's rollout correction turns them
    into a weight of exp(-20) (its log-ratio clamp) and its token_k1 rejection masks them, and
    the PPO loss over the rejection's mask stays finite. The reference engine (forward_only) and
    the default (no sampling) score the untruncated softmax."""
    ti, tf = verl_engine
    pad = import_peer("verl.workers.utils.padding")
    eng = _verl_setup(ti, tf)
    mb = _rollout_batch(eng.module, 0.8)
    untruncated = _verl_run(eng, mb)()
    logits, labels = _materialised(eng, mb)
    want = pk.token_logprobs(logits / 0.8, labels, top_k=2)
    with pki.patched("verl", sampling={"top_k": 2, "top_p": 1.0}):
        got = _verl_run(eng, mb)()
        eng.engine_config.forward_only = True  # the reference policy's engine
        ref = _verl_run(eng, mb)()
        del eng.engine_config.forward_only
        rep = pki.report("verl")["sampling"]
    torch.testing.assert_close(got[0], want, rtol=RTOL, atol=1e-5)
    torch.testing.assert_close(ref[0], untruncated[0], rtol=RTOL, atol=ATOL)
    old = pad.no_padding_2_padding(_nested_like(got[0], mb), mb)
    mask = mb["response_mask"]
    out = torch.isneginf(old) & mask.bool()
    assert rep["outside"] == int(out.sum()) > 0 and rep["reference_calls"] == 1
    assert not old.isnan().any()
    roll = pad.no_padding_2_padding(_nested_like(untruncated[0], mb), mb).detach()
    w, kept, _ = verl_rc.rch.compute_rollout_correction_and_rejection_mask(
        old.detach(), roll, mask, rollout_is="token", rollout_is_threshold=2.0,
        rollout_rs="token_k1", rollout_rs_threshold="0.01_100",
    )  # fmt: skip
    w = w.batch["rollout_is_weights"]
    assert not w.isnan().any() and torch.all(w[out] <= math.exp(-20) * 1.01)
    assert not kept[out].any() and kept.any()

    # the update: old and new log-probs both -inf at those tokens (0 - 0 in the ratio): verl's
    # vanilla PPO loss over the rejection's mask, forward and model gradients finite; over the
    # unrejected mask, NaN (what the docs warn of)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    cfg = actor_config(verl_rc, "token-mean")
    loss_fn = verl_rc.core.compute_policy_loss_vanilla
    for m, finite in ((kept, True), (mask, False)):
        with pki.patched("verl", sampling={"top_k": 2}):
            lp = pad.no_padding_2_padding(_nested_like(_verl_run(eng, mb)()[0], mb), mb)
        loss = loss_fn(old.detach(), lp, adv, m, "token-mean", cfg)[0]
        assert bool(loss.isfinite()) is finite
        if finite:
            assert all(g.isfinite().all() for g in _grads(eng.module, [loss]))
