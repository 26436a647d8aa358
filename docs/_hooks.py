"""MkDocs hooks (mkdocs.yml `hooks:`): what the docs generate at build time.

- `::: ppo_kernels.NAME` in a page is the public name's reference entry. ppo_kernels/__init__.py
  says where NAME is defined (`from .token_logprobs.api import token_logprobs`), and the entry is
  rewritten to that path, so mkdocstrings reads the docstring from the source without importing
  torch (a name such as `gae` is both a subpackage and the function the package exports; read
  statically, the subpackage would win). Moving a function keeps its entry working.
- `<!-- bench-table: STEM -->` is replaced by the tables of bench/results/STEM.csv (`tables=0,2`
  picks some of a CSV read from a markdown file with several) and
  `<!-- bench-plot: STEM -->` by a bar chart (an SVG made here) of its timings;
  `<!-- bench-index -->` by the index of every benchmark (bench/run.py's table). The numbers on
  the benchmark page are the results files', never pasted.
"""

from __future__ import annotations

import ast
import csv
import html
import importlib.util
import math
import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PLOTS = "benchmarks"  # the folder of the generated SVGs in the site


def public_names():
    """{public name: dotted path of its definition}, from ppo_kernels/__init__.py's imports."""
    tree = ast.parse((ROOT / "ppo_kernels" / "__init__.py").read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for a in node.names:
                name = a.asname or a.name
                if not name.startswith("_"):
                    names[name] = f"ppo_kernels.{node.module}.{a.name}"
    return names


def _reference(markdown):
    names = public_names()

    def entry(m):
        name = m.group(1)
        if name not in names:
            raise ValueError(
                f"docs: `::: ppo_kernels.{name}` names no public import of ppo_kernels/__init__.py"
            )
        options = f"\n    options:\n      heading: {name}\n      toc_label: {name}"
        return f"::: {names[name]}{options}"

    return re.sub(r"^::: ppo_kernels\.(\w+)[ \t]*$", entry, markdown, flags=re.M)


# -- benchmark tables and plots -------------------------------------------------------------------


def _read(stem):
    path = RESULTS / f"{stem}.csv"
    if not path.exists():
        raise FileNotFoundError(f"docs: bench/results/{stem}.csv does not exist")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _ms(row):
    """A row's median time in ms, for the op tables (seconds) and the GPU reports (ms)."""
    for key, scale in (("seconds", 1e3), ("ms", 1.0)):
        try:
            return float(row[key]) * scale
        except (KeyError, TypeError, ValueError):
            continue
    return math.nan


def _fmt(ms):
    """A time in ms with 3 significant digits, never in e-notation."""
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _md_table(header, rows):
    esc = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(r) + " |" for r in esc]
    )


def bench_table(stem, only=None):
    """The tables of bench/results/STEM.csv as markdown (`only`: the indices of the tables to
    show, for a CSV read from a markdown file with several)."""
    rows = _read(stem)
    if not rows:
        return f"*(bench/results/{stem}.csv holds no rows)*"
    cols = list(rows[0])
    if "impl" in cols and ("seconds" in cols or "ms" in cols):  # op tables and GPU reports
        base = {}
        for r in rows:
            if r["impl"].startswith("eager"):
                base.setdefault((r.get("op"), r["case"]), _ms(r))
        head = (["op"] if "op" in cols else []) + ["case", "impl", "median ms", "vs eager"]
        peak = "peak_extra_mb" if "peak_extra_mb" in cols else "peak_mb"
        head.append("peak extra MiB")
        if "pct_bw" in cols:
            head.append("% of bandwidth")
        out = []
        for r in rows:
            t, b = _ms(r), base.get((r.get("op"), r["case"]))
            speed = f"{b / t:.2f}x" if b and t > 0 else ""
            cells = ([r["op"]] if "op" in cols else []) + [r["case"], r["impl"], _fmt(t), speed]
            cells.append(f"{float(r[peak]):.1f}" if r.get(peak) else "")
            if "pct_bw" in cols:
                cells.append(f"{float(r['pct_bw']):.0f}" if r.get("pct_bw") else "")
            out.append(cells)
        return _md_table(head, out)
    # tables read from a results markdown file: section, table index, then the table's columns
    parts, tables = [], {}
    for r in rows:
        if only is None or int(r["table"]) in only:
            tables.setdefault(r["table"], []).append(r)
    for group in tables.values():
        head = [c for c in cols[2:] if any(r.get(c) for r in group)]
        parts.append(
            f"**{group[0]['section']}**\n\n"
            + _md_table(head, [[r[c] for c in head] for r in group])
        )
    return "\n\n".join(parts)


