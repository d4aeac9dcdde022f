"""The CPU kernels' extension (kvserve/ops/csrc/): its sources and flags, built just in time
(torch.utils.cpp_extension.load, ninja, g++) on first use and cached under
~/.cache/kvserve/torch_extensions, or under $KVSERVE_EXTENSIONS_DIR when set. Its name carries
a hash of the sources, flags and toolchain, so an edit rebuilds instead of loading a stale
binary; the sources are built from a copy in the build directory, so installs of the same
sources share one build (kvserve/ops/build.py says why, and how the build lock works).

CpuOps (ops/cpu.py) loads it; benchmarks/kernel_ab.py builds another revision's sources beside
it (build_extension).
"""

from __future__ import annotations

import functools
import logging
import platform
import subprocess
import time
from pathlib import Path
from types import ModuleType

import torch

from kvserve.ops.build import (
    SRC_DIR,
    build_key,
    build_lock,
    extensions_root,
    read_sources,
    stage_sources,
    toolchain,
)

logger = logging.getLogger("kvserve.ops")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("bindings.cpp", "llama_stack.cpp", "linear.cpp", "linear_avx512.cpp",
            "qlinear.cpp", "qlinear_avx512.cpp", "attention.cpp", "elementwise.cpp",
            "qlinear_kquant.cpp", "qlinear_kquant_avx512.cpp")
_HEADERS = ("kernels.h", "simd.h", "tiles.h", "tensor_args.h", "llama_stack.h", "kquant.h",
            "kquant_driver.h", "vnni.h")
KERNEL_FILES = _SOURCES + _HEADERS  # every file of csrc/ that a build reads (and is keyed on)
# -ffp-contract=off: the kernels ask for FMAs explicitly; elsewhere (RoPE, norm scaling) it
# keeps the reference's separate roundings, so those ops match torch bit for bit.
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-DNDEBUG")


def cpu_has_avx2_fma() -> bool:
    """True when this x86 CPU has AVX2 and FMA. /proc/cpuinfo is authoritative (torch's
    capability can be capped by ATEN_CPU_CAPABILITY); torch's answer is the fallback."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma", "f16c"} <= flags
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def extension_name() -> str:
    return _name(read_sources(_CSRC, KERNEL_FILES))


def build_directory() -> Path:
    """Where this install's sources build (and are staged, in src/)."""
    return extensions_root() / extension_name()


def _name(files: dict[str, bytes]) -> str:
    return f"kvserve_cpu_{build_key(files, _CFLAGS, toolchain())[:12]}"


def load_extension() -> ModuleType:
    """Build (first time) and import the kernels. Raises RuntimeError with the compiler's
    complaint when the build fails."""
    ext = _build_once()
    if isinstance(ext, RuntimeError):
        raise ext
    return ext


@functools.lru_cache(maxsize=1)
def _build_once() -> ModuleType | RuntimeError:
    """The outcome is cached per process, failures included: get_ops("auto") may ask many
    times, and a broken toolchain must cost one failed build, not one per call."""
    return build_extension(read_sources(_CSRC, KERNEL_FILES))


def build_extension(files: dict[str, bytes]) -> ModuleType | RuntimeError:
    """Build (first time) and import the kernels from these sources (KERNEL_FILES by name:
    this install's, or another revision's for benchmarks/kernel_ab.py), in the build
    directory their bytes name; the error instead of raising it."""
    from torch.utils.cpp_extension import load

    name = _name(files)
    build_dir = extensions_root() / name
    try:
        with build_lock(build_dir):
            src = build_dir / SRC_DIR
            stage_sources(files, src)
            # No binary yet: ninja is about to compile everything, which takes minutes on a
            # small machine; say so, or a server start looks hung.
            fresh = not (build_dir / f"{name}.so").exists()
            if fresh:
                logger.info("compiling the kvserve CPU kernels in %s (once per version of the "
                            "sources; a few minutes on 2 cores)", build_dir)
            t0 = time.monotonic()
            ext = load(name=name, sources=[str(src / s) for s in _SOURCES],
                       extra_cflags=list(_CFLAGS), extra_ldflags=["-fopenmp"],
                       build_directory=str(build_dir), verbose=False)
            if fresh:
                logger.info("compiled the kvserve CPU kernels in %.0f s", time.monotonic() - t0)
            return ext
    # torch raises RuntimeError for a compiler error or a missing ninja, ImportError for a
    # binary that does not load; either way say what was tried and why it failed.
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        return RuntimeError(f"building the kvserve CPU kernels in {build_dir} failed (needs "
                            f"g++ and ninja): {e}")
