"""A GGUF file's i-quants (IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S; IQ2_XS, IQ2_S, IQ1_M) rewritten
exactly at load in IQ4_XS's layout (IQ3_S4 .. IQ1_S4) or its 16-scale twin (IQ2_X16, IQ1_M16):
each super-block taken apart into its grid indices, signs, scales and d (`_IQParts`, one
function per type, from gguf-py's grids), then each grid value written as a nibble indexing
the type's own 16 values (ggml_kquants.IQ4_FAMILY). The layouts, and why a value fits a
nibble, are ggml_kquants.py's; the kernels then run these as IQ4_XS (IQ4Lut<table, shift>).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.quant.ggml_kquants import (
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_FAMILY,
    IQ4_REWRITES,
    KQUANT_BYTES,
    QK_K,
    as_blocks,
)


class _IQParts(NamedTuple):
    """An i-quant's super-blocks taken apart: index long [n, nsb, 256 / width] into the grids
    plus and minus (int16 [entries, width]: each entry's values where negative is 0 / 1),
    negative uint8 [n, nsb, 256] (IQ3 / IQ2: the weight's sign; IQ1_S / IQ1_M: the delta's
    sign of its sub-block / group of 8), s4 uint8 [n, nsb, 8] (scale 1 + 2 s4 per 32
    weights; IQ2_XS / IQ2_S / IQ1_M: [n, nsb, 16], per 16), d uint8 [n, nsb, 2] (the fp16
    d's bytes)."""

    index: torch.Tensor
    plus: torch.Tensor
    minus: torch.Tensor
    negative: torch.Tensor
    s4: torch.Tensor
    d: torch.Tensor


def _grid(name: str, entries: int, width: int) -> torch.Tensor:
    """gguf-py's grid of the i-quant `name` (its gguf.quants class) -> int16 [entries, width]."""
    from gguf import quants as gguf_quants

    quant = getattr(gguf_quants, name)
    quant.init_grid()
    return torch.from_numpy(quant.grid.reshape(entries, width)).to(torch.int16)


def _ksign_bits(index: torch.Tensor) -> torch.Tensor:
    """7-bit ksigns indices (any integer dtype) [..., g] -> uint8 [..., g, 8]: the 8 signs
    (1: negative) of each group of 8 weights, 7 stored bits and their parity (gguf-py's
    IQ2_XXS.ksigns)."""
    from gguf import quants as gguf_quants

    ksigns = torch.frombuffer(bytearray(gguf_quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    return ksigns[index.long()][..., None] >> torch.arange(8, dtype=torch.uint8) & 1


def _word_signs(aux: torch.Tensor) -> torch.Tensor:
    """int64 [n, nsb, 8] sub-block words -> uint8 [n, nsb, 256]: bits 7l .. 7l + 6 of word s
    index ksigns, whose bit b is weight 32s + 8l + b's sign."""
    index = aux[..., None] >> torch.arange(0, 28, 7) & 127  # [n, nsb, 8, 4]
    return _ksign_bits(index).reshape(*aux.shape[:2], QK_K)


def _iq3_s_parts(raw: torch.Tensor) -> _IQParts:
    """IQ3_S blocks [n, nsb, 110] (gguf-py IQ3_S.dequantize_blocks):
        [0, 2) d   [2, 66) qs: the low 8 bits of grid index j (weights 4j .. 4j + 3)
        [66, 74) qh: bit j (byte j // 8, bit j % 8) is bit 8 of index j
        [74, 106) signs: bit b of byte i negates weight 8i + b
        [106, 110) scales: s_4 of sub-block s in byte s // 2, nibble s % 2"""
    n, nsb = raw.shape[:2]
    bits = torch.arange(8, dtype=torch.uint8)
    qh = ((raw[..., 66:74, None] >> bits) & 1).reshape(n, nsb, 64)
    index = raw[..., 2:66].long() | qh.long() << 8
    negative = ((raw[..., 74:106, None] >> bits) & 1).reshape(n, nsb, QK_K)
    s4 = torch.stack([raw[..., 106:110] & 15, raw[..., 106:110] >> 4], -1).reshape(n, nsb, 8)
    grid = _grid("IQ3_S", 512, 4)
    return _IQParts(index, grid, -grid, negative, s4, raw[..., 0:2])


def _iq3_xxs_parts(raw: torch.Tensor) -> _IQParts:
    """IQ3_XXS blocks [n, nsb, 98] (gguf-py IQ3_XXS.dequantize_blocks):
        [0, 2) d   [2, 66) qs: grid index j (weights 4j .. 4j + 3)
        [66, 98) one uint32 a sub-block s: bits 7l .. 7l + 6 (l < 4) index ksigns, whose bit
                 b negates weight 32s + 8l + b; bits 28..31 are s_4"""
    aux = raw[..., 66:98].contiguous().view(torch.int32).long()  # [n, nsb, 8]
    grid = _grid("IQ3_XXS", 256, 4)
    return _IQParts(raw[..., 2:66].long(), grid, -grid, _word_signs(aux),
                    (aux >> 28 & 15).to(torch.uint8), raw[..., 0:2])


def _iq2_xxs_parts(raw: torch.Tensor) -> _IQParts:
    """IQ2_XXS blocks [n, nsb, 66] (gguf-py IQ2_XXS.dequantize_blocks):
        [0, 2) d   then per sub-block s two uint32 at 2 + 8s:
        the first's 4 bytes: grid indices (weights 32s + 8l .. 32s + 8l + 7, l < 4)
        the second: bits 7l .. 7l + 6 index ksigns (weights 32s + 8l + b), bits 28..31 s_4"""
    n, nsb = raw.shape[:2]
    pairs = raw[..., 2:66].reshape(n, nsb, 8, 2, 4)
    aux = pairs[..., 1, :].contiguous().view(torch.int32).long().squeeze(-1)  # [n, nsb, 8]
    grid = _grid("IQ2_XXS", 256, 8)
    return _IQParts(pairs[..., 0, :].reshape(n, nsb, 32).long(), grid, -grid,
                    _word_signs(aux), (aux >> 28 & 15).to(torch.uint8), raw[..., 0:2])


def _iq1_s_parts(raw: torch.Tensor) -> _IQParts:
    """IQ1_S blocks [n, nsb, 50] (gguf-py IQ1_S.dequantize_blocks), weight d (1 + 2 s)
    (g +- 1/8) with g in -1, 0, 1 from the grid:
        [0, 2) d   [2, 34) qs: the low 8 bits of grid index 4s + l (weights 32s + 8l ..)
        [34, 50) one uint16 a sub-block s: bits 3l .. 3l + 2 the index's bits 8..10, bits
                 12..14 s, bit 15 the delta's sign (1: -1/8)"""
    n, nsb = raw.shape[:2]
    qh = raw[..., 34:50].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, nsb, 8]
    high = (qh[..., None] >> torch.tensor([0, 3, 6, 9], dtype=torch.int32) & 7).long() << 8
    index = (raw[..., 2:34].reshape(n, nsb, 8, 4).long() | high).reshape(n, nsb, 32)
    negative = (qh >> 15).to(torch.uint8).repeat_interleave(32, dim=-1)
    grid = _grid("IQ1_S", 2048, 8)  # -1, 0, 1: 8 g + 1 or 8 g - 1, in eighths
    return _IQParts(index, 8 * grid + 1, 8 * grid - 1, negative, (qh >> 12 & 7).to(torch.uint8),
                    raw[..., 0:2])


def _scale_nibbles(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [n, nsb, 8] -> [n, nsb, 16]: byte i's low nibble then its high one."""
    return torch.stack([raw & 15, raw >> 4], -1).reshape(*raw.shape[:2], 16)


def _iq2_xs_parts(raw: torch.Tensor) -> _IQParts:
    """IQ2_XS blocks [n, nsb, 74] (gguf-py IQ2_XS.dequantize_blocks):
        [0, 2) d   [2, 66) one uint16 a group of 8 weights: bits 0..8 the grid index, bits
        9..15 index ksigns   [66, 74) s of weights 16j .. 16j + 15: byte j // 2, nibble j % 2"""
    qs = raw[..., 2:66].contiguous().view(torch.int16).long() & 0xFFFF  # [n, nsb, 32]
    negative = _ksign_bits(qs >> 9)
    grid = _grid("IQ2_XS", 512, 8)
    return _IQParts(qs & 511, grid, -grid, negative.reshape(*raw.shape[:2], QK_K),
                    _scale_nibbles(raw[..., 66:74]), raw[..., 0:2])


def _iq2_s_parts(raw: torch.Tensor) -> _IQParts:
    """IQ2_S blocks [n, nsb, 82] (gguf-py IQ2_S.dequantize_blocks):
        [0, 2) d   [2, 34) the low 8 bits of group g's grid index (weights 8g .. 8g + 7)
        [34, 66) signs: bit b of byte g negates weight 8g + b
        [66, 74) bits 2l, 2l + 1 of byte s: bits 8, 9 of group 4s + l's index
        [74, 82) s of weights 16j .. 16j + 15: byte j // 2, nibble j % 2"""
    n, nsb = raw.shape[:2]
    high = raw[..., 66:74, None] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8) & 3
    index = raw[..., 2:34].long() | high.reshape(n, nsb, 32).long() << 8
    bits = torch.arange(8, dtype=torch.uint8)
    negative = (raw[..., 34:66, None] >> bits & 1).reshape(n, nsb, QK_K)
    grid = _grid("IQ2_S", 1024, 8)
    return _IQParts(index, grid, -grid, negative, _scale_nibbles(raw[..., 74:82]),
                    raw[..., 0:2])


def _iq1_m_parts(raw: torch.Tensor) -> _IQParts:
    """IQ1_M blocks [n, nsb, 56] (gguf-py IQ1_M.dequantize_blocks), weight d (1 + 2 s)
    (g +- 1/8), s per 16 weights, the delta's sign per 8:
        [0, 32) the low 8 bits of group g's grid index (weights 8g .. 8g + 7)
        [32, 48) nibble t of byte i: group 2i + t's index bits 8..10 (bits 0..2), its delta
                 sign (bit 3, 1: -1/8)
        [48, 56) 4 uint16: bits 3i .. 3i + 2 of word w are s of weights 16 (4w + i) ..; the
                 four words' top nibbles are the fp16 d's nibbles, lowest first"""
    n, nsb = raw.shape[:2]
    words = raw[..., 48:56].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [.., 4]
    d = (words >> 12 << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1)
    s = (words[..., None] >> torch.tensor([0, 3, 6, 9], dtype=torch.int32) & 7).reshape(n, nsb, 16)
    qh = torch.stack([raw[..., 32:48] & 15, raw[..., 32:48] >> 4], -1).reshape(n, nsb, 32)
    index = raw[..., 0:32].long() | (qh & 7).long() << 8
    negative = (qh >> 3).repeat_interleave(8, dim=-1)
    grid = _grid("IQ1_M", 2048, 8)
    d_bytes = torch.stack([d & 255, d >> 8], -1).to(torch.uint8)
    return _IQParts(index, 8 * grid + 1, 8 * grid - 1, negative, s.to(torch.uint8), d_bytes)


_IQ_PARTS = {IQ3_S: _iq3_s_parts, IQ3_XXS: _iq3_xxs_parts, IQ2_XXS: _iq2_xxs_parts,
             IQ1_S: _iq1_s_parts, IQ2_XS: _iq2_xs_parts, IQ2_S: _iq2_s_parts,
             IQ1_M: _iq1_m_parts}


def rewrite_iq4(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """GGUF blocks of an IQ4_REWRITES type uint8 [N, K / 256 * its bytes] -> the same weights
    as blocks of the type it names, [N, K / 256 * 136] (IQ2_X16, IQ1_M16: 146), exactly
    (dequantize_kquant of the result equals gguf-py's dequantize of the input bit for bit)."""
    nbytes, target = IQ4_REWRITES[qtype]
    # Bytes stay bytes (the grid's index aside): the 1.5B IQ3_M file's 138 IQ3_S matrices load
    # ~3x faster than through int64 values.
    from gguf import GGMLQuantizationType

    raw = as_blocks(data, k, QK_K, nbytes, GGMLQuantizationType(qtype).name)
    n, nsb = raw.shape[:2]
    p = _IQ_PARTS[qtype](raw)
    # Each grid entry's nibbles in the target's table, on either side of negative.
    table = torch.tensor(IQ4_FAMILY[target][0])
    where = torch.zeros(128, dtype=torch.uint8)
    where[table + 64] = torch.arange(16, dtype=torch.uint8)  # the padding zeros: never a value
    plus, minus = where[p.plus.long() + 64][p.index], where[p.minus.long() + 64][p.index]
    nibble = torch.where(p.negative.bool(), minus.reshape(n, nsb, QK_K),
                         plus.reshape(n, nsb, QK_K))
    pairs = nibble.reshape(n, nsb, 8, 2, 16)  # [s, t, l]: weight 32s + 16t + l
    qs = (pairs[..., 0, :] | pairs[..., 1, :] << 4).reshape(n, nsb, 128)
    if IQ4_FAMILY[target][2] == 16:  # int8 scales 1 + 2 s (at most 31)
        out = torch.cat([p.d, 1 + 2 * p.s4, qs], dim=-1)
        return out.reshape(n, nsb * KQUANT_BYTES[target])
    ls = 33 + 2 * p.s4  # 6 bits: IQ4_XS's scale + 32 (uint8: at most 63)
    high = ((ls >> 4) & 3).to(torch.int32) << 2 * torch.arange(8, dtype=torch.int32)
    scales_h = high.sum(-1, dtype=torch.int32)  # uint16: bits 2s, 2s + 1
    scales_l = (ls[..., 0::2] & 15) | (ls[..., 1::2] & 15) << 4
    h = torch.stack([scales_h & 255, scales_h >> 8], -1).to(torch.uint8)
    out = torch.cat([p.d, h, scales_l, qs], dim=-1)
    return out.reshape(n, nsb * KQUANT_BYTES[target])
