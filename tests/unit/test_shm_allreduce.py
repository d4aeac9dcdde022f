"""The shared-memory all-reduce of tensor-parallel CPU ranks (distributed/shm.py), with one
thread per rank on one segment: every rank gets the sum taken in rank order, bit for bit the
same everywhere, call after call (its two buffers alternate); a rank that never arrives is
an error naming it."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch

from kvserve.distributed.shm import ShmAllReduce


def _ranks(size: int, capacity: int, timeout_s: float = 30.0) -> list[ShmAllReduce]:
    name = f"kvserve-test-{uuid.uuid4().hex[:12]}"
    first = ShmAllReduce(name, 0, size, capacity, True, timeout_s)
    ranks = [first] + [ShmAllReduce(name, r, size, capacity, False, timeout_s)
                       for r in range(1, size)]
    first.unlink()  # mapped by all: the name can go
    return ranks


def _run_all(ranks: list[ShmAllReduce], fn: Any) -> list[Any]:
    out: list[Any] = [None] * len(ranks)
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r, ranks[r])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_rank_order_sum(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    shapes = [(1, 576), (8, 576), (3, 7), (1, 576)]  # sizes change: both buffers in turn
    inputs = [[torch.randn(s, generator=g) * 1e3 for s in shapes] for _ in range(size)]
    ranks = _ranks(size, capacity=8 * 576)

    def work(r: int, ar: ShmAllReduce) -> list[torch.Tensor]:
        return [ar(x.clone()) for x in inputs[r]]

    got = _run_all(ranks, work)
    for c in range(len(shapes)):
        want = inputs[0][c].clone()
        for r in range(1, size):
            want += inputs[r][c]  # rank order, as the ranks sum
        for r in range(size):
            assert torch.equal(got[r][c], want)
    for ar in ranks:
        ar.close()


def test_a_rank_that_never_arrives_is_named() -> None:
    ranks = _ranks(2, capacity=16, timeout_s=0.5)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not arrive within"):
        ranks[0](torch.ones(4))
    for ar in ranks:
        ar.close()


def test_a_dead_rank_is_reported_by_alive() -> None:
    ranks = _ranks(2, capacity=16, timeout_s=60)

    def alive() -> None:
        raise RuntimeError("tensor-parallel worker rank 1 exited with code 9")

    ranks[0].alive = alive
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        ranks[0](torch.ones(4))
    for ar in ranks:
        ar.close()
