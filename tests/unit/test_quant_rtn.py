"""Weight-only int8 / int4 (kvserve/quant/rtn.py): the blocks they write decode, by gguf-py's
own dequantize, to exactly the round-to-nearest weights; the rounding error is within half a
step; a quantized Linear equals its dequantize-then-int8-matmul oracle bit for bit; and a
whole model quantized at load stays close to the float32 model."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.config import QuantConfig
from kvserve.layers.linear import Linear
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.ops.reference import ReferenceOps
from kvserve.quant import get_quant_method, quant_config
from kvserve.quant.block_pack import Q4_1, Q4_1_128, Q8_0, qlinear_reference
from kvserve.quant.rtn import (
    RTNLinearMethod,
    int4_to_q4_1,
    int8_to_q8_0,
    quantize_int4,
    quantize_int8,
)
from tests.helpers import next_token_kl


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0  # an all-zero row: scale 0
    w[1, :64] = 0.25  # a constant group: d = 0 in int4
    return w


def _gguf_py(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    out = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, np.float32))


def test_int8_blocks_decode_to_the_rounded_weights() -> None:
    w = _weights(24, 256)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.equal(s, s.half().float())  # stored exactly as the block's fp16 d
    want = s[:, None] * q.float()
    assert torch.equal(_gguf_py(int8_to_q8_0(q, s), Q8_0), want)
    # Round to nearest: within half a step of every weight.
    assert ((w - want).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert not want[0].any()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_blocks_decode_to_the_rounded_weights(group: int) -> None:
    w = _weights(24, 256, seed=group)
    q, d, m = quantize_int4(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    want = (d.repeat_interleave(group, 1) * q.float() + m.repeat_interleave(group, 1))
    assert torch.equal(_gguf_py(int4_to_q4_1(q, d, m, group), Q4_1), want)
    step = d.repeat_interleave(group, 1)
    # Half a step, plus what rounding m to float16 moved the grid (at most half its ulp).
    slack = m.abs().repeat_interleave(group, 1) * 2.0**-11
    assert ((w - want).abs() <= step / 2 * (1 + 1e-6) + slack).all()
    assert torch.equal(want[1, :64], w[1, :64])  # a constant group is exact


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32), (4, 128)])
def test_linear_equals_its_dequantize_then_int8_matmul_oracle(bits: int, group: int | None
                                                             ) -> None:
    n, k = 40, 256
    w = _weights(n, k, seed=bits)
    lin = Linear(k, n, bias=True, ops=ReferenceOps(), dtype=torch.float32,
                 shard_sizes=(24, 16), quant_method=RTNLinearMethod(bits, group))
    lin.load_shard("weight", 0, w[:24])
    lin.load_shard("weight", 1, w[24:])
    lin.load_shard("bias", 0, torch.zeros(24))
    lin.load_shard("bias", 1, torch.ones(16))
    lin.process_weights_after_loading()
    # groups of 128 keep their one (d, m) once per 4 blocks (Q4_1_128); smaller ones per block
    wtype = Q8_0 if bits == 8 else Q4_1_128 if group == 128 else Q4_1
    assert lin.quant_method.wtype == wtype and lin.weight.dtype == torch.uint8
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(lin(x), qlinear_reference(x, lin.weight, wtype, n, lin.bias))
    # What the whole method costs against the float linear (weights and activations).
    ref = F.linear(x, w, lin.bias)
    err = (lin(x) - ref).abs().max() / (ref - lin.bias).abs().max()
    # Over 20 random x: at most 0.011 (int8), 0.089 (int4, g32), 0.122 (int4, g128).
    assert err < (0.02 if bits == 8 else 0.15), err


def test_group_sizes_and_dtypes_are_checked() -> None:
    with pytest.raises(ValueError, match="needs group_size in 32, 64, 128, got 96"):
        quant_config("int4", 96)
    with pytest.raises(ValueError, match="'int8' takes no group_size"):
        quant_config("int8", 32)
    with pytest.raises(ValueError, match="needs group_size in 32, 64, 128, got 96"):
        get_quant_method(QuantConfig("int4", 96))  # unchecked configs are checked on use
    assert quant_config("int4").group_size == 32  # the default


@pytest.mark.parametrize("method, max_kl", [("int8", 0.02), ("int4", 0.01)])
def test_model_quantized_at_load_stays_near_float32(smollm2_exact: Any, method: str,
                                                    max_kl: float) -> None:
    """The default model's float weights (its Q4_1 / Q8_0 blocks dequantized) requantized at
    load, against the float32 model: mean KL of the next-token distributions (measured 0.011
    for int8, 0.005 for int4 in groups of 32, which recovers Q4_1's own 32-weight grids; the
    "gguf" path itself is at 0.004), and the same greedy token almost everywhere."""
    _path, ckpt, exact = smollm2_exact
    model = build_model(ckpt, get_ops("auto"), torch.float32, method)
    lm_head = model.lm_head.quant_method
    assert isinstance(lm_head, RTNLinearMethod) and lm_head.bits == 8  # kept at 8 bits
    prompt = ckpt.tokenizer.encode("The capital of France is Paris, and the capital of Italy")
    kl, agree = next_token_kl(model, exact, prompt)
    assert kl < max_kl, kl
    assert agree >= 0.85, agree  # near-ties may flip a position or two
