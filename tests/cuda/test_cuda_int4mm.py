"""tests/unit/test_int4mm.py on a CUDA GPU: 4-bit groups on tinygemm
(aten._weight_int4pack_mm) in bfloat16, against the same float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_int4mm import (  # noqa: F401  (tests)
    test_matmul_is_the_groups_dequantized,
    test_what_the_kernel_lacks_is_refused_by_name,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def target() -> tuple[str, torch.dtype]:
    return "cuda", torch.bfloat16
