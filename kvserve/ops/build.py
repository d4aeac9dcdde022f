"""Building a just-in-time extension into a cache that several installs of kvserve share.

Where it builds: one directory per build key, a hash of what decides the binary (the sources'
bytes, the compiler flags and the toolchain), under ~/.cache/kvserve/torch_extensions or
$KVSERVE_EXTENSIONS_DIR.

Why the sources are copied there (src/) before ninja runs: ninja records absolute paths. Built
from where they lie, two installs of the same sources (two venvs, an editable checkout and a
wheel) would each find the other's paths in build.ninja and recompile everything whenever
they alternate. Staged, every install compiles the same paths, so the first build serves them
all. Copying beats putting the install's path into the key, which would cost one build per
install for identical binaries.

Why the toolchain is in the key: build.ninja also records torch's and Python's include paths
and the compiler, so two venvs would thrash one directory the same way; keyed, each toolchain
gets its own directory, built once.

Locking: torch.utils.cpp_extension guards a build with a baton file (`lock`) and spins while
the file exists, so one left by a process killed mid-build makes every later start wait
forever, silently. We take our own flock (`kvserve.lock`, holding the owner's pid) around the
staging and torch's build. The kernel drops an flock when its owner dies, so once we hold it
a baton in the directory has no live owner, and it is removed. A live owner is waited for,
with a log line naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sysconfig
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger("kvserve.ops")

LOCK_FILE = "kvserve.lock"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
SRC_DIR = "src"
# In the key: a kvserve from before the staging (which built from the checkout and took no
# flock) never shares a directory with this one, so every baton owner holds our flock.
_LAYOUT = "staged-src, flock 1"


def extensions_root() -> Path:
    env = os.environ.get("KVSERVE_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvserve" / "torch_extensions"


def read_sources(csrc: Path, names: Sequence[str]) -> dict[str, bytes]:
    """name -> bytes, read once: the key and the staged copy must be of the same bytes."""
    return {name: (csrc / name).read_bytes() for name in names}


def toolchain() -> str:
    """What, besides the sources and flags, build.ninja records and the binary depends on."""
    import torch

    return "\n".join((torch.__version__, str(Path(torch.__file__).resolve().parent),
                      sysconfig.get_paths()["include"], os.environ.get("CXX", "c++")))


def build_key(files: Mapping[str, bytes], flags: Sequence[str], toolchain: str) -> str:
    """A hex sha256 of everything that decides the binary; where the files were read from
    does not enter it."""
    h = hashlib.sha256(_LAYOUT.encode())
    for name in sorted(files):
        data = files[name]
        # Lengths delimit the fields, so no two different file sets hash the same bytes.
        h.update(len(name).to_bytes(8, "little") + name.encode())
        h.update(len(data).to_bytes(8, "little") + data)
    h.update("\0".join(flags).encode() + b"\0" + toolchain.encode())
    return h.hexdigest()


def stage_sources(files: Mapping[str, bytes], dest: Path) -> list[str]:
    """Writes each file into dest unless it already holds these bytes; returns the names
    written. Untouched files keep their mtimes, which is what lets ninja find nothing to do.
    Precondition: the caller holds build_lock on dest's build directory."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in files.items():
        path = dest / name
        with contextlib.suppress(FileNotFoundError):
            if path.read_bytes() == data:
                continue
        # Through a rename, so a build never compiles a half-written file.
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        written.append(name)
    return written


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Holds the build directory's flock: waits (saying for whom) while another process
    builds there, then removes a baton that torch left behind in a killed build."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            logger.warning("waiting for %s, which is building the kvserve CPU kernels in %s "
                           "(lock %s)", f"process {owner}" if owner else "another process",
                           build_dir, path)
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            logger.info("waited %.0f s for the kernel build lock %s", time.monotonic() - t0,
                        path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        break_stale_baton(build_dir)
        yield
    finally:
        os.close(fd)  # drops the flock


def break_stale_baton(build_dir: Path) -> bool:
    """Removes torch's baton from build_dir; True when there was one. Precondition: the caller
    holds build_lock. Every process that builds here takes the flock before the baton and
    keeps it until the baton is gone, so a baton seen now belongs to a process that died."""
    baton = build_dir / TORCH_BATON
    try:
        baton.unlink()
    except FileNotFoundError:
        return False
    logger.warning("removed a stale build lock %s (left by a kernel build that was killed); "
                   "building again", baton)
    return True
