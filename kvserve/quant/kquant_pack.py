"""GGUF K-quant matrices (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) repacked for the int8 kernels
(ops/csrc/qlinear_kquant*.cpp).

The weight rows go in groups of 16, as the Q4_1 / Q8_0 packing does (kvserve/quant/gguf.py):
one vpdpbusd multiplies 16 rows x 4 quants (64 bytes) by 4 activation bytes broadcast, and
lands 16 int32 lanes that are 16 output rows, so at M = 1 no horizontal sum is ever needed and
each thread streams one run of records. Rows kept as stored would need one reduction per row
and super-block and 16 streams per 16 outputs.

Per (group g, super-block i) one record of 16 * (stored record) bytes, at
packed[g, i]: every field of the stored super-block (ggml_kquants.py documents them) in stored
order, each transposed over the group's 16 rows in units of u bytes: unit j of row r lies at
field start + (16 * j + r) * u. So packing moves bytes and adds none (the ceiling stays 2.625
/ 3.4375 / 4.5 / 5.5 / 6.5625 / 4.25 bits per weight), and it is one rule for every field:

    u = 2  fp16 d, dmin:    d[r] at 2r                       (16 halves, one load + cvtph)
    u = 1  scale bytes:     plane j = stored byte j of rows 0..15   (16 bytes, one xmm)
    u = 4  quant bytes:     chunk j = stored bytes 4j .. 4j + 3 of rows 0..15   (one zmm)

  Q2_K, 84 -> 1344 bytes:
    [0, 256) 16 scale planes (scale | min << 4)
    [256, 1280) 16 qs chunks: chunk 8h + l4, byte 4r + j = row r's qs[32h + 4 l4 + j], whose
                 bits 2c, 2c + 1 are weight 128h + 32c + 4 l4 + j (sub-block 8h + 2c + l4 // 4)
    [1280, 1312) d[16]   [1312, 1344) dmin[16]
  Q3_K, 110 -> 1760 bytes:
    [0, 512) 8 hmask chunks: chunk l4, byte 4r + j = row r's hmask[4 l4 + j], whose bit 4h + c
                 is the high bit of weight 128h + 32c + 4 l4 + j
    [512, 1536) 16 qs chunks (the low 2 bits), as Q2_K's
    [1536, 1728) 12 scale planes   [1728, 1760) d[16]
  Q4_K, 144 -> 2304 bytes:
    [0, 32) d[16]   [32, 64) dmin[16]   [64, 256) 12 scale planes
    [256, 2304) 32 chunks: chunk 8c + l4, byte 4r + j = row r's qs[32c + 4 l4 + j], which holds
                 weight 64c + 4 l4 + j (low nibble, sub-block 2c) and 64c + 32 + 4 l4 + j (high)
  Q5_K, 176 -> 2816 bytes:
    [0, 32) d[16]   [32, 64) dmin[16]   [64, 256) 12 scale planes (as Q4_K)
    [256, 768) 8 qh chunks: chunk l4, byte 4r + j = row r's qh[4 l4 + j], whose bit b is bit 4
                 of weight 32b + 4 l4 + j: bits 2c and 2c + 1 go with qs chunk 8c + l4's nibbles
    [768, 2816) 32 qs chunks, as Q4_K's
  Q6_K, 210 -> 3360 bytes:
    [0, 2048) 32 ql chunks: chunk 16h + l4 (l4 < 16): row r's ql[64h + 4 l4 + j]
    [2048, 3072) 16 qh chunks: chunk 8h + l4 (l4 < 8): row r's qh[32h + 4 l4 + j]
    [3072, 3328) 16 scale planes (int8)   [3328, 3360) d[16]
  IQ4_XS (and the other IQ4_FAMILY types but IQ2_X16 / IQ1_M16, its layout), 136 -> 2176 bytes:
    [0, 32) d[16]   [32, 64) scales_h[16] (uint16)   [64, 128) 4 scales_l planes
    [128, 2176) 32 qs chunks: chunk 4s + l4 (l4 < 4), byte 4r + j = row r's qs[16s + 4 l4 + j],
                 whose nibbles index weights 32s + 4 l4 + j (low) and 32s + 16 + 4 l4 + j (high)
  IQ2_X16, IQ1_M16, 146 -> 2336 bytes:
    [0, 32) d[16]   [32, 288) 16 scale planes (int8)   [288, 2336) 32 qs chunks as IQ4_XS's

A short last group is padded with zero records (d = dmin = 0), which compute zeros.
"""

