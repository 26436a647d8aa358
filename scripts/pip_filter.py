"""pip's output for scripts/dev.sh, line by line, minus two kinds of noise on a run that works.

- "WARNING: Location '...' is ignored": this machine's pip configuration names local indexes
  that do not exist everywhere.
- The block "ERROR: pip's dependency resolver does not currently take into account all the
  packages that are installed ..." when every line of it is an unmet requirement of a peer
  (argv: their names or pins, "verl==0.9.1"): dev.sh installs verl / TRL / OpenRLHF with --no-deps on purpose (ray,
  vllm, deepspeed ... are what tests/support/peer_stubs.py stands in for), and pip repeats their
  pins after each later install. Such a block becomes one line saying what was left out and why. A
  conflict of any other package keeps the whole block, so real problems still show.

pip's exit status is not ours to change: dev.sh pipes into this under `set -o pipefail`.
Standard library only (it runs before the venv exists).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator

RESOLVER_HEADER = "ERROR: pip's dependency resolver does not currently take into account"
LOCATION_WARNING = "WARNING: Location"
# pip's two forms of a conflict line (pip/_internal/commands/install.py, _warn_about_conflicts)
CONFLICT = re.compile(
    r"^(?P<name>\S+) (?P<version>\S+) requires (?P<req>.+?)"
    r"(?:, which is not installed\.|, but you(?:'ll)? have .+ which is incompatible\.)$"
)


def _canonical(name: str) -> str:
    """The project name of a name or pin, normalised as pip compares them."""
    name = re.split(r"[=<>!~\[; ]", name, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _summary(block: list[re.Match]) -> str:
    peers = list(dict.fromkeys(f"{m['name']} {m['version']}" for m in block))
    missing = sum(m.string.endswith("which is not installed.") for m in block)
    return (
        f"== pip: {len(block)} unmet requirements of the peers {', '.join(peers)} not shown "
        f"({missing} not installed, {len(block) - missing} at another version): they are "
        "installed --no-deps on purpose, tests/support/peer_stubs.py stands in for their cluster "
        "stack; `pip check` lists them"
    )


def filter_lines(lines: Iterable[str], peers: Iterable[str]) -> Iterator[str]:
    """`lines` (without newlines) as dev.sh shows them."""
    peers = {_canonical(p) for p in peers}
    header, block = None, []

    def close():
        if header is None:
            return
        if all(_canonical(m["name"]) in peers for m in block) and block:
            yield _summary(block)
        else:
            yield header
            yield from (m.string for m in block)

    for line in lines:
        if line.startswith(LOCATION_WARNING):
            continue
        if header is not None:
            m = CONFLICT.match(line)
            if m:
                block.append(m)
                continue
            yield from close()
            header, block = None, []
        if line.startswith(RESOLVER_HEADER):
            header = line
            continue
        yield line
    yield from close()


def main(argv: list[str]) -> int:
    def stdin_lines():
        for line in sys.stdin:
            yield line.rstrip("\n")

    for line in filter_lines(stdin_lines(), argv):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
