"""A pytest plugin (tests/conftest.py loads it): the short test summary's skips (-rs, -ra) as one
line per reason with its count, most frequent first. pytest folds skips by (file, line,
reason), which for this suite repeats each reason once per file or parametrised skip site (~47
lines); the reason is what a reader needs. Failures, errors and xfails are pytest's own lines,
after these; `--no-fold-skipped` still lists every skipped test."""

from __future__ import annotations

from collections import Counter

import pytest

_ON = pytest.StashKey[bool]()


def skip_reasons(reports) -> list[tuple[int, str]]:
    """(count, reason) of skip reports, most frequent first (then in order of appearance)."""
    counts = Counter()
    for rep in reports:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        counts[reason.removeprefix("Skipped: ")] += 1
    return [(n, r) for r, n in counts.most_common()]


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or "s" not in tr.reportchars or not tr.foldskipped:
        return
    tr.reportchars = tr.reportchars.replace("s", "")  # pytest's skip lines: ours instead
    config.stash[_ON] = True


# a plain hook: runs inside the terminal reporter's wrapper, before its short test summary, so
# failures and errors stay the last lines above the final counts
def pytest_terminal_summary(terminalreporter, config):
    skipped = terminalreporter.stats.get("skipped", [])
    if not (config.stash.get(_ON, False) and skipped):
        return
    reasons = skip_reasons(skipped)
    n = len(reasons)
    terminalreporter.write_sep(
        "=", f"{len(skipped)} skipped, {n} reason{'s' if n > 1 else ''}", yellow=True
    )
    for count, reason in reasons:
        terminalreporter.write_line(f"SKIPPED [{count}] {reason}")
