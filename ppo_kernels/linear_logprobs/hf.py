"""causal_lm_logprobs: per-token log-probs (and entropy) of a `transformers` causal LM's own tokens,
through the LM head with linear_token_logprobs, so the [B, T, V] logits are never built.

The helpers that take a transformers model apart (`backbone`, `lm_head`, `logit_transform`) live
here once; the trainer (ppo_kernels/trainer/models.py) uses them too."""

from __future__ import annotations

from torch import Tensor

from .._checks import check_bool, check_devices, check_int, check_str, check_temperature
from ..token_logprobs.api import check_sampler_unused, sampler_options, sampler_requested
from ..token_logprobs.naive import SAMPLERS
from .api import linear_token_logprobs

# Config fields through which a model post-processes its logits in ways the LM head matmul alone
# does not reproduce; refused rather than silently giving different numbers. Gemma-2 style
# final_logit_softcapping is applied (linear_token_logprobs' softcap).
_LOGIT_TRANSFORMS = ("logit_softcapping", "logits_scaling", "logit_scale")


def backbone(model):
    """The decoder that produces the last hidden states (model.model, model.transformer, ...)."""
    dec = None
    if hasattr(model, "get_decoder"):
        try:
            dec = model.get_decoder()
        except (AttributeError, NotImplementedError):
            dec = None
    if dec is None or dec is model:
        prefix = getattr(model, "base_model_prefix", "")
        dec = getattr(model, prefix, None) if prefix else None
    if dec is None or dec is model:
        raise ValueError(
            f"model: cannot find the backbone of {type(model).__name__} (tried "
            "get_decoder() and base_model_prefix); pass a transformers *ForCausalLM"
        )
    return dec


def lm_head(model):
    """(weight [V, H], bias or None) of the model's output embedding; ValueError if none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"model: {type(model).__name__} has no accessible LM head "
            "(get_output_embeddings() returned no module with a [V, H] weight)"
        )
    return weight, getattr(head, "bias", None)


def _configs(model):
    cfg = getattr(model, "config", None)
    return [cfg] + ([cfg.get_text_config()] if hasattr(cfg, "get_text_config") else [])


def _softcap(model):
    caps = {getattr(c, "final_logit_softcapping", None) for c in _configs(model)} - {None}
    if len(caps) > 1:
        raise NotImplementedError(f"causal_lm_logprobs: conflicting final_logit_softcapping {caps}")
    return caps.pop() if caps else None


def _transforms(model, names):
    """(config field, value) of each of `names` the model applies to its logits."""
    for c in _configs(model):
        for name in names:
            val = getattr(c, name, None)
            if val is None or ("scal" in name and val == 1):  # a scale of 1 changes nothing
                continue
            yield name, val


def logit_transform(model):
    """(config field, value) of the first transform the model applies to its logits after the LM
    head (soft-capping included, scaling), or None when they are the LM head's output."""
    return next(_transforms(model, ("final_logit_softcapping",) + _LOGIT_TRANSFORMS), None)


def _check_logit_transforms(model):
    for name, val in _transforms(model, _LOGIT_TRANSFORMS):
        raise NotImplementedError(
            f"causal_lm_logprobs: {type(model).__name__} applies config.{name}={val} to its "
            "logits (soft-capping / scaling after the LM head), which linear_token_logprobs "
            "does not support; compute the logits with the model instead"
        )


