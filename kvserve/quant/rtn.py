"""Weight-only int8 and int4 for float checkpoints, quantized at load by round to nearest.

    int8 (--quantization int8): symmetric, one scale per output channel
        w[n, k] ~= s[n] * q[n, k],           q in [-127, 127]
    int4 (--quantization int4, --quant-group-size 32 | 64 | 128): asymmetric, per group of G
        consecutive inputs of a row
        w[n, k] ~= d[n, g] * q[n, k] + m[n, g],  q in [0, 15],  g = k // G

Both are written as GGUF blocks, so they run on the kernel family that already runs GGUF
files (int8-quantized activations, exact integer dot products, kvserve/quant/gguf.py):

    int8 -> Q8_0 blocks: each 32-weight block of row n carries d = s[n]
    int4 -> Q4_1 blocks: each 32-weight block of group g carries (d[n, g], m[n, g]);
            a group of 64 or 128 is 2 or 4 blocks with the same pair, and groups of
            128 are packed as Q4_1_128, the pair once per 4 blocks

The scales are rounded to float16 (the blocks' type) before the weights are quantized
against them, so the stored quants are the nearest ones for the scales actually used. Per
channel, int8 keeps 8.5 bits per weight (the per-block scale repeats); int4 keeps 5 (4.25
in groups of 128).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvserve.quant.base import (
    KernelWeight,
    LinearMethod,
    QuantizedTensor,
    QuantMethod,
    copy_shard,
    create_dense_weight,
    dense,
    dense_names,
    require_float32,
)
from kvserve.quant.block_pack import BLOCK, F32, Q4_1, Q4_1_128, Q8_0, SHARED_SPAN, pack
from kvserve.quant.int4_groups import Int4Groups
from kvserve.quant.kernel_runs import dequantize_runs, int4_runs

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

INT4_GROUP_SIZES = (32, 64, 128)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to float16 (the blocks' scale type), back in float32."""
    return x.to(torch.float16).float()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q int8 [N, K], s float32 [N], float16-exact): per output channel,
    s = amax / 127 rounded to float16, q = round-half-even(w / s) clamped to [-127, 127]
    (q = 0 for an all-zero row)."""
    w = w.float()
    s = _f16(w.abs().amax(dim=1) / 127)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def quantize_int4(w: torch.Tensor, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q uint8 [N, K] in [0, 15], d, m float32 [N, K / G], float16-exact):
    per group, m = min rounded to float16, d = (max - m) / 15 rounded to float16,
    q = round-half-even((w - m) / d) clamped to [0, 15] (q = 0 where d = 0)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    m = _f16(g.amin(dim=-1))
    d = _f16((g.amax(dim=-1) - m) / 15)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((g - m[..., None]) / safe[..., None]).clamp_(0, 15)
    q = torch.where(d[..., None] > 0, q, torch.zeros_like(q))
    return q.to(torch.uint8).reshape(n, k), d, m


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> uint8 [..., 2], the float16 values' little-endian bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def int8_to_q8_0(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(q int8 [N, K], s [N] per row or [N, K / G] per group of G inputs) -> Q8_0 rows uint8
    [N, K / 32 * 34]: each block's fp16 d is its row's (group's) scale, then 32 int8."""
    n, k = q.shape
    nb = k // BLOCK
    per_block = s[:, None].expand(n, nb) if s.dim() == 1 else s.repeat_interleave(
        nb // s.shape[1], dim=1)
    d = _half_bytes(per_block)
    qs = q.reshape(n, nb, BLOCK).view(torch.uint8)
    return torch.cat([d, qs], dim=-1).reshape(n, -1)


def int4_to_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int
                 ) -> torch.Tensor:
    """(q [N, K] in [0, 15], d, m [N, K / G]) -> Q4_1 rows uint8 [N, K / 32 * 20]: fp16 d,
    fp16 m, then 16 bytes whose low nibble is quant j and high nibble quant 16 + j."""
    n, k = q.shape
    nb = k // BLOCK
    per = group_size // BLOCK  # blocks per group: each repeats its group's (d, m)
    d_b = _half_bytes(d.repeat_interleave(per, dim=1))
    m_b = _half_bytes(m.repeat_interleave(per, dim=1))
    qb = q.reshape(n, nb, BLOCK)
    qs = qb[..., :16] | (qb[..., 16:] << 4)
    return torch.cat([d_b, m_b, qs], dim=-1).reshape(n, -1)


