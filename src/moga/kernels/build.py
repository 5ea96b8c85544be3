"""JIT build of the C++ kernel (torch.utils.cpp_extension + ninja) on first use, cached on disk.

The build directory is per torch version, Python version, CPU capability and hash of everything ninja's
build file names (the source, the include and library paths, the compiler and its flags), under
``TORCH_EXTENSIONS_DIR`` (default: torch's user cache), and the source is compiled from a copy inside it:
two checkouts of the same source share one build, and different sources or toolchains never rebuild each
other's (ninja rebuilds whenever a command line changes: compiling each checkout's own file, or the same
file against the same torch installed in two virtualenvs, would rebuild on every switch). An ``flock``
around the build lets parallel pytest or sweep workers share one build: the first builds, the others wait
and load it. A lock is released by the kernel when its holder dies, so a killed build never blocks the
next one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
from contextlib import contextmanager
from pathlib import Path

import torch

from moga.filelock import exclusive_lock

# torch.utils.cpp_extension is imported where a build needs it, deferred on purpose: it pulls in
# setuptools, which ``import moga`` has no use for.

SOURCE = Path(__file__).with_name("lmo_step.cpp")

# at::vec picks its implementation from these macros; the flags must match (vec256 needs AVX2 + FMA).
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}

_module = None


def capability() -> str:
    """The at::vec flavour to build: torch's own CPU capability where we know its flags, else generic."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _CAPABILITY_FLAGS else "DEFAULT"


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
        root = os.path.join(_cpp_extension().get_default_build_root(), tag)
    return Path(root) / name


def toolchain(flags: list[str]) -> list[str]:
    """What the build's command lines name besides the source: torch's and Python's include paths, torch's
    library paths (all inside one virtualenv), the compiler torch will call, and the flags."""
    cpp_extension = _cpp_extension()
    compiler = os.environ.get("CXX", "c++")
    python_include = sysconfig.get_path("include", scheme="posix_prefix") or ""
    return [*cpp_extension.include_paths(), python_include, *cpp_extension.library_paths(),
            shutil.which(compiler) or compiler, *flags]


def build_tag(name: str, code: bytes, tools: list[str]) -> str:
    """The build's directory name: the library's name and the hash of its source (not its path) and
    :func:`toolchain`, so that a build is only reused where ninja would not redo it."""
    digest = hashlib.sha256(code)
    for part in tools:
        digest.update(b"\0" + part.encode())
    return f"{name}_{digest.hexdigest()[:12]}"


def _cpp_extension():
    from torch.utils import cpp_extension

    return cpp_extension


@contextmanager
def _build_lock(directory: Path):
    with exclusive_lock(directory / "moga-build.lock"):
        # torch's own FileBaton ('lock') stays behind when a build is killed, and would then make
        # every later build wait forever; nobody else can hold it while we hold the flock.
        (directory / "lock").unlink(missing_ok=True)
        yield


def build_recipe() -> tuple[str, bytes, list[str], Path]:
    """(library name, source, compiler flags, build directory) for this process's torch and CPU."""
    cap = capability()
    name = f"moga_kernels_{cap.lower()}"
    code = SOURCE.read_bytes()
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(cap, ["-DCPU_CAPABILITY=DEFAULT"])]
    return name, code, flags, build_directory(build_tag(name, code, toolchain([*flags, *LDFLAGS])))


LDFLAGS = ("-fopenmp",)


def load_extension(verbose: bool = False):
    """Build (first use) and load the library; its ops are then ``torch.ops.moga_kernels.*``. Raises when
    it cannot be built."""
    global _module
    if _module is None:
        name, code, flags, directory = build_recipe()
        with _build_lock(directory):
            source = directory / SOURCE.name
            if not source.is_file() or source.read_bytes() != code:
                source.write_bytes(code)
            if not (directory / f"{name}.so").is_file():  # a silent 15-20 s pause looks like a hang
                print(f"moga: building the fused C++ kernel once, cached in {directory}: 20 s on a quiet many-core "
                      "machine, 2-4 min on 2 busy cores. To skip it: kernel=\"torch\" (the same steps in torch ops); "
                      "to build ahead of time: python -m moga.kernels.build", file=sys.stderr, flush=True)
            try:
                _cpp_extension().load(
                    name=name, sources=[str(source)], extra_cflags=list(flags),
                    extra_ldflags=list(LDFLAGS),  # a copy: torch appends to it
                    build_directory=str(directory), verbose=verbose, is_python_module=False,
                )
            except Exception as e:  # torch's message is the whole compiler command line
                if verbose:
                    raise
                raise RuntimeError("the C++ build failed; to see the compiler's output run: python -m "
                                   "moga.kernels.build") from e
        _module = torch.ops.moga_kernels
    return _module


if __name__ == "__main__":  # python -m moga.kernels.build: build (or load) with the compiler's full output
    load_extension(verbose=True)
    print(f"moga: the fused C++ kernel is built in {build_recipe()[3]}")
