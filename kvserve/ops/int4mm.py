"""4-bit weights on torch's own int4 matmul, for a backend without kvserve's CPU kernels.

torch has one int4-weight GEMM per device: tinygemm on CUDA (aten._weight_int4pack_mm, sm80+)
and its CPU twin (aten._weight_int4pack_mm_for_cpu), both run here in bfloat16 only (the
CPU's is slow in any other dtype: `unsupported`). Both take N outputs x K inputs as 4-bit
integers q in [0, 15], packed in the device's own tile layout, and per group of G inputs (G in
32, 64, 128, 256) a scale and a zero:

    w[n, k] = (q[n, k] - 8) * scale[n, k / G] + zero[n, k / G]

The groups come from a quantization method (kvserve/quant/int4_groups.py's Int4Groups);
packed, a layer keeps ~4.5-5 bits a weight on the device, where DequantizedLinearMethod would
otherwise hold the model's dtype. ReferenceOps.int4_pack / int4_linear are this module to the
quantization seam. Values: the scale and zero are rounded to the activations' dtype (bfloat16
on CUDA: up to 1/32 of a quantization step), and the sum runs in the kernel's order, so a
result is within float rounding of the dequantized weight's, not bit for bit.
"""

from __future__ import annotations

import torch

from kvserve.quant.int4_groups import GROUP_SIZES, Int4Groups

N_ALIGN = 16  # the CPU packing needs N % 16 == 0 (CUDA's, N % 8): the rows are padded to it
# Above this many rows, tinygemm (built for decode: 0.5x bfloat16's time at 1 row) is slower
# than dequantizing the weight (dequantize_cuda) and running cuBLAS. Measured on an H200,
# Llama-8B shapes (benchmarks/cuda_int4_linear.py): tinygemm's time grows with the rows
# (1.0 ms at 256 rows of a 14336 x 4096 weight, 4.1 ms at 1024), the dequantized path's
# barely (0.97, 1.07 ms); they cross between 128 and 256 rows.
DENSE_ABOVE_M = 192


def unsupported(device: torch.device, dtype: torch.dtype, groups: Int4Groups) -> str | None:
    """Why torch's int4 matmul cannot run these groups on device in dtype; None when it can."""
    k = groups.q.shape[1]
    if device.type not in ("cuda", "cpu"):
        return f"torch has no int4 matmul on {device.type}"
    if dtype != torch.bfloat16:
        # CUDA's takes nothing else. The CPU's takes float32 and float16 too, but then runs
        # 6-60x slower than a dense linear (5632 x 2048, 1-128 rows, this 2-core EPYC), where
        # in bfloat16 it takes 0.3-0.7x a dense bfloat16 linear's time.
        return f"torch's int4 matmul runs bfloat16 activations, not {dtype}"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "CUDA's int4 matmul needs compute capability 8.0 or newer"
    if groups.group_size not in GROUP_SIZES:
        return f"group size {groups.group_size} is not one of {GROUP_SIZES}"
    if _inner_k_tiles(k) is None:
        return f"{k} inputs do not divide by 32"
    return None


