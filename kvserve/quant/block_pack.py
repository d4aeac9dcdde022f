"""GGUF's 32-weight block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; W8A8, kvserve's Q8_0
with a scale per row) repacked for the int8 kernels (ops/csrc/qlinear*.cpp), and the oracle
those kernels are held to: the activation quantizations llama.cpp pairs with these blocks
(Q8_1 per 32 values; per token for W8A8) and `qlinear_reference`, the packed kernels' result
bit for bit. The block layouts as stored are drawn in kvserve/quant/gguf.py (Q4_1, Q8_0) and
ggml_blocks.py (the others); kquant_pack.py is this module's twin for the 256-weight
K-quants.
"""

from __future__ import annotations

import torch

from kvserve.quant import ggml_kquants

F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = 0, 2, 3, 6, 7, 8, 20  # ggml type ids
Q4_1_128 = 263  # kvserve's own: Q4_1 with d and m per 128 inputs (below)
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18}  # a stored block
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              IQ4_NL: "IQ4_NL", Q4_1_128: "Q4_1_128"}
# The packed layout: weight rows in groups of GROUP; per (group, block) one record of
# GROUP * BLOCK_BYTES bytes, so packing costs no memory and the ceiling stays the same.
# Offsets [lo, hi) in a record; r < 16 a row, j < 4, c < 4 a chunk; d, m fp16[16] (row r's at
# 2r); a chunk is 64 bytes whose byte 4r + j belongs to row r:
#   Q4_1 (320):  [0, 32) d  [32, 64) m  [64, 320) 4 chunks
#   Q4_0 (288):  [0, 32) d              [32, 288) 4 chunks
#   IQ4_NL (288): Q4_0's record; its nibbles index ggml_kquants.IQ4_VALUES (-127..113)
#   Q5_0 (352):  [0, 32) d              [32, 96) qh plane  [96, 352) 4 chunks
#   Q5_1 (384):  [0, 32) d  [32, 64) m  [64, 128) qh plane  [128, 384) 4 chunks
#        chunk c, byte 4r + j: row r's stored qs[4c + j], i.e. quant 4c + j in its low nibble
#        and quant 16 + 4c + j in its high (the low 4 bits, unsigned, for the 5-bit types)
#        qh plane, byte 4r + j: bit b (b < 8) = bit 4 of row r's quant 4b + j, so chunk c's
#        low nibbles take bit c and its high nibbles bit 4 + c (a shift, or one vptestmb)
#   Q8_0 (544):  [0, 32) d  [32, 544) 8 chunks; byte 4r + j of chunk c is row r's quant
#        4c + j plus 128, as uint8 (VNNI multiplies unsigned by signed bytes).
# One 64-byte chunk is one vpdpbusd: 16 rows x 4 quants against 4 activation bytes broadcast.
# Quants stay unsigned (Q4_0 q + 8, Q5_0 q + 16, Q8_0 q + 128 on VNNI; IQ4_NL's nibbles are
# looked up as value + 128 there); the kernels take back the offset * sum(activation quants)
# per block, so the int32 sums are the signed ones, exact.
GROUP = 16
PACKED_BYTES = {q: GROUP * b for q, b in BLOCK_BYTES.items()}
OFFSET = {Q4_0: 8, Q5_0: 16}
# kvserve's own format id (past ggml's), for ops.qlinear: Q8_0 groups whose blocks carry their
# row's scale (per output channel), against activations quantized per token
# (quantize_activations_per_token): SmoothQuant's W8A8 (kvserve/quant/smoothquant.py).
W8A8 = 256
# kvserve's own id (past the K-quant layouts' 257..262): Q4_1 blocks whose d and m hold for
# 4 blocks in a row, as a GPTQ / AWQ / int4 group of 128 (or a row's one group) gives them.
# One record per (16 rows, 4 blocks), the scales once (`share_scales`):
#   Q4_1_128 (1088):  [0, 32) d  [32, 64) m  [64 + 256 j, 320 + 256 j) block j's 4 chunks
# 4.25 bits a weight against Q4_1's 5.0. The kernels compute each block as Q4_1's, so a
# weight gives the bits of its Q4_1 packing (`widen` is the way back).
SHARED_SPAN = 4  # blocks per Q4_1_128 record
RECORD_BYTES = {**PACKED_BYTES, Q4_1_128: 64 + SHARED_SPAN * 256}


# Where each stored block keeps its fields: (d, m or None, qh or None, qs), byte offsets.
_STORED_AT = {Q4_0: (0, None, None, 2), Q4_1: (0, 2, None, 4), Q5_0: (0, None, 2, 6),
              Q5_1: (0, 2, 4, 8), IQ4_NL: (0, None, None, 2)}


