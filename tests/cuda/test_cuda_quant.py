"""tests/e2e/test_quant_without_kernels.py on a CUDA GPU: GPTQ / AWQ checkpoints on tinygemm
(4-bit, bfloat16) or dequantized once loaded (float32; 8-bit), W8A8 through torch._int_mm,
int8 / int4 rounded at load, each against the same independent references as on the torch
backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.quant import get_quant_method, quant_config
from tests.e2e.test_quant_without_kernels import (  # noqa: F401  (fixtures and tests)
    checkpoints,
    test_4_bit_checkpoints_stay_4_bit,
    test_a_quantized_checkpoint_runs_without_the_cpu_kernels,
    test_int8_linear_is_the_packed_kernels_oracle,
    test_round_to_nearest_at_load_runs_without_the_cpu_kernels,
    tiny_dir,
)
from tests.unit.test_gguf_kquants_model import _write

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def target() -> tuple[str, str]:
    return "cuda", "auto"


def test_a_q4_k_m_files_q4_k_layers_run_on_tinygemm(tmp_path: Path) -> None:
    """tests/unit/test_gguf_kquants_model.py's Q4_K_M-like file under an explicit "gguf" on
    CUDA in bfloat16: its Q4_K layers hold tinygemm's int32 tiles, and each computes the
    float model's layer on the same blocks (bfloat16's rounding: the pairs, x and y)."""
    path, _types = _write(tmp_path, "Q4_K_M")
    ck = load_checkpoint(str(path))
    ops = get_ops("auto", "cuda")
    quant = get_quant_method(quant_config("gguf")).without_kernels("cuda")
    model = build_model(ck, ops, torch.bfloat16, quant).to("cuda")
    floats = build_model(ck, ops, torch.float32, "none")
    g = torch.Generator().manual_seed(0)
    for name in ("layers.0.mlp.gate_up_proj", "layers.1.self_attn.o_proj"):
        ours, ref = model.get_submodule(name), floats.get_submodule(name)
        assert ours.weight.dtype == torch.int32 and ours.weight.is_cuda, name
        for m in (1, 300):  # tinygemm, and the dequantized tiles + cuBLAS
            x = torch.randn(m, ours.in_features, generator=g)
            y = ours(x.to("cuda", torch.bfloat16)).float().cpu()
            want = ref(x)
            assert (y - want).abs().max() < 0.02 * want.abs().max(), (name, m)
