"""Tensor parallelism's rank 0: the engine process starts ranks 1..N-1 and drives them.

    engine process (rank 0)                     worker process (rank r, worker.py)
    ------------------------                    ----------------------------------
    TPExecutor.start: spawn, join the gloo      join the group; load the checkpoint and
      group, load rank 0's shard                  build rank r's shard
    agree_blocks: min of the ranks' KV block    send its block count; allocate its KV shard
      counts over the pipes                       (the same block ids, its KV heads)
    each step: send_step(ModelInput)  ------>   recv the step (a pipe: idle ranks wait there,
      the same forward, all-reduces paired         never inside a collective)
      (a self-draft's: its first layers)
      gather_logits -> rank 0 samples           forward; its vocabulary slice to rank 0
    check(): a dead rank is an error            exits when rank 0 says stop or its pipe
    shutdown(): stop, join, kill                  closes (rank 0 died)

One scheduler and one sampler, on rank 0. A step crosses to the other ranks as a compact
array of its ModelInput (token ids, positions, slots, block tables, lengths, logits rows),
never as Request objects; the sampled tokens stay on rank 0, which builds the next step.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from kvserve.distributed.group import TPGroup
from kvserve.executor.step import STOP, encode_step, shm_elements
from kvserve.outputs import ModelInput
from kvserve.platform import pin_thread, share_cores

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine_args import EngineArgs

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPExecutor:
    def __init__(self, procs: list[Any], conns: list[Any]) -> None:
        self.procs = procs  # ranks 1..N-1
        self.conns = conns
        self.group = TPGroup.single()  # rank 0's, once joined
        self._closed = False
        # thread id -> (its affinity, its torch thread count) before pin_thread
        self._saved: dict[int, tuple[set[int], int]] = {}

    @classmethod
    def start(cls, args: EngineArgs, config: EngineConfig) -> TPExecutor:
        """Spawns ranks 1..size-1 (each pinned to its share of the cores) and joins the group
        as rank 0; they load their shards while this process loads its own."""
        from kvserve.executor.worker import worker_main

        size, device = config.parallel.tensor_parallel_size, config.device
        spin = size <= len(os.sched_getaffinity(0))  # a core per rank: waits may spin
        port = _free_port()
        ctx = mp.get_context("spawn")  # a fork would copy the engine's threads and locks
        procs, conns = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"kvserve-tp{rank}", daemon=True,
                            args=(args, rank, size, port, theirs, share_cores(rank, size),
                                  spin))
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
        executor = cls(procs, conns)
        try:
            executor.group = TPGroup.connect(0, size, port, device, config.parallel.timeout_s,
                                             shm_elements(config), spin)
            if executor.group.shm is not None:
                executor.group.shm.alive = executor.check  # a dead rank: an error at once
        except BaseException:
            executor.shutdown()
            raise
        # Rank 0's share of the cores: the thread that steps the engine is pinned there with
        # as many OpenMP threads (pin_thread: this one, and AsyncEngine's engine thread), not
        # the whole process, which also runs the server's threads. Unpinned, it would share a
        # worker's core half the time. shutdown() gives this thread back what it had: the
        # caller's thread (and whatever it starts later) must not stay on one core.
        threads = len(share_cores(0, size))
        executor.pin_thread()
        how = ("nccl" if device.startswith("cuda") else
               "shared memory" if executor.group.shm is not None else "gloo")
        logger.info("tensor parallelism: %d ranks, all-reduce over %s (worker pids %s); rank 0 "
                    "runs %d threads", size, how, [p.pid for p in procs], threads)
        return executor

    def pin_thread(self) -> None:
        """Pins the calling thread (and the OpenMP threads it starts after this) to rank 0's
        cores, with one intra-op thread each; the thread's own settings come back at
        shutdown() if it is the thread that calls it."""
        self._saved[threading.get_ident()] = (os.sched_getaffinity(0), torch.get_num_threads())
        pin_thread(share_cores(0, len(self.procs) + 1))

    def agree_blocks(self, num_blocks: int, timeout_s: float = 600.0) -> int:
        """Every rank's KV block count (from its own view of free memory) -> the minimum,
        which every rank then allocates. A rank that failed to load is an error here."""
        counts = [num_blocks]
        for rank, conn in enumerate(self.conns, start=1):
            msg = self._recv(rank, conn, timeout_s)
            if msg[0] == "error":
                self.shutdown()
                raise ValueError(f"tensor-parallel rank {rank} failed to start: {msg[1]}")
            counts.append(int(msg[1]))
        agreed = min(counts)
        for conn in self.conns:
            conn.send(("blocks", agreed))
        if self.group.shm is not None:
            self.group.shm.unlink()  # every rank has mapped it by now (they joined first)
        return agreed

    def _recv(self, rank: int, conn: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            self.check()
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"tensor-parallel rank {rank} did not start within "
                                   f"{timeout_s:.0f}s")
        return conn.recv()

    def send_step(self, inp: ModelInput, num_layers: int = 0) -> None:
        """The other ranks run the forward of inp (its first num_layers decoder layers: 0
        for all) with this one."""
        data = encode_step(inp, num_layers)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError:  # its end of the pipe is gone
                self.check()
                raise RuntimeError(f"tensor-parallel rank {rank} is unreachable") from None

    def check(self, wait_s: float = 0.0) -> None:
        """RuntimeError naming the first rank that is no longer running. wait_s: after a
        collective failed, how long to give a dying rank to be reaped (the reset reaches
        this rank before the kernel has its exit status)."""
        if wait_s > 0:
            from multiprocessing.connection import wait

            wait([p.sentinel for p in self.procs], timeout=wait_s)
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                code = p.exitcode
                how = f"was killed by signal {-code}" if code is not None and code < 0 \
                    else f"exited with code {code}"
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {p.pid}) {how}")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops every rank and reaps it: asked first, then SIGTERM, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(STOP)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(1.0)
        for conn in self.conns:
            conn.close()
        saved = self._saved.pop(threading.get_ident(), None)
        if saved is not None:
            os.sched_setaffinity(0, saved[0])
            torch.set_num_threads(saved[1])
        self.group.close()
        self.group = TPGroup.single()  # drops the process group and its store
