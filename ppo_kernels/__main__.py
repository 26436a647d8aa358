"""`python -m ppo_kernels {info,train}` (benchmarks: bench/run.py)."""

from __future__ import annotations

import argparse
import os
import sys


def _info(args):
    import platform

    import torch

    import ppo_kernels
    from ppo_kernels import _backend

    print(f"ppo-kernels {ppo_kernels.__version__}")
    print(
        f"python {platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda or 'none'})"
    )
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    print(f"triton {tv}{' (TRITON_INTERPRET=1)' if _backend.triton_interpreting() else ''}")
    if _backend.HAS_EXTENSION:
        cuda_built = any(
            _backend.has_compiled_kernel(o.kernel, "cuda")
            for o in _backend.OPS.values()
            if o.kernel
        )
        print(
            f"compiled extension: yes (CPU kernels; CUDA kernels: {'yes' if cuda_built else 'no'})"
        )
    else:
        print(f"compiled extension: no ({_backend.EXTENSION_ERROR})")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"GPU: {gpu}")
    env = os.environ.get("PPO_KERNELS_BATCH_INVARIANT")
    print(
        f"batch-invariant mode: {'on' if _backend.invariant() else 'off'}"
        + (f" (PPO_KERNELS_BATCH_INVARIANT={env})" if env is not None else "")
        + "; strict checks: "
        + ("on" if _backend.strict() else "off")
    )
    print()
    devices = ["cpu", "cuda"]
    print(f"{'op (backend key)':24s} {'public names':42s} " + " ".join(f"{d:>8s}" for d in devices))
    notes = []
    for name in sorted(_backend.OPS):
        info = _backend.OPS[name]
        row = []
        for d in devices:
            if d == "cuda" and not torch.cuda.is_available():
                b = _backend.default_backend(name, "cuda")
                shown = b + "*"
            else:
                b = shown = _backend.resolve(name, d)
            row.append(f"{shown:>8s}")
            also = _backend.delegation(name, b, d)
            if also:
                notes.append(f"  {name} on {d} ({b}): {also}")
        public = ", ".join(p for p in info.public)
        print(f"{name:24s} {public:42s} " + " ".join(row))
    if not torch.cuda.is_available():
        print("\n* no GPU here: the backend a CUDA tensor would get with this build")
    if notes:
        print("\nwhat else runs under those backends:")
        print("\n".join(notes))
    for (op, b, d), what in sorted(_backend.delegations().items()):
        print(f"  handed off at run time: {op} on {d} ({b}): {what}")


def _parser():
    import ppo_kernels

    parser = argparse.ArgumentParser(
        prog="python -m ppo_kernels",
        description="ppo-kernels: fused kernels for PPO-style RL on language models.",
        epilog="python -m ppo_kernels train --help: the trainer's flags and examples",
    )
    parser.add_argument(
        "--version", action="version", version=f"ppo-kernels {ppo_kernels.__version__}"
    )
    sub = parser.add_subparsers(dest="cmd", metavar="{info,train}")
    sub.add_parser("info", help="versions, compiled backends, and the backend each op uses")
    sub.add_parser(
        "train", help="the thin PPO / GRPO / DPO / RM trainer (the main job)", add_help=False
    )
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        # argparse's REMAINDER does not pass on flags like --out through a subparser
        from ppo_kernels.trainer.cli import main as train_main

        return train_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd == "info":
        return _info(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    rc = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a torchrun rank whose run finished (process group destroyed, files closed): leave
        # without the interpreter's finalization, which can destroy gloo threads and abort the
        # process ("terminate called without an active exception") after a successful run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc or 0)
    sys.exit(rc)
