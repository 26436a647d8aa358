"""The documentation against the code: every public name of ppo_kernels has a reference entry,
the README's Python blocks run, the README stays short, and bench/results holds one indexed
current result per claim. The site itself is built by `bash scripts/dev.sh docs --build` (CI's
docs stage), which fails on a broken link or an entry that does not resolve."""

import inspect
import os
import re

import pytest
import torch
from support import ROOT

import ppo_kernels

REFERENCE = os.path.join(ROOT, "docs", "reference")


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def public_names():
    """The names `import ppo_kernels` exports: everything public that is not a module."""
    return sorted(
        n for n, v in vars(ppo_kernels).items() if not n.startswith("_") and not inspect.ismodule(v)
    )


def reference_entries():
    """{name: page} of the `::: ppo_kernels.<name>` lines of docs/reference/*.md."""
    entries = {}
    for page in sorted(os.listdir(REFERENCE)):
        if page.endswith(".md"):
            for name in re.findall(r"^::: ppo_kernels\.(\w+)\s*$", _read(REFERENCE, page), re.M):
                entries[name] = page
    return entries


def test_public_names_found():
    names = public_names()
    assert "token_logprobs" in names and "gae" in names and "linear_policy_loss" in names


@pytest.mark.parametrize("name", public_names())
def test_every_public_name_has_a_reference_entry(name):
    obj = getattr(ppo_kernels, name)
    pages = "".join(_read(REFERENCE, p) for p in sorted(os.listdir(REFERENCE)) if p.endswith(".md"))
    if callable(obj):
        assert name in reference_entries(), (
            f"ppo_kernels.{name} has no reference entry: add the line `::: ppo_kernels.{name}` "
            "to the page of docs/reference/ it belongs on (its docstring is rendered there)"
        )
    else:  # a constant: named in the text of a reference page
        assert f"`{name}`" in pages, f"ppo_kernels.{name} is named on no page of docs/reference/"


def test_every_reference_entry_is_a_public_name():
    stale = sorted(set(reference_entries()) - set(public_names()))
    assert not stale, f"docs/reference/ documents names ppo_kernels does not export: {stale}"


def test_every_reference_page_is_in_the_navigation():
    nav = _read("mkdocs.yml")
    for page in os.listdir(REFERENCE):
        if page.endswith(".md"):
            assert f"reference/{page}" in nav, f"docs/reference/{page} is not in mkdocs.yml's nav"


def _python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_readme_python_blocks_run(capsys):
    blocks = _python_blocks(_read("README.md"))
    assert blocks, "the README has no Python block"
    torch.manual_seed(0)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert "hidden.grad (4, 16, 32)" in out
    assert "tokens outside the kept sets" in out


def test_readme_is_short():
    lines = _read("README.md").count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail into docs/ (at most ~300)"


def test_readme_ops_list_names_every_function():
    readme = _read("README.md")
    missing = [n for n in public_names() if inspect.isfunction(getattr(ppo_kernels, n))]
    missing = [n for n in missing if f"`{n}`" not in readme]
    assert not missing, f"README.md's op list does not name {missing}"


def test_bench_results_one_indexed_result_per_claim():
    results = os.path.join(ROOT, "bench", "results")
    index = _read("bench", "results", "README.md")
    listed = set(re.findall(r"\(([\w.-]+\.(?:md|csv))\)", index))
    files = {f for f in os.listdir(results) if f != "README.md"}
    assert files - listed == set(), f"bench/results files not in its README.md: {files - listed}"
    assert listed - files == set(), f"bench/results/README.md lists missing files: {listed - files}"
    for f in sorted(files):
        stem, ext = os.path.splitext(f)
        assert not re.search(r"\d{4}-\d{2}-\d{2}|_run\d|_[a-c]$", stem), (
            f"bench/results/{f}: one current result per claim, named after its benchmark "
            "(no dates or run suffixes; earlier runs live in git's history)"
        )
        other = ".csv" if ext == ".md" else ".md"
        assert stem + other in files, f"bench/results/{f} has no {other} beside it"
        if ext == ".md":
            text = _read("bench", "results", f)
            assert re.search(r"20\d\d-\d\d-\d\d", text), f"bench/results/{f} names no date"
            assert re.search(r"commits? [0-9a-f]{7}|in [0-9a-f]{7}", text), (
                f"bench/results/{f} names no commit"
            )


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _read("README.md")):
        assert os.path.exists(os.path.join(ROOT, target)), f"README.md links to missing {target}"