def _inner_k_tiles(k: int) -> int | None:
    """The widest packing (k-tiles of 16 side by side) that divides K: 8, 4 or 2."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def pack(groups: Int4Groups, device: torch.device, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the device's tile layout of q, its rows padded to N_ALIGN; the pairs [K / G, padded
    N, 2] in the activations' dtype), on device, for matmul. unsupported(device, dtype,
    groups) must be None."""
    n, k = groups.q.shape
    pad = -n % N_ALIGN
    q = torch.nn.functional.pad(groups.q, (0, 0, 0, pad)).to(device)
    tiles = _inner_k_tiles(k)
    if device.type == "cuda":
        # Two inputs a byte, the first in the high nibble (tinygemm's order).
        packed = torch.ops.aten._convert_weight_to_int4pack(
            (q[:, 0::2] << 4 | q[:, 1::2]).contiguous(), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)
    pairs = torch.stack([groups.scale, groups.zero], dim=-1)  # [N, K / G, 2]
    pairs = torch.nn.functional.pad(pairs, (0, 0, 0, 0, 0, pad))  # padded rows compute 0
    return packed, pairs.transpose(0, 1).to(device=device, dtype=dtype).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor, group_size: int,
           out_features: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times pack()'s weight (x's inputs gathered by perm first): [..., N], in
    the pairs' dtype."""
    # Each torch call costs a launch on CUDA, where a decode step is launch-bound: none that
    # would be a no-op (a 2-D contiguous x in the pairs' dtype, rows not padded).
    shape = x.shape
    if x.dim() != 2:
        x = x.reshape(-1, shape[-1])
    if perm is not None:
        x = x.index_select(-1, perm)
    if x.dtype != pairs.dtype:
        x = x.to(pairs.dtype)
    x = x.contiguous()
    if x.device.type == "cuda" and x.shape[0] > DENSE_ABOVE_M:
        y = torch.nn.functional.linear(x, dequantize_cuda(packed, pairs, group_size))
    elif x.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(x, packed, group_size, pairs)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, pairs)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y if len(shape) == 2 else y.reshape(*shape[:-1], out_features)


def unpack_cuda(packed: torch.Tensor) -> torch.Tensor:
    """tinygemm's tile layout (int32 [N / 8, K / (16 T), 32, T / 2], T inner k-tiles) back to
    q uint8 [N, K]. aten's _convert_weight_to_int4pack writes, for lane t of n-tile a and
    outer k-tile b, word [a, b, t, i] from the bytes v0..v3 = row 8a + t / 4, bytes
    B + t % 4 + (0, 4, 8, 12) with B = 8 (b T + 2 i); its nibble j < 4 is v_j's high nibble
    and nibble 4 + j v_j's low one. A byte's high nibble is the even input (pack), so nibble
    (h, c, d) of the word (j = 4 h + 2 c + d) is input k = 16 T b + 32 i + 16 c + 8 d
    + 2 (t % 4) + h of row n = 8 a + t / 4: a fixed permutation of the nibbles.

    In two moves, so that the one over the whole matrix moves words, not nibbles: the words
    into row order (a, t / 4, b, i, t % 4), then within each run of 4 words (32 inputs) the
    nibbles (t % 4, h, c, d) into (c, d, t % 4, h). Byte y of a word (little endian) holds
    nibbles 2 y (low) and 2 y + 1 (high), so y = 2 h + c and the high nibble is d = 1."""
    nt, ko, _, half = packed.shape
    words = packed.reshape(nt, ko, 8, 4, half).permute(0, 2, 1, 4, 3)  # (a, t/4, b, i, t%4)
    by = words.contiguous().view(torch.uint8).reshape(nt, 8, ko, half, 4, 2, 2)  # .., h, c
    nib = torch.stack([by & 15, by >> 4], dim=-1)  # (a, t/4, b, i, t%4, h, c, d)
    return nib.permute(0, 1, 2, 3, 6, 7, 4, 5).reshape(nt * 8, -1)


def dequantize_cuda(packed: torch.Tensor, pairs: torch.Tensor, group_size: int) -> torch.Tensor:
    """pack()'s CUDA weight as [padded N, K] in the pairs' dtype."""
    q = unpack_cuda(packed)
    n, k = q.shape
    scale, zero = pairs[..., 0].t().unsqueeze(-1), pairs[..., 1].t().unsqueeze(-1)  # [N, K/G, 1]
    # (q - 8) s + z, not q s + (z - 8 s): in bfloat16 the two large terms of the latter
    # cancel (a weight near 0 came out 15% off), where q - 8 is exact.
    w = torch.addcmul(zero, q.reshape(n, k // group_size, group_size).to(pairs.dtype) - 8,
                      scale)
    return w.reshape(n, k)