def pack(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 blocks [N, K // 32 * block bytes] -> the packed layout [ceil(N / 16), K // 32,
    packed bytes]. Rows past N (to fill the last group) are zero blocks: they compute zeros.
    Q4_1_128 takes Q4_1 blocks and gives [ceil(N / 16), K // 128, 1088] (`share_scales`)."""
    if qtype == Q4_1_128:
        return share_scales(pack(data, Q4_1, k))
    if qtype not in PACKED_BYTES:
        raise ValueError(f"qtype must be one of {sorted(TYPE_NAMES.values())}, got {qtype}")
    n, nb = data.shape[0], k // BLOCK
    groups = -(-n // GROUP)
    blocks = torch.zeros(groups * GROUP, nb, BLOCK_BYTES[qtype], dtype=torch.uint8)
    blocks[:n] = data.reshape(n, nb, BLOCK_BYTES[qtype])
    blocks = blocks.reshape(groups, GROUP, nb, -1).transpose(1, 2)  # [G, nb, 16, bytes]
    if qtype == Q8_0:
        qs = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        chunks = qs.reshape(groups, nb, GROUP, 8, 4).transpose(2, 3)
        return torch.cat([blocks[..., 0:2].reshape(groups, nb, -1),
                          chunks.reshape(groups, nb, -1)], dim=-1).contiguous()
    d_at, m_at, qh_at, qs_at = _STORED_AT[qtype]
    parts = [blocks[..., d_at:d_at + 2]]  # d[r] at 2r
    if m_at is not None:
        parts.append(blocks[..., m_at:m_at + 2])  # m[r] at 32 + 2r
    if qh_at is not None:
        qh = blocks[..., qh_at:qh_at + 4].to(torch.int64)  # little endian: bit i = quant i's
        qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        bits = (qh[..., None] >> torch.arange(32)) & 1  # [G, nb, r, 4b + j]
        plane = (bits.reshape(groups, nb, GROUP, 8, 4) << torch.arange(8)[:, None]).sum(3)
        parts.append(plane.to(torch.uint8))  # [G, nb, r, j]: bit b = quant 4b + j's bit 4
    # [.., r, c, j]: byte 4c + j, which already holds quant 4c + j (low nibble) and
    # 16 + 4c + j (high), as a packed byte must
    qs = blocks[..., qs_at:qs_at + 16].reshape(groups, nb, GROUP, 4, 4)
    return torch.cat([p.reshape(groups, nb, -1) for p in parts]
                     + [qs.transpose(2, 3).reshape(groups, nb, -1)], dim=-1).contiguous()


def share_scales(packed: torch.Tensor) -> torch.Tensor:
    """Packed Q4_1 [G, nb, 320] whose d and m repeat over each 4 blocks in a row -> Q4_1_128
    [G, nb / 4, 1088]: each run's scales once, then its 4 blocks' chunks. ValueError if nb is
    no multiple of 4 or a run's scales differ."""
    check_packed(packed, Q4_1)
    groups, nb = packed.shape[:2]
    if nb % SHARED_SPAN:
        raise ValueError(f"Q4_1_128 needs K a multiple of {BLOCK * SHARED_SPAN}, "
                         f"got K={nb * BLOCK}")
    runs = packed.reshape(groups, nb // SHARED_SPAN, SHARED_SPAN, -1)
    scales = runs[:, :, :1, :64]
    if not torch.equal(runs[..., :64], scales.expand(-1, -1, SHARED_SPAN, -1)):
        raise ValueError(f"Q4_1_128 needs each {BLOCK * SHARED_SPAN} inputs of a row to share "
                         f"one d and m")
    return torch.cat([scales[:, :, 0], runs[..., 64:].reshape(groups, nb // SHARED_SPAN, -1)],
                     dim=-1).contiguous()


def widen(packed: torch.Tensor) -> torch.Tensor:
    """Q4_1_128 [G, nb / 4, 1088] -> the packed Q4_1 [G, nb, 320] of the same blocks."""
    check_packed(packed, Q4_1_128)
    groups, runs = packed.shape[:2]
    scales = packed[..., None, :64].expand(-1, -1, SHARED_SPAN, -1)
    chunks = packed[..., 64:].reshape(groups, runs, SHARED_SPAN, -1)
    return torch.cat([scales, chunks], dim=-1).reshape(groups, runs * SHARED_SPAN, -1)


def check_packed(packed: torch.Tensor, qtype: int) -> int:
    """ValueError unless packed is uint8 [groups, K / 32 (K / 128 for Q4_1_128), record
    bytes] of the named format; returns the block format of its records (W8A8's are Q8_0's)."""
    qtype = Q8_0 if qtype == W8A8 else qtype
    if qtype not in RECORD_BYTES:
        raise ValueError(f"qtype must be one of {sorted(TYPE_NAMES.values())}, got {qtype}")
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[-1] != RECORD_BYTES[qtype]:
        per = BLOCK * (SHARED_SPAN if qtype == Q4_1_128 else 1)
        raise ValueError(f"packed {TYPE_NAMES[qtype]} weights are uint8 [groups, K / {per}, "
                         f"{RECORD_BYTES[qtype]}], got {packed.dtype} {tuple(packed.shape)}")
    return qtype


def unpack(packed: torch.Tensor, qtype: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """packed (of the format qtype) -> (quants int32 [G*16, nb, 32], d float32 [G*16, nb],
    m float32 or None): the integers and scales the kernels compute with, signed again where
    the format is (Q4_0 q - 8, Q5_0 q - 16, Q8_0; IQ4_NL the values its nibbles index)."""
    if qtype == Q4_1_128:
        return unpack(widen(packed), Q4_1)
    qtype = check_packed(packed, qtype)
    groups, nb = packed.shape[:2]

    def half(lo: int) -> torch.Tensor:  # 16 fp16 at byte lo -> [G*16, nb]
        h = packed[..., lo:lo + 2 * GROUP].contiguous().view(torch.float16).float()
        return h.transpose(1, 2).reshape(groups * GROUP, nb)

    if qtype == Q8_0:
        chunks = packed[..., 32:].reshape(groups, nb, 8, GROUP, 4).to(torch.int32) - 128
        q = chunks.permute(0, 3, 1, 2, 4).reshape(groups * GROUP, nb, BLOCK)
        return q, half(0), None
    has_m, five = qtype in (Q4_1, Q5_1), qtype in (Q5_0, Q5_1)
    qs_at = 32 + 32 * has_m + 64 * five
    chunks = packed[..., qs_at:].reshape(groups, nb, 4, GROUP, 4).to(torch.int32)
    lo, hi = chunks & 15, chunks >> 4  # [G, nb, c, r, j]
    q = torch.cat([lo, hi], dim=2).permute(0, 3, 1, 2, 4)  # [G, r, nb, 8, 4]: quant 4c + j
    if five:
        plane = packed[..., qs_at - 64:qs_at].reshape(groups, nb, GROUP, 4).to(torch.int32)
        bits = (plane[..., None] >> torch.arange(8, dtype=torch.int32)) & 1  # [G, nb, r, j, b]
        q = q | bits.permute(0, 2, 1, 4, 3) << 4  # [G, r, nb, b, j]: quant 4b + j's bit 4
    q = q.reshape(groups * GROUP, nb, BLOCK)
    q = ggml_kquants.iq4_values(q) if qtype == IQ4_NL else q - OFFSET.get(qtype, 0)
    return q, half(0), half(32) if has_m else None


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 [M, K] -> (q int8 [M, K], d [M, nb], s [M, nb], sum int32 [M, nb]) per block of
    32 values, as llama.cpp's quantize_row_q8_1: d = amax / 127, q = round-half-even(x * (127 /
    amax)) (q = 0 when amax = 0), sum = sum(q), s = d * sum."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    d = amax / 127
    # A tensor divided by a tensor: `127 / amax` would be 127 * (1 / amax) in torch, which
    # can be an ulp off and flip a round-half-even tie.
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / torch.where(amax > 0, amax, 1), 0)
    q = torch.round(xb * inv[..., None]).to(torch.int8)
    total = q.to(torch.int32).sum(-1, dtype=torch.int32)
    return q.reshape(m, k), d, d * total.float(), total


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [M, K] -> (q int8 [M, K], amax float32 [M, 1]): q = round-half-even(x * (127 /
    amax)) with amax over the whole row (q = 0 when amax = 0), the row's scale amax / 127."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / torch.where(amax > 0, amax, 1), 0)
    return torch.round(xf * inv).to(torch.int8), amax


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """quantize_activations' outputs with one scale per row (W8A8's dynamic per-token int8):
    quantize_per_token's q, d = amax / 127 for each of the row's blocks; sum and s = d * sum
    per block of 32 as before."""
    m, k = x.shape
    q, amax = quantize_per_token(x)
    total = q.reshape(m, k // BLOCK, BLOCK).to(torch.int32).sum(-1, dtype=torch.int32)
    d = (amax / 127).expand(m, k // BLOCK)
    return q, d, d * total.float(), total


def qlinear_reference(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The packed kernels' result, bit for bit: per output (m, n), blocks b in order,
        acc = acc + float(sum_i qw[n, b, i] * qx[m, b, i]) * (dw[n, b] * dx[m, b])
        acc = acc + mw[n, b] * s[m, b]                                (Q4_1, Q5_1 only)
    then + bias[n], acc starting at +0, qw the signed quants `unpack` gives (the kernels sum
    the unsigned ones and take back OFFSET * sum(qx): the same integer). The int sums are
    exact (float64 holds them), so only the float32 operations above, one rounding each,
    decide the bits. W8A8: the Q8_0 sum over activations quantized per token."""
    qw, dw, mw = unpack(packed, qtype)
    lead, k = x.shape[:-1], x.shape[-1]
    quantize = quantize_activations_per_token if qtype == W8A8 else quantize_activations
    qx, dx, sx, _ = quantize(x.reshape(-1, k))
    qx = qx.reshape(qx.shape[0], -1, BLOCK).double()
    qw = qw[:n].double()
    acc = torch.zeros(qx.shape[0], n, device=x.device)
    for b in range(k // BLOCK):
        isum = (qx[:, b] @ qw[:, b].T).float()
        acc = acc + isum * (dw[None, :n, b] * dx[:, b, None])
        if mw is not None:
            acc = acc + mw[None, :n, b] * sx[:, b, None]
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*lead, n)
