"""The tensor-parallel group as the model sees it: its rank, its size, and the collectives a
sharded layer needs, over torch.distributed (gloo on CPU, NCCL on CUDA).

    column-parallel Linear (qkv, gate_up, lm_head)  rank r holds output rows [r*n, (r+1)*n)
    row-parallel Linear (o_proj, down_proj)         rank r holds input columns of its heads /
                                                    MLP columns; all_reduce sums the partial
                                                    outputs, so every rank holds the same
                                                    hidden states again
    lm_head                                         gather_logits: rank 0 gets [rows, vocab]

Every rank runs the same forward with the same inputs, so the collectives pair up in order.
TPGroup.single() is the one-process group: the collectives are no-ops.

The group is a process group object of its own (torch.distributed's ProcessGroupGloo /
ProcessGroupNCCL over a TCPStore), not torch.distributed's global default group: one process
may hold several engines (tests do), each with its own ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvserve.distributed.shm import ShmAllReduce


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    pg: Any = None  # the process group (None in one process)
    shm: ShmAllReduce | None = None  # the CPU all-reduce (shm.py); None: the process group's
    timeout_s: float = 0.0  # how long a collective waits for the other ranks

    @staticmethod
    def single() -> TPGroup:
        return TPGroup(0, 1)

    @staticmethod
    def connect(rank: int, size: int, port: int, device: str, timeout_s: float,
                shm_elements: int = 0, spin: bool = True) -> TPGroup:
        """Joins the group of `size` ranks whose store rank 0 serves on 127.0.0.1:port: gloo
        on the CPU, NCCL on CUDA (rank r on GPU r). A collective waits timeout_s for the
        others, then raises. shm_elements > 0 (CPU): all-reduces of up to that many floats go
        through shared memory (rank 0 creates the segment and names it in the store); spin:
        false when the ranks outnumber the cores (shm.py)."""
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
        shm = None
        if device.startswith("cuda"):
            torch.cuda.set_device(rank)  # "cuda" then means this rank's GPU
            pg = dist.ProcessGroupNCCL(store, rank, size)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
            if shm_elements > 0:
                if rank == 0:
                    name = f"kvserve-tp-{os.getpid()}-{port}"
                    shm = ShmAllReduce(name, 0, size, shm_elements, True, timeout_s, spin)
                    store.set("shm", name)
                else:
                    shm = ShmAllReduce(store.get("shm").decode(), rank, size, shm_elements,
                                       False, timeout_s, spin)
        return TPGroup(rank, size, pg, shm, timeout_s)

    def close(self) -> None:
        if self.shm is not None:
            if self.rank == 0:
                self.shm.unlink()
            self.shm.close()

    def shard(self, n: int) -> int:
        """This rank's share of n (heads, columns, vocabulary); ParallelConfig checked that
        n divides."""
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (every rank gets the same bits: gloo and NCCL
        reduce each element once and hand the result to all)."""
        if self.size == 1:
            return x
        if self.shm is not None and x.numel() <= self.shm.capacity and x.is_contiguous():
            return self.shm(x)  # every rank takes the same branch: the same numel
        self._wait(self.pg.allreduce([x]), "all-reduce")
        return x

    def _wait(self, work: Any, what: str) -> None:
        """A process-group collective's wait, its timeout said in our words (the rank that is
        late is not known here: any of the others may be)."""
        try:
            work.wait()
        except RuntimeError as e:
            if "imed out" not in str(e):
                raise
            late = [r for r in range(self.size) if r != self.rank]
            raise TimeoutError(f"tensor parallelism: the {what} did not complete within "
                               f"{self.timeout_s:g}s: one of ranks {late} is late ({e})"
                               ) from None

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab / size] on each rank -> [rows, vocab] on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.pg.gather([parts] if parts else [], [x], opts), "logits gather")
        return torch.cat(parts, dim=-1) if parts else None
