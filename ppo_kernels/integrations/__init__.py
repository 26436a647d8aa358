"""Drop-in replacement of verl's, TRL's and OpenRLHF's per-token math, and of Liger's fused linear
GRPO loss, by ppo_kernels ops.

    import ppo_kernels.integrations as pki
    pki.apply("verl")            # or "trl", "openrlhf", "liger"; strict=True, dtype="peer"
    ...                          # the peer's code now runs our ops, same numbers
    print(pki.report("verl"))    # every replaced function: calls, replaced, fallbacks and why
    pki.apply("verl", sampling={"top_k": 50, "top_p": 0.9})  # the trainer's log-probs under the
                                 # rollout's truncation (opt-in; docs/integrations/verl.md)
    pki.revert("verl")           # or: with pki.patched("verl"): ...

In every worker process (Ray actors included):
  * verl: `VERL_USE_EXTERNAL_MODULES=ppo_kernels.integrations.verl` (verl imports it on its own
    import, in the driver and in each worker it starts);
  * any peer: `PPO_KERNELS_PATCH=trl,openrlhf` (or verl) in the environment, honoured when
    ppo_kernels is imported, plus Ray's `worker_process_setup_hook` to import it there:
        ray.init(runtime_env={
            "env_vars": {"PPO_KERNELS_PATCH": "openrlhf"},
            "worker_process_setup_hook": "ppo_kernels.integrations.worker_setup"})
    Environment activation uses strict=False (an unsupported call runs the peer's own code and
    is counted) unless PPO_KERNELS_PATCH_STRICT=1; verl's `sampling` comes from
    PPO_KERNELS_VERL_SAMPLING ("top_k=50,top_p=0.9").

strict=True raises `Unsupported` naming the argument when a call uses something our op cannot
express; strict=False runs the peer's original for that call and counts it in `report`.
dtype="peer" returns the dtype the peer's function returns; "float32" keeps our float32.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings

from ._patch import Unsupported, UnsupportedVersion  # noqa: F401 (public: pki.Unsupported)

PEERS = ("verl", "trl", "openrlhf", "liger")
_peers: dict = {}


def _peer(name: str):
    if name not in PEERS:
        raise ValueError(f"peer: expected one of {PEERS}, got {name!r}")
    if name not in _peers:
        _peers[name] = importlib.import_module(f"ppo_kernels.integrations._{name}").PEER
    return _peers[name]


def supported_versions(peer: str) -> tuple[str, ...]:
    """The version prefixes of a peer whose semantics the adapter was checked against.

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".

    Returns:
        tuple[str, ...]: prefixes such as "0.9." (any 0.9.x) or an exact version.
    """
    return _peer(peer).versions


def apply(peer: str, *, strict: bool = True, dtype: str = "peer", sampling=None) -> dict:
    """Replace a peer's per-token functions by ppo_kernels ops, everywhere the peer reaches them.

    Every place is patched: the defining module, `from ... import` copies, registries and class
    methods. The peer's code then runs our ops and gives the same numbers. `revert` undoes it.

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".
        strict (bool): True: a call using something our op cannot express raises `Unsupported`
            naming the argument, and an unsupported peer version raises `UnsupportedVersion`.
            False: such a call runs the peer's own code and is counted in `report`; another
            version is patched with a warning. Default True.
        dtype (str): "peer": return the dtype the peer's function returns. "float32": keep our
            float32 results. Default "peer".
        sampling (dict, optional): verl only. The rollout's truncation, `{"top_k": int,
            "top_p": float, "min_p": float, "sampler": "vllm" | "sglang"}` (verl's rollout
            config values; -1 / 1.0 / 0.0 mean off): the actor's log-probs and entropy are then
            computed under the distribution the rollout sampled from, as vLLM's
            processed_logprobs are; the reference policy keeps the untruncated softmax. A label
            outside the kept set gets -inf (counted in `report`). Default None: unchanged.

    Why: a drop-in with the peer's exact semantics lets a trainer adopt the fused ops without
    changing its code; strict mode makes every gap visible instead of silent.
    """
    _peer(peer).apply(strict=strict, dtype=dtype, sampling=sampling)
    return report(peer)


def revert(peer: str) -> None:
    """Put back every original function of a peer; a no-op when it is not patched.

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".
    """
    _peer(peer).revert()


@contextlib.contextmanager
def patched(peer: str, *, strict: bool = True, dtype: str = "peer", sampling=None):
    """Context manager: `apply(peer, ...)` for the `with` block, then `revert(peer)`.

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".
        strict (bool): as in `apply`. Default True.
        dtype (str): as in `apply`. Default "peer".
        sampling (dict, optional): as in `apply` (verl only). Default None.

    Returns:
        ContextManager: yields the peer's adapter; `report(peer)` reads its counts.
    """
    apply(peer, strict=strict, dtype=dtype, sampling=sampling)
    try:
        yield _peer(peer)
    finally:
        revert(peer)


def report(peer: str) -> dict:
    """What the patch of a peer did: per replaced function, its calls, replacements and fallbacks.

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".

    Returns:
        dict: `{"peer", "active", "version", "strict", "dtype", "functions"}`. `functions` maps each
        qualified name to `{"calls", "replaced", "fallbacks", "fallback_reasons", "passed",
        "passed_reasons", "notes", "patched_in"}`. `fallback_reasons` counts each reason a call ran
        the peer's code. `passed` counts calls of a caller target with nothing to fuse. `notes`
        counts replaced calls that took a second-best path (e.g. the logits instead of the hidden
        states). `patched_in` lists the places patched. `"unavailable"` says why a caller's module
        does not import here.
    """
    return _peer(peer).report()


def format_report(peer: str) -> str:
    """`report(peer)` as readable text: one line per function, then its reasons and notes.

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".

    Returns:
        str: the report, or "<peer>: not patched".
    """
    r = report(peer)
    if not r["active"]:
        return f"{peer}: not patched"
    lines = [
        f"{peer} {r['version']} patched by ppo_kernels (strict={r['strict']}, dtype={r['dtype']})"
    ]
    if r.get("sampling"):
        lines.append(f"  rollout sampling: {r['sampling']}")
    for name, s in r["functions"].items():
        lines.append(
            f"  {name}: {s['calls']} calls, {s['replaced']} replaced, {s['fallbacks']} "
            f"fallbacks, {s['passed']} passed through; in {len(s['patched_in'])} places"
        )
        if "unavailable" in s:
            lines.append(f"      unavailable: {s['unavailable']}")
        for why, n in s["fallback_reasons"].items():
            lines.append(f"      fallback x{n}: {why}")
        for why, n in s["passed_reasons"].items():
            lines.append(f"      passed through x{n} (nothing to fuse): {why}")
        for how, n in s["notes"].items():
            lines.append(f"      replaced x{n} by {how}")
    return "\n".join(lines)


def activate_from_env() -> list[str]:
    """Apply the peers named in the environment variable PPO_KERNELS_PATCH (comma-separated).

    Strict only with PPO_KERNELS_PATCH_STRICT=1. A peer that cannot be patched here (not
    installed, an unsupported version) is a warning, not an error, unless strict. `import
    ppo_kernels` calls it when the variable is set.

    Returns:
        list[str]: the peers that are patched.
    """
    names = [
        n.strip().lower() for n in os.environ.get("PPO_KERNELS_PATCH", "").split(",") if n.strip()
    ]
    strict = os.environ.get("PPO_KERNELS_PATCH_STRICT", "0") == "1"
    done = []
    for n in names:
        p = _peer(n)
        if p.active is not None:
            done.append(n)
            continue
        try:
            apply(n, strict=strict, **env_options(n))
            done.append(n)
        except (ImportError, UnsupportedVersion) as e:
            if strict:
                raise
            warnings.warn(f"PPO_KERNELS_PATCH: {n} not patched: {e}", stacklevel=2)
    return done


def env_options(peer: str) -> dict:
    """A peer's own `apply` options from the environment: verl's `sampling` from
    PPO_KERNELS_VERL_SAMPLING ("top_k=50,top_p=0.9,min_p=0.05,sampler=vllm").

    Args:
        peer (str): "verl", "trl", "openrlhf" or "liger".

    Returns:
        dict: keywords for `apply`.
    """
    s = os.environ.get("PPO_KERNELS_VERL_SAMPLING", "").strip()
    return {"sampling": s} if peer == "verl" and s else {}


def worker_setup():
    """Ray `worker_process_setup_hook`: apply $PPO_KERNELS_PATCH in the worker."""
    activate_from_env()
