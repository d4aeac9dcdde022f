"""GGML K-quant super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS, which has their shape)
and Q8_K activations: the layouts, documented once, and the pure-torch oracles the packed
kernels (kvserve/quant/kquant_pack.py, ops/csrc/qlinear_kquant*.cpp) are held to.

A K-quant row of K weights is K / 256 super-blocks. Each super-block splits into sub-blocks
(16 of 16 weights, or 8 of 32) with small integer scales (and mins), themselves scaled by the
super-block's fp16 d (and dmin):

    w = (d * scale_s) * q - (dmin * min_s)        s = the weight's sub-block

Byte layouts (offsets [lo, hi) inside one record; fp16 little-endian; l is a lane < 32, h < 2
the 128-weight half, c < 4 a 2-bit plane, t < 2 a nibble), from ggml-common.h / gguf-py:

  Q2_K (ggml type 10), 84 bytes, 16 sub-blocks of 16:
    [0, 16)    scales: byte s = min_s << 4 | scale_s              (4 bits each, unsigned)
    [16, 80)   qs:     weight 128h + 32c + l = qs[32h + l] >> 2c & 3
    [80, 82)   d       [82, 84) dmin
  Q3_K (ggml type 11), 110 bytes, 16 sub-blocks of 16, no min:
    [0, 32)    hmask:  bit b of hmask[l] is weight 32b + l's high bit; q = low - 4 where it is 0
    [32, 96)   qs:     the low 2 bits, placed as Q2_K's                       (q in [-4, 3])
    [96, 108)  scales: 16 x 6 bits, stored + 32:
                 bytes 0..7: low 4 bits, scale s in byte s % 8, nibble s // 8
                 bytes 8..11: high 2 bits, scale s in byte 8 + s % 4 at bit 2 * (s // 4)
    [108, 110) d
  Q4_K (ggml type 12), 144 bytes, 8 sub-blocks of 32:
    [0, 2) d   [2, 4) dmin
    [4, 16)    scales: 8 scales and 8 mins of 6 bits (j < 4 | j >= 4):
                 byte 0..3:  sc[j+4] >> 4 (2 bits) | sc[j]   (6 bits)
                 byte 4..7:  mn[j+4] >> 4 (2 bits) | mn[j]   (6 bits)
                 byte 8..11: mn[j+4] & 15 (4 bits) | sc[j+4] & 15 (4 bits)
    [16, 144)  qs:     weight 64c + 32t + l = qs[32c + l] >> 4t & 15   (c < 4; sub-block 2c + t)
  Q5_K (ggml type 13), 176 bytes, 8 sub-blocks of 32:
    [0, 2) d   [2, 4) dmin   [4, 16) scales as Q4_K
    [16, 48)   qh:     bit b of qh[l] is bit 4 of weight 32b + l
    [48, 176)  qs:     the low 4 bits, placed as Q4_K's                       (q in [0, 31])
  Q6_K (ggml type 14), 210 bytes, 16 sub-blocks of 16, no min:
    [0, 128)   ql:     weight 128h + 64t + l = ql[64h + l] >> 4t & 15      (l < 64: low 4 bits)
    [128, 192) qh:     weight 128h + 32c + l = qh[32h + l] >> 2c & 3       (high 2 bits)
    [192, 208) scales: int8, one per sub-block
    [208, 210) d                                                    q = (hi << 4 | lo) - 32
  IQ4_XS (ggml type 23), 136 bytes, 8 sub-blocks of 32, no min; q is not the stored index
  but IQ4_VALUES[index] (a non-uniform grid, -127..113):
    [0, 2) d
    [2, 4)     scales_h: uint16, bits 2s, 2s + 1 are scale s's high 2 bits
    [4, 8)     scales_l: scale s's low 4 bits in byte s // 2, nibble s % 2   (stored + 32)
    [8, 136)   qs:     weight 32s + 16t + l = IQ4_VALUES[qs[16s + l] >> 4t & 15]  (l < 16)
  IQ3_S4, IQ3_XXS4, IQ2_XXS4, IQ1_S4 (kvserve's own ids 257..260, never in a file): a GGUF
  IQ3_S, IQ3_XXS, IQ2_XXS or IQ1_S super-block (ggml types 21, 18, 16, 19) rewritten exactly
  in IQ4_XS's 136-byte layout (iquant_rewrite.py), its nibbles indexing the type's own 16
  values (IQ4_FAMILY). These i-quants' weight is d * (1 + 2 s) * value / 2^shift, s a 4-bit (IQ1_S:
  3-bit) scale per 32 weights and the values few and below 64: IQ3_S +-1, 3, .., 15 (shift
  0), IQ3_XXS +-4, 12, .., 52, 62 (shift 2), IQ2_XXS +-8, 25, 43 (shift 3), IQ1_S 8 g +- 1
  for g in -1, 0, 1 and the sub-block's delta sign, i.e. g +- 1/8 (shift 3); gguf-py's
  grid_map. A value is one nibble's table entry, and 1 + 2 s (1..31) is the 6-bit scale
  minus 32 (stored 33 + 2 s). The power of two scales d (KParts.d, and the kernels' d), not
  the fp16 record: these files' d lie near 1e-4, where d / 8 would turn subnormal. The same
  floats at 4.25 bits a weight (the files': 3.44, 3.06, 2.06, 1.56), on IQ4_XS's kernels.
  IQ2_X16 and IQ1_M16 (kvserve's own ids 261, 262): a GGUF IQ2_XS or IQ2_S super-block (ggml
  types 17, 22: 2.31 and 2.56 bits a weight), or an IQ1_M one (29: 1.75 bits, its delta per
  8 weights and its fp16 d in the top nibbles of its scales), whose scale 1 + 2 s is per 16
  weights, in a 146-byte layout of IQ4_XS's quants with 16 int8 scales (4.56 bits a weight);
  IQ2_XXS's values and shift, IQ1_S's:
    [0, 2) d   [2, 18) scales: int8, scale j of weights 16j .. 16j + 15
    [18, 146)  qs: as IQ4_XS's [8, 136) (weight 32s + 16t + l: sub-block of 16 2s + t)
  Q8_K (ggml type 15), 292 bytes, activations only (never in a file): float32 d, int8 qs[256],
    int16 bsums[16] (the sum of each 16 qs). Kept here as tensors (`Q8KBlocks`).

dequantize_kquant follows gguf-py's float32 operations (so it equals gguf.quants.dequantize bit
for bit); dot_kquant is llama.cpp's ggml_vec_dot_<type>_q8_K with the float order stated there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 10, 11, 12, 13, 14, 15  # ggml ids
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ4_XS = 16, 17, 18, 19, 21, 22, 23
IQ1_M = 29
# kvserve's own (past ggml's, as block_pack.W8A8): a file's i-quant in IQ4_XS's layout (IQ2_X16:
# and IQ1_M16: with a scale per 16 weights)
IQ3_S4, IQ3_XXS4, IQ2_XXS4, IQ1_S4, IQ2_X16, IQ1_M16 = 257, 258, 259, 260, 261, 262
QK_K = 256
KQUANT_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136, IQ3_S4: 136,
                IQ3_XXS4: 136, IQ2_XXS4: 136, IQ1_S4: 136, IQ2_X16: 146, IQ1_M16: 146}
KQUANT_NAMES = {Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
                IQ4_XS: "IQ4_XS", IQ3_S4: "IQ3_S4", IQ3_XXS4: "IQ3_XXS4", IQ2_XXS4: "IQ2_XXS4",
                IQ1_S4: "IQ1_S4", IQ2_X16: "IQ2_X16", IQ1_M16: "IQ1_M16"}
# IQ4_NL / IQ4_XS's 16 values (ggml-common.h kvalues_iq4nl): the index's weight before scaling.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The rewritten i-quants': their grid values with both signs (IQ1_S: 8 x grid +- 1; the 6 of
# IQ2_XXS and IQ1_S padded with unused zeros, the extremes kept at the ends).
IQ3S_VALUES = tuple(range(-15, 16, 2))
IQ3XXS_VALUES = (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62)
IQ2XXS_VALUES = (-43, -25, -8) + (0,) * 10 + (8, 25, 43)
IQ1S_VALUES = (-9, -7, -1) + (0,) * 10 + (1, 7, 9)
# The IQ4_XS-layout types: (their nibbles' 16 values, the shift d is scaled by 2^-shift with,
# weights per scale).
IQ4_FAMILY = {IQ4_XS: (IQ4_VALUES, 0, 32), IQ3_S4: (IQ3S_VALUES, 0, 32),
              IQ3_XXS4: (IQ3XXS_VALUES, 2, 32), IQ2_XXS4: (IQ2XXS_VALUES, 3, 32),
              IQ1_S4: (IQ1S_VALUES, 3, 32), IQ2_X16: (IQ2XXS_VALUES, 3, 16),
              IQ1_M16: (IQ1S_VALUES, 3, 16)}
# A file's i-quant -> (its stored bytes per 256 weights, the type rewrite_iq4 makes of it:
# iquant_rewrite.py).
IQ4_REWRITES = {IQ3_S: (110, IQ3_S4), IQ3_XXS: (98, IQ3_XXS4), IQ2_XXS: (66, IQ2_XXS4),
                IQ1_S: (50, IQ1_S4), IQ2_XS: (74, IQ2_X16), IQ2_S: (82, IQ2_X16),
                IQ1_M: (56, IQ1_M16)}


def iq4_values(index: torch.Tensor, table: tuple[int, ...] = IQ4_VALUES) -> torch.Tensor:
    """Nibbles (0..15, any integer dtype) -> their int32 values in table: IQ4_NL / IQ4_XS's
    by default, an IQ4_FAMILY type's own."""
    return torch.tensor(table, dtype=torch.int32)[index.long()]


