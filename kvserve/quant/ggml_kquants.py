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
  in IQ4_XS's 136-byte layout (rewrite_iq4), its nibbles indexing the type's own 16 values
  (IQ4_FAMILY). These i-quants' weight is d * (1 + 2 s) * value / 2^shift, s a 4-bit (IQ1_S:
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
# A file's i-quant -> (its stored bytes per 256 weights, the type rewrite_iq4 makes of it).
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