from __future__ import annotations

import torch

from kvserve.quant.ggml_kquants import (
    IQ4_FAMILY,
    IQ4_XS,
    KQUANT_BYTES,
    KQUANT_NAMES,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    QK_K,
    as_blocks,
)

GROUP = 16
# (start, stop, unit) of each stored field, in stored order; the packed record keeps the order.
FIELDS = {
    Q2_K: ((0, 16, 1), (16, 80, 4), (80, 82, 2), (82, 84, 2)),
    Q3_K: ((0, 32, 4), (32, 96, 4), (96, 108, 1), (108, 110, 2)),
    Q4_K: ((0, 2, 2), (2, 4, 2), (4, 16, 1), (16, 144, 4)),
    Q5_K: ((0, 2, 2), (2, 4, 2), (4, 16, 1), (16, 48, 4), (48, 176, 4)),
    Q6_K: ((0, 128, 4), (128, 192, 4), (192, 208, 1), (208, 210, 2)),
    IQ4_XS: ((0, 2, 2), (2, 4, 2), (4, 8, 1), (8, 136, 4)),
}
# IQ3_S4, ..: IQ4_XS's layout; a type with a scale per 16 weights has 16 int8 scales instead
FIELDS.update({q: FIELDS[IQ4_XS] if per_scale == 32 else ((0, 2, 2), (2, 18, 1), (18, 146, 4))
               for q, (_, _, per_scale) in IQ4_FAMILY.items()})
PACKED_KQUANT_BYTES = {q: GROUP * KQUANT_BYTES[q] for q in FIELDS}
PACKED_NAMES = {q: KQUANT_NAMES[q] for q in FIELDS}


def _check_qtype(qtype: int) -> None:
    if qtype not in FIELDS:
        raise ValueError(f"packed K-quant qtype must be one of "
                         f"{[f'{n} ({q})' for q, n in PACKED_NAMES.items()]}, got {qtype}")


def pack_kquant(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 super-blocks [N, K / 256 * record bytes] as stored -> the packed layout
    [ceil(N / 16), K / 256, 16 * record bytes] (module docstring)."""
    _check_qtype(qtype)
    nbytes = KQUANT_BYTES[qtype]
    blocks = as_blocks(data, k, QK_K, nbytes, KQUANT_NAMES[qtype])
    n, nsb = blocks.shape[:2]
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, nsb, nbytes, dtype=torch.uint8)
    padded[:n] = blocks
    rec = padded.reshape(groups, GROUP, nsb, nbytes).transpose(1, 2)  # [G, nsb, 16, bytes]
    parts = []
    for lo, hi, u in FIELDS[qtype]:
        f = rec[..., lo:hi].reshape(groups, nsb, GROUP, (hi - lo) // u, u)
        parts.append(f.transpose(2, 3).reshape(groups, nsb, -1))  # [.., unit, row, byte]
    return torch.cat(parts, dim=-1).contiguous()


def check_packed_kquant(packed: torch.Tensor, qtype: int) -> None:
    """ValueError unless packed is uint8 [groups, K / 256, packed record bytes] of qtype."""
    _check_qtype(qtype)
    rb = PACKED_KQUANT_BYTES[qtype]
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[-1] != rb:
        raise ValueError(f"packed {KQUANT_NAMES[qtype]} weights are uint8 [groups, K / 256, "
                         f"{rb}], got {packed.dtype} {tuple(packed.shape)}")


def unpack(packed: torch.Tensor, qtype: int, n: int | None = None) -> torch.Tensor:
    """The inverse of pack_kquant: the first n rows (all groups' rows when None) as stored,
    uint8 [n, K / 256 * record bytes]."""
    check_packed_kquant(packed, qtype)
    groups, nsb = packed.shape[:2]
    n = groups * GROUP if n is None else n
    if not groups * GROUP - GROUP < n <= groups * GROUP:
        raise ValueError(f"n={n} does not fit {groups} groups of {GROUP} rows")
    parts, at = [], 0
    for lo, hi, u in FIELDS[qtype]:
        size = (hi - lo) * GROUP
        f = packed[..., at:at + size].reshape(groups, nsb, (hi - lo) // u, GROUP, u)
        parts.append(f.transpose(2, 3).reshape(groups, nsb, GROUP, hi - lo))
        at += size
    rec = torch.cat(parts, dim=-1).transpose(1, 2)  # [G, 16, nsb, bytes]
    return rec.reshape(groups * GROUP, -1)[:n].contiguous()
