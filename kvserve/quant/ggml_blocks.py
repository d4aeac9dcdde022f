"""GGML block types kept packed (issue 11): the pure-torch oracles for llama.cpp's arithmetic.

Each weight type is multiplied by int8-quantized activations as llama.cpp's CPU does: the
products summed exactly as integers per (sub-)block, the scales applied in float32 in a fixed
order. These functions are the contract a packed kernel is held to, bit for bit:

    dequantize(data, qtype, k)          the float32 weights, equal to gguf-py's bit for bit
    quantize_activations_for(qtype, x)  x as the type's llama.cpp vec_dot_type
    dot_reference(data, qtype, xq)      float32 [M, N], the scales applied in the stated order

The legacy types' packed kernels (block_pack.pack, ops/csrc/qlinear*.cpp) quantize activations as
kvserve's Q4_1 / Q8_0 path does (block_pack.quantize_activations: round half to even, float32 d) and
are held bit for bit to block_pack.qlinear_reference; dot_reference here is llama.cpp's arithmetic,
which that lands close to (tests/unit/test_qlinear_q5.py).

This file holds the legacy 32-weight blocks and the entry points; the K-quants (256-weight
super-blocks, Q8_K activations) live in ggml_kquants.py. Legacy layouts (offsets [lo, hi),
fp16 little-endian, j < 16):

  Q4_0 (ggml type 2), 18 bytes:  [0, 2) d   [2, 18) qs
      q[j] = (qs[j] & 15) - 8,  q[16 + j] = (qs[j] >> 4) - 8;                w = d * q
  Q5_0 (ggml type 6), 22 bytes:  [0, 2) d   [2, 6) qh (uint32, bit i = q[i]'s bit 4)   [6, 22) qs
      q[j] = (qs[j] & 15 | qh bit j << 4) - 16,  q[16 + j] = (qs[j] >> 4 | bit 16 + j << 4) - 16
                                                                              w = d * q
  Q5_1 (ggml type 7), 24 bytes:  [0, 2) d   [2, 4) m   [4, 8) qh   [8, 24) qs
      q as Q5_0 without the - 16 (q in [0, 31]);                              w = d * q + m
  IQ4_NL (ggml type 20), 18 bytes, Q4_0's layout:  [0, 2) d   [2, 18) qs
      q[j] = IQ4_VALUES[qs[j] & 15],  q[16 + j] = IQ4_VALUES[qs[j] >> 4]     w = d * q
      (a nibble indexes 16 fixed values in -127..113, not a linear grid: IQ4_XS's, in blocks
      of 32, what llama-quantize writes where a row is no multiple of 256)
  Activations, llama.cpp's vec_dot_type: Q8_0 (type 8: fp16 d, int8 q[32]) for Q4_0, Q5_0
  and IQ4_NL, Q8_1 (type 9: fp16 d, fp16 s = d * sum(q), int8 q[32]) for Q5_1; both kept here as
  one `Q8Blocks` of tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.quant.ggml_kquants import (
    IQ4_XS,
    KQUANT_BYTES,
    KQUANT_NAMES,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    QK_K,
    Q8KBlocks,
    as_blocks,
    bit_planes,
    dequantize_kquant,
    dot_kquant,
    half_field,
    iq4_values,
    quantize_activations_q8_k,
)

Q4_0, Q5_0, Q5_1, Q8_0, Q8_1, IQ4_NL = 2, 6, 7, 8, 9, 20  # ggml type ids
QK = 32
LEGACY_BYTES = {Q4_0: 18, Q5_0: 22, Q5_1: 24, IQ4_NL: 18}
BLOCK_BYTES = {**LEGACY_BYTES, **KQUANT_BYTES}
BLOCK_SIZE = {**{t: QK for t in LEGACY_BYTES}, **{t: QK_K for t in KQUANT_BYTES}}
TYPE_NAMES = {Q4_0: "Q4_0", Q5_0: "Q5_0", Q5_1: "Q5_1", IQ4_NL: "IQ4_NL", **KQUANT_NAMES}
VEC_DOT_TYPE = {Q4_0: Q8_0, Q5_0: Q8_0, Q5_1: Q8_1, IQ4_NL: Q8_0, Q2_K: Q8_K, Q3_K: Q8_K,
                Q4_K: Q8_K, Q5_K: Q8_K, Q6_K: Q8_K, IQ4_XS: Q8_K}


class Q8Blocks(NamedTuple):
    """Activations [M, K] as Q8_0 / Q8_1 per 32 values: q int8 [M, K], d float32 [M, K / 32]
    and s float32 [M, K / 32] = Q8_1's d * sum(q), both holding their fp16 values (rounded as
    llama.cpp stores them, then widened exactly). Q8_0 consumers ignore s."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor


def _check_qtype(qtype: int) -> None:
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(TYPE_NAMES.values())} (ggml ids "
                         f"{sorted(TYPE_NAMES)}), got {qtype}")


