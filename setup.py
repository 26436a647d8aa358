"""Build ppo-kernels: one compiled extension, `ppo_kernels._C`.

C++ CPU kernels always; CUDA kernels from csrc/cuda/*.cu whenever torch is a CUDA build and nvcc is
found -- also on a machine without a GPU. Switches (environment variables):
  PPO_KERNELS_SKIP_CUDA_BUILD=1  never compile the CUDA kernels
  PPO_KERNELS_FORCE_CUDA=1       fail (instead of skipping) when the CUDA kernels cannot be built
  PPO_KERNELS_CPU_ARCH=generic   do not compile the CPU kernels for AVX2 even if this CPU has it
  PPO_KERNELS_BUILD_SIMT=1       also build the test-only `ppo_kernels._simt`: the CUDA kernels of
                                 csrc/cuda compiled by g++ and run on the CPU by the SIMT emulator of
                                 csrc/testing (no nvcc or GPU needed; CI sets it)
  PPO_KERNELS_SANITIZE=1         compile and link `_C` (and `_simt`) with AddressSanitizer and
                                 UndefinedBehaviorSanitizer, -O0, no CUDA: a test build that loads
                                 only with libasan preloaded (scripts/sanitize.sh builds and runs it)
  TORCH_CUDA_ARCH_LIST           GPU targets (default "8.0;9.0+PTX": A100, H100/H200, PTX for newer)
  PPO_KERNELS_DEBUG=1            keep debug information (-g, from Python's CFLAGS) in the C++ objects
  PPO_KERNELS_PCH=0              do not precompile the torch headers (csrc/common/pch.h) first
  PPO_KERNELS_OPT=1              compile the C++ kernels at -O1 instead of -O3: about a quarter
                                 less compile time, for test runs that do not time the kernels
  PPO_KERNELS_CUDA_OPT=1         compile the CUDA kernels at -O1 (host code, cicc and ptxas): about
                                 30% less nvcc time, for builds whose CUDA kernels never run (CI
                                 compiles them without a GPU, to fail on a compile error)
  MAX_JOBS                       parallel compile jobs (ninja)

The extension must be compiled against the torch it will run with, so build with
`pip install --no-build-isolation .` (pip's default build isolation would hide that torch; the
build stops at once saying so). Next to the extension, `_C.torch_version` records the torch it was
built against; ppo_kernels refuses to load it under another torch (ppo_kernels/_extension.py).
"""

import glob
import hashlib
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)


def _default_cuda_home():
    """torch guesses CUDA_HOME from `which nvcc`; a wrapper such as /usr/local/bin/nvcc then gives
    /usr/local, which has no lib64/libcudart. Prefer a real toolkit directory."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for cand in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(cand, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = cand
            return


_default_cuda_home()


def _require_torch():
    """The extension is compiled against the torch it will run with: stop at once, in one line,
    when pip's build isolation hides it (instead of building against another torch)."""
    hint = (
        "ppo-kernels: build with `pip install --no-build-isolation .` (torch installed "
        "first): pip's default build isolation hides your torch, and the extension must be "
        "compiled against the torch it runs with"
    )
    try:
        import torch
    except ImportError:
        raise SystemExit(hint) from None
    if "pip-build-env-" in torch.__file__:  # torch installed into an isolated build env
        raise SystemExit(hint)


_require_torch()


def _torch_versions():
    """(the package version naming the torch it is built against, the torch requirement).

    The extension runs only under the torch it was compiled with, so a wheel says which in its
    name: the local version `+torch2.13.0.cpu` (PEP 440: letters, digits and dots; pip accepts
    it, PyPI does not take it, so wheels for several torch builds can share a folder or a
    private index) and the requirement `torch==2.13.0`, which the CPU and CUDA builds of that
    release both satisfy."""
    import torch

    full = torch.__version__
    public = full.split("+")[0]
    local = re.sub(r"[^0-9A-Za-z.]+", ".", full).strip(".")
    return f"{VERSION}+torch{local}", f"torch=={public}"


VERSION = "0.1.0"


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _nvcc_version(cuda_home):
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    out = subprocess.check_output([nvcc, "--version"], text=True)
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _pip_cuda_include_dirs():
    """CUDA headers (cusparse.h, cublas_v2.h, ...) shipped in pip's nvidia-* packages.

    torch's CUDA headers include some of them, and a bare nvcc toolkit may lack them."""
    import site

    roots = site.getsitepackages() + [site.getusersitepackages()]
    dirs = []
    for root in roots:
        for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
            for d in sorted(glob.glob(os.path.join(root, pattern))):
                if os.path.isdir(d) and d not in dirs:
                    dirs.append(d)
    return dirs


def _host_has_avx2():
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return " avx2" in flags and " fma" in flags
    except OSError:
        return False


