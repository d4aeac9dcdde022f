"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest

from kvserve.ops.cpu import CpuOps, cpu_has_avx2_fma


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    """The CPU backend as the engine builds it (kernels where this CPU has AVX2+FMA)."""
    o = CpuOps()
    assert o.uses_kernels == cpu_has_avx2_fma()
    return o