def q4_1_format(group_size: int) -> int:
    """The packed format int4_to_q4_1's blocks run as: Q4_1_128 where every 4 blocks in a row
    repeat one group's (d, m) (groups of 128 or a multiple: 4.25 bits a weight), else Q4_1
    (5.0). The kernels give the same bits either way."""
    return Q4_1_128 if group_size % (BLOCK * SHARED_SPAN) == 0 else Q4_1


class RTNLinearMethod:
    """A Linear whose float weight is quantized once loaded (process_weights_after_loading)
    into GGUF blocks and packed for the int8-activation kernels (ops.qlinear)."""

    def __init__(self, bits: int, group_size: int | None) -> None:
        self.bits = bits
        self.group_size = group_size
        self.wtype = F32  # until quantized

    def checkpoint_names(self, layer: Any) -> tuple[str, ...]:
        return dense_names(layer)

    def create_weights(self, layer: Any, dtype: torch.dtype) -> None:
        unit = self.group_size or BLOCK
        if layer.in_features % unit:
            raise ValueError(f"int{self.bits} quantizes groups of {unit} inputs; a linear layer "
                             f"of {layer.in_features} inputs does not divide by {unit}")
        create_dense_weight(layer, dtype)

    def load_shard(self, layer: Any, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        copy_shard(layer, name, shard, dense(tensor))

    def process_weights_after_loading(self, layer: Any) -> None:
        w = layer.weight.data
        if self.bits == 8:
            blocks, qtype = int8_to_q8_0(*quantize_int8(w)), Q8_0
        else:
            assert self.group_size is not None
            q, d, m = quantize_int4(w, self.group_size)
            blocks = int4_to_q4_1(q, d, m, self.group_size)
            qtype = q4_1_format(self.group_size)
        layer.weight = nn.Parameter(pack(blocks, qtype, layer.in_features),
                                    requires_grad=False)
        self.wtype = qtype

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return layer.ops.qlinear(x, layer.weight, layer.out_features, layer.bias,
                                 wtype=self.wtype)

    def kernel_weights(self, layer: Any) -> list[KernelWeight] | None:
        return [KernelWeight(layer.weight, self.wtype, 0, layer.out_features)]

    def weight_rows(self, layer: Any) -> None:
        return None  # quantized at load: its rows are not the checkpoint's values

    def dense_weight(self, layer: Any) -> torch.Tensor:
        return dequantize_runs(self.kernel_weights(layer), layer.in_features)

    def int4_groups(self, layer: Any) -> Int4Groups | None:
        return int4_runs(self.kernel_weights(layer), layer.in_features)  # None for int8


class _RTNQuantMethod(QuantMethod):
    bits: ClassVar[int]
    needs_kernels = True
    default_kv_cache_dtype = "float16"

    @classmethod
    def validate(cls, config: EngineConfig) -> None:
        require_float32(cls.name, config)
        mc = config.model_config
        unit = config.quant.group_size or BLOCK
        widths = {mc.hidden_size, mc.intermediate_size, mc.num_attention_heads * mc.head_dim}
        bad = sorted(k for k in widths if k % unit)
        if bad:
            raise ValueError(f"quantization {cls.name!r} quantizes groups of {unit} inputs; "
                             f"the model's layer widths {bad} do not divide by {unit}")

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix == "lm_head":
            # The output layer is the most sensitive to weight error (every logit reads all of
            # it): it stays at 8 bits under int4 too, as llama.cpp keeps it at Q6_K / Q8_0 in
            # its 4-bit mixes. Not float: tied to a large embedding it would be most of the
            # bytes a decode step reads.
            return RTNLinearMethod(8, None)
        group = self.config.group_size if self.config is not None else None
        return RTNLinearMethod(self.bits, group)


class Int8QuantMethod(_RTNQuantMethod):
    """int8 weights, one scale per output channel, quantized at load."""

    name = "int8"
    bits = 8


class Int4QuantMethod(_RTNQuantMethod):
    """int4 weights, asymmetric per group of 32 / 64 / 128 inputs, quantized at load."""

    name = "int4"
    bits = 4
    group_sizes = INT4_GROUP_SIZES
    default_group_size = 32  # llama.cpp's Q4_0 / Q4_1 group: the best RTN quality
