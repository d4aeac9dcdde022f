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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @staticmethod
    def single() -> TPGroup:
        return TPGroup(0, 1)

    def shard(self, n: int) -> int:
        """This rank's share of n (heads, columns, vocabulary); ParallelConfig checked that
        n divides."""
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (every rank gets the same bits: gloo and NCCL
        reduce each element once and hand the result to all)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab / size] on each rank -> [rows, vocab] on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None
