"""TPGroup's process-group collectives say a timeout in our words (which collective, how long,
which ranks may be late); any other failure passes through as it came."""

from __future__ import annotations

import pytest
import torch

from kvserve.distributed.group import TPGroup


class _Work:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def wait(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)


class _PG:
    """A process group whose collectives fail with `error` (gloo's words)."""

    def __init__(self, error: str | None) -> None:
        self.error = error

    def gather(self, *_args: object) -> _Work:
        return _Work(self.error)

    def allreduce(self, *_args: object) -> _Work:
        return _Work(self.error)


GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 3000ms for recv operation to complete")


def test_a_gather_timeout_names_the_collective_the_time_and_the_ranks() -> None:
    g = TPGroup(0, 3, _PG(GLOO_TIMEOUT), None, 3.0)
    with pytest.raises(TimeoutError, match=r"^tensor parallelism: the logits gather did not "
                                           r"complete within 3s: one of ranks \[1, 2\] is late "
                                           r"\(.*Timed out waiting 3000ms"):
        g.gather_logits(torch.zeros(2, 4))
    with pytest.raises(TimeoutError, match=r"the all-reduce did not complete within 3s"):
        g.all_reduce(torch.zeros(8))


def test_other_collective_failures_pass_through() -> None:
    g = TPGroup(1, 2, _PG("Connection closed by peer"), None, 3.0)
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        g.all_reduce(torch.zeros(8))
