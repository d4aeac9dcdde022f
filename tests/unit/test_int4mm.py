"""kvserve/ops/int4mm.py: 4-bit groups (kvserve/quant/int4_groups.py) on torch's int4
matmul (its CPU kernel here; CUDA's tinygemm in tests/cuda/test_cuda_int4mm.py, which runs
these tests on the GPU in bfloat16).

The reference is independent of torch's kernels: the groups' own dequantization in float64,
and gguf-py's decode of the same Q4_0 / Q4_1 / Q4_K blocks.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from kvserve.ops import int4mm
from kvserve.quant.base import KernelWeight
from kvserve.quant.block_pack import Q4_0, Q4_1, pack
from kvserve.quant.gguf_weights import Q4_K, Q6_K
from kvserve.quant.int4_groups import Int4Groups
from kvserve.quant.kernel_runs import int4_runs
from kvserve.quant.kquant_pack import pack_kquant
from kvserve.quant.rtn import int4_to_q4_1, quantize_int4


@pytest.fixture(scope="module")
def target() -> tuple[str, torch.dtype]:
    """(device, activations dtype): tests/cuda overrides it with ("cuda", torch.bfloat16)."""
    return "cpu", torch.bfloat16


def _groups(n: int, k: int, g: int, seed: int, act_order: bool = False) -> Int4Groups:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // g, generator=gen) + 0.5) / 64
    zero = torch.randn(n, k // g, generator=gen) / 16
    perm = torch.randperm(k, generator=gen) if act_order else None
    return Int4Groups(q, scale, zero, g, perm)


@pytest.mark.parametrize("n,k,g,act_order", [(48, 64, 32, False), (40, 96, 32, True),
                                             (64, 256, 128, False), (16, 512, 256, True)])
@pytest.mark.parametrize("m", [1, 7, 33, int4mm.DENSE_ABOVE_M + 36])
def test_matmul_is_the_groups_dequantized(target: tuple[str, torch.dtype], n: int, k: int,
                                          g: int, act_order: bool, m: int) -> None:
    """Rows padded (N = 40), K of 3 k-tile pairs (96), every group size, act-order's
    gathered inputs, on CUDA both tinygemm (few rows) and the dequantized weight (many): x
    times the packed weight is x times the groups dequantized (float64)."""
    device, dtype = torch.device(target[0]), target[1]
    groups = _groups(n, k, g, seed=n + k + m, act_order=act_order)
    assert int4mm.unsupported(device, dtype, groups) is None
    packed, pairs = int4mm.pack(groups, device, dtype)
    perm = None if groups.perm is None else groups.perm.to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = int4mm.matmul(x.to(device), packed, pairs, g, n, perm)
    assert got.shape == (m, n) and got.device.type == device.type
    # The pairs as the kernel holds them (bfloat16); x, the pairs and y are rounded to 8 bits.
    w = Int4Groups(groups.q, groups.scale.to(dtype).float(), groups.zero.to(dtype).float(), g,
                   groups.perm).dequantize().double()
    want = x.double() @ w.T
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)


def test_what_the_kernel_lacks_is_refused_by_name(target: tuple[str, torch.dtype]) -> None:
    device, dtype = torch.device(target[0]), target[1]
    assert "group size 16" in int4mm.unsupported(device, dtype, _groups(16, 64, 16, 0))
    assert "80 inputs" in int4mm.unsupported(device, dtype, _groups(16, 80, 16, 0)._replace(
        group_size=32, scale=torch.ones(16, 2), zero=torch.zeros(16, 2)))
    # float32 / float16 models keep a dense weight (the CPU kernel is slow in them).
    assert "bfloat16" in int4mm.unsupported(device, torch.float32, _groups(16, 64, 32, 0))


def test_coarsest_merges_only_groups_that_repeat_one_pair() -> None:
    g = _groups(8, 256, 128, 1)
    as_blocks = g._replace(scale=g.scale.repeat_interleave(4, 1),
                           zero=g.zero.repeat_interleave(4, 1), group_size=32)
    merged = as_blocks.coarsest()
    assert merged.group_size == 128
    assert torch.equal(merged.scale, g.scale) and torch.equal(merged.zero, g.zero)
    as_blocks.zero[3, 5] += 1e-3  # block 5 of row 3 (group 1) differs: 64 still repeats
    assert as_blocks.coarsest().group_size == 32
    assert _groups(8, 256, 32, 2).coarsest().group_size == 32


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_int4_runs_are_the_blocks_gguf_py_decodes(qtype: int) -> None:
    """Packed Q4_0 / Q4_1 runs (two, as a fused qkv holds) read back as torch's int4 groups
    dequantize to gguf-py's values of the same blocks."""
    gen = torch.Generator().manual_seed(qtype)
    k, rows = 128, (24, 40)
    blocks = []
    for n in rows:
        w = torch.randn(n, k, generator=gen)
        q, d, m = quantize_int4(w, 32)
        b = int4_to_q4_1(q, d, m, 32)
        if qtype == Q4_0:  # the same quants as Q4_0 blocks: fp16 d, then the 16 bytes
            b = b.reshape(n, -1, 20)
            b = torch.cat([b[..., :2], b[..., 4:]], dim=-1).reshape(n, -1)
        blocks.append(b)
    parts, start = [], 0
    for n, b in zip(rows, blocks):
        parts.append(KernelWeight(pack(b, qtype, k), qtype, start, n))
        start += n
    groups = int4_runs(parts, k)
    assert groups is not None and groups.group_size == 32 and groups.q.dtype == torch.uint8
    want = np.concatenate([gguf.quants.dequantize(b.numpy(), gguf.GGMLQuantizationType(qtype))
                           for b in blocks]).reshape(sum(rows), k)
    torch.testing.assert_close(groups.dequantize(), torch.from_numpy(want), rtol=1e-6,
                               atol=1e-7)
    assert int4_runs([KernelWeight(torch.zeros(4, k), 0, 0, 4)], k) is None  # float rows


