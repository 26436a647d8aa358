"""The peers' own test suites, unpatched and with `ppo_kernels.integrations.apply(peer)` active:
every test that passes unpatched must pass patched.

    python tests/integrations/peer_suites/run_peer_suites.py [verl] [trl] [openrlhf]
        [--src trl=DIR --src openrlhf=DIR --src verl=DIR] [--cache DIR] [--out FILE.md]

Where their tests come from (none of their code is kept in this repository):
  verl      the PyPI sdist of the installed version (`pip download --no-binary :all:`), which
            ships tests/trainer (core_algos, losses, advantages, rollout correction); a checkout
            given with --src verl=DIR adds tests/utils/test_torch_functional.py
  trl       a checkout (--src trl=DIR; its sdist ships no tests): tests/test_utils.py
            (selective_log_softmax, entropy_from_logits, the chunked log-prob function)
  liger     a checkout (--src liger=DIR; its sdist ships no tests): test/chunked_loss/
            test_grpo_loss.py (the fused linear GRPO loss), a selection of its cases ("select"
            below: the whole file is far too slow for a CPU run)
  openrlhf  a checkout (--src openrlhf=DIR; PyPI has no sdist): tests/test_loss_aggregation.py,
            tests/test_experience.py. They load the checkout's openrlhf/*.py under private module
            names; here the installed package stands in for the checkout's, and the patch is also
            applied to those private copies (the same targets, under their names).
A DIR may also be a bare git repository (a mirror): its HEAD's tests/ is read with `git archive`.
Each suite runs twice in a fresh pytest process from a temporary tree holding only the peer's
tests/ (the installed peer imported, never a source copy), with tests/integrations/peer_suites/
ppo_kernels_peer_plugin.py loaded (the peers' cluster-only imports stubbed, the patch applied
with strict=False, as environment activation does). Exit status 1 on a test that passes
unpatched and not patched, 2 when no suite could run.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]

SUITES = {
    "verl": {
        "files": [
            "tests/trainer/ppo/test_core_algos_on_cpu.py",
            "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
            "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
            "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
            "tests/trainer/ppo/test_rollout_corr.py",
            "tests/trainer/ppo/test_rollout_corr_integration.py",
            "tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py",
            "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
            "tests/utils/test_torch_functional.py",  # checkouts only (not in the sdist)
        ],
        "sdist": True,
    },
    "trl": {
        "files": ["tests/test_utils.py"],
        # names the stored TRL tests import that TRL 1.16 removed: a stand-in that raises, so
        # that the file collects (the tests of those functions then fail unpatched: not counted)
        "shims": [
            "trl.trainer.utils:patch_chunked_lm_head",
            "trl.import_utils:is_joblib_available",
        ],
        # fp16 / bf16 (parameters dtype2, dtype3): TRL's tests want torch's half-precision
        # log_softmax bit for bit, or the half-precision entropy within 1e-5; ours rounds once from
        # float32 (nearer the float64 value: README, "What differs")
        "known": {
            "tests.test_utils.TestSelectiveLogSoftmax::test_selective_log_softmax[[]dtype[23][]]": (
                "half precision: one rounding from float32, not torch's half log_softmax"
            ),
            "tests.test_utils.TestEntropyFromLogits::test_entropy_from_logits_2_dims[[]dtype[23]-*": (
                "half precision: one rounding from float32, not half-precision arithmetic"
            ),
        },
    },
    "liger": {
        "dist": "liger_kernel",
        # its tests live in test/ (with LFS data beside them): only what the GRPO tests import
        "paths": [
            "test/__init__.py",
            "test/conftest.py",
            "test/utils.py",
            "test/chunked_loss/__init__.py",
            "test/chunked_loss/test_grpo_loss.py",
        ],
        "files": ["test/chunked_loss/test_grpo_loss.py"],
        # 1590 cases, most at B x T x H x V = 8 x 128 x 1024 x 4096 under torch.compile: far too
        # slow on a CPU. Selected: every test at its small shapes (not N = 4096 or H = 1024), but
        # test_correctness only at the small shape in float32 with bias, beta 0.1, no delta,
        # for every loss type and level, with given ref / old log-probs and with the reference
        # head (ref_input) and no old log-probs; test_triton_* need a GPU
        "select": (
            "not 1024-4096 and not 4096-256-5000 and not large_seq and not test_triton and "
            "(not test_correctness[ or (None- and 3-47-31-123 and "
            "(-True-True-True-0.1-0.2-0.2-1.0-True-1.0-dtype1- or "
            "-True-False-False-0.1-0.2-0.2-1.0-True-1.0-dtype1-)))"
        ),
    },
    "openrlhf": {
        "files": ["tests/test_loss_aggregation.py", "tests/test_experience.py"],
        "link_package": True,
        "aliases": {
            "_openrlhf_loss_test.loss": "openrlhf.models.loss",
            "_openrlhf_loss_test.utils": "openrlhf.models.utils",
        },
    },
}


def _installed(peer):
    try:
        return importlib.metadata.version(SUITES[peer].get("dist", peer))
    except importlib.metadata.PackageNotFoundError:
        return None


def _sdist_tests(peer, version, cache):
    """tests/ of the peer's PyPI sdist at `version`, extracted once into the cache."""
    dest = cache / f"{peer}-{version}"
    if (dest / "tests").is_dir():
        return dest
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + ["-d", d, f"{peer}=={version}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        archives = list(pathlib.Path(d).glob(f"{peer}-{version}.tar.gz"))
        if r.returncode or not archives:
            raise RuntimeError(
                f"pip download of the {peer} {version} sdist failed: {r.stderr[-500:]}"
            )
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{peer}-{version}/tests/")]
            tar.extractall(d, members=members, filter="data")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(pathlib.Path(d) / f"{peer}-{version}", dest)
    return dest


def _tests_from(src, into, paths=("tests",)):
    """Copy `paths` (default tests/) of `src` (a checkout, or a bare git repository's HEAD) into
    `into`."""
    src = pathlib.Path(src)
    if (src / paths[0]).exists():
        for p in paths:
            if (src / p).is_dir():
                shutil.copytree(src / p, into / p)
            else:
                (into / p).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / p, into / p)
        return
    archive = subprocess.run(
        ["git", f"--git-dir={src}", "archive", "--format=tar", "HEAD", *paths],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    with tempfile.NamedTemporaryFile(suffix=".tar") as f:
        f.write(archive)
        f.flush()
        with tarfile.open(f.name) as tar:
            tar.extractall(into, filter="data")


def _outcomes(xml_path):
    """{test id: "passed" | "failed" | "error" | "skipped"} from a junit XML report."""
    out = {}
    if not os.path.exists(xml_path):
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        out[tid] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        out[tid] = {"failure": "failed"}.get(out[tid], out[tid])
    return out


def _run_pytest(tree, files, patch, cfg, reports):
    xml = tree / f"junit-{'patched' if patch else 'unpatched'}.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tests"), str(HERE), env.get("PYTHONPATH", "")]
    )
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    for k in ("PPO_KERNELS_PATCH", "VERL_USE_EXTERNAL_MODULES"):
        env.pop(k, None)
    env.pop("PPO_KERNELS_PEER_SUITE_PATCH", None)
    if patch:
        env["PPO_KERNELS_PEER_SUITE_PATCH"] = patch
        env["PPO_KERNELS_PEER_SUITE_REPORT"] = str(reports)
    if cfg.get("aliases"):
        env["PPO_KERNELS_PEER_SUITE_ALIASES"] = ",".join(
            f"{a}={m}" for a, m in cfg["aliases"].items()
        )
    if cfg.get("shims"):
        env["PPO_KERNELS_PEER_SUITE_SHIMS"] = ",".join(cfg["shims"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    cmd += ["ppo_kernels_peer_plugin", "--continue-on-collection-errors", f"--junitxml={xml}"]
    # the peer's tests as its own pytest imports them (not by our pyproject's importlib mode)
    cmd += ["--import-mode=prepend", "-o", "junit_family=xunit1", "--rootdir", str(tree), *files]
    if cfg.get("select"):
        cmd += ["-k", cfg["select"]]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    return _outcomes(xml), time.time() - t0, r


def run_suite(peer, src, cache):
    """(summary dict) for one peer, or raises RuntimeError saying why it cannot run here."""
    cfg = SUITES[peer]
    version = _installed(peer)
    if version is None:
        raise RuntimeError(f"{peer} is not installed")
    with tempfile.TemporaryDirectory(prefix=f"peer-suite-{peer}-") as d:
        tree = pathlib.Path(d)
        if src is not None:
            _tests_from(src, tree, cfg.get("paths", ("tests",)))
            where = f"{src} (tests of its HEAD / work tree)"
        elif cfg.get("sdist"):
            shutil.copytree(_sdist_tests(peer, version, cache) / "tests", tree / "tests")
            where = f"the {peer} {version} sdist from PyPI"
        else:
            raise RuntimeError(
                f"no test sources: pass --src {peer}=DIR (a checkout or a git mirror)"
            )
        if cfg.get("link_package"):  # the tests load <root>/<peer>/...: the installed package
            spec = importlib.util.find_spec(peer)
            (tree / peer).symlink_to(pathlib.Path(spec.origin).parent, target_is_directory=True)
        files = [f for f in cfg["files"] if (tree / f).is_file()]
        if not files:
            raise RuntimeError(f"none of {cfg['files']} in {where}")
        reports = tree / "report.json"
        base, t_base, r_base = _run_pytest(tree, files, None, cfg, reports)
        got, t_got, r_got = _run_pytest(tree, files, peer, cfg, reports)
        rep = json.loads(reports.read_text()) if reports.exists() else {}
    if not base:
        raise RuntimeError(
            f"pytest collected nothing:\n{r_base.stdout[-2000:]}{r_base.stderr[-2000:]}"
        )
    passed = [t for t, o in base.items() if o == "passed"]
    known, regressions = {}, []
    for t in passed:
        if got.get(t) != "passed":
            why = next(
                (w for pat, w in cfg.get("known", {}).items() if fnmatch.fnmatchcase(t, pat)), None
            )
            if why is None:
                regressions.append(t)
            else:
                known[why] = known.get(why, 0) + 1
    calls = {}
    for r in [rep] + rep.get("aliases", []):
        for name, s in r.get("functions", {}).items():
            if s["calls"]:
                c = calls.setdefault(name, [0, 0, 0])
                c[0] += s["calls"]
                c[1] += s["replaced"]
                c[2] += s["fallbacks"]
    return {
        "peer": peer,
        "version": version,
        "source": where,
        "files": files,
        "unpatched": _count(base),
        "patched": _count(got),
        "seconds": (round(t_base, 1), round(t_got, 1)),
        "regressions": regressions,
        "known": known,
        "calls": calls,
        "log": r_got.stdout[-3000:] if regressions else "",
    }


def _count(outcomes):
    c = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for o in outcomes.values():
        c[o] += 1
    return c


def _fmt(c):
    return (
        f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
    )


def _diffs(s):
    parts = [f"{len(s['regressions'])} regressions"] if s["regressions"] or not s["known"] else []
    parts += [f"{n} known: {why}" for why, n in s["known"].items()]
    return "; ".join(parts)


def markdown(results, skipped):
    lines = [
        "| peer | tests from | files | unpatched | patched | passing unpatched, not patched | our ops called (replaced / fallbacks) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in results:
        ops = ", ".join(
            f"`{n.rsplit('.', 2)[-2] + '.' + n.rsplit('.', 1)[-1] if '.' in n else n}` {c[1]}/{c[2]}"
            for n, c in sorted(s["calls"].items())
        )
        lines.append(
            f"| {s['peer']} {s['version']} | {s['source']} | "
            + ", ".join(f"`{f}`" for f in s["files"])
            + f" | {_fmt(s['unpatched'])} | {_fmt(s['patched'])} | {_diffs(s)} | {ops} |"
        )
    for peer, why in skipped.items():
        lines.append(f"| {peer} | not run: {why.splitlines()[0]} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("peers", nargs="*", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--src", action="append", default=[], help="PEER=DIR: the peer's checkout")
    ap.add_argument(
        "--cache",
        default=os.environ.get("PPO_KERNELS_PEER_CACHE", REPO / ".peer_tests"),
        help="where sdists' tests are kept (default .peer_tests/, ignored by git)",
    )
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    a = ap.parse_args(argv)
    srcs = dict(s.split("=", 1) for s in a.src)
    for peer in SUITES:  # PPO_KERNELS_PEER_SRC_TRL=DIR and the like, as --src
        env = os.environ.get(f"PPO_KERNELS_PEER_SRC_{peer.upper()}")
        if env and peer not in srcs:
            srcs[peer] = env
    results, skipped = [], {}
    for peer in a.peers:
        try:
            s = run_suite(peer, srcs.get(peer), pathlib.Path(a.cache))
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:
            skipped[peer] = str(e)
            print(f"{peer}: not run: {e}", flush=True)
            continue
        results.append(s)
        print(
            f"{peer} {s['version']} ({s['source']}): unpatched {_fmt(s['unpatched'])}; patched "
            f"{_fmt(s['patched'])}; {s['seconds'][0]} s / {s['seconds'][1]} s",
            flush=True,
        )
        for t in s["regressions"]:
            print(f"  passes unpatched, not patched: {t}")
        for why, n in s["known"].items():
            print(f"  {n} known differences: {why}")
        if s["log"]:
            print(s["log"])
    table = markdown(results, skipped)
    print(table)
    if a.out:
        pathlib.Path(a.out).write_text(table)
    if a.json:
        with contextlib.suppress(OSError):
            pathlib.Path(a.json).write_text(json.dumps({"results": results, "skipped": skipped}))
    if any(s["regressions"] for s in results):
        return 1
    return 0 if results else 2


if __name__ == "__main__":
    sys.exit(main())
