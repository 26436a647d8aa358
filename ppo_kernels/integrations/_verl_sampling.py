"""verl's trainer log-probs under the rollout's own sampling parameters (`apply("verl",
sampling=...)`).

verl's rollout samples from the truncated distribution (temperature, then top-k / top-p; min-p
where the engine has it) and, with vLLM's default `logprobs_mode="processed_logprobs"`, returns
the log-probs of that distribution as `rollout_log_probs`; its actor scores the same tokens under
the untruncated tempered softmax. verl 0.9.1 passes only the temperature to the actor (in the
batch's meta_info): the truncation is given here, once, as the rollout config's values. With it,
every log-prob, entropy and Σπ² the FSDP engine computes for the actor (old_log_probs and the
update's) is taken under the truncated distribution: on the logits path by `token_logprobs`, with
`use_fused_kernels` by `linear_token_logprobs` in the patched fused kernels. The reference policy
(an engine built `forward_only`, or the actor's own engine inside `disable_adapter()`) keeps the
untruncated softmax: a KL to a truncated reference is infinite wherever the policy drifts out of
its kept set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import numbers
import threading

import torch

import ppo_kernels as pk

from ._args import NO_IGNORE, need
from ._fused import call
from ._patch import Passthrough

FSDP = "verl.workers.engine.fsdp.transformer_impl"
TF = "verl.utils.torch_functional"
PADDING = "verl.workers.utils.padding"
SAMPLERS = ("vllm", "sglang")


@dataclasses.dataclass(frozen=True)
class RolloutSampling:
    """The rollout's truncation (verl's `actor_rollout_ref.rollout.top_k` / `top_p`; min-p for an
    engine that applies one): the keywords of `token_logprobs` / `linear_token_logprobs`."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    sampler: str = "vllm"

    @property
    def active(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    def kwargs(self) -> dict:
        return {
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "sampler": self.sampler,
        }


def _number(d, key, kind):
    v = d.get(key)
    if v is None:
        return None
    ok = isinstance(v, numbers.Integral if kind is int else numbers.Real) and not isinstance(
        v, bool
    )
    if not ok:
        raise ValueError(f"sampling[{key!r}]: expected a {kind.__name__}, got {v!r}")
    return kind(v)


def sampling_option(value) -> RolloutSampling | None:
    """`apply(..., sampling=)` checked: None, a RolloutSampling, a dict with the keys top_k, top_p,
    min_p, sampler, or the string form of PPO_KERNELS_VERL_SAMPLING ("top_k=50,top_p=0.9").
    verl's / vLLM's "off" values (top_k -1 or 0, top_p 1, min_p 0) turn a parameter off; all off
    is None (nothing changes)."""
    if value is None or isinstance(value, RolloutSampling):
        return value if value is not None and value.active else None
    if isinstance(value, str):
        value = dict(_pair(p) for p in value.split(",") if p.strip())
    if not isinstance(value, dict):
        raise ValueError(f"sampling: expected a dict of top_k / top_p / min_p, got {value!r}")
    unknown = set(value) - {"top_k", "top_p", "min_p", "sampler"}
    if unknown:
        raise ValueError(f"sampling: unknown keys {sorted(unknown)} (top_k, top_p, min_p, sampler)")
    k, p, m = (
        _number(value, "top_k", int),
        _number(value, "top_p", float),
        _number(value, "min_p", float),
    )
    if k is not None and k < -1:
        raise ValueError(f"sampling['top_k']: expected -1 (off) or >= 0, got {k}")
    if p is not None and not 0 < p <= 1:
        raise ValueError(f"sampling['top_p']: expected a value in (0, 1], got {p}")
    if m is not None and not 0 <= m <= 1:
        raise ValueError(f"sampling['min_p']: expected a value in [0, 1], got {m}")
    sampler = value.get("sampler", "vllm")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampling['sampler']: expected one of {SAMPLERS}, got {sampler!r}")
    s = RolloutSampling(
        top_k=None if k is None or k <= 0 else k,
        top_p=None if p is None or p == 1 else p,
        min_p=None if m is None or m == 0 else m,
        sampler=sampler,
    )
    return s if s.active else None


def _pair(text):
    key, sep, v = text.partition("=")
    key, v = key.strip(), v.strip()
    if not sep or not key:
        raise ValueError(f"sampling: expected key=value, got {text!r}")
    if key == "sampler":
        return key, v
    try:
        return key, int(v) if key == "top_k" else float(v)
    except ValueError:
        raise ValueError(f"sampling[{key!r}]: not a number: {v!r}") from None


class _State(threading.local):
    """The truncation of the current micro-batch's fused forward (set by prepare_model_inputs,
    read by the patched fused kernels, checked by prepare_model_outputs), and the reference
    policy's `disable_adapter()` scope."""

    fused: RolloutSampling | None = None
    kept = None  # the log-probs tensor a fused kernel computed under `fused`
    adapter_off = 0

    def ask(self, sampling):
        self.fused, self.kept = sampling, None

    def kwargs(self) -> dict:
        """The fused kernel's truncation keywords for this micro-batch ({} without one)."""
        return self.fused.kwargs() if self.fused is not None else {}

    def keep(self, logprobs):
        if self.fused is not None:
            self.kept = logprobs

    def take(self, logprobs) -> bool:
        """Whether `logprobs` are a fused kernel's under the truncation; ends the micro-batch."""
        kept, self.kept, self.fused = self.kept, None, None
        return kept is not None and kept is logprobs


STATE = _State()


class Counts:
    """What the opt-in did, for `report("verl")["sampling"]`: the actor's calls, its response
    tokens scored under the truncation and how many of them got -inf (outside the kept set),
    summed on the device (read once, by `report`), and the reference policy's calls."""

    def __init__(self):
        self.calls = self.reference = 0
        self._sums = None  # (response tokens, outside)

    def add(self, outside: torch.Tensor, mask: torch.Tensor):
        self.calls += 1
        got = torch.stack([mask.sum(), (outside & mask).sum()])
        self._sums = got if self._sums is None else self._sums + got.to(self._sums.device)

    def section(self, sampling: RolloutSampling) -> dict:
        tokens, outside = (0, 0) if self._sums is None else self._sums.tolist()
        return {
            **dataclasses.asdict(sampling),
            "actor_calls": self.calls,
            "response_tokens": tokens,
            "outside": outside,
            "reference_calls": self.reference,
        }


def for_engine(engine, o, count=False) -> RolloutSampling | None:
    """The truncation of this engine's log-probs: None without the opt-in and for the reference
    policy (counted where `count`)."""
    s = o.extras.get("sampling")
    if s is None:
        return None
    if bool(getattr(engine.engine_config, "forward_only", False)) or STATE.adapter_off:
        o.extras["sampling_counts"].reference += count
        return None
    return s


def count_response(o, out: dict, micro_batch):
    """Count the actor's response tokens in the engine's nested log-probs and those that are -inf,
    sliced as verl's losses slice them (`no_padding_2_padding`); a micro-batch without verl's
    response layout (prompts, responses, response_mask) counts the call only."""
    lp = out.get("log_probs")
    counts = o.extras["sampling_counts"]
    if lp is None or not all(k in micro_batch for k in ("prompts", "responses", "response_mask")):
        counts.calls += 1
        return
    pad = importlib.import_module(PADDING)
    flags = torch.nested.nested_tensor_from_jagged(
        torch.isneginf(lp.values().detach()), lp.offsets()
    )
    counts.add(pad.no_padding_2_padding(flags, micro_batch), micro_batch["response_mask"].bool())


class Truncated:
    """verl's logits path for one prepare_model_outputs call under the rollout's truncation: each
    entropy, log-prob and Σπ² it computes from its temperature-scaled logits, on token_logprobs
    with the truncation (never verl's untruncated functions); the entropy call, then the log-prob
    call on the same logits and labels, share one pass."""

    def __init__(self, sampling: RolloutSampling, labels):
        self.kw, self.labels = sampling.kwargs(), labels
        self._logits = self._lp = None

    def _labels_of(self, x):
        y = self.labels
        if isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(x.shape[:-1]):
            return y, True
        return torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device), False

    def entropy(self, logits, *args, **kwargs):
        x = logits
        y, real = self._labels_of(x)
        lp, ent = pk.token_logprobs(x, y, ignore_index=NO_IGNORE, return_entropy=True, **self.kw)
        if real:
            self._logits, self._lp = x, lp
        return ent

    def logprobs(self, logits, labels, inplace_backward=True):
        x, y = logits, labels
        same = y is self.labels or (
            isinstance(self.labels, torch.Tensor)
            and y.shape == self.labels.shape
            and torch.equal(y, self.labels)
        )
        if self._lp is not None and x is self._logits and same:
            lp, self._logits, self._lp = self._lp, None, None
            return lp
        need(y.dtype in (torch.int64, torch.int32), "labels", f"dtype {y.dtype}")
        return pk.token_logprobs(x, y, ignore_index=NO_IGNORE, **self.kw)

    def sum_p2(self, logits):
        x = logits
        y, _ = self._labels_of(x)
        st = pk.token_logprobs(x, y, ignore_index=NO_IGNORE, stats=("sum_p2",), **self.kw)[-1]
        return st.sum_p2


def disable_adapter(a, orig, o):
    """FSDPEngineWithLMHead.disable_adapter (verl's reference policy on the actor's own LoRA
    engine): the scope in which the engine scores for the reference, untruncated."""
    if o.extras.get("sampling") is None:
        raise Passthrough("no rollout sampling: the reference and the actor score alike")

    @contextlib.contextmanager
    def scope():
        with call(orig, a):
            STATE.adapter_off += 1
            try:
                yield
            finally:
                STATE.adapter_off -= 1

    return scope()


def configure(sampling=None) -> dict:
    """`apply("verl", sampling=...)`'s options, checked (Options.extras)."""
    return {"sampling": sampling_option(sampling), "sampling_counts": Counts()}


def report_section(extras: dict) -> dict:
    s = extras.get("sampling")
    return {"sampling": None if s is None else extras["sampling_counts"].section(s)}
