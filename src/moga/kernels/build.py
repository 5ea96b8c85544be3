"""JIT build of the C++ kernel (torch.utils.cpp_extension + ninja) on first use, cached on disk.

The build directory is per torch version, Python version, CPU capability and source hash, under
``TORCH_EXTENSIONS_DIR`` (default: torch's user cache), and the source is compiled from a copy inside it:
two checkouts of the same source share one build, and different sources never rebuild each other's (the
build files name the source by its path, so compiling each checkout's own file would rebuild whenever
another checkout had built last). An ``flock`` around the build lets parallel pytest or sweep workers
share one build: the first builds, the others wait and load it. A lock is released by the kernel when its
holder dies, so a killed build never blocks the next one.
"""

from __future__ import annotations

import hashlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from moga.filelock import exclusive_lock

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
        from torch.utils.cpp_extension import get_default_build_root

        tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
        root = os.path.join(get_default_build_root(), tag)
    return Path(root) / name


def source_tag(name: str, code: bytes) -> str:
    """The build's directory name: the library's name and the hash of its source (not its path)."""
    return f"{name}_{hashlib.sha256(code).hexdigest()[:12]}"


@contextmanager
def _build_lock(directory: Path):
    with exclusive_lock(directory / "moga-build.lock"):
        # torch's own FileBaton ('lock') stays behind when a build is killed, and would then make
        # every later build wait forever; nobody else can hold it while we hold the flock.
        (directory / "lock").unlink(missing_ok=True)
        yield


def load_extension(verbose: bool = False):
    """Build (first use) and load the library; its ops are then ``torch.ops.moga_kernels.*``. Raises when
    it cannot be built."""
    global _module
    if _module is None:
        from torch.utils import cpp_extension

        cap = capability()
        code = SOURCE.read_bytes()
        name = f"moga_kernels_{cap.lower()}"
        directory = build_directory(source_tag(name, code))
        flags = ["-O3", "-fopenmp", "-DCPU_CAPABILITY=DEFAULT"] if cap == "DEFAULT" else ["-O3", "-fopenmp", *_CAPABILITY_FLAGS[cap]]
        with _build_lock(directory):
            source = directory / SOURCE.name
            if not source.is_file() or source.read_bytes() != code:
                source.write_bytes(code)
            cpp_extension.load(
                name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(directory), verbose=verbose, is_python_module=False,
            )
        _module = torch.ops.moga_kernels
    return _module
