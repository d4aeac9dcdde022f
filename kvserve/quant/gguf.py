"""GGUF block-quantized weights run as stored on the CPU kernels: GGUFLinearMethod and the
two quantization methods. The matrices themselves (GGUFWeight, PackedRows, the formats' byte
layouts and dequantize oracles) are gguf_weights.py's; their runs' helpers, kernel_runs.py's.

Two ways to run the blocks (two registry entries, kvserve/quant/__init__.py):

- "gguf" (the default on the CPU): llama.cpp's arithmetic. The weights are repacked at load
  (block_pack.pack, same bytes) into groups of 16 rows whose int4/int5/int8 quants interleave
  4 at a time, and each activation row is quantized to int8 per 32 values
  (block_pack.quantize_activations, the Q8_1 scheme llama.cpp applies before its quantized dot
  products). The kernels (ops/csrc/qlinear*.cpp) then sum int8 products exactly in int32 per
  block, with VNNI or AVX2, and scale per block in float32: ~4x less compute per weight than
  dequantizing, and a result that block_pack.qlinear_reference reproduces bit for bit on
  every ISA.
- "gguf_exact": the blocks as stored, dequantized in registers (ops/csrc/linear*.cpp): the
  float32 model's output bit for bit, at the cost of float32 compute.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.quant.base import (
    DequantizedQuantMethod,
    KernelWeight,
    LinearMethod,
    QuantizedTensor,
    QuantMethod,
    copy_shard,
    create_dense_weight,
    dense,
    dense_names,
    kernels_run,
    require_float32,
)
from kvserve.quant.block_pack import BLOCK, PACKED_BYTES
from kvserve.quant.gguf_weights import (
    KEPT_TYPES,
    KQUANT_TYPES,
    QK_K,
    ROW_TYPES,
    GGUFWeight,
    PackedRows,
    pack_groups,
)
from kvserve.quant.half_weights import float_wtype, half_rows, keep_exact_halves
from kvserve.quant.int4_groups import Int4Groups
from kvserve.quant.kernel_runs import apply_kernel_weights, dequantize_runs, int4_runs

if TYPE_CHECKING:
    from kvserve.config import EngineConfig


class GGUFLinearMethod:
    """A Linear whose checkpoint tensors may arrive as GGUFWeight blocks.

    Each output shard (q/k/v of a fused qkv, gate/up) is loaded on its own; once all have
    arrived, the shards are kept in runs of one format each (`parts`): a run's shards are
    concatenated row-wise (rows of blocks stack like rows of floats) and, for int8 activations,
    repacked into 16-row groups (`pack`; K-quants `pack_kquant`). One run is the usual case; a
    Q4_K_M file mixes types inside one fused layer (q and k Q4_K, v Q6_K), and then the runs'
    outputs are concatenated. Anything else (a float tensor, a format without a kernel, K not
    a multiple of the block) ends up dequantized into the usual float weight, kept at 16 bits
    where every value is a float16 (or bfloat16) one: a file's F16 / BF16 matrices.

    int8_activations: runs go to `ops.qlinear` / `ops.qlinear_kquant` (llama.cpp's
    arithmetic); otherwise Q4_1 / Q8_0 rows stay as stored and `ops.linear` dequantizes them
    in registers. requantize: a weight shard of a block type outside KEPT_TYPES is rewritten
    as it arrives (GGUFWeight.for_kernels: the i-quants of ggml_kquants.IQ4_REWRITES exactly
    in or after IQ4_XS's layout, any other as Q8_0), and so runs on the kernels too."""

    def __init__(self, int8_activations: bool = True, requantize: bool = False) -> None:
        self.int8_activations = int8_activations
        self.requantize = requantize
        self.shards: dict[int, GGUFWeight] = {}
        self.parts: list[KernelWeight] = []  # set once loaded

    def checkpoint_names(self, layer: Any) -> tuple[str, ...]:
        return dense_names(layer)

    def create_weights(self, layer: Any, dtype: torch.dtype) -> None:
        # Untouched until a float shard is copied in: torch.empty takes no physical memory,
        # and a layer loaded from blocks replaces it.
        create_dense_weight(layer, dtype)

    def load_shard(self, layer: Any, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        """A weight shard in a kernel format is kept until every shard is in (one of another
        block format first rewritten for the kernels when `requantize`); anything else (a bias, a
        float tensor, another block format) goes in as floats now."""
        if (self.requantize and name == "weight" and isinstance(tensor, GGUFWeight)
                and tensor.k % BLOCK == 0):
            tensor = tensor.for_kernels()  # itself where a kernel reads it
        if name != "weight" or not isinstance(tensor, GGUFWeight) \
                or tensor.qtype not in KEPT_TYPES:
            copy_shard(layer, name, shard, dense(tensor))
            return
        size = layer.shard_sizes[shard]
        if tensor.k != layer.in_features or tensor.data.shape[0] != size:
            raise ValueError(f"GGUF tensor of {tensor.data.shape[0]} x {tensor.k} weights does "
                             f"not fit shard {shard} of shape {(size, layer.in_features)}")
        self.shards[shard] = tensor

    def _kept(self, qtype: int, k: int) -> bool:
        """Whether a matrix of this format and width runs on the kernels as stored."""
        if not self.int8_activations:
            return qtype in ROW_TYPES and k % BLOCK == 0
        if qtype in KQUANT_TYPES:
            return k % QK_K == 0
        return qtype in PACKED_BYTES and k % BLOCK == 0

    def process_weights_after_loading(self, layer: Any) -> None:
        shards = [self.shards.get(i) for i in range(len(layer.shard_sizes))]
        self.shards = {}
        k = layer.in_features
        if not all(s is not None and self._kept(s.qtype, k) for s in shards):
            start = 0
            for i, s in enumerate(shards):
                size = layer.shard_sizes[i]
                if s is not None:
                    layer.weight.data[start:start + size].copy_(s.dequantize())
                start += size
            # A file's F16 / BF16 matrices (dequantized exactly by the loader) stay 16-bit.
            keep_exact_halves(layer)
            self.parts = [KernelWeight(layer.weight, float_wtype(layer.weight), 0,
                                       layer.out_features)]
            return
        runs: list[tuple[int, int, list[GGUFWeight]]] = []  # (qtype, first row, shards)
        row = 0
        for s in shards:
            assert s is not None
            if runs and runs[-1][0] == s.qtype:
                runs[-1][2].append(s)
            else:
                runs.append((s.qtype, row, [s]))
            row += s.data.shape[0]
        self.parts = [KernelWeight(self._repack(torch.cat([s.data for s in ss]).contiguous(),
                                                qtype, k),
                                   qtype, start, sum(s.data.shape[0] for s in ss))
                      for qtype, start, ss in runs]
        # One run: it is the weight. Several: the parts hold it, and the float placeholder
        # goes (it would take memory).
        layer.weight = nn.Parameter(self.parts[0].weight if len(self.parts) == 1
                                    else torch.empty(0, dtype=torch.uint8), requires_grad=False)

    def _repack(self, data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        # K-quants run packed only; the row formats stay as stored for gguf_exact's kernels.
        if self.int8_activations or qtype in KQUANT_TYPES:
            return pack_groups(data, qtype, k)
        return data

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return apply_kernel_weights(layer.ops, x, self.parts, layer.bias)

    def kernel_weights(self, layer: Any) -> list[KernelWeight] | None:
        return self.parts

    def weight_rows(self, layer: Any) -> QuantizedTensor | None:
        if len(self.parts) != 1:
            return None
        w, qtype, k = self.parts[0].weight, self.parts[0].wtype, layer.in_features
        if w.dtype != torch.uint8:
            return half_rows(w)
        if w.dim() == 3:  # 16-row groups
            return PackedRows(w, qtype, k, layer.out_features)
        return GGUFWeight(w, qtype, k)  # rows as stored (int8_activations False)

    def dense_weight(self, layer: Any) -> torch.Tensor:
        return dequantize_runs(self.parts, layer.in_features)

    def int4_groups(self, layer: Any) -> Int4Groups | None:
        return int4_runs(self.parts, layer.in_features)


class GGUFQuantMethod(QuantMethod):
    """quantization "gguf": a GGUF file's block-quantized matrices (KEPT_TYPES) kept and
    packed, run against int8 activations (llama.cpp's arithmetic); a matrix of another block
    type requantized to Q8_0 for the same kernels. The default for a .gguf file in float32 on
    kvserve's CPU kernels."""

    name = "gguf"
    default_kv_cache_dtype = "float16"
    keeps_quantized = True
    needs_kernels = True
    int8_activations = True
    requantize = True  # other block types to Q8_0 (GGUFLinearMethod)

    @classmethod
    def detect(cls, model_path: str, device: str, dtype: str, ops_backend: str,
               quantization_config: dict[str, Any] | None = None) -> bool:
        return (cls.name == "gguf" and model_path.lower().endswith(".gguf")
                and dtype == "float32" and kernels_run(device, ops_backend))

    @classmethod
    def validate(cls, config: EngineConfig) -> None:
        if not config.model.lower().endswith(".gguf"):
            raise ValueError(f"quantization {cls.name!r} needs a .gguf model file, got "
                             f"{config.model!r}")
        require_float32(cls.name, config)

    def linear_method(self, prefix: str) -> LinearMethod:
        return GGUFLinearMethod(int8_activations=self.int8_activations,
                                requantize=self.requantize)

    def without_kernels(self, device: str) -> QuantMethod:
        # Off the kernels every weight but a 4-bit group ends up dequantized: a Q8_0 detour
        # would only add its rounding.
        plain = copy.copy(self)
        plain.requantize = False  # type: ignore[misc]
        return DequantizedQuantMethod(plain, device)


class GGUFExactQuantMethod(GGUFQuantMethod):
    """quantization "gguf_exact": the same blocks kept as stored and dequantized in
    registers, so the output is the float32 model's bit for bit (any other block type
    dequantized, never requantized)."""

    name = "gguf_exact"
    int8_activations = False
    requantize = False
    default_kv_cache_dtype = "auto"  # float32's outputs bit for bit, its cache too
