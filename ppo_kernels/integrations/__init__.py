"""Drop-in replacement of verl's, TRL's and OpenRLHF's per-token math, and of Liger's fused linear
GRPO loss, by ppo_kernels ops.

    import ppo_kernels.integrations as pki
    pki.apply("verl")            # or "trl", "openrlhf", "liger"; strict=True, dtype="peer"
    ...                          # the peer's code now runs our ops, same numbers
    print(pki.report("verl"))    # every replaced function: calls, replaced, fallbacks and why
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
    is counted) unless PPO_KERNELS_PATCH_STRICT=1.

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
    """The version prefixes of `peer` whose semantics the adapter was checked against."""
    return _peer(peer).versions


def apply(peer: str, *, strict: bool = True, dtype: str = "peer") -> dict:
    """Replace the peer's per-token functions by ppo_kernels ops everywhere the peer reaches them
    (defining module, `from ... import` copies, registries, class methods). Returns `report`."""
    _peer(peer).apply(strict=strict, dtype=dtype)
    return report(peer)


def revert(peer: str) -> None:
    """Put every original back (no-op when not applied)."""
    _peer(peer).revert()


@contextlib.contextmanager
def patched(peer: str, *, strict: bool = True, dtype: str = "peer"):
    apply(peer, strict=strict, dtype=dtype)
    try:
        yield _peer(peer)
    finally:
        revert(peer)


def report(peer: str) -> dict:
    """{"peer", "active", "version", "strict", "dtype", "functions": {qualified name: {"calls",
    "replaced", "fallbacks", "fallback_reasons": {reason: count}, "passed", "passed_reasons"
    (caller targets: calls with nothing to fuse, run as the peer's code), "notes" ({how: count}
    for replaced calls that took a second-best path, e.g. the logits instead of the hidden
    states), "patched_in": [places],
    and "unavailable": why, for a caller whose module does not import here}}}."""
    return _peer(peer).report()


def format_report(peer: str) -> str:
    r = report(peer)
    if not r["active"]:
        return f"{peer}: not patched"
    lines = [
        f"{peer} {r['version']} patched by ppo_kernels (strict={r['strict']}, dtype={r['dtype']})"
    ]
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
    """Apply the peers named in $PPO_KERNELS_PATCH (comma-separated); strict only with
    PPO_KERNELS_PATCH_STRICT=1. A peer that cannot be patched here is a warning, not an error."""
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
            apply(n, strict=strict)
            done.append(n)
        except (ImportError, UnsupportedVersion) as e:
            if strict:
                raise
            warnings.warn(f"PPO_KERNELS_PATCH: {n} not patched: {e}", stacklevel=2)
    return done


def worker_setup():
    """Ray `worker_process_setup_hook`: apply $PPO_KERNELS_PATCH in the worker."""
    activate_from_env()
