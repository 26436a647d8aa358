"""Test helpers: NaN-poisoning of kernel outputs, the documented tolerances, the backends that
run an op here."""

import contextlib
import importlib.util
import os
import sys

import torch

from ppo_kernels import _backend

from . import BENCH, TESTS

sys.path.insert(0, BENCH)
from _common import peak_extra_bytes  # noqa: E402,F401  (the benchmarks' exact peak-memory probe)


def cpu_backends(op):
    """Backends that can run `op` on CPU tensors here (triton only through the interpreter)."""
    return [b for b in _backend.BACKENDS if _backend.available(op, b, "cpu")[0]]


# Tolerances of a float32-accumulating kernel against the float64 reference, per input dtype. The
# inputs are rounded to the dtype before the reference sees them, so forward outputs (float32)
# only carry float32 accumulation error; gradients are also rounded to the input dtype on output.
TOL = {
    torch.float32: dict(atol=5e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=5e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-5, rtol=2e-5),
}
GRAD_TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-4),
    torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),  # rounding to bf16: 2^-8 relative
    torch.float16: dict(atol=1e-6, rtol=2e-3),  # rounding to fp16: 2^-11 relative
}


@contextlib.contextmanager
def poisoned():
    """Every output buffer a kernel allocates starts NaN-filled (ints: -1)."""
    old = _backend.set_poison(True)
    try:
        yield
    finally:
        _backend.set_poison(old)


# Op-specific bounds, looser than TOL for a reason of the computation:
# gae: a float32 scan against float64. With gamma * lam < 1 a rounding error decays within about
# 1 / (1 - gamma * lam) steps; with gamma = lam = 1 the scan is a plain running sum over the whole
# row (up to 20000 positions in tests/cuda), where rounding accumulates.
SCAN_TOL = dict(atol=1e-4, rtol=1e-4)
SUM_SCAN_TOL = dict(atol=1e-2, rtol=1e-4)
# linear_token_logprobs: the logits come out of a GEMM (float32 accumulation over H in an order of
# the GPU's choosing), then the same float32 reductions as token_logprobs.
GEMM_TOL = dict(atol=1e-4, rtol=1e-4)
# ... and its gradients, with atol relative to the largest |gradient| (support/gpu.close_scaled):
# bf16/fp16 round the logits-gradient tile to the input dtype before the backward GEMMs, an error
# of up to 2^-8 relative on each of the V (or N) terms of a sum.
GEMM_GRAD_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
}


class PassThroughMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that changes nothing: calls under it take an op's traceable autograd path
    (its torch::autograd::Function and registered backward op) instead of a hand-built graph
    node (csrc/ops/plain_node.h)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def registered_ops(namespace: str) -> list[str]:
    """The names of every op registered in `namespace` (all of them: `dir(torch.ops.<ns>)` lists
    only the ops used so far in the process)."""
    prefix = namespace + "::"
    names = torch._C._dispatch_get_all_op_names()
    return sorted({n[len(prefix) :] for n in names if n.startswith(prefix)})


def load_test_file(relpath: str):
    """The test file tests/<relpath> as a module, for a test that reads another file's tables or
    reruns its tests. Test files are imported by path (pytest's importlib mode), not as a package
    (there is no name to import them by): this is the module pytest imported, or an import of the
    file as pytest makes it -- under the same name, assertions rewritten -- that pytest reuses."""
    path = os.path.join(TESTS, relpath)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) == path:
            return mod
    name = "tests." + relpath.removesuffix(".py").replace("/", ".")
    for finder in sys.meta_path:  # pytest's assertion rewriter comes first
        find = getattr(finder, "find_spec", None)
        spec = find(name, [os.path.dirname(path)]) if find else None
        if spec is not None and spec.origin == path:
            break
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class TinyCausalLM(torch.nn.Module):
    """The parts of a transformers causal LM that causal_lm_logprobs uses: a backbone returning
    the last hidden states, an output embedding, a config."""

    class _Backbone(torch.nn.Module):
        def __init__(self, V, H):
            super().__init__()
            self.embed = torch.nn.Embedding(V, H)

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return (torch.tanh(self.embed(input_ids)),)

    def __init__(self, V=7, H=4):
        super().__init__()
        self.model = self._Backbone(V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.config = type("Config", (), {})()

    def get_decoder(self):
        return self.model

    def get_output_embeddings(self):
        return self.lm_head
