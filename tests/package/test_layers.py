"""The package's layers (DEVELOPING.md "Layers"): dependencies point down only.

  1 base          _backend (the facade of _extension, _registry, _dispatch, _settings, _outputs,
                  _library), _checks, _modes, _memory, _triton_utils, distributed/_comm
  2 shared math   _math, _triton_math
  3 kernels       <op>/naive, <op>/triton_* (Triton kernels), <op>/tiles (an engine loss's tile
                  kernels), the fused-linear engine (fused_linear/*), the losses' configurations
                  and two-stage math
  4 registered    <op>/op (the registered ops' Python side) and a fused loss's head term
                  (<op>/head), distributed/* (the distributed forms)
  5 public API    <op>/api, linear_logprobs/hf, the package itself (ppo_kernels/__init__)
  6 users         integrations/*, trainer/*, __main__

Every import is read from the source, function-level ones included. The test fails on an import
cycle, on a module importing a higher layer, on a module below the API importing `distributed`
(only the API routes process_group=), and on a module the table above does not place."""

import ast
import os

import pytest
from support import ROOT
from support.skips import UNPLACED_MODULE

PKG = os.path.join(ROOT, "ppo_kernels")

BASE = {
    "_backend",
    "_checks",
    "_dispatch",
    "_extension",
    "_library",
    "_memory",
    "_modes",
    "_outputs",
    "_registry",
    "_settings",
    "_triton_utils",
}
MATH = {"_math", "_triton_math"}
KERNELS = {"naive", "tiles"}  # and triton_* (an op's Triton kernels)
# losses/: the shared two-stage math of every policy-loss type, its autograd reference and the
# rollout-correction math are kernel-level; policy_loss holds the registered op's Python side
LEAVES = {
    ("losses", "config"): 3,
    ("losses", "preference_config"): 3,
    ("losses", "distill_config"): 3,
    ("losses", "policy_math"): 3,
    ("losses", "policy_naive"): 3,
    ("losses", "rollout_correction"): 3,
    ("losses", "preference_math"): 3,
    ("losses", "preference_unpaired"): 3,
    ("losses", "preference_naive"): 3,
    ("losses", "distill_math"): 3,
    ("losses", "distill_naive"): 3,
    ("losses", "policy_loss"): 4,
    ("losses", "aggregate"): 5,
    ("losses", "pairwise"): 5,
}
# compiled extensions: `from ppo_kernels import _C` is not an import of the package
EXTENSIONS = {"ppo_kernels._C", "ppo_kernels._simt"}


def layer(mod: str) -> int | None:
    parts = mod.split(".")
    assert parts[0] == "ppo_kernels"
    rest = parts[1:]
    if not rest:
        return 5
    head = rest[0]
    if head in ("integrations", "trainer", "__main__"):
        return 6
    if len(rest) == 1:
        if head in BASE:
            return 1
        if head in MATH or head.startswith("_math"):
            return 2
        if head == "distributed":
            return 4  # the package of the distributed forms (its __init__ re-exports them)
        return 0  # an op folder's __init__: a docstring, no imports
    if head == "distributed":
        return 1 if len(rest) > 1 and rest[1] == "_comm" else 4
    if head == "_math":
        return 2
    leaf = rest[-1]
    if (head, leaf) in LEAVES:
        return LEAVES[head, leaf]
    if leaf == "api" or (head == "linear_logprobs" and leaf == "hf"):
        return 5
    if head == "fused_linear":
        return 3  # the engine every loss from hidden states runs on
    if leaf in ("op", "head"):
        return 4
    if leaf in KERNELS or leaf.startswith("triton_"):
        return 3
    return None


def _modules():
    out = {}
    for dirpath, _, files in os.walk(PKG):
        if "__pycache__" in dirpath:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            is_pkg = rel.endswith(".__init__")
            out[rel[: -len(".__init__")] if is_pkg else rel] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(mod: str) -> set[str]:
    path, is_pkg = MODULES[mod]
    tree = ast.parse(open(path).read(), path)
    pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            names = [n for n in names if n not in EXTENSIONS]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub not in EXTENSIONS:
                    names.append(sub if sub in MODULES else target)
        else:
            continue
        for n in names:
            if n == "ppo_kernels" or n.startswith("ppo_kernels."):
                # the longest known module prefix (import a.b.c names module a.b.c)
                while n not in MODULES and "." in n:
                    n = n.rsplit(".", 1)[0]
                if n != mod:
                    found.add(n)
    return found


# The one upward edge: PPO_KERNELS_PATCH=<peer> activates the drop-ins at the end of
# `import ppo_kernels`, so every process of a peer's trainer (Ray workers too) gets them.
ALLOWED_UP = {("ppo_kernels", "ppo_kernels.integrations")}

GRAPH = {m: {n for n in _imports(m) if (m, n) not in ALLOWED_UP} for m in MODULES}

# While op registrations move to C++: the modules of the op folders whose registration has not
# moved yet still break the rules (their op.py routes process_group=, their __init__ exports the
# API). Their tests are strict expected failures: once a folder has moved its tests pass, which
# fails them until the module leaves this set. Empty when every folder has moved.
PENDING: set[str] = set()


def _expect_pending(request, *mods):
    pending = sorted(m for m in mods if m in PENDING)
    if pending:
        reason = f"not moved to the C++ op layer yet: {pending}"
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if layer(m) is None)
    assert not unplaced, f"modules the layer table does not place: {unplaced}"


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) == 0))
def test_op_folder_inits_import_nothing(mod, request):
    """`import ppo_kernels.kl.naive` runs ppo_kernels/kl/__init__.py first: an import there
    would pull the API (or anything) into every kernel module's import."""
    _expect_pending(request, mod)
    assert not GRAPH[mod], f"{mod} imports {sorted(GRAPH[mod])}"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_point_down(mod, request):
    _expect_pending(request, mod)
    mine = layer(mod)
    if mine is None:
        pytest.skip(UNPLACED_MODULE)
    up = sorted(n for n in GRAPH[mod] if (layer(n) or 0) > mine)
    assert not up, f"{mod} (layer {mine}) imports higher layers: {up}"
    if mine < 5:
        dist = sorted(n for n in GRAPH[mod] if n.startswith("ppo_kernels.distributed"))
        if not mod.startswith("ppo_kernels.distributed"):
            assert not dist, f"{mod} imports {dist}: only the API routes process_group="


def test_no_import_cycle(request):
    _expect_pending(request, *PENDING)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
