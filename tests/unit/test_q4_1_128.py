"""Q4_1_128: Q4_1 blocks packed with one (d, m) per 4 blocks (kvserve/quant/block_pack.py
`share_scales` / `widen`, the kernels in ops/csrc/qlinear*.cpp), the format GPTQ / AWQ /
compressed-tensors / int4 weights in groups of 128 run as: 4.25 bits a weight, not Q4_1's 5.

References: the layout drawn in block_pack.py, read here byte by byte; and the Q4_1 packing of
the same blocks (held to gguf-py in test_quant_gguf.py, its kernels to qlinear_reference in
test_qlinear_q5.py), whose kernel result Q4_1_128 must equal bit for bit on every ISA and tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.ops.cpu import PACKED_WTYPES, CpuOps
from kvserve.quant.block_pack import (
    Q4_1,
    Q4_1_128,
    check_packed,
    pack,
    qlinear_reference,
    unpack,
    widen,
)


def shared_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of Q4_1 blocks as stored (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles), random
    nibbles, and per 128 inputs one random d ~ 0.02 and m ~ 0.1 written into its 4 blocks."""
    rng = np.random.default_rng(seed)
    runs = k // 128
    raw = rng.integers(0, 256, size=(n, runs, 4, 20), dtype=np.uint8)
    for at, scale in ((0, 0.02), (2, 0.1)):
        half = (rng.standard_normal((n, runs, 1)) * scale).astype(np.float16).view(np.uint8)
        raw[..., at:at + 2] = half.reshape(n, runs, 1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def test_layout_is_the_documented_one() -> None:
    """block_pack.py's drawing: row 5's d and m of inputs 128..255 at bytes 10 and 42 of
    record 1, once; its block 6 (record 1's block 2), quants 9 and 25 (stored qs[9]) in chunk 2
    of that block, byte 64 + 256 * 2 + 64 * 2 + 4 * 5 + 1."""
    raw = torch.zeros(16, 8, 20, dtype=torch.uint8)
    d, m = torch.tensor([1.5], dtype=torch.float16), torch.tensor([-0.25], dtype=torch.float16)
    raw[5, 4:8, 0:2] = d.view(torch.uint8)
    raw[5, 4:8, 2:4] = m.view(torch.uint8)
    raw[5, 6, 4 + 9] = 0xA3  # quant 9: low nibble 3, quant 25: high nibble 10
    packed = pack(raw.reshape(16, -1), Q4_1_128, 256)
    assert packed.shape == (1, 2, 1088)
    rec = packed[0, 1]
    assert torch.equal(rec[10:12].view(torch.float16), d)
    assert torch.equal(rec[32 + 10:32 + 12].view(torch.float16), m)
    assert int(rec[:64].count_nonzero()) == int((rec[10:12] != 0).sum() + (rec[42:44] != 0).sum())
    assert rec[64 + 256 * 2 + 64 * 2 + 4 * 5 + 1] == 0xA3
    assert int(rec[64:].count_nonzero()) == 1 and not packed[0, 0].any()


@pytest.mark.parametrize("n, k", [(16, 128), (37, 384), (96, 1536)])
def test_pack_round_trips_and_takes_4_25_bits_a_weight(n: int, k: int) -> None:
    raw = shared_blocks(n, k, seed=n + k)
    packed, q4_1 = pack(raw, Q4_1_128, k), pack(raw, Q4_1, k)
    groups = -(-n // 16)
    assert packed.shape == (groups, k // 128, 1088)
    assert packed.numel() * 8 == groups * 16 * k * 4.25  # Q4_1: 5.0
    assert q4_1.numel() * 8 == groups * 16 * k * 5
    assert torch.equal(widen(packed), q4_1)
    for got, want in zip(unpack(packed, Q4_1_128), unpack(q4_1, Q4_1)):
        assert want is not None and torch.equal(got, want)


def test_blocks_that_do_not_share_their_scales_are_refused() -> None:
    raw = shared_blocks(16, 256).reshape(16, 8, 20)
    raw[3, 5, 0] ^= 1  # one block's d differs from its run's
    with pytest.raises(ValueError, match="needs each 128 inputs of a row to share one d and m"):
        pack(raw.reshape(16, -1), Q4_1_128, 256)
    raw = shared_blocks(16, 256).reshape(16, 8, 20)
    raw[3, 5, 2] ^= 1  # or its m
    with pytest.raises(ValueError, match="share one d and m"):
        pack(raw.reshape(16, -1), Q4_1_128, 256)
    with pytest.raises(ValueError, match="needs K a multiple of 128, got K=96"):
        pack(torch.zeros(16, 60, dtype=torch.uint8), Q4_1_128, 96)
    with pytest.raises(ValueError, match=r"packed Q4_1_128 weights are uint8 \[groups, "
                                         r"K / 128, 1088\], got torch.uint8 \(1, 8, 320\)"):
        check_packed(pack(shared_blocks(16, 256), Q4_1, 256), Q4_1_128)


@pytest.mark.parametrize("n, k", [(16, 128), (37, 384), (1, 256), (96, 1536)])
def test_kernel_gives_the_q4_1_packings_bits(qlinear_ops: CpuOps, n: int, k: int) -> None:
    """The same blocks as Q4_1_128 and as Q4_1 give the same bits at every tile height of both
    kernels (AVX2 1 and 3, VNNI 1, 2 x 4 and 8, their leftovers, past one pass), and those of
    qlinear_reference."""
    assert Q4_1_128 in PACKED_WTYPES  # CpuOps sends it to the kernel, not the reference
    raw = shared_blocks(n, k, seed=3 * n + k)
    packed, q4_1 = pack(raw, Q4_1_128, k), pack(raw, Q4_1, k)
    g = torch.Generator().manual_seed(n * k)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64):
        x = torch.randn(m, k, generator=g) * 2
        for b in (None, bias):
            ours = qlinear_ops._ext.qlinear(x, packed, Q4_1_128, n, b, qlinear_ops._vnni)
            assert torch.equal(ours, qlinear_ops._ext.qlinear(x, q4_1, Q4_1, n, b,
                                                              qlinear_ops._vnni)), (m, b is None)
            assert torch.equal(ours, qlinear_reference(x, packed, Q4_1_128, n, b))


def test_kernel_exact_at_the_extreme_quants(qlinear_ops: CpuOps) -> None:
    """Every quant 15 with d = 1, m = 0, against activation quants all +127 or all -127:
    exactly 4 blocks of d_w * d_x * 15 * 127 * 32, summed in order."""
    raw = torch.zeros(16, 4, 20, dtype=torch.uint8)
    raw[..., 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # d = 1.0
    raw[..., 4:] = 0xFF
    packed = pack(raw.reshape(16, -1), Q4_1_128, 128)
    x = torch.cat([torch.full((1, 128), 0.5), torch.full((1, 128), -0.5)])
    ours = qlinear_ops._ext.qlinear(x, packed, Q4_1_128, 16, None, qlinear_ops._vnni)
    block = torch.tensor(float(15 * 127 * 32)) * (torch.tensor(0.5) / 127)
    want = ((block + block) + block) + block
    assert torch.equal(ours[0], want.expand(16)) and torch.equal(ours[1], -want.expand(16))


def test_kernel_names_a_weight_of_another_shape(qlinear_ops: CpuOps) -> None:
    packed = pack(shared_blocks(16, 256), Q4_1, 256)  # Q4_1 records named Q4_1_128
    with pytest.raises(RuntimeError, match="packed wtype 263 records take 1088 bytes, the "
                                           "weight's have 320"):
        qlinear_ops._ext.qlinear(torch.randn(1, 256), packed, Q4_1_128, 16, None, False)
    packed = pack(shared_blocks(16, 256), Q4_1_128, 256)
    with pytest.raises(RuntimeError, match="must have K = 256 for this packed weight, got K=512"):
        qlinear_ops._ext.qlinear(torch.randn(1, 512), packed, Q4_1_128, 16, None, False)
