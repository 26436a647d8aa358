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


def pack_rows(x, keep, fill=0):
    """x [B, L, ...] -> [B, T, ...]: each row's entries where `keep` [B, L] is set, moved to the
    left in their order, `fill` after them (T = the most any row keeps). A completion's action
    tokens as a row of their own: the preference loss takes rows of T tokens, and the prompt and
    tool-output positions would only cost logits tiles."""
    n = keep.sum(1)
    T = max(int(n.max()), 1) if len(n) else 1
    slots = torch.arange(T, device=keep.device) < n[:, None]
    out = x.new_full((x.shape[0], T, *x.shape[2:]), fill)
    out[slots] = x[keep]
    return out


def action_hidden(actor, input_ids, attention_mask, position_ids, *, only):
    """The last hidden states that predict each row's action tokens (`only` [B, L-1] non-zero),
    packed (`pack_rows`): [B, T, H]."""
    h = hidden_states(hf.backbone(actor), input_ids, attention_mask, position_ids)[:, :-1]
    return pack_rows(h, only > 0)


def head_from_hidden(model, what: str):
    """(weight, bias) of a model whose loss is taken from its hidden states and LM head, as a
    ConfigError when its logits are soft-capped or scaled after the head."""
    t = hf.logit_transform(model)
    if t is not None:
        raise ConfigError(
            f"--model: {what} is computed from the hidden states and the LM head, but the model "
            f"transforms its logits after the head (config.{t[0]}={t[1]})"
        )
    return lm_head(model)


def preference_loss(
    ops, actor, input_ids, attention_mask, position_ids, *, only, beta, nll, ref_hidden=None,
    ref_head=None, ref_logps=None,
):  # fmt: skip
    """The DPO step's loss from the Actor's last hidden states and LM head (rows: the chosen
    completions, then the rejected ones; `only` [2P, L-1]: their action tokens) in one
    `linear_preference_loss` pass, the Reference as its packed hidden states `ref_hidden` with
    `ref_head` (weight, bias), or as sequence log-prob sums `ref_logps`. With `nll`, the RPO
    term: the chosen rows' per-token NLL as `algos/dpo.py` defines it (each row's log-prob sum
    over its token count, then the pair mean) from one `linear_token_logprobs` pass over the
    chosen rows' tokens -- the op's own `sft` type is the batch's token mean, another
    normalisation. Returns (DPO loss, op stats, NLL or None); the NLL carries its gradient."""
    keep = only > 0
    h = hidden_states(hf.backbone(actor), input_ids, attention_mask, position_ids)[:, :-1]
    labels = input_ids[:, 1:]
    weight, bias = head_from_hidden(actor, "the fused DPO loss")
    rw, rb = ref_head if ref_head is not None else (None, None)
    loss, st = ops.preference_loss_from_hidden(
        pack_rows(h, keep),
        weight,
        bias,
        pack_rows(labels, keep, fill=-100),
        beta=beta,
        ref_hidden=ref_hidden,
        ref_weight=rw,
        ref_bias=rb,
        ref_logps=ref_logps,
    )
    if not nll:
        return loss, st, None
    P = input_ids.shape[0] // 2
    kc = keep[:P]
    lp = ops.logprobs_from_hidden(
        h[:P][kc], weight, bias, labels[:P][kc], temperature=1.0, return_entropy=False
    )
    rows = torch.arange(P, device=kc.device)[:, None].expand_as(kc)[kc]
    sums = lp.new_zeros(P).index_add(0, rows, lp)
    return loss, st, -(sums / kc.sum(1).clamp(min=1)).mean()


def distill_loss(
    ops, actor, input_ids, attention_mask, position_ids, *, only, teacher_hidden, teacher_head,
    temperature,
):  # fmt: skip
    """On-policy distillation's loss from the student's last hidden states and LM head: the
    token mean over the action tokens (`only` [B, L-1]: non-zero there, packed) of the
    full-vocabulary reverse KL to the teacher, given as its hidden states at those tokens
    (`teacher_hidden` [N, H_t]) and its head (weight, bias)."""
    keep = only > 0
    h = hidden_states(hf.backbone(actor), input_ids, attention_mask, position_ids)[:, :-1]
    weight, bias = head_from_hidden(actor, "the distillation loss")
    tw, tb = teacher_head
    if bias is not None or tb is not None:
        raise ConfigError(
            "--model / --teacher: the distillation loss takes LM heads without a bias"
        )
    return ops.distill_loss_from_hidden(
        h[keep], weight, input_ids[:, 1:][keep], teacher_hidden, tw, temperature=temperature
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

    def forward(self, input_ids, attention_mask, position_ids, pairwise_ops=None):
        """Each prefix's value [B, L]; with `pairwise_ops` (an Ops; rows: the chosen
        completions, then the rejected ones) the reward model's pairwise loss straight from the
        head (`Ops.reward_model_head_loss`): (loss, chosen scores, rejected scores)."""
        h = hidden_states(self.body, input_ids, attention_mask, position_ids)
        if pairwise_ops is not None:  # inside the forward: FSDP2 has the head gathered
            last = h[torch.arange(h.shape[0], device=h.device), last_index(attention_mask)]
            hc, hr = last.chunk(2)
            return pairwise_ops.reward_model_head_loss(hc, hr, self.head.weight, self.head.bias)
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
