"""The kernel build cache (kvserve/ops/build.py; the CPU kernels' build, ops/cpu_extension.py):
keyed on what is compiled, not where it lies, and a build lock that a killed build cannot leave
behind. The key, staging and locking are tested directly; one real build (in a temp
KVSERVE_EXTENSIONS_DIR, in subprocesses) holds the whole path to it: a stale torch lock does
not hang it, and two source copies share its binary.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.ops import build
from kvserve.ops import cpu_extension as cpu_mod

ROOT = Path(__file__).resolve().parents[2]
NAMES = cpu_mod.KERNEL_FILES


def copy_csrc(dest: Path) -> Path:
    shutil.copytree(cpu_mod._CSRC, dest)
    return dest


def test_key_follows_the_bytes_flags_and_toolchain_not_the_location(tmp_path: Path) -> None:
    a = build.read_sources(copy_csrc(tmp_path / "a"), NAMES)
    b = build.read_sources(copy_csrc(tmp_path / "b"), NAMES)
    key = build.build_key(a, cpu_mod._CFLAGS, "tc")
    assert build.build_key(b, cpu_mod._CFLAGS, "tc") == key
    edited = {**a, "linear.cpp": a["linear.cpp"] + b"\n"}
    assert build.build_key(edited, cpu_mod._CFLAGS, "tc") != key
    assert build.build_key(a, cpu_mod._CFLAGS[:-1], "tc") != key
    assert build.build_key(a, cpu_mod._CFLAGS, "another venv's torch") != key


def test_staging_rewrites_only_what_changed(tmp_path: Path) -> None:
    files = {"k.h": b"// header\n", "k.cpp": b"#include \"k.h\"\n"}
    dest = tmp_path / "src"
    assert build.stage_sources(files, dest) == ["k.h", "k.cpp"]
    old = time.time() - 3600  # an hour ago, so a rewrite cannot land on the same mtime
    for name in files:
        os.utime(dest / name, (old, old))
    mtimes = {name: (dest / name).stat().st_mtime_ns for name in files}
    assert build.stage_sources(files, dest) == []
    assert {name: (dest / name).stat().st_mtime_ns for name in files} == mtimes
    assert build.stage_sources({**files, "k.cpp": b"int x;\n"}, dest) == ["k.cpp"]
    assert (dest / "k.cpp").read_bytes() == b"int x;\n"
    assert (dest / "k.h").stat().st_mtime_ns == mtimes["k.h"]
    assert sorted(p.name for p in dest.iterdir()) == ["k.cpp", "k.h"]  # no temp files left


def test_lock_breaks_a_baton_without_an_owner(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    baton = tmp_path / build.TORCH_BATON
    baton.touch()  # what torch leaves when its process is killed mid-build
    with caplog.at_level(logging.INFO, "kvserve.ops"), build.build_lock(tmp_path):
        assert not baton.exists()
        assert (tmp_path / build.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert f"removed a stale build lock {baton}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "kvserve.ops"), build.build_lock(tmp_path):
        pass
    assert caplog.text == ""  # nothing to break, nobody to wait for


HOLDER = """
import sys, time
from pathlib import Path
from kvserve.ops import build
d = Path(sys.argv[1])
with build.build_lock(d):
    (d / build.TORCH_BATON).touch()  # torch's baton, taken inside our lock as _build_once does
    print("held", flush=True)
    time.sleep(600)
"""


def test_lock_waits_for_a_live_owner_and_takes_over_when_it_is_killed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    acquired = threading.Event()

    def take() -> None:
        with build.build_lock(tmp_path):
            acquired.set()

    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with caplog.at_level(logging.INFO, "kvserve.ops"):
            waiter = threading.Thread(target=take, daemon=True)
            waiter.start()
            # Its owner lives, so the baton is a build in progress: wait, and leave it be.
            assert not acquired.wait(1.0)
            assert (tmp_path / build.TORCH_BATON).exists()
            assert f"waiting for process {holder.pid}, which is building" in caplog.text
            holder.kill()  # dies mid-build: the baton stays, the flock goes with the process
            assert acquired.wait(30.0)
            waiter.join(30.0)
        assert not (tmp_path / build.TORCH_BATON).exists()
        assert "removed a stale build lock" in caplog.text
    finally:
        holder.kill()
        holder.wait(30)


LOAD = """
import logging, sys
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
import kvserve.ops.cpu_extension as cpu
from kvserve.ops.reference import ReferenceOps
cpu._CSRC = Path(sys.argv[1])
ext = cpu.load_extension()
x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
torch.testing.assert_close(ext.silu_and_mul(x), ReferenceOps.silu_and_mul(x))
print(Path(ext.__file__).resolve())
"""


@pytest.mark.skipif(not cpu_mod.cpu_has_avx2_fma(), reason="the kernels need an AVX2+FMA CPU")
def test_real_build_breaks_a_stale_lock_and_two_source_copies_share_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The only test that compiles (~1-4 minutes on 2 cores), once."""
    monkeypatch.setenv("KVSERVE_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = copy_csrc(tmp_path / "a"), copy_csrc(tmp_path / "b")
    build_dir = cpu_mod.build_directory()  # the same for both copies: same bytes
    build_dir.mkdir(parents=True)
    (build_dir / build.TORCH_BATON).touch()  # a build killed before this one started

    def load(csrc: Path) -> subprocess.CompletedProcess[str]:
        # Bounded: before the build lock, a stale baton made this spin forever.
        r = subprocess.run([sys.executable, "-c", LOAD, str(csrc)], cwd=ROOT, text=True,
                           capture_output=True, timeout=900)
        assert r.returncode == 0, r.stderr
        return r

    first = load(a)
    assert "removed a stale build lock" in first.stderr
    assert f"compiling the kvserve CPU kernels in {build_dir}" in first.stderr
    assert "compiled the kvserve CPU kernels in" in first.stderr
    so = Path(first.stdout.strip())
    assert so.parent == build_dir
    ninja = (build_dir / "build.ninja").read_text()
    assert str(build_dir / build.SRC_DIR / "linear.cpp") in ninja and str(a) not in ninja
    built = (so.stat().st_mtime_ns, (build_dir / ".ninja_log").read_bytes())

    # Alternating source locations: each load finds ninja with nothing to do.
    for csrc in (b, a):
        again = load(csrc)
        assert Path(again.stdout.strip()) == so
        assert "compil" not in again.stderr and "stale" not in again.stderr, again.stderr
        assert (so.stat().st_mtime_ns, (build_dir / ".ninja_log").read_bytes()) == built
    assert [p.name for p in (tmp_path / "ext").iterdir()] == [build_dir.name]