def _extensions():
    import torch
    from torch.utils import cpp_extension

    sources = sorted(
        glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp") + glob.glob("csrc/ops/*.cpp")
    )
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))

    sanitize = _flag("PPO_KERNELS_SANITIZE")
    base = ["-fopenmp", "-Wno-unknown-pragmas", "-DPPO_KERNELS_BUILD"]
    link = ["-fopenmp"]
    if sanitize:
        # -O0: half the compile time of -O1 for about a fifth more test time (CI's sanitizer stage
        # is mostly its build), and whole stacks in the reports; -g1 gives them file:line. UB
        # aborts at the first finding instead of printing and going on. -fno-wrapv undoes
        # Python's -fwrapv (in every extension's flags), under which signed overflow is defined
        # and never reported. (The SIMT emulator keeps its own -O1, added after these.)
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        cxx = ["-O0", "-g1", "-fno-omit-frame-pointer", "-fno-wrapv"] + san + base
        link += san
    else:
        # -g0 undoes the -g of Python's own CFLAGS (every extension gets them): debug information
        # for torch's templates doubles each file's compile time and the library's size.
        opt = "-O1" if os.environ.get("PPO_KERNELS_OPT") == "1" else "-O3"
        cxx = [opt] + base + ([] if _flag("PPO_KERNELS_DEBUG") else ["-g0"])
    if os.environ.get("PPO_KERNELS_CPU_ARCH", "auto") != "generic" and _host_has_avx2():
        # at::vec picks its 256-bit implementation from these two macros.
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    # a torch upgrade (its version.py is rewritten) relinks the extension: never a stale build
    # recorded as built against the new torch
    depends = [os.path.join(os.path.dirname(torch.__file__), "version.py")]

    build_cuda = False
    why_not = None
    if _flag("PPO_KERNELS_SKIP_CUDA_BUILD"):
        why_not = "PPO_KERNELS_SKIP_CUDA_BUILD=1"
    elif sanitize:
        why_not = "PPO_KERNELS_SANITIZE=1"
    elif torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is a CPU-only build"
    elif cpp_extension.CUDA_HOME is None:
        why_not = "nvcc not found (set CUDA_HOME)"
    elif not cuda_sources:
        why_not = "no csrc/cuda/*.cu"
    else:
        build_cuda = True
    if not build_cuda and _flag("PPO_KERNELS_FORCE_CUDA"):
        raise RuntimeError(
            f"PPO_KERNELS_FORCE_CUDA=1 but the CUDA kernels cannot be built: {why_not}"
        )

    if build_cuda:
        nvcc_ver = _nvcc_version(cpp_extension.CUDA_HOME)
        torch_major = int(torch.version.cuda.split(".")[0])
        if nvcc_ver is not None and nvcc_ver[0] != torch_major:
            raise RuntimeError(
                f"CUDA major version mismatch: nvcc at {cpp_extension.CUDA_HOME} is "
                f"{nvcc_ver[0]}.{nvcc_ver[1]} but torch {torch.__version__} was built with CUDA "
                f"{torch.version.cuda}. Point CUDA_HOME at a CUDA {torch_major}.x toolkit, install a "
                f"torch built for CUDA {nvcc_ver[0]}, or set PPO_KERNELS_SKIP_CUDA_BUILD=1."
            )
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        include_dirs += _pip_cuda_include_dirs()
        fast = _flag("PPO_KERNELS_CUDA_OPT")
        nvcc_opt = ["-O1", "-Xcicc", "-O1", "-Xptxas", "-O1"] if fast else ["-O3"]
        nvcc = nvcc_opt + [
            "--use_fast_math",
            "-lineinfo",
            "-DPPO_KERNELS_BUILD",
            "--expt-relaxed-constexpr",
        ]
        print(
            f"ppo-kernels: building CPU + CUDA kernels (arch {os.environ['TORCH_CUDA_ARCH_LIST']})"
        )
        main = cpp_extension.CUDAExtension(
            "ppo_kernels._C",
            sources + cuda_sources,
            include_dirs=include_dirs,
            depends=depends,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=link,
        )
    else:
        print(f"ppo-kernels: building CPU kernels only ({why_not})")
        main = cpp_extension.CppExtension(
            "ppo_kernels._C",
            sources,
            include_dirs=include_dirs,
            depends=depends,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    exts = [main]
    if _flag("PPO_KERNELS_BUILD_SIMT"):
        print("ppo-kernels: building the SIMT emulator test extension ppo_kernels._simt")
        exts.append(
            cpp_extension.CppExtension(
                "ppo_kernels._simt",
                sorted(glob.glob("csrc/testing/*.cpp")),
                include_dirs=[os.path.join(ROOT, "csrc")],
                # -O1: the emulator's time goes to fiber switches, and -O3 triples the compile time
                extra_compile_args={"cxx": cxx + ["-O1", "-DPPO_SIMT", "-fno-strict-aliasing"]},
                extra_link_args=link,
            )
        )
    return exts


TORCH_VERSION_FILE = "_C.torch_version"
PCH = os.path.join("csrc", "common", "pch.h")


def _with_pch(write_and_compile, build_dir):
    """torch's `_write_ninja_file_and_compile_objects` with csrc/common/pch.h precompiled first,
    by gcc, with the final flags torch's ninja rule gives the C++ sources, and force-included in
    each of them (-include). gcc takes a .gch only when the flags match and otherwise reads the
    header itself: at worst the build is as slow as without it. The .gch is remade only when its
    command or a header changed (a stamp beside it): ninja's incremental builds stay so."""
    import shlex

    import torch
    from torch.utils import cpp_extension as ce

    def run(**kw):
        cxx = ce.get_cxx_compiler()
        if not _is_gcc(cxx):
            return write_and_compile(**kw)
        out = os.path.join(os.path.abspath(build_dir), "pch")
        os.makedirs(out, exist_ok=True)
        header = os.path.join(out, "pch.h")
        text = _read(os.path.join(ROOT, PCH), "rb")
        if _read(header, "rb") != text:
            with open(header, "wb") as f:
                f.write(text)
        cflags = [f for f in shlex.split(" ".join(kw["cflags"])) if f != "-c"]
        post = shlex.split(" ".join(kw["post_cflags"]))
        cmd = [cxx, *cflags, "-x", "c++-header", header, "-o", header + ".gch", *post]
        key = hashlib.sha256("\0".join(cmd + [torch.__version__]).encode() + text).hexdigest()
        stamp = header + ".stamp"
        if not (os.path.exists(header + ".gch") and _read(stamp, "r") == key):
            print("ppo-kernels: precompiling the torch headers (csrc/common/pch.h)", flush=True)
            if subprocess.call(cmd) != 0:
                print("ppo-kernels: precompiling them failed; building without it", flush=True)
                return write_and_compile(**kw)
            with open(stamp, "w") as f:
                f.write(key)
        # -Winvalid-pch: a .gch gcc refuses (it then reads the header) says so in the build log.
        # -Wno-sign-compare: with the headers precompiled, gcc reports a signed / unsigned
        # comparison inside a torch template (c10::checked_convert) in every source
        extra = ["-Winvalid-pch", "-Wno-sign-compare", "-include", shlex.quote(header)]
        kw["post_cflags"] = [*kw["post_cflags"], *extra]
        return write_and_compile(**kw)

    return run


def _read(path, mode):
    """The file's content, or None where there is none."""
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def _is_gcc(cxx):
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "Free Software Foundation" in out and "clang" not in out


def _pch_wanted():
    # on unless turned off (PPO_KERNELS_PCH=0): _flag's words, read with "on" as the default
    off = os.environ.get("PPO_KERNELS_PCH", "1").lower() in ("0", "false", "no", "off")
    return not off and sys.platform.startswith("linux")


def _build_ext():
    import torch
    from torch.utils.cpp_extension import BuildExtension

    class BuildExt(BuildExtension.with_options(use_ninja=True)):
        def build_extension(self, ext):
            # the main extension's C++ sources only: the SIMT emulator's few files have flags of
            # their own
            if ext.name != "ppo_kernels._C" or not _pch_wanted():
                return super().build_extension(ext)
            # ccache (torch puts it before the compiler when installed) caches sources built
            # with a precompiled header only when told these differences do not matter
            from torch.utils import cpp_extension as ce

            os.environ.setdefault("CCACHE_SLOPPINESS", "pch_defines,time_macros")
            write_and_compile = getattr(ce, "_write_ninja_file_and_compile_objects", None)
            if write_and_compile is None:  # another torch's internals: no precompiled header
                return super().build_extension(ext)
            ce._write_ninja_file_and_compile_objects = _with_pch(write_and_compile, self.build_temp)
            try:
                return super().build_extension(ext)
            finally:
                ce._write_ninja_file_and_compile_objects = write_and_compile

        def run(self):
            super().run()
            # next to the extension, in build/ and (--inplace) in the source tree: read by
            # ppo_kernels._backend before it loads the extension
            dirs, inplace = set(), self.inplace
            for self.inplace in {0, inplace}:
                dirs |= {os.path.dirname(self.get_ext_fullpath(e.name)) for e in self.extensions}
            self.inplace = inplace
            for d in dirs:
                with open(os.path.join(d, TORCH_VERSION_FILE), "w") as f:
                    f.write(torch.__version__ + "\n")

    return BuildExt


PACKAGE_VERSION, TORCH_REQUIREMENT = _torch_versions()

setup(
    name="ppo-kernels",
    version=PACKAGE_VERSION,
    description="Fused CUDA / Triton / C++ kernels for PPO-style RL training of language models",
    packages=find_packages(include=["ppo_kernels", "ppo_kernels.*"]),
    ext_modules=_extensions(),
    cmdclass={"build_ext": _build_ext()},
    python_requires=">=3.10",
    install_requires=[TORCH_REQUIREMENT, "numpy"],  # numpy: torch warns at import without it
    extras_require={
        "triton": ["triton>=3.6"],
        "test": ["pytest", "pytest-benchmark", "numpy", "expecttest", "hypothesis"],
        "train": ["transformers>=4.45", "tqdm", "matplotlib"],
    },
    zip_safe=False,
)
