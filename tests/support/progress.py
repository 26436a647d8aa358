"""A pytest plugin (tests/conftest.py loads it): a quiet run (-q) names the running test file when
no result has come for a while, so that its silences say where it is (the bad-input child, the
distributed workers and the trainer runs take a minute or more each). One line after 30 s, then
after 60, 120, ... s of the same silence; `--quiet-notes=SECONDS` sets the first wait, 0 turns the
lines off. Under pytest-xdist the controller writes them, naming every file still running."""

from __future__ import annotations

import os
import sys
import threading
import time


def pytest_addoption(parser):
    parser.addoption(
        "--quiet-notes",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with -q: name the running test files after this many seconds without a result "
        "(0: never)",
    )


def pytest_configure(config):
    after = config.getoption("quiet_notes")
    if after <= 0 or config.getoption("verbose") >= 0 or hasattr(config, "workerinput"):
        return
    try:  # a test's output capture redirects fd 1: write to a copy of it taken now
        out = os.fdopen(os.dup(sys.stdout.fileno()), "w", closefd=True)
    except (AttributeError, OSError, ValueError):  # no real stdout (e.g. an embedded run)
        return
    config.pluginmanager.register(_Notes(config, after, out), "ppo_kernels_quiet_notes")


class _Notes:
    def __init__(self, config, after, out):
        self.config, self.after, self.out = config, after, out
        self.running: dict[str, None] = {}  # node ids, in start order
        self.last = time.monotonic()
        self.wait = after
        self.after_note = False  # nothing written since the last note: no newline before the next
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="quiet-notes", daemon=True)
        self.thread.start()

    def pytest_runtest_logstart(self, nodeid, location):
        self.running[nodeid] = None

    def pytest_runtest_logreport(self, report):
        self.last, self.wait, self.after_note = time.monotonic(), self.after, False

    def pytest_runtest_logfinish(self, nodeid, location):
        self.running.pop(nodeid, None)

    def pytest_unconfigure(self, config):
        self.stop.set()
        self.thread.join()
        self.out.close()

    def _loop(self):
        while not self.stop.wait(1.0):
            idle = time.monotonic() - self.last
            files = list(dict.fromkeys(n.split("::", 1)[0] for n in list(self.running)))
            if idle < self.wait or not files:
                continue
            self.wait *= 2
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            mid_line = tr is not None and tr._tw.width_of_current_line and not self.after_note
            self.out.write(f"{chr(10) if mid_line else ''}[{idle:.0f} s in {', '.join(files)}]\n")
            self.out.flush()
            self.after_note = True