BASELINES = ("eager", "torch.compile", "trl", "liger", "copy", "verl", "openrlhf", "logits")


def bench_plot_svg(stem):
    """Horizontal bars of each case's median times (log scale), each bar labelled with its time
    and implementation; ours in blue, the baselines (eager code, peers, a copy) in orange."""
    rows = [r for r in _read(stem) if _ms(r) == _ms(r) and _ms(r) > 0]
    key = lambda r: (r.get("op") or "") + (" " if r.get("op") else "") + r["case"]
    cases = list(dict.fromkeys(key(r) for r in rows))
    lo = math.floor(math.log10(min(_ms(r) for r in rows)))
    hi = max(math.ceil(math.log10(max(_ms(r) for r in rows))), lo + 1)
    left, width, bar, gap = 8, 360, 12, 8
    x = lambda ms: left + width * (math.log10(ms) - lo) / (hi - lo)
    out, y = [], 8
    for case in cases:
        out.append(f'<text x="{left}" y="{y + 10}" font-size="11" font-weight="bold">'
                   f"{html.escape(case)}</text>")  # fmt: skip
        y += 14
        for r in (r for r in rows if key(r) == case):
            w = max(x(_ms(r)) - left, 1)
            ours = not r["impl"].lower().startswith(BASELINES)
            out.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 2}" '
                f'fill="{"#3f51b5" if ours else "#ef8a17"}"/>'
                f'<text x="{left + w + 4:.1f}" y="{y + 9}" font-size="10">'
                f"{_fmt(_ms(r))} ms  {html.escape(r['impl'])}</text>"
            )
            y += bar
        y += gap
    for p in range(lo, hi + 1):
        out.insert(
            0,
            f'<line x1="{x(10**p):.1f}" y1="4" x2="{x(10**p):.1f}" y2="{y}" stroke="#ddd"/>'
            f'<text x="{x(10**p):.1f}" y="{y + 12}" font-size="9" text-anchor="middle">'
            f"{10**p:g}</text>",
        )
    out.append(
        f'<text x="{left + width / 2}" y="{y + 26}" font-size="10" text-anchor="middle">'
        "median ms (log scale); blue: ppo_kernels, orange: baselines</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 330}" '
        f'height="{y + 34}" font-family="sans-serif">{"".join(out)}</svg>\n'
    )


def _plottable(stem):
    cols = list(_read(stem)[0]) if _read(stem) else []
    return "impl" in cols and ("seconds" in cols or "ms" in cols)


def bench_index():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)  # the registry only: run.py imports torch lazily
    rows = []
    for name, (claim, stem, _) in run.BENCHMARKS.items():
        flag = "" if name in run.OP_TABLES else f" --only {name}"
        rows.append([claim, f"`bench/results/{stem}.md`", f"`bash scripts/dev.sh bench{flag}`"])
    for gpu in sorted(RESULTS.glob("gpu_*.md")):
        rows.append(
            [f"the GPU check on {gpu.stem[4:]}", f"`bench/results/{gpu.name}`",
             "`python bench/gpu_check.py`"]
        )  # fmt: skip
    return _md_table(["claim", "file", "command"], rows)


def _plots_in(markdown):
    return re.findall(r"<!-- bench-plot: (\w+) -->", markdown)


def on_files(files, config):
    """The SVG of every plot a page asks for, as a file of the site (so links to it validate)."""
    stems = set()
    for f in files.documentation_pages():
        stems.update(_plots_in(pathlib.Path(f.abs_src_path).read_text()))
    for stem in sorted(stems):
        if not _plottable(stem):
            raise ValueError(f"docs: bench/results/{stem}.csv has no timings to plot")
        files.append(File.generated(config, f"{PLOTS}/{stem}.svg", content=bench_plot_svg(stem)))
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = _reference(markdown)
    markdown = re.sub(
        r"<!-- bench-table: (\w+)(?: tables=([\d,]+))? -->",
        lambda m: bench_table(
            m.group(1), {int(t) for t in m.group(2).split(",")} if m.group(2) else None
        ),
        markdown,
    )
    depth = page.file.src_uri.count("/")
    markdown = re.sub(
        r"<!-- bench-plot: (\w+) -->",
        lambda m: f"![{m.group(1)}]({'../' * depth}{PLOTS}/{m.group(1)}.svg)",
        markdown,
    )
    return markdown.replace("<!-- bench-index -->", bench_index())