def _unpack_legacy(data: torch.Tensor, qtype: int, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """uint8 blocks -> (q int32 [N, K / 32, 32], d float32 [N, K / 32], m or None)."""
    raw = as_blocks(data, k, QK, LEGACY_BYTES[qtype], TYPE_NAMES[qtype])
    b = raw.to(torch.int32)
    start = {Q4_0: 2, Q5_0: 6, Q5_1: 8, IQ4_NL: 2}[qtype]
    qs = b[..., start:start + 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # quants j, then 16 + j
    if qtype == Q4_0:
        return q - 8, half_field(raw, 0), None
    if qtype == IQ4_NL:
        return iq4_values(q), half_field(raw, 0), None
    high = bit_planes(b[..., start - 4:start], range(8), 1).transpose(-1, -2)  # [.., byte, bit]
    q = q | high.reshape(*q.shape) << 4  # bit 8 * byte + bit belongs to quant 8 * byte + bit
    if qtype == Q5_0:
        return q - 16, half_field(raw, 0), None
    return q, half_field(raw, 0), half_field(raw, 2)


def dequantize(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [rows, K / block * record bytes] -> float32 [rows, K], gguf-py's arithmetic (one
    float32 rounding per operation: d * q, then + m for Q5_1)."""
    _check_qtype(qtype)
    if qtype in KQUANT_BYTES:
        return dequantize_kquant(data, qtype, k)
    return scale_quants(*_unpack_legacy(data, qtype, k)).reshape(data.shape[0], k)


def scale_quants(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """A 32-weight block format's weights from its integers q [..., 32] (offset already
    taken off) and float32 scales d [...] (and mins m): d * q, then + m, one float32 rounding
    each, gguf-py's order."""
    w = d[..., None] * q.float()
    return w if m is None else w + m[..., None]


def quantize_activations_q8(x: torch.Tensor) -> Q8Blocks:
    """float32 [M, K] -> Q8_0 / Q8_1 per 32 values, as llama.cpp's quantize_row_q8_0_ref and
    quantize_row_q8_1_ref (the CPU's generic path; they share d and q):
        d = amax / 127,  id = 1 / d (0 when d = 0),  q = roundf(x * id)  (half away from zero)
        s = sum(q) * d                                    (d unrounded here; stored as fp16)
    Equal to gguf-py's Q8_0 quantize bit for bit."""
    if x.dim() != 2 or x.shape[1] % QK:
        raise ValueError(f"x must be [M, K] with K a multiple of {QK}, got {tuple(x.shape)}")
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    amax = xb.abs().amax(-1)
    d = amax / 127
    # Tensor by tensor: torch computes `1 / d` as a reciprocal-multiply, not llama.cpp's divide.
    inv = torch.where(d != 0, torch.ones_like(d) / torch.where(d != 0, d, 1), 0)
    v = xb * inv[..., None]
    # roundf without the x + 0.5 trap (0.49999997 + 0.5 rounds up to 1): the fraction is exact
    a = v.abs()
    whole = a.floor()
    q = (torch.sign(v) * (whole + (a - whole >= 0.5))).to(torch.int8)
    total = q.sum(-1, dtype=torch.int32)
    s = total.float() * d
    return Q8Blocks(q.reshape(m, k), d.half().float(), s.half().float())


def quantize_activations_for(qtype: int, x: torch.Tensor) -> Q8Blocks | Q8KBlocks:
    """x [M, K] quantized as what `qtype` weights multiply in llama.cpp (VEC_DOT_TYPE)."""
    _check_qtype(qtype)
    if VEC_DOT_TYPE[qtype] == Q8_K:
        return quantize_activations_q8_k(x)
    return quantize_activations_q8(x)


def dot_reference(data: torch.Tensor, qtype: int, xq: Q8Blocks | Q8KBlocks) -> torch.Tensor:
    """Quantized activations [M, K] times `qtype` weights [N, K]^T -> float32 [M, N].

    K-quants: see ggml_kquants.dot_kquant. Legacy types, per output (m, n), blocks b in order,
    isum_b = sum_j q[j] * qx[j] exact (int32), dw / mw the weight's fp16 d / m, dx / sx the
    activation's, then one float32 rounding per operation, never fused:
        Q4_0:  acc = acc + (float(isum_b) * dw) * dx
        Q5_0, IQ4_NL:  acc = acc + (dw * dx) * float(isum_b)
        Q5_1:  acc = acc + ((dw * dx) * float(isum_b) + mw * sx)
    acc starting at +0: exactly ggml_vec_dot_{q4_0_q8_0, q5_0_q8_0, iq4_nl_q8_0,
    q5_1_q8_1}_generic (IQ4_NL's d is dx * dw there: the same float product), each
    C expression evaluated left to right. (A C build may contract `acc + a * b` into an FMA;
    this oracle, and the kernels held to it, do not.)"""
    _check_qtype(qtype)
    if qtype in KQUANT_BYTES:
        return dot_kquant(data, qtype, xq)
    if not isinstance(xq, Q8Blocks):
        raise ValueError(f"{TYPE_NAMES[qtype]} weights take Q8Blocks activations "
                         f"(quantize_activations_q8), got {type(xq).__name__}")
    m, k = xq.q.shape
    qw, dw, mw = _unpack_legacy(data, qtype, k)
    n, nb = dw.shape
    # Integer sums in float64 are exact (|isum| <= 32 * 31 * 128); one rounding to float32.
    qx = xq.q.reshape(m, nb, QK).double()
    isum = torch.einsum("mbj,nbj->mnb", qx, qw.double()).float()
    acc = torch.zeros(m, n)
    for b in range(nb):
        wd, xd = dw[None, :, b], xq.d[:, b, None]
        if qtype == Q4_0:
            acc = acc + (isum[..., b] * wd) * xd
        elif qtype in (Q5_0, IQ4_NL):
            acc = acc + (wd * xd) * isum[..., b]
        else:
            acc = acc + ((wd * xd) * isum[..., b] + mw[None, :, b] * xq.s[:, b, None])
    return acc