def test_q4_k_runs_are_the_blocks_gguf_py_decodes() -> None:
    """Packed Q4_K rows (a Q4_K_M file's commonest type) as groups of 32, one per sub-block:
    scale d * scale_s, zero 8 d scale_s - dmin min_s; a Q6_K run has no such form."""
    from tests.unit.test_kquant_kernels import random_blocks as kquant_blocks

    k, n = 512, 40
    blocks = kquant_blocks(Q4_K, n, k, seed=4)
    groups = int4_runs([KernelWeight(pack_kquant(blocks, Q4_K, k), Q4_K, 0, n)], k)
    assert groups is not None and groups.group_size == 32
    want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(Q4_K))
    torch.testing.assert_close(groups.dequantize(), torch.from_numpy(want.reshape(n, k)),
                               rtol=1e-5, atol=1e-6)
    q6 = kquant_blocks(Q6_K, 16, 256, seed=5)
    assert int4_runs([KernelWeight(pack_kquant(q6, Q6_K, 256), Q6_K, 0, 16)], 256) is None


def _tinygemm_layout(q: torch.Tensor, tiles: int) -> torch.Tensor:
    """q uint8 [N, K] as aten's _convert_weight_to_int4pack (CUDA) writes it, transcribed
    loop for loop from its kernel (aten/src/ATen/native/cuda/int4mm.cu,
    matrix_to_m16n8k16_Bint4_layout), from bytes holding two inputs each, the first in the
    high nibble."""
    n, k = q.shape
    by = (q[:, 0::2] << 4 | q[:, 1::2]).tolist()
    out = np.zeros((math.ceil(n / 8), k // (tiles * 16), 32, tiles // 2), dtype=np.uint32)
    for n_tile in range(out.shape[0]):
        for k_outer in range(out.shape[1]):
            for t in range(32):
                for inner in range(0, tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    base0 = (k_outer * tiles + inner) * 16 // 2
                    ks = [base0 + t % 4, base0 + t % 4 + 4, base0 + 8 + t % 4,
                          base0 + 8 + t % 4 + 4]
                    v = [by[n0][kk] if n0 < n else 0 for kk in ks]
                    out[n_tile, k_outer, t, inner // 2] = (
                        (v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20
                        | (v[0] & 0xF) << 16 | (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4
                        | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4)
    return torch.from_numpy(out.view(np.int32))


@pytest.mark.parametrize("n,k,tiles", [(16, 64, 4), (24, 128, 8), (16, 96, 2)])
def test_unpack_cuda_inverts_tinygemms_layout(n: int, k: int, tiles: int) -> None:
    """The layout CUDA's packing writes (transcribed above), read back by unpack_cuda, is
    the integers; dequantize_cuda applies each group's pair (run here on the CPU: it is
    torch ops alone, and tests/cuda checks it against the real packing)."""
    groups = _groups(n, k, 32, seed=n + k)
    packed = _tinygemm_layout(groups.q, tiles)
    assert torch.equal(int4mm.unpack_cuda(packed)[:n], groups.q)
    pairs = torch.stack([groups.scale, groups.zero], dim=-1).transpose(0, 1)
    pairs = torch.nn.functional.pad(pairs, (0, 0, 0, -n % 8)).contiguous()
    torch.testing.assert_close(int4mm.dequantize_cuda(packed, pairs, 32)[:n],
                               groups.dequantize(), rtol=1e-6, atol=1e-7)
