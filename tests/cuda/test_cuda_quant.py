"""tests/e2e/test_quant_without_kernels.py on a CUDA GPU: GPTQ / AWQ checkpoints on tinygemm
(4-bit, bfloat16) or dequantized once loaded (float32; 8-bit), W8A8 through torch._int_mm,
int8 / int4 rounded at load, each against the same independent references as on the torch
backend."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_quant_without_kernels import (  # noqa: F401  (fixtures and tests)
    checkpoints,
    test_4_bit_checkpoints_stay_4_bit,
    test_a_quantized_checkpoint_runs_without_the_cpu_kernels,
    test_int8_linear_is_the_packed_kernels_oracle,
    test_round_to_nearest_at_load_runs_without_the_cpu_kernels,
    tiny_dir,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def target() -> tuple[str, str]:
    return "cuda", "auto"