def causal_lm_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    labels: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    max_chunk_bytes: int | None = None,
    logits_dtype: str = "auto",
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    sampler: str = "vllm",
    stats=None,
    stats_top_k: int = 0,
    **model_kwargs,
):
    """Log-probs of each next token under a `transformers` causal LM, never building its logits.

    Runs the model's backbone on `input_ids`, then `linear_token_logprobs` of the last hidden
    states through the LM head (tied or untied, with its bias if any). Position t of the result is
    `log p(target[t + 1] | tokens[: t + 1])`. The targets are `labels[:, 1:]` when labels are given,
    else `input_ids[:, 1:]`. A target whose attention_mask is 0 gives 0 and no gradient.

    Args:
        model (PreTrainedModel): a `transformers` `*ForCausalLM` (a backbone and an output
            embedding). Gradients flow to every parameter that requires grad. Gemma-2's
            `config.final_logit_softcapping` is applied; other logit transforms (Granite's
            `logits_scaling`, Cohere's `logit_scale`) raise NotImplementedError.
        input_ids (Tensor): `[B, T]`, integer token ids.
        attention_mask (Tensor, optional): `[B, T]`, 0 / 1, passed to the backbone; 0 also drops
            the target. Default None: every token counts.
        labels (Tensor, optional): `[B, T]`, integer. The targets in the HF convention: a label
            equal to `ignore_index` gives 0. Default None: the targets are `input_ids`.
        temperature (float or Tensor): divides the logits; positive. A float tensor gives per-row
            values aligned with the result: `[B]` (per sequence) or `[B, T - 1]` (per output
            position: position t holds the temperature that sampled token t + 1). A `[B, T]`
            tensor is refused: slice it as your rollout aligns it (`[:, 1:]` when entry t is the
            temperature token t was sampled at). Default 1.0.
        return_entropy (bool): also return the entropy of each next-token distribution.
            Default False.
        ignore_index (int): the label of a position without a log-prob. Default -100.
        max_chunk_bytes (int, optional): the chunk buffers' budget, as in `linear_token_logprobs`.
            Default None: 64 MiB on the CPU, 2 GiB on a GPU.
        logits_dtype (str): "float32", "input" (the head's GEMMs in the model's bf16 / fp16 dtype,
            the roundings of the model's own logits) or "auto", as in `linear_token_logprobs`.
            Default "auto".
        top_k (int or Tensor, optional): the rollout engine's top-k (0 or >= V: off), a scalar
            or a per-row int tensor shaped like a per-row temperature (`[B]` or `[B, T - 1]`):
            the log-probs and entropy under the distribution the engine sampled from, as in
            `linear_token_logprobs` (a target outside the kept set gets -inf). Default None: off.
        top_p (float or Tensor, optional): the engine's top-p, in (0, 1] (1: off), scalar or per
            row. Default None: off.
        min_p (float or Tensor, optional): the engine's min-p, in [0, 1] (0: off), scalar or per
            row. Default None: off.
        sampler (str): whose truncation rules, "vllm" or "sglang". Default "vllm".
        stats (tuple of str, optional): the head's statistics per output position, as in
            `linear_token_logprobs` ("outside", "sum_p2", "lse", "topk", "is_argmax").
            Default None: none computed.
        stats_top_k (int): how many top tokens "topk" returns, 1 to 64. Default 0.
        **model_kwargs: passed to the backbone (e.g. `position_ids`).

    Returns:
        Tensor: the log-probs, `[B, T - 1]`, float32 (float64 for a float64 model). With
        `return_entropy=True`, the pair `(logprobs, entropy)`, both of that shape and dtype.
        With `stats`, a HeadStats follows (the last element of a tuple).

    Why: `model(input_ids).logits` builds `[B, T, V]` logits, often the largest tensor of the
    step. This runs the backbone alone and reduces the head in chunks. Formulas: docs/ppo-math.md
    ("Token log-probs and entropy").
    """
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids: expected a [batch, seq] tensor of token ids")
    if labels is not None and tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"labels: expected shape {tuple(input_ids.shape)} (input_ids.shape), "
            f"got {tuple(labels.shape)}"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask: expected shape {tuple(input_ids.shape)} "
            f"(input_ids.shape), got {tuple(attention_mask.shape)}"
        )
    # the arguments before the (expensive) backbone runs; linear_token_logprobs checks the rest
    check_int("ignore_index", ignore_index)
    check_bool("return_entropy", return_entropy)
    _check_logit_transforms(model)
    weight, bias = lm_head(model)
    # on the LM head's device (a meta tensor would otherwise reach the backbone's embedding)
    check_devices(
        "model", weight, input_ids=input_ids, attention_mask=attention_mask, labels=labels
    )
    target = (labels if labels is not None else input_ids)[:, 1:]
    if sampler_requested(temperature, top_k, top_p, min_p, stats):
        if isinstance(temperature, Tensor) and tuple(temperature.shape) == tuple(input_ids.shape):
            raise ValueError(
                f"temperature: expected [B] or [B, T - 1] {tuple(target.shape)} (aligned with the "
                f"result), got input_ids' shape {tuple(input_ids.shape)}: slice it as the rollout "
                "aligns it (temperature[:, 1:] when entry t sampled token t)"
            )
        check_str("sampler", sampler, SAMPLERS)
        # shapes and devices; the values too where reading them costs no device sync
        sampler_options(target, temperature, top_k, top_p, min_p, stats, stats_top_k,
                        values=target.device.type == "cpu")  # fmt: skip
    else:
        check_temperature(temperature)
        check_sampler_unused(sampler, stats_top_k)
    out = backbone(model)(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    hidden = hidden[:, :-1]
    if hidden.dtype != weight.dtype:  # e.g. autocast: run the head in the weight's dtype
        hidden = hidden.to(weight.dtype)
    if attention_mask is not None:
        target = target.masked_fill(attention_mask[:, 1:] == 0, ignore_index)
    return linear_token_logprobs(
        hidden,
        weight,
        target,
        bias=bias,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        max_chunk_bytes=max_chunk_bytes,
        logits_dtype=logits_dtype,
        softcap=_softcap(model),
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        sampler=sampler,
        stats=stats,
        stats_top_k=stats_top_k,
    )
