"""GGUF block-quantized weights kept as stored, for the formats the CPU kernels read.

A GGUF matrix of N rows by K weights is N rows of K / 32 blocks. The kernels
(ops/csrc/linear*.cpp) dequantize a block in registers with exactly gguf-py's arithmetic (one
float32 rounding per operation), so a linear over the blocks equals the float32 linear over
`dequantize(blocks)` bit for bit, while streaming 5 (Q4_1) or 8.5 (Q8_0) bits per weight
instead of 32. `dequantize` below is the pure-torch reference, itself tested against gguf-py.

    Q4_1 (ggml type 3), 20 bytes: fp16 d, fp16 m, 16 bytes qs;
         weight j = d * (qs[j] & 15) + m, weight 16 + j = d * (qs[j] >> 4) + m
    Q8_0 (ggml type 8), 34 bytes: fp16 d, 32 int8 q; weight j = d * q[j]

Other GGUF types are dequantized to the model's dtype at load, as before.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

Q4_1, Q8_0 = 3, 8  # ggml type ids
BLOCK = 32
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


class GGUFWeight(NamedTuple):
    """One GGUF matrix as stored: data uint8 [rows, K // 32 * block bytes], K weights a row."""

    data: torch.Tensor
    qtype: int
    k: int

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.qtype, self.k)


def dequantize(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [rows, K // 32 * block bytes] -> float32 [rows, K], gguf-py's arithmetic."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(TYPE_NAMES.values())}, got {qtype}")
    rows = data.shape[0]
    blocks = data.reshape(rows, k // BLOCK, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, nb, 1]
    if qtype == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(rows, k)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # weights j, then 16 + j
    return (d * q + m).reshape(rows, k)


class GGUFLinearMethod:
    """A Linear whose checkpoint tensors may arrive as GGUFWeight blocks.

    Each output shard (q/k/v of a fused qkv, gate/up) is loaded on its own; once all have
    arrived, shards of one kernel format are concatenated row-wise into a uint8 weight
    (rows of blocks stack like rows of floats). Anything else — a float tensor, mixed formats,
    K not a multiple of 32 — ends up dequantized into the usual float weight."""

    def __init__(self) -> None:
        self.shards: dict[int, GGUFWeight] = {}

    def create_weights(self, layer: Any, dtype: torch.dtype) -> None:
        # Untouched until a float shard is copied in: torch.empty takes no physical memory,
        # and a layer loaded from blocks replaces it.
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=dtype), requires_grad=False)

    def load_quantized(self, layer: Any, shard: int, w: GGUFWeight) -> None:
        size = layer.shard_sizes[shard]
        if w.k != layer.in_features or w.data.shape[0] != size:
            raise ValueError(f"GGUF tensor of {w.data.shape[0]} x {w.k} weights does not fit "
                             f"shard {shard} of shape {(size, layer.in_features)}")
        self.shards[shard] = w

    def process_weights_after_loading(self, layer: Any) -> None:
        shards = [self.shards.get(i) for i in range(len(layer.shard_sizes))]
        self.shards = {}
        if all(s is not None for s in shards) and len({s.qtype for s in shards}) == 1 \
                and layer.in_features % BLOCK == 0:
            layer.weight = nn.Parameter(torch.cat([s.data for s in shards]).contiguous(),
                                        requires_grad=False)
            return
        start = 0
        for i, s in enumerate(shards):
            size = layer.shard_sizes[i]
            if s is not None:
                layer.weight.data[start:start + size].copy_(s.dequantize())
            start += size

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return layer.ops.linear(x, layer.weight, layer.bias)


def qtype_of(data: torch.Tensor, k: int) -> int:
    """The format of a uint8 weight, read off its row length, as the C++ kernels do: only
    Q4_1 and Q8_0 reach the kernels, and their rows differ (20 vs 34 bytes per block)."""
    for qtype, nbytes in BLOCK_BYTES.items():
        if k % BLOCK == 0 and data.shape[-1] == k // BLOCK * nbytes:
            return qtype
    raise ValueError(f"uint8 weight rows of {data.shape[-1]} bytes are neither Q4_1 nor Q8_0 "
                     f"blocks for K={k}")


def dequantize_any(weight: torch.Tensor, k: int) -> torch.Tensor:
    """A linear weight as float32 [N, K]: uint8 GGUF blocks dequantized, floats as they are."""
    if weight.dtype != torch.uint8:
        return weight
    return dequantize(weight, qtype_of(weight, k), k)
