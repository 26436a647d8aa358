"""uv's arguments for pip's configuration, so that scripts/dev.sh can install with uv from the same
places pip would.

Reads `pip config list` on stdin (lines such as `global.find-links='/opt/wheels'` or
`:env:.constraint='/etc/c.txt'`) and prints `uv pip install`'s arguments, one a line: the index,
the extra indexes, find-links, constraints, trusted hosts, --no-index and --pre. An environment
variable (`:env:`) replaces the configuration files' value of the same key, as in pip. pip merges
the versions of every index and takes the best; uv by default stops at the first index that has
the project, so `--index-strategy unsafe-best-match` comes first.

With --env it prints instead the environment uv reads for the settings it has no option for, one
`NAME=value` a line: pip's certificate bundle as SSL_CERT_FILE and its timeout as UV_HTTP_TIMEOUT,
each unless the environment already sets it.

Standard library only (it runs before the venv has anything installed).
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable

# pip's key -> uv's option; every value may hold several items, separated by whitespace
LISTS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
FLAGS = {"no-index": "--no-index", "pre": "--prerelease=allow"}
# pip's key -> the variable uv reads for it
ENV = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT"}


def config(lines: Iterable[str]) -> dict[str, str]:
    """pip's settings by key ("find-links"), the environment's over the files'."""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.strip().partition("=")
        if not sep or "." not in key:
            continue
        where, _, name = key.rpartition(".")
        if where not in ("global", "install", ":env:"):  # another command's section
            continue
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        (env if where == ":env:" else files)[name] = str(value)
    return {**files, **env}


def uv_args(lines: Iterable[str]) -> list[str]:
    conf = config(lines)
    args = ["--index-strategy", "unsafe-best-match"]
    for key, option in LISTS.items():
        for item in conf.get(key, "").split():
            args += [option, item]
    for key, option in FLAGS.items():
        if conf.get(key, "").lower() in ("1", "true", "yes", "on"):
            args.append(option)
    return args


def uv_env(lines: Iterable[str], environ=os.environ) -> list[str]:
    conf = config(lines)
    return [f"{var}={conf[key]}" for key, var in ENV.items() if key in conf and var not in environ]


if __name__ == "__main__":
    out = uv_env(sys.stdin) if sys.argv[1:] == ["--env"] else uv_args(sys.stdin)
    print("\n".join(out))
