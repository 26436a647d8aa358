"""verl 0.9's FSDP engine with `use_fused_kernels=True`: what verl refuses there, lifted.

verl asserts a number temperature when the fused kernels are on (a per-sample tensor only on its
logits path) and raises for `calculate_sum_pi_squared` (its Σπ² needs the logits). Our hidden-state
kernel takes per-row temperatures and gives sum_j p_j^2 from the same pass, so the engine's
`prepare_model_inputs` hands the model's fused forward the per-token temperatures verl lays out for
its logits path, and `prepare_model_outputs` takes the Σπ² the patched fused kernel kept.
"""

from __future__ import annotations

import sys
import threading

import torch

from ._args import need
from ._fused import call
from ._patch import Noted, Passthrough
from ._verl_sampling import STATE as SAMPLED
from ._verl_sampling import for_engine

FSDP = "verl.workers.engine.fsdp.transformer_impl"


class _SumP2(threading.local):
    """Σπ² for the fused forward of one micro-batch: `prepare_model_inputs` asks (or not), the
    patched fused kernel computes it in its pass and keeps it with its log-probs, and
    `prepare_model_outputs` takes it for the output holding those log-probs."""

    wanted = False
    kept = None

    def ask(self, wanted: bool):
        self.wanted, self.kept = bool(wanted), None

    def stats(self):
        """linear_token_logprobs' `stats` for the fused kernel's call."""
        return ("sum_p2",) if self.wanted else None

    def keep(self, logprobs, out):
        if self.wanted:
            self.kept = (logprobs, out[-1].sum_p2)

    def take(self, logprobs):
        kept, self.kept, self.wanted = self.kept, None, False
        return kept[1] if kept is not None and kept[0] is logprobs else None


SUM_P2 = _SumP2()


class _Overridden:
    """The micro-batch as verl's engine reads it (`get`, `[]`, attributes), some non-tensor flags
    overridden; the caller's batch itself untouched."""

    def __init__(self, micro_batch, **flags):
        self._mb, self._flags = micro_batch, flags

    def get(self, key, default=None):
        return self._flags[key] if key in self._flags else self._mb.get(key, default)

    def __getitem__(self, key):
        return self._flags[key] if key in self._flags else self._mb[key]

    def __contains__(self, key):
        return key in self._flags or key in self._mb

    def __getattr__(self, name):
        return getattr(self._mb, name)


def _flag(micro_batch, key, default=False):
    return sys.modules[FSDP].tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def _with_flags(a: dict, **flags):
    b = dict(a)
    b["micro_batch"] = _Overridden(a["micro_batch"], **flags)
    return b


def fsdp_model_inputs(a, orig, o):
    """FSDPEngineWithLMHead.prepare_model_inputs with use_fused_kernels and a per-sample
    temperature tensor (verl asserts a number): verl's own inputs of its logits path, which lays
    the temperatures out per token as the model's packed / Ulysses-sliced rows, plus what its fused
    branch adds; the temperatures go to the fused forward as [1, tokens, 1] (remove-padding) or
    [batch, 1, 1], which the patched fused kernels take per row. Also asks the fused kernel for
    Σπ² where the micro-batch wants it, and for the rollout's truncation (`apply(...,
    sampling=)`) where the engine scores for the actor. An engine that overrides prepare_model_inputs (VeOmni's:
    its model's fused forward runs VeOmni's kernels, not verl's) keeps verl's assertion."""
    self, mb = a["self"], a["micro_batch"]
    fused = _flag(mb, "use_fused_kernels")
    SUM_P2.ask(fused and _flag(mb, "calculate_sum_pi_squared"))
    SAMPLED.ask(for_engine(self, o) if fused else None)
    t = mb["temperature"]
    if not fused:
        raise Passthrough("use_fused_kernels=False: verl takes a per-sample temperature itself")
    if not isinstance(t, torch.Tensor):
        raise Passthrough("a number temperature: verl's fused branch passes it on")
    need(t.dim() == 1, "temperature", f"shape {tuple(t.shape)}: expected [batch] (per sample)")
    ours = sys.modules[FSDP].FSDPEngineWithLMHead.prepare_model_inputs
    need(
        type(self).prepare_model_inputs is ours,
        "self",
        f"{type(self).__name__} overrides prepare_model_inputs: its fused forward may not run "
        "verl's kernels",
    )
    inputs, args = call(orig, _with_flags(a, use_fused_kernels=False))
    if _flag(mb, "use_remove_padding", True):
        temperature = args["temperature_rmpad"].view(1, -1, 1)
        inputs["shift_labels"] = args["input_ids_rmpad_rolled"].unsqueeze(0)
    else:
        temperature = args["temperature"].view(-1, 1, 1)
    inputs.update(temperature=temperature, return_dict=True)
    return inputs, args


def fused_sum_p2_outputs(a, orig):
    """prepare_model_outputs with use_fused_kernels and calculate_sum_pi_squared (verl raises:
    no logits): verl's own outputs without Σπ², then the Σπ² the fused kernel kept, unpadded,
    gathered and nested as verl's fused branch does the log-probs."""
    self, out, args, mb = a["self"], a["output"], a["output_args"], a["micro_batch"]
    sp = SUM_P2.take(getattr(out, "log_probs", None))
    need(
        sp is not None,
        "calculate_sum_pi_squared",
        "the fused forward's log-probs are not from a patched fused kernel asked for Σπ² by "
        "prepare_model_inputs",
    )
    res = call(orig, _with_flags(a, calculate_sum_pi_squared=False))
    offsets = mb["input_ids"].offsets()
    if _flag(mb, "use_remove_padding", True):
        sp = self._gather_and_unpad_packed(sp.squeeze(0), args["pad_size"])
    else:
        mask = torch.arange(sp.shape[1], device=sp.device) < offsets.diff().unsqueeze(1)
        sp = sp[mask]
    res["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(sp, offsets)
    return Noted(res, "sum_pi_squared from the fused kernel's pass (linear_token_logprobs)")
