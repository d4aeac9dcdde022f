"""GGUF matrices as stored (GGUFWeight) and as the kernels pack them (PackedRows), with
their dequantize oracles: what the loader hands over and what gguf.py's linear method runs.

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
IQ2_S, IQ1_M in its quants with a scale per 16 weights (iquant_rewrite.rewrite_iq4). A matrix of
any other block type (TQ1_0 / TQ2_0, MXFP4, ...) is requantized to Q8_0 at load under "gguf"
(GGUFWeight.for_kernels: 8.5 bits a weight on the int8 kernels instead of float32's 32, for
about Q8_0's rounding on top of the file's); "gguf_exact" and a backend without the kernels
dequantize it to the model's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvserve.quant import ggml_blocks, ggml_kquants, iquant_rewrite
from kvserve.quant.block_pack import (
    BLOCK,
    BLOCK_BYTES,
    GROUP,
    PACKED_BYTES,
    Q4_1,
    Q4_1_128,
    Q8_0,
    TYPE_NAMES,
    pack,
    unpack,
)
from kvserve.quant.kquant_pack import pack_kquant

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


def pack_groups(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """A matrix as stored, in the kernels' 16-row groups: `pack_kquant` for a K-quant (or an
    IQ4_XS-layout type), `pack` for a 32-weight block type."""
    return pack_kquant(data, qtype, k) if qtype in KQUANT_TYPES else pack(data, qtype, k)


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
            data = iquant_rewrite.rewrite_iq4(self.data, self.qtype, self.k)
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
        return pack_groups(data, qtype, k).reshape(-1)

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
