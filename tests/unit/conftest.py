"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest

from kvserve.ops.cpu import ISAS, CpuOps, cpu_has_avx2_fma, runnable_isas


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    """The CPU backend as the engine builds it (kernels where this CPU has AVX2+FMA)."""
    o = CpuOps()
    assert o.uses_kernels == cpu_has_avx2_fma()
    return o


@pytest.fixture(scope="module", params=ISAS)
def qlinear_ops(request: pytest.FixtureRequest) -> CpuOps:
    """CpuOps whose int8-activation kernels (qlinear, qlinear_kquant) are the AVX-512 VNNI
    ones with AMX tiles, the VNNI ones alone, or the AVX2 ones; skipped where this CPU lacks
    that ISA."""
    if request.param not in runnable_isas():
        pytest.skip(f"needs a CPU with {request.param} (and AVX2+FMA)")
    ops = CpuOps(isa=request.param)
    if request.param != "avx2" and not ops._vnni:
        pytest.skip("needs an AVX-512 VNNI CPU")
    return ops
