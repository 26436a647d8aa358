"""Docstrings of the public API, and no dates or issue numbers in the source.

The public callables are what `ppo_kernels` exports, the public names of
`ppo_kernels.integrations`, and the configuration classes of `ppo_kernels/losses/config.py`.
Each one has a docstring whose `Args:` section (Google style) has one entry per parameter of
`inspect.signature`, and no entry that is not a parameter (a callable without parameters needs
no section). The rules:

- An entry is a line at the section's first indentation: `name (type): text` or `name: text`.
  Its continuation lines are indented deeper. Any other line at that indentation is an error.
- `*args` / `**kwargs` are written with or without their stars.
- Several parameters sharing one description may share an entry: `tau_pos, tau_neg: ...`.
- A class documents its constructor's parameters under `Args:` or `Attributes:`.
- A function decorated with `takes_configs` lists each configuration keyword (`loss_config`,
  ...) itself. The flat fields in its signature are documented by their configuration class's
  own `Args:` (checked here too), so the function need not repeat them; an entry it does write
  must still be a parameter.

The second test greps the source (ppo_kernels/, csrc/, tests/, bench/ but its results/,
scripts/) for dates and issue numbers. Measurements live in bench/results/ and history in git,
so a comment points to a bench/results file by name: such a file name is the one place a date
may appear.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest

import ppo_kernels
import ppo_kernels.integrations as integrations
from ppo_kernels.losses import config


def _repo_root():
    """The checkout's root (the folder with setup.py), wherever under tests/ this file sits."""
    d = os.path.dirname(os.path.abspath(__file__))
    while not os.path.exists(os.path.join(d, "setup.py")) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    return d


ROOT = _repo_root()

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\([^)]*\))?\s*:(?:\s|$)")


def _public():
    """{qualified name: object} of every public callable."""
    out = {}
    for mod in (ppo_kernels, integrations):
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") or inspect.ismodule(obj) or not callable(obj):
                continue
            out[f"{mod.__name__}.{name}"] = obj
    for cls in config.CONFIGS:
        out[f"ppo_kernels.{cls.__name__}"] = cls
    return out


PUBLIC = _public()


def parse_args(doc: str | None, sections=("Args", "Arguments")) -> tuple[list[str], list[str]]:
    """(documented names, malformed lines) of a docstring's argument sections."""
    names: list[str] = []
    bad: list[str] = []
    lines = inspect.cleandoc(doc or "").splitlines()
    i = 0
    while i < len(lines):
        m = _SECTION.match(lines[i])
        i += 1
        if not m or m.group(2) not in sections:
            continue
        head = len(m.group(1))
        indent = None
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            ind = len(line) - len(line.lstrip())
            if ind <= head:
                break
            if indent is None:
                indent = ind
            if ind < indent:
                bad.append(line.strip())
            elif ind == indent:
                e = _ENTRY.match(line.strip())
                if e:
                    names += [n.strip().lstrip("*") for n in e.group(1).split(",")]
                else:
                    bad.append(line.strip())
            i += 1
    return names, bad


def _params(obj) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a class with a builtin constructor: no parameters
        return []
    return [p for p in sig.parameters if p != "self"]


def check(obj) -> list[str]:
    """What is wrong with obj's docstring: [] when every parameter has its entry."""
    sections = ("Args", "Arguments", "Attributes") if inspect.isclass(obj) else ("Args",)
    names, bad = parse_args(obj.__doc__, sections)
    params = _params(obj)
    errors = [f"malformed Args line: {b!r}" for b in bad]
    by_config = set()
    for cls in getattr(obj, "config_params", {}).values():
        by_config |= set(parse_args(cls.__doc__)[0]) & set(config.fields(cls))
    for p in params:
        if p not in names and p not in by_config:
            errors.append(f"parameter {p!r} has no Args entry")
    for n in names:
        if n not in params:
            errors.append(f"Args entry {n!r} is not a parameter")
    dup = {n for n in names if names.count(n) > 1}
    errors += [f"Args entry {n!r} written twice" for n in sorted(dup)]
    return errors


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_argument_is_documented(name):
    obj = PUBLIC[name]
    assert obj.__doc__, f"{name}: no docstring"
    errors = check(obj)
    assert not errors, f"{name}: " + "; ".join(errors)


def test_the_checker_finds_undocumented_and_unknown_arguments():
    def f(a, b, *, c=1, **kw):
        """Summary.

        Args:
            a (Tensor): `[N]`.
                More about a.
            c: a number. Default 1.
            d: not a parameter.
        """

    errors = check(f)
    assert "parameter 'b' has no Args entry" in errors
    assert "parameter 'kw' has no Args entry" in errors
    assert "Args entry 'd' is not a parameter" in errors
    assert len(errors) == 3, errors

    def g(x, y):
        """Summary.

        Args:
            x, y: grouped.
            and a loose line
        """

    assert check(g) == ["malformed Args line: 'and a loose line'"]


# ------------------------------------------------------------------ no dates, no issue numbers
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
_ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
_RESULTS = re.compile(r"bench/results/[\w.\-]+")  # a results file's name may hold its date
_SOURCE_EXT = (".py", ".cpp", ".h", ".cu", ".cuh", ".sh")


def _source_files():
    """The source files of ppo_kernels/, csrc/, tests/, bench/ (not its results) and scripts/."""
    for root in ("ppo_kernels", "csrc", "tests", "bench", "scripts"):
        for d, dirs, files in os.walk(os.path.join(ROOT, root)):
            dirs[:] = [x for x in dirs if not x.startswith((".", "__pycache__")) and x != "results"]
            for f in files:
                if f.endswith(_SOURCE_EXT):
                    yield os.path.join(d, f)


def find_dates_and_issues(text: str) -> list[str]:
    """Each date or issue number in text (a bench/results file name excepted)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = _RESULTS.sub("", line)
        out += [f"{n}: {m.group(0)}" for m in _DATE.finditer(line)]
        out += [f"{n}: {m.group(0)}" for m in _ISSUE.finditer(line)]
    return out


def test_the_grep_finds_dates_and_issue_numbers():
    # the dates and numbers are built here so that this file passes its own grep
    date, issue, tag = "20" + "26-11-30", "Issue" + " #21", "issue" + " 9"
    assert find_dates_and_issues(f"# the run of {date}\n# see {issue}") == [
        f"1: {date}",
        f"2: {issue}",
    ]
    assert find_dates_and_issues(f"# bench/results/gpu_{date}_gpu.md, {tag}") == [f"1: {tag}"]
    assert find_dates_and_issues("# an issue of size 3; issues with it") == []


def test_no_dates_or_issue_numbers_in_the_source():
    found = []
    for path in _source_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            hits = find_dates_and_issues(f.read())
        rel = os.path.relpath(path, ROOT)
        found += [f"{rel}:{h}" for h in hits]
    assert not found, "dates / issue numbers (history lives in git):\n" + "\n".join(found)
