"""An all-reduce through shared memory, for tensor-parallel ranks on one machine's CPUs: gloo
goes through TCP on loopback and costs ~0.3 ms a call here, which a 30-layer model pays 60
times a step (vLLM's CPU backend has its own shared-memory all-reduce for the same reason).

    segment: flags int64 [size] | data float32 [2 buffers][size ranks][capacity]

    call s (s = 1, 2, ...), rank r:
      1. copy x into data[s % 2][r], then flags[r] = s      (x86 keeps stores in order)
      2. wait until flags[j] >= s for every rank j
      3. x = data[s % 2][0] + data[s % 2][1] + ... in rank order: the same bits everywhere

Two buffers suffice: a rank writing buffer s % 2 at call s has seen every flag reach s - 1,
and each rank set that flag only after it had read buffer (s - 2) % 2 at call s - 2.

Waiting spins, yielding the core after a while (more ranks than cores still progress), and
gives up after timeout_s (a hung rank), asking `alive()` now and then so that a dead rank is
an error at once. Tensors over the capacity go through the fallback (gloo).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

# Spins before each wait yields its core: none when there are more ranks than cores (a
# spinning rank would hold the core the rank it waits for needs).
_SPINS_BEFORE_YIELD = 2000
_SHM_DIR = "/dev/shm"


def _path(name: str) -> str:
    return os.path.join(_SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir(), name)


def _map(name: str, create: bool, nbytes: int) -> mmap.mmap:
    """The segment: a file in /dev/shm (tmpfs), mapped shared. Not multiprocessing's
    SharedMemory: before Python 3.13 every process that attaches registers it with the one
    resource tracker the ranks share, which then unlinks it or warns of a leak."""
    fd = os.open(_path(name), os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class ShmAllReduce:
    def __init__(self, name: str, rank: int, size: int, capacity: int, create: bool,
                 timeout_s: float, spin: bool = True) -> None:
        """capacity: float32 elements one call may carry. spin: false when the ranks
        outnumber the cores (each wait then yields at once)."""
        self.rank, self.size, self.capacity, self.timeout_s = rank, size, capacity, timeout_s
        nbytes = 8 * size + 4 * 2 * size * capacity
        self.name = name
        self.map = buf = _map(name, create, nbytes)
        self.flags = np.ndarray((size,), dtype=np.int64, buffer=buf)
        if create:
            self.flags[:] = 0
        self.data = torch.frombuffer(buf, dtype=torch.float32, offset=8 * size,
                                     count=2 * size * capacity).view(2, size, capacity)
        self.calls = 0
        self.spins = _SPINS_BEFORE_YIELD if spin else 0
        self.alive: Callable[[], None] | None = None  # raises when a rank is gone (rank 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        self.calls += 1
        s, buf = self.calls, self.data[self.calls % 2]
        buf[self.rank, :n].copy_(x.reshape(-1))
        self.flags[self.rank] = s
        self._wait(s)
        out = buf[0, :n].clone()
        for j in range(1, self.size):
            out.add_(buf[j, :n])
        x.copy_(out.view_as(x))
        return x

    def _wait(self, s: int) -> None:
        flags, spins, deadline = self.flags, 0, 0.0
        while flags.min() < s:
            spins += 1
            if spins < self.spins:
                continue
            os.sched_yield()
            if spins % 1000 == 0:
                now = time.monotonic()
                if deadline == 0.0:
                    deadline = now + self.timeout_s
                elif now > deadline:
                    late = [j for j in range(self.size) if flags[j] < s]
                    raise RuntimeError(f"tensor-parallel all-reduce: ranks {late} did not "
                                       f"arrive within {self.timeout_s:.0f}s")
                if self.alive is not None:
                    self.alive()

    def unlink(self) -> None:
        """Removes the segment's name (rank 0, once every rank has mapped it: the mapping
        stays, and nothing is left behind however the processes end)."""
        with contextlib.suppress(FileNotFoundError):  # unlinked already
            os.unlink(_path(self.name))

    def close(self) -> None:
        del self.flags, self.data
        self.map.close()
