"""Rollouts in the multi-turn tool environment, and sequence batches for training.

A batch row is `[left-padded prompt | response | right padding]`. Per-token tensors have L-1
columns aligned with `input_ids[:, 1:]`: column t holds the prediction of token t+1 from its prefix.
`action_mask` is 1 exactly where the Actor sampled that token; prompt, tool output and padding
are 0.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field

import torch

from .task import EOS


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    action_mask: torch.Tensor  # [B, L-1] float32
    truncated: torch.Tensor  # [B] bool: cut off by the length limit (bootstrap from V)
    responses: list = field(default_factory=list)  # decoded response text (actions + tool)

    def __len__(self):
        return self.input_ids.shape[0]

    def rows(self, idx):
        return SeqBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.position_ids[idx],
            self.action_mask[idx],
            self.truncated[idx],
            [self.responses[i] for i in idx.tolist()] if self.responses else [],
        )

    def model_inputs(self):
        return self.input_ids, self.attention_mask, self.position_ids


def position_ids_for(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def assemble(
    prompts: list[list[int]],
    responses: list[list[int]],
    resp_masks: list[list[int]],
    pad_id: int,
    truncated=None,
    texts=None,
    device="cpu",
) -> SeqBatch:
    """Left-pad prompts, right-pad responses, build the aligned action mask."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    act = torch.zeros((B, P + R), dtype=torch.float32)
    for i, (p, r, m) in enumerate(zip(prompts, responses, resp_masks)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p) : P] = 1
        if r:
            ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, P : P + len(r)] = 1
            act[i, P : P + len(r)] = torch.tensor(m, dtype=torch.float32)
    trunc = torch.zeros(B, dtype=torch.bool) if truncated is None else torch.tensor(truncated)
    return SeqBatch(
        ids.to(device),
        attn.to(device),
        position_ids_for(attn).to(device),
        act[:, 1:].contiguous().to(device),
        trunc.to(device),
        texts or [],
    )


def segments_to_tokens(tok, segments):
    """[(text, is_action)] -> token ids and mask (for demonstrations and preference pairs)."""
    ids, mask = [], []
    for text, is_action in segments:
        t = tok.encode(text)
        if (
            text.endswith(EOS)
            and is_action
            and tok.eos_token_id is not None
            and EOS not in tok.decode(t[-1:])
        ):
            t = t + [tok.eos_token_id]
        ids += t
        mask += [int(is_action)] * len(t)
    return ids, mask


def sample(logits, temperature, generator, rows=None):
    """One token per row from softmax(logits / temperature), by inverse transform sampling: one
    uniform per row against the float64 CDF (torch.multinomial draws one random number per
    vocabulary entry, which at V = 32000 made sampling most of a rollout's time).
    rows=(offset, total): these are rows offset.. of a batch of `total` split over data-parallel
    ranks; the uniforms of the whole batch are drawn and this share's are used, so each row gets
    the number it gets in a one-process run."""
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    cdf = probs.double().cumsum(-1)
    B = probs.shape[0]
    lo, total = rows or (0, B)
    u = torch.rand(total, 1, generator=generator, dtype=torch.float64)[lo : lo + B]
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.clamp(max=probs.shape[-1] - 1).squeeze(1).tolist()


@torch.no_grad()
def generate(
    model,
    tok,
    task,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    device="cpu",
    rows=None,
    group=None,
) -> SeqBatch:
    """Sample responses; a closed tool call makes the environment append the tool's output,
    which is fed to the model token by token as mask = 0 context. A row ends at EOS
    (terminated) or when its response reaches max_new_tokens (truncated).
    Data-parallel: rows=(offset, total) and the process group; decoding stops when the rows of
    every rank are done, so the generator advances as in the one-process run."""
    from transformers import DynamicCache

    from . import dist

    model.eval()
    B = len(prompts)
    P = max(len(p) for p in prompts)
    ids = torch.full((B, P), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        attn[i, P - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = position_ids_for(attn)
    # newer transformers call the KV cache argument `cache`, older ones `past_key_values`; the
    # DynamicCache is updated in place either way. `model`: the causal LM, or the data-parallel
    # dist.Policy around it (called like it)
    lm = dist.unwrap(model)
    lm = lm.actor if isinstance(lm, dist.Policy) else lm
    params = inspect.signature(lm.forward).parameters
    cache = {("cache" if "cache" in params else "past_key_values"): DynamicCache()}
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **cache)
    logits = out.logits[:, -1]
    next_pos = pos[:, -1] + 1
    resp = [[] for _ in range(B)]
    rmask = [[] for _ in range(B)]
    text = [""] * B
    pending = [deque() for _ in range(B)]
    done = [False] * B
    for _ in range(max_new_tokens):
        sampled = sample(logits, temperature, generator, rows)
        feed, live = [], []
        for i in range(B):
            if done[i]:
                feed.append(tok.pad_token_id)
                live.append(0)
                continue
            if pending[i]:
                t, a = pending[i].popleft(), 0
            else:
                t, a = sampled[i], 1
            resp[i].append(t)
            rmask[i].append(a)
            piece = EOS if (a and t == tok.eos_token_id) else tok.decode([t])
            text[i] += piece
            live.append(1)
            if a and EOS in piece:  # the task's end marker, or the tokenizer's EOS token
                done[i] = True
            elif a:
                tool_out = task.tool_response(text[i])
                if tool_out is not None:
                    pending[i].extend(tok.encode(tool_out))
            feed.append(t)
        if not dist.any_true(not all(done), group):
            break
        step_ids = torch.tensor(feed, device=device)[:, None]
        attn = torch.cat([attn, torch.tensor(live, device=device)[:, None]], 1)
        out = model(
            input_ids=step_ids,
            attention_mask=attn,
            position_ids=next_pos[:, None],
            use_cache=True,
            **cache,
        )
        logits = out.logits[:, -1]
        next_pos = next_pos + torch.tensor(live, device=device)
    truncated = [not d for d in done]
    return assemble(prompts, resp, rmask, tok.pad_token_id, truncated, text, device)
