"""The four roles on transformers models: Actor (causal LM), Reference (frozen copy of the Actor
after SFT), Critic and reward model (a backbone with a scalar head)."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from ..linear_logprobs import hf
from .config import ConfigError, TrainConfig
from .task import CharTokenizer


class HFTokenizer:
    """The few tokenizer calls the trainer makes, on a Hugging Face tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        self.pad_token_id, self.eos_token_id = tok.pad_token_id, tok.eos_token_id
        self.bos_token_id = tok.bos_token_id

    def __len__(self):
        return len(self.tok)

    def encode(self, text, add_special_tokens=False):
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, path):
        self.tok.save_pretrained(path)


def tiny_model(cfg: TrainConfig, vocab_size: int):
    """A random-init Llama- or Qwen2-style causal LM."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if cfg.arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kw))
    return LlamaForCausalLM(LlamaConfig(**kw))


def load_actor(cfg: TrainConfig):
    """(actor, tokenizer): the tiny model + character tokenizer, or `--model PATH`."""
    if cfg.model is None:
        tok = CharTokenizer(cfg.vocab)
        torch.manual_seed(cfg.seed)
        return tiny_model(cfg, len(tok)), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(cfg.model):
        raise ConfigError(
            f"--model: {cfg.model!r} is not a local directory with a transformers "
            f"model and tokenizer"
        )
    model = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.float32)
    lm_head(model)  # raises for a model without an LM head
    return model, HFTokenizer(AutoTokenizer.from_pretrained(cfg.model))


def lm_head(model):
    """(weight, bias) of the Actor's LM head (ppo_kernels.linear_logprobs.hf), as a ConfigError."""
    try:
        return hf.lm_head(model)
    except ValueError as e:
        raise ConfigError(
            f"--model: {e}; the Actor must be a causal LM (AutoModelForCausalLM)"
        ) from None


def hidden_states(model_backbone, input_ids, attention_mask, position_ids):
    out = model_backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state


def token_logprobs(
    ops,
    actor,
    input_ids,
    attention_mask,
    position_ids,
    *,
    temperature=1.0,
    return_entropy=False,
    only=None,
):
    """Log-prob of each token given its prefix: [B, L-1], aligned with input_ids[:, 1:].

    `only` [B, L-1]: compute them (and the entropy) only where it is non-zero, 0 elsewhere -- the
    action tokens, the only ones a loss uses (packed rows, as a trainer that removes padding
    does), in both --ops modes."""
    labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    keep = None if only is None else only > 0
    if hf.logit_transform(actor) is not None:  # soft-capped / scaled logits: the model's own
        logits = actor(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits[:, :-1]
        rows = logits if keep is None else logits[keep]
        out = ops.logprobs_from_logits(
            rows,
            labels if keep is None else labels[keep],
            temperature=temperature,
            return_entropy=return_entropy,
        )
    else:
        h = hidden_states(hf.backbone(actor), input_ids, attention_mask, position_ids)[:, :-1]
        weight, bias = lm_head(actor)
        out = ops.logprobs_from_hidden(
            h if keep is None else h[keep],
            weight,
            bias,
            labels if keep is None else labels[keep],
            temperature=temperature,
            return_entropy=return_entropy,
        )
    if keep is None:
        return out

    def unpack(x):
        return x.new_zeros(keep.shape).masked_scatter(keep, x)

    return tuple(map(unpack, out)) if return_entropy else unpack(out)


def actor_loss(ops, actor, input_ids, attention_mask, position_ids, *, temperature, only, **loss):
    """The PPO / GRPO actor loss from the Actor's last hidden states and LM head in one pass
    (`Ops.policy_loss_from_hidden`; `loss`: its per-token inputs [B, L-1] and coefficients), only
    on the tokens where `only` is non-zero (packed): (logprobs, entropy, (loss, stats)), the
    per-token values [B, L-1] detached (the loss carries the gradient). Where that pass does not
    run (eager ops, a model whose logits are soft-capped or scaled): `token_logprobs`'
    (logprobs, entropy), from which the caller composes the loss."""
    if hf.logit_transform(actor) is None:
        keep = only > 0
        labels = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)[keep]
        h = hidden_states(hf.backbone(actor), input_ids, attention_mask, position_ids)[:, :-1]
        weight, bias = lm_head(actor)
        per_token = ("old_logprobs", "advantages", "mask", "ref_logprobs")
        kw = {k: (v[keep] if k in per_token and v is not None else v) for k, v in loss.items()}
        out = ops.policy_loss_from_hidden(
            h[keep], weight, bias, labels, temperature=temperature, **kw
        )
        if out is not None:
            lp, st = out

            def unpack(x):
                return x.new_zeros(keep.shape).masked_scatter(keep, x)

            return unpack(st["logprobs"]), unpack(st["entropy"]), (lp, st)
    return token_logprobs(
        ops,
        actor,
        input_ids,
        attention_mask,
        position_ids,
        temperature=temperature,
        return_entropy=True,
        only=only,
    )


class ValueModel(nn.Module):
    """A transformers backbone with a scalar head: the Critic (a value per prefix) and the reward
    model (the value at the last token). Causal attention restricts each value to its prefix."""

    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_causal_lm(cls, model) -> ValueModel:
        p = next(model.parameters())
        return cls(copy.deepcopy(hf.backbone(model)), model.config.hidden_size).to(p.device)

    def forward(self, input_ids, attention_mask, position_ids):
        h = hidden_states(self.body, input_ids, attention_mask, position_ids)
        # the head as a per-row dot product, not nn.Linear: a matmul with one output column runs
        # as a GEMV whose result for a row depends on the number of rows (MKL), so a value would
        # change with the micro-batch it was computed in (--batch-invariant)
        return ((h * self.head.weight[0]).sum(-1) + self.head.bias[0]).float()

    def score(self, input_ids, attention_mask, position_ids):
        return score(self, input_ids, attention_mask, position_ids)


def score(value_model, input_ids, attention_mask, position_ids):
    """Reward-model score: the value at each row's last real token. `value_model` is a
    ValueModel or its data-parallel wrapper (called, so that DDP / FSDP2 see the forward)."""
    v = value_model(input_ids, attention_mask, position_ids)
    return v.gather(1, last_index(attention_mask)[:, None]).squeeze(1)


def last_index(attention_mask):
    pos = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.where(attention_mask > 0, pos, -1).amax(1)


def frozen_copy(model):
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
