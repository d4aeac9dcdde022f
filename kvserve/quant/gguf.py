"""GGUF block-quantized weights kept as stored, for the formats the CPU kernels read.

A GGUF matrix of N rows by K weights is N rows of K / 32 blocks. The kernels
(ops/csrc/linear*.cpp) dequantize a block in registers with exactly gguf-py's arithmetic (one
float32 rounding per operation), so a linear over the blocks equals the float32 linear over
`dequantize(blocks)` bit for bit, while streaming 5 (Q4_1) or 8.5 (Q8_0) bits per weight
instead of 32. `dequantize` below is the pure-torch reference, itself tested against gguf-py.

    Q4_1 (ggml type 3), 20 bytes: fp16 d, fp16 m, 16 bytes qs;
         weight j = d * (qs[j] & 15) + m, weight 16 + j = d * (qs[j] >> 4) + m
    Q8_0 (ggml type 8), 34 bytes: fp16 d, 32 int8 q; weight j = d * q[j]
    Q4_0 (2), Q5_0 (6), Q5_1 (7), IQ4_NL (20): 18, 22, 24, 18 bytes, laid out in
         ggml_blocks.py; only packed (kvserve/quant/block_pack.py), never read as rows:
         ROW_TYPES are the row kernels' formats.

The K-quants in KQUANT_TYPES stay packed too under "gguf" (kvserve/quant/kquant_pack.py), and
IQ3_S, IQ3_XXS, IQ2_XXS and IQ1_S join them rewritten exactly in IQ4_XS's layout, IQ2_XS and
IQ2_S, IQ1_M in its quants with a scale per 16 weights (ggml_kquants.rewrite_iq4). A matrix of
any other block type (TQ1_0 / TQ2_0, MXFP4, ...) is requantized to Q8_0 at load under "gguf"
(GGUFWeight.for_kernels: 8.5 bits a weight on the int8 kernels instead of float32's 32, for
about Q8_0's rounding on top of the file's); "gguf_exact" and a backend without the kernels
dequantize it to the model's dtype.

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
import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import nn

from kvserve.quant import ggml_blocks, ggml_kquants
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
    float_wtype,
    half_rows,
    keep_exact_halves,
    kernels_run,
    require_float32,
)
from kvserve.quant.block_pack import (
    BLOCK,
    BLOCK_BYTES,
    GROUP,
    PACKED_BYTES,
    Q4_0,
    Q4_1,
    Q4_1_128,
    Q8_0,
    TYPE_NAMES,
    pack,
    unpack,
)
from kvserve.quant.int4_groups import Int4Groups

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

# The formats ops.linear's row kernels read as stored (gguf_exact); the others run packed only.
ROW_TYPES = (Q4_1, Q8_0)
# K-quant matrices kept packed too (kvserve/quant/kquant_pack.py, ops/csrc/qlinear_kquant*.cpp:
# Q8_K activations per 256 values) under "gguf"; 256 weights per super-block.
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 10, 11, 12, 13, 14, 23
# with a file's IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S, IQ2_XS, IQ2_S, IQ1_M as rewritten for them
# (ggml_kquants.IQ4_REWRITES; the last two share IQ2_X16)
KQUANT_TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) + tuple(
    dict.fromkeys(target for _, target in ggml_kquants.IQ4_REWRITES.values()))
QK_K = 256
# What the loader hands over as stored (GGUFWeight) when the method keeps blocks: every type
# a kernel reads (GGUFLinearMethod keeps Q4_0 / Q5_0 / Q5_1 for int8 activations only, the
# row kernels of gguf_exact reading ROW_TYPES).
KEPT_TYPES = tuple(PACKED_BYTES) + KQUANT_TYPES


def block_bytes(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one stored block of a ggml type or of a kvserve IQ4_XS-layout
    type (IQ3_S4, ...)."""
    if qtype in KQUANT_TYPES:
        return QK_K, ggml_kquants.KQUANT_BYTES[qtype]
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