class KParts(NamedTuple):
    """A K-quant matrix of N rows taken apart: q int32 [N, nsb, 256] (signed where the type
    is), scale int32 [N, nsb, nsub], min int32 [N, nsb, nsub] or None, d and dmin float32
    [N, nsb] (dmin None where min is). nsb = K / 256 super-blocks, nsub sub-blocks each."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None


class Q8KBlocks(NamedTuple):
    """Activations [M, K] as Q8_K: q int8 [M, K], d float32 [M, K / 256], bsums int16
    [M, K / 16]. x ~= q * d per super-block (d is negative when the block's peak is)."""

    q: torch.Tensor
    d: torch.Tensor
    bsums: torch.Tensor


def as_blocks(data: torch.Tensor, k: int, block: int, nbytes: int, name: str) -> torch.Tensor:
    """uint8 [rows, K / block * nbytes] -> [rows, K / block, nbytes], or a ValueError that
    names what does not fit."""
    if k <= 0 or k % block:
        raise ValueError(f"{name}: k must be a positive multiple of {block}, got {k}")
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != k // block * nbytes:
        raise ValueError(f"{name}: data must be uint8 [rows, {k // block * nbytes}] for k={k}, "
                         f"got {data.dtype} {tuple(data.shape)}")
    return data.reshape(data.shape[0], k // block, nbytes)


def half_field(blocks: torch.Tensor, lo: int) -> torch.Tensor:
    """The fp16 at bytes [lo, lo + 2) of each record [..., nbytes] -> float32 [...] (exact)."""
    return blocks[..., lo:lo + 2].contiguous().view(torch.float16).float().squeeze(-1)


def bit_planes(x: torch.Tensor, shifts: range | list[int], mask: int) -> torch.Tensor:
    """int32 [..., n] -> [..., len(shifts), n]: plane i holds (x >> shifts[i]) & mask, so a
    flattened [..., i * n + l] reads lane l of plane i, the order every layout above uses."""
    sh = torch.tensor(list(shifts), dtype=torch.int32)
    return (x.unsqueeze(-2) >> sh[:, None]) & mask


def _scale_min_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of Q4_K / Q5_K (int32 [..., 12]) -> (scales, mins) [..., 8]."""
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    scale = torch.cat([lo & 63, (hi & 15) | (lo >> 6 << 4)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | (mid >> 6 << 4)], dim=-1)
    return scale, mins


def unpack_kquant(data: torch.Tensor, qtype: int, k: int) -> KParts:
    """uint8 [N, K / 256 * record bytes] -> KParts, per the layouts in the module docstring."""
    if qtype not in KQUANT_BYTES:
        raise ValueError(f"qtype must be one of {sorted(KQUANT_NAMES.values())}, got {qtype}")
    raw = as_blocks(data, k, QK_K, KQUANT_BYTES[qtype], KQUANT_NAMES[qtype])
    b = raw.to(torch.int32)
    lead = b.shape[:2]

    def planes(lo: int, hi: int, halves: int, shifts: range | list[int], mask: int
               ) -> torch.Tensor:  # bytes [lo, hi) as `halves` runs, expanded to 256 weights
        run = b[..., lo:hi].reshape(*lead, halves, -1)
        return bit_planes(run, shifts, mask).reshape(*lead, QK_K)

    if qtype == Q2_K:
        q = planes(16, 80, 2, [0, 2, 4, 6], 3)
        return KParts(q, b[..., 0:16] & 15, b[..., 0:16] >> 4, half_field(raw, 80),
                      half_field(raw, 82))
    if qtype == Q3_K:
        low = planes(32, 96, 2, [0, 2, 4, 6], 3)
        high = planes(0, 32, 1, range(8), 1)
        s_lo = bit_planes(b[..., 96:104], [0, 4], 15).reshape(*lead, 16)
        s_hi = bit_planes(b[..., 104:108], [0, 2, 4, 6], 3).reshape(*lead, 16)
        return KParts(low - 4 * (1 - high), (s_lo | s_hi << 4) - 32, None,
                      half_field(raw, 108), None)
    if qtype in IQ4_FAMILY:
        table, shift, per_scale = IQ4_FAMILY[qtype]
        # d / 2^shift is exact in float32 (an fp16's exponent stays far above float32's floor)
        d = half_field(raw, 0) * 2.0 ** -shift
        if per_scale == 16:
            scale = raw[..., 2:18].contiguous().view(torch.int8).to(torch.int32)
            return KParts(iq4_values(planes(18, 146, 8, [0, 4], 15), table), scale, None, d,
                          None)
        index = planes(8, 136, 8, [0, 4], 15)
        s_lo = bit_planes(b[..., 4:8], [0, 4], 15).transpose(-1, -2).reshape(*lead, 8)
        s_hi = bit_planes((b[..., 2] | b[..., 3] << 8)[..., None], range(0, 16, 2), 3)
        return KParts(iq4_values(index, table), (s_lo | s_hi.reshape(*lead, 8) << 4) - 32,
                      None, d, None)
    if qtype == Q6_K:
        q = planes(0, 128, 2, [0, 4], 15) | planes(128, 192, 2, [0, 2, 4, 6], 3) << 4
        scale = raw[..., 192:208].contiguous().view(torch.int8).to(torch.int32)
        return KParts(q - 32, scale, None, half_field(raw, 208), None)
    scale, mins = _scale_min_k4(b[..., 4:16])
    if qtype == Q4_K:
        q = planes(16, 144, 4, [0, 4], 15)
    else:  # Q5_K
        q = planes(48, 176, 4, [0, 4], 15) | planes(16, 48, 1, range(8), 1) << 4
    return KParts(q, scale, mins, half_field(raw, 0), half_field(raw, 2))


def dequantize_kquant(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 blocks -> float32 [N, K], gguf-py's arithmetic: dl = d * scale and dm = dmin * min
    per sub-block, then w = dl * q - dm, one float32 rounding each (never fused)."""
    p = unpack_kquant(data, qtype, k)
    n, nsb, nsub = p.scale.shape
    q = p.q.reshape(n, nsb, nsub, -1).float()
    w = (p.d[..., None] * p.scale.float())[..., None] * q
    if p.min is not None:
        w = w - (p.dmin[..., None] * p.min.float())[..., None]
    return w.reshape(n, k)


def quantize_activations_q8_k(x: torch.Tensor) -> Q8KBlocks:
    """float32 [M, K] -> Q8_K per 256 values, as llama.cpp's quantize_row_q8_K_ref:
        max    = the value of largest |x| (the first one on a tie; its sign matters)
        iscale = -127 / max,  q = min(127, round-half-even(iscale * x)),  d = 1 / iscale
    and a block of zeros gets d = 0, q = 0. bsums[j] = sum of q[16j, 16j + 16)."""
    if x.dim() != 2 or x.shape[1] % QK_K:
        raise ValueError(f"x must be [M, K] with K a multiple of {QK_K}, got {tuple(x.shape)}")
    m, k = x.shape
    xb = x.float().reshape(m, k // QK_K, QK_K)
    peak = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))  # argmax keeps the first on ties
    live = peak != 0
    # Tensor by tensor: torch computes `-127 / peak` as -127 * (1 / peak), which can be an ulp
    # off llama.cpp's division and flip a rounding.
    iscale = torch.where(live, torch.full_like(peak, -127) / torch.where(live, peak, 1), 0)
    # nearest_int(f) is (f + 1.5 * 2^23)'s low mantissa bits: round half to even, as torch.round
    q = torch.round(xb * iscale).clamp(max=127).to(torch.int8)
    d = torch.where(live, torch.ones_like(iscale) / torch.where(live, iscale, 1), 0)
    bsums = q.reshape(m, k // 16, 16).sum(-1, dtype=torch.int16)
    return Q8KBlocks(q.reshape(m, k), d.squeeze(-1), bsums)


def dot_kquant(data: torch.Tensor, qtype: int, xq: Q8KBlocks) -> torch.Tensor:
    """Q8_K activations [M, K] times K-quant weights [N, K]^T -> float32 [M, N].

    Per output (m, n) and super-block i (in order), with every integer exact:
        isum_i = sum_s scale_s * sum_{j in s} q[j] * qx[j]               (int32)
        msum_i = sum_s min_s * (the bsums covering s)                     (int32; Q2/4/5_K)
        dw_i = fp16 d * xd_i,  dm_i = fp16 dmin * xd_i                    (float32 products)
    then, one float32 rounding per operation, never fused (float(isum) is round-to-nearest-even,
    exact below 2^24):
        Q4_K, Q5_K:  sums = sums + dw_i * float(isum_i);  mins = mins - dm_i * float(msum_i)
                     result = mins + sums                         (both start at +0)
        Q3_K, Q6_K, IQ4_FAMILY:  sums = sums + dw_i * float(isum_i);  result = 0 + sums
        Q2_K:        acc = acc + (dw_i * float(isum_i) - dm_i * float(msum_i));  result = acc

    That is ggml_vec_dot_<type>_q8_K_generic's order with one change: the C code splits isum
    into 8 int32 lanes (positions j mod 8, an artifact of writing scalar code the compiler can
    vectorize) and keeps 8 float sums. llama.cpp's own AVX2/NEON kernels do not keep those lanes
    either, so llama.cpp has no single bit pattern to match; one int32 per super-block is what
    a VNNI / maddubs kernel produces naturally, and the order above is fixed and cheap to
    follow (two accumulators per output). Kernels are held to this, bit for bit. Q2_K's
    C code has no lanes and is followed exactly."""
    if not isinstance(xq, Q8KBlocks):
        raise ValueError(f"K-quant weights take Q8KBlocks activations, got {type(xq).__name__}")
    m, k = xq.q.shape
    p = unpack_kquant(data, qtype, k)
    n, nsb, nsub = p.scale.shape
    wint = (p.scale[..., None] * p.q.reshape(n, nsb, nsub, -1)).reshape(n, nsb, QK_K)
    # Integer sums in float64 are exact (|isum| < 2^31 < 2^53); one rounding to float32 after.
    qx = xq.q.reshape(m, nsb, QK_K).double()
    isum = torch.einsum("mip,nip->mni", qx, wint.double()).float()
    msum = None
    if p.min is not None:
        bs = xq.bsums.reshape(m, nsb, nsub, -1).sum(-1).double()  # one bsum per 16 values
        msum = torch.einsum("mis,nis->mni", bs, p.min.double()).float()
    sums, mins = torch.zeros(m, n), torch.zeros(m, n)
    for i in range(nsb):
        dw = p.d[None, :, i] * xq.d[:, i, None]
        if msum is None:
            sums = sums + dw * isum[..., i]
            continue
        dm = p.dmin[None, :, i] * xq.d[:, i, None]
        if qtype == Q2_K:
            sums = sums + (dw * isum[..., i] - dm * msum[..., i])
        else:
            sums = sums + dw * isum[..., i]
            mins = mins - dm * msum[..., i]
    return mins + sums
