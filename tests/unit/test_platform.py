"""kvserve.platform.setup_process: the process-wide settings an entry point makes once."""

from __future__ import annotations

import gc

import pytest
import torch

from kvserve import platform
from kvserve.platform import setup_process, share_cores


def test_setup_process_sets_threads_then_freezes_what_was_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    monkeypatch.setenv("KVSERVE_NUM_THREADS", str(threads + 1))
    try:
        with setup_process("cpu") as n:
            assert n == torch.get_num_threads() == threads + 1
            before = gc.get_freeze_count()
            built = [[i] for i in range(1000)]  # gc-tracked objects start-up made
        assert gc.get_freeze_count() >= before + len(built)
    finally:
        torch.set_num_threads(threads)


def test_setup_process_freezes_nothing_when_the_build_fails() -> None:
    threads = torch.get_num_threads()
    made = [[i] for i in range(1000)]  # gc-tracked, not frozen: a freeze would count them
    before = gc.get_freeze_count()
    try:
        with pytest.raises(RuntimeError, match="load failed"), setup_process("cpu"):
            raise RuntimeError("load failed")
    finally:
        torch.set_num_threads(threads)
    # Frozen objects can still die (refcount) meanwhile, so the count may drop; a freeze
    # would raise it by at least the objects made above.
    assert gc.get_freeze_count() <= before
    assert len(made) == 1000


def test_share_cores_splits_the_mask_into_disjoint_slices(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    assert [share_cores(i, 2) for i in range(2)] == [[0, 1], [2, 3]]  # core 4 left over
    assert [share_cores(i, 1) for i in range(1)] == [[0, 1, 2, 3, 4]]
    # More shares than cores: one core each, round-robin.
    assert [share_cores(i, 7) for i in range(7)] == [[0], [1], [2], [3], [4], [0], [1]]