class GGUFWeight(NamedTuple):
    """One GGUF matrix as stored: data uint8 [rows, K // block * block bytes], K weights a
    row."""

    data: torch.Tensor
    qtype: int
    k: int

    def dequantize(self) -> torch.Tensor:
        if self.qtype in BLOCK_BYTES:
            return dequantize(self.data, self.qtype, self.k)
        if self.qtype in ggml_blocks.BLOCK_BYTES:
            return ggml_blocks.dequantize(self.data, self.qtype, self.k)
        # A type without an oracle here (requantized or dequantized at load): gguf-py's.
        floats = gguf_quants.dequantize(self.data.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(floats.astype("float32", copy=False)).reshape(-1, self.k)

    def for_kernels(self) -> GGUFWeight:
        """The matrix in a format the kernels read: as stored where they read it (KEPT_TYPES),
        the i-quants of ggml_kquants.IQ4_REWRITES rewritten in (or after) IQ4_XS's layout
        (the same weights), any other block type requantized to Q8_0. K % 32 == 0."""
        if self.qtype in KEPT_TYPES:
            return self
        if self.qtype in ggml_kquants.IQ4_REWRITES:
            _, target = ggml_kquants.IQ4_REWRITES[self.qtype]
            data = ggml_kquants.rewrite_iq4(self.data, self.qtype, self.k)
            return GGUFWeight(data, target, self.k)
        return self.as_q8_0()

    def as_q8_0(self) -> GGUFWeight:
        """The matrix requantized to Q8_0 (K % 32 == 0): what the kernels read of a block
        type they have no kernel for."""
        return q8_0_blocks(self.dequantize())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids dequantized (row by row, so each equals its row of dequantize()), on ids'
        device."""
        picked = self.data.index_select(0, ids.to(self.data.device))
        return GGUFWeight(picked, self.qtype, self.k).dequantize().to(ids.device)

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight | None:
        """Rows [start, start + length) (dim 0), or columns (dim 1) along whole blocks, as
        stored: a tensor-parallel shard. Columns that cut a K-quant's 256-weight super-block
        (Qwen2.5 0.5B's 896 / 2 = 448) are requantized to Q8_0, whose 32-weight blocks the cut
        keeps whole: a quarter of float32's bytes, for about Q8_0's error on top of the
        file's. None when even 32 does not divide the cut (the caller dequantizes)."""
        if dim == 0:
            return GGUFWeight(self.data[start:start + length], self.qtype, self.k)
        block, nbytes = block_bytes(self.qtype)
        if start % block == 0 and length % block == 0:
            b0, nb = start // block * nbytes, length // block * nbytes
            return GGUFWeight(self.data[:, b0:b0 + nb].contiguous(), self.qtype, length)
        if start % BLOCK or length % BLOCK:
            return None
        return q8_0_blocks(self.dequantize()[:, start:start + length].contiguous())


def q8_0_blocks(floats: torch.Tensor) -> GGUFWeight:
    """float32 [rows, K] (K % 32 == 0) as Q8_0 blocks, gguf-py's quantizer: one fp16 scale
    per 32 weights, ~1/254 of a block's largest weight of rounding at most (a quarter of
    float32's bytes)."""
    q8 = gguf_quants.quantize(floats.numpy(), GGMLQuantizationType.Q8_0)
    return GGUFWeight(torch.from_numpy(q8), Q8_0, floats.shape[1])


class PackedRows(NamedTuple):
    """A matrix the kernels hold in 16-row groups (`pack`, `pack_kquant`), read row by row as
    QuantizedTensor is: a tied lm_head's packed blocks, which the embedding lookup shares
    instead of a second copy of the same blocks as stored (the SmolLM2 Q4_1 file's Q8_0
    embedding: 30 MB). Each row equals its row of GGUFWeight.dequantize() on the stored
    blocks, bit for bit."""

    packed: torch.Tensor  # uint8 [ceil(n / 16), K / block, packed record bytes]
    qtype: int
    k: int
    n: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def dequantize(self) -> torch.Tensor:
        # In slices: one gather index over a whole vocabulary would be ~16x its bytes.
        return torch.cat([self.rows(torch.arange(s, min(s + 4096, self.n)))
                          for s in range(0, self.n, 4096)])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's stored blocks gathered from its group, then dequantize (Q5_0 / Q5_1,
        whose bit-4 plane is no byte move, unpack their groups instead). About twice a lookup
        in the stored blocks: ~65 against ~30 us for one row on the default model, torch's
        per-call overhead on a few hundred bytes (~0.7% of its decode step)."""
        flat = ids.to(self.packed.device, torch.long).reshape(-1)
        if not len(flat):
            return torch.empty(*ids.shape, self.k, device=ids.device)
        gather = _row_gather(self.qtype, self.k)
        if gather is not None:
            at, flip = gather
            if len(flat) == 1:  # one decoding request: views and one index
                g, r = divmod(int(flat[0]), GROUP)
                stored = self.packed[g].reshape(-1)[at[r]][None]
            else:
                r = flat % GROUP
                stored = self.packed.reshape(len(self.packed), -1).index_select(
                    0, flat // GROUP).gather(1, at[r])
            if flip is not None:
                stored ^= flip[r]
            out = GGUFWeight(stored, self.qtype, self.k).dequantize()
        else:
            groups, which = torch.unique(flat // GROUP, return_inverse=True)
            q, d, m = unpack(self.packed.index_select(0, groups), self.qtype)
            pick = which * GROUP + flat % GROUP  # each id's row among those groups' rows
            out = ggml_blocks.scale_quants(q.index_select(0, pick), d.index_select(0, pick),
                                           None if m is None else m.index_select(0, pick))
        return out.reshape(*ids.shape, self.k).to(ids.device)

    def narrow(self, dim: int, start: int, length: int) -> None:
        return None  # the caller dequantizes (a tied embedding is never sharded: tp.size 1)


@functools.cache
def _row_gather(qtype: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Where a 16-row group's packing put each stored byte, for a format whose packing only
    moves bytes and flips fixed bits (Q8_0's + 128 is a flip of bit 7; the K-quants and the
    4-bit types only move them): (at int64 [16, row bytes], flip uint8 [16, row bytes]) with
    stored row r = packed group flattened [at[r]] ^ flip[r]. Found by packing each byte's
    position (three byte planes of it), checked on random bytes; None for any other format
    (Q4_1_128, which keeps one of 4 blocks' repeated scales, among them)."""
    if qtype == Q4_1_128:
        return None
    block, nbytes = block_bytes(qtype)
    row = k // block * nbytes

    def packed(data: torch.Tensor) -> torch.Tensor:
        if qtype in KQUANT_TYPES:
            from kvserve.quant.kquant_pack import pack_kquant

            return pack_kquant(data, qtype, k).reshape(-1)
        return pack(data, qtype, k).reshape(-1)

    flip_at = packed(torch.zeros(GROUP, row, dtype=torch.uint8))  # what packing adds to zeros
    pos = torch.arange(GROUP * row)
    source = sum(((packed((pos >> 8 * i & 255).to(torch.uint8).reshape(GROUP, row)) ^ flip_at)
                  .long() << 8 * i) for i in range(3))
    if not torch.equal(source.sort().values, pos):
        return None
    at = torch.empty_like(pos)
    at[source] = torch.arange(len(pos))  # stored byte p sits at packed index at[p]
    probe = torch.randint(0, 256, (GROUP, row), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    if not torch.equal(packed(probe)[at] ^ flip_at[at], probe.reshape(-1)):
        return None
    flip = flip_at[at].reshape(GROUP, row)
    return at.reshape(GROUP, row), flip if flip.any() else None


def dequantize(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [rows, K // 32 * block bytes] -> float32 [rows, K], gguf-py's arithmetic."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(TYPE_NAMES.values())}, got {qtype}")
    if qtype not in ROW_TYPES:
        return ggml_blocks.dequantize(data, qtype, k)
    rows = data.shape[0]
    blocks = data.reshape(rows, k // BLOCK, BLOCK_BYTES[qtype])
    # Views, no copies (a block's bytes are even, so its fp16 fields are aligned): a lookup
    # of one embedding row is a handful of small ops, each mostly call overhead.
    d = blocks[..., 0:2].view(torch.float16).float()  # [rows, nb, 1]
    if qtype == Q8_0:
        q = blocks[..., 2:].view(torch.int8).float()
        return (q * d).reshape(rows, k)
    m = blocks[..., 2:4].view(torch.float16).float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # weights j, then 16 + j
    return (d * q + m).reshape(rows, k)


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
        if qtype in KQUANT_TYPES:
            from kvserve.quant.kquant_pack import pack_kquant

            return pack_kquant(data, qtype, k)
        return pack(data, qtype, k) if self.int8_activations else data

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


def int4_runs(parts: list[KernelWeight], k: int, perm: torch.Tensor | None = None
              ) -> Int4Groups | None:
    """A weight held as packed Q4_0 / Q4_1 (or Q4_1_128) / Q4_K runs as 4-bit groups of 32 in
    torch's int4 convention, w = (q - 8) * scale + zero: Q4_1's d q + m is scale d, zero
    m + 8 d; Q4_0's d (q - 8) is scale d, zero 0; a Q4_K sub-block's dl q - dm (dl = d *
    scale, dm = dmin * min) is scale dl, zero 8 dl - dm. None if any run is another format.
    perm: act-order's input order, which the runs' columns follow."""
    qs, scales, zeros = [], [], []
    for p in parts:
        if p.weight.dim() != 3 or p.wtype not in (Q4_0, Q4_1, Q4_1_128, Q4_K):
            return None
        if p.wtype == Q4_K:
            from kvserve.quant.kquant_pack import unpack as unpack_kquant_rows

            kp = ggml_kquants.unpack_kquant(unpack_kquant_rows(p.weight, Q4_K, p.rows), Q4_K, k)
            q = kp.q.reshape(p.rows, k)
            d = (kp.d[..., None] * kp.scale.float()).reshape(p.rows, -1)
            assert kp.dmin is not None and kp.min is not None
            zero = 8 * d - (kp.dmin[..., None] * kp.min.float()).reshape(p.rows, -1)
        else:
            q, d, m = unpack(p.weight, p.wtype)
            q, d = q[:p.rows].reshape(p.rows, k), d[:p.rows]
            if m is None:  # Q4_0: unpack gave q - 8
                q, zero = q + 8, torch.zeros_like(d)
            else:
                zero = m[:p.rows] + 8 * d
        qs.append(q.to(torch.uint8))
        scales.append(d)
        zeros.append(zero)
    return Int4Groups(torch.cat(qs), torch.cat(scales), torch.cat(zeros), BLOCK, perm)


def dequantize_runs(parts: list[KernelWeight], k: int) -> torch.Tensor:
    """A weight held as KernelWeight runs, as float32 [N, K]: each run's floats, 16-row
    groups (a packed legacy or K-quant format) or GGUF rows as stored, dequantized."""
    out = []
    for p in parts:
        if p.weight.dtype != torch.uint8:
            out.append(p.weight.float())
        elif p.weight.dim() == 3:
            out.append(PackedRows(p.weight, p.wtype, k, p.rows).dequantize())
        else:
            out.append(GGUFWeight(p.weight, p.wtype, k).dequantize())
    return torch.cat(out)


def apply_kernel_weights(ops: Any, x: torch.Tensor, parts: list[KernelWeight],
                         bias: torch.Tensor | None) -> torch.Tensor:
    """x times a weight held as KernelWeight runs, each on the kernel for its format, the
    runs' outputs side by side: what the fused layer stack computes for such a linear."""
    outs = []
    for p in parts:
        b = bias if bias is None or len(parts) == 1 else bias[p.start:p.start + p.rows]
        if p.wtype in KQUANT_TYPES:
            outs.append(ops.qlinear_kquant(x, p.weight, p.rows, b, wtype=p.wtype))
        elif p.weight.dim() == 3:
            outs.append(ops.qlinear(x, p.weight, p.rows, b, wtype=p.wtype))
        else:
            outs.append(ops.linear(x, p.weight, b, wtype=p.wtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


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
