"""GGUF Q4_0 / Q5_0 / Q5_1 kept packed for the int8-activation kernels (kvserve/quant/gguf.py
pack, ops/csrc/qlinear*.cpp).

References: ggml_blocks.dequantize (held bit-equal to gguf-py in test_ggml_blocks.py) for
what pack / unpack must keep; a float64 product of the oracle's weights and the quantized
activations (within a stated rounding bound) for qlinear_reference's arithmetic, and
llama.cpp's own block dot (ggml_blocks.dot_reference, its Q8_0 / Q8_1 activations) for how far
from it that lands; and qlinear_reference itself, which both ISAs' kernels must equal bit for
bit at every M and N.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.quant import ggml_blocks
from kvserve.quant.gguf import (
    BLOCK_BYTES,
    PACKED_BYTES,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    TYPE_NAMES,
    check_packed,
    pack,
    qlinear_reference,
    quantize_activations,
    unpack,
)

NEW = [Q4_0, Q5_0, Q5_1]
HAS_M = {Q4_1, Q5_1}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of k weights: random quant bytes (qh included), fp16 d ~ 0.02 and m ~ 0.1 of both
    signs (finite, as a quantizer writes them)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    raw = rng.integers(0, 256, size=(n, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at, scale in ((0, 0.02), (2, 0.1)) if qtype in HAS_M else ((0, 0.02),):
        raw[..., at:at + 2] = (rng.standard_normal((n, nb)) * scale).astype(np.float16).view(
            np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def fp16_min(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Each block's m (Q5_1: bytes 2..3) as float32 [n, nb]; zeros for a type without one."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype])
    if qtype not in HAS_M:
        return torch.zeros(blocks.shape[:2])
    return blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]


@pytest.mark.parametrize("qtype", NEW, ids=TYPE_NAMES.get)
@pytest.mark.parametrize("n", [16, 37, 96])
def test_pack_round_trips_every_weight_and_scale(qtype: int, n: int) -> None:
    k = 96
    raw = random_blocks(qtype, n, k, seed=n + qtype)
    packed = pack(raw, qtype, k)
    groups = -(-n // 16)
    assert packed.dtype == torch.uint8
    assert packed.shape == (groups, 3, PACKED_BYTES[qtype]) == (groups, 3, 16 * BLOCK_BYTES[qtype])
    q, d, m = unpack(packed, qtype)
    assert (m is not None) == (qtype in HAS_M)
    lo, hi = {Q4_0: (-8, 7), Q5_0: (-16, 15), Q5_1: (0, 31)}[qtype]
    assert int(q.min()) == lo and int(q.max()) == hi  # every quant value occurs
    weights = d[..., None] * q.float() + (m[..., None] if m is not None else 0)
    assert torch.equal(weights[:n].reshape(n, k), ggml_blocks.dequantize(raw, qtype, k))
    # padding rows are zero blocks: d = m = 0, so they compute zeros (their quants read as
    # stored 0, i.e. -8 / -16 once signed)
    assert not d[n:].any() and (m is None or not m[n:].any()) and not weights[n:].any()


@pytest.mark.parametrize("qtype", [Q5_0, Q5_1], ids=TYPE_NAMES.get)
def test_packed_layout_is_the_documented_one(qtype: int) -> None:
    """gguf.py's layout comment, byte by byte: row 5's quants 9 and 25 (stored qs[9], bits 9 and
    25 of qh) land in chunk 2, byte 4 * 5 + 1, and in qh plane byte 21, bits 2 and 6."""
    raw = torch.zeros(16, BLOCK_BYTES[qtype], dtype=torch.uint8)
    qh_at, qs_at = (2, 6) if qtype == Q5_0 else (4, 8)
    raw[5, qs_at + 9] = 0xA3  # quant 9: low nibble 3, quant 25: high nibble 10
    qh = (1 << 9) | (1 << 25)
    raw[5, qh_at:qh_at + 4] = torch.tensor(list(qh.to_bytes(4, "little")), dtype=torch.uint8)
    rec = pack(raw, qtype, 32)[0, 0]
    plane_at = 32 + 32 * (qtype == Q5_1)
    chunks_at = plane_at + 64
    assert rec[plane_at + 21] == (1 << 2) | (1 << 6)
    assert rec[chunks_at + 64 * 2 + 21] == 0xA3
    assert int(rec[plane_at:].count_nonzero()) == 2  # nothing else set
    q = unpack(pack(raw, qtype, 32), qtype)[0][5, 0] + (16 if qtype == Q5_0 else 0)
    assert q[9] == 16 + 3 and q[25] == 16 + 10


def test_a_packed_weight_must_be_of_the_named_format() -> None:
    packed = pack(random_blocks(Q5_0, 16, 64), Q5_0, 64)
    with pytest.raises(ValueError, match=r"packed Q5_1 weights are uint8 \[groups, K / 32, "
                                         r"384\], got torch.uint8 \(1, 2, 352\)"):
        check_packed(packed, Q5_1)
    with pytest.raises(ValueError, match="packed Q5_0 weights are uint8"):
        check_packed(packed.to(torch.int16), Q5_0)
    with pytest.raises(ValueError, match="qtype must be one of"):
        pack(random_blocks(Q5_0, 16, 64), 12, 64)


def _bound(raw: torch.Tensor, qtype: int, xd: torch.Tensor) -> torch.Tensor:
    """An upper bound on qlinear_reference's rounding error: (nb + 4) ulps (2^-24) of
    sum_k |x_k| (|d q_k| + |m|), bounded by |w| + 2|m| (nb + 1 float32 additions, and a few
    roundings per block term: d_w * d_x, the product, s = d_x * sum(q_x), m * s, and the
    oracle's own d * q + m)."""
    k = xd.shape[1]
    w = ggml_blocks.dequantize(raw, qtype, k).double()
    m = fp16_min(raw, qtype).double().repeat_interleave(32, dim=1)
    return (k // 32 + 4) * 2.0**-24 * (xd.abs() @ (w.abs() + 2 * m.abs()).T)


@pytest.mark.parametrize("qtype", NEW, ids=TYPE_NAMES.get)
def test_qlinear_reference_is_the_oracles_product(qtype: int) -> None:
    """Independent of unpack's integers: the oracle's float weights times the dequantized
    int8 activations in float64, within the rounding bound above."""
    n, k = 53, 576
    raw = random_blocks(qtype, n, k, seed=11 + qtype)
    g = torch.Generator().manual_seed(qtype)
    x = torch.randn(7, k, generator=g) * 3
    q, d, _, _ = quantize_activations(x)
    xd = (q.double().reshape(7, -1, 32) * d.double()[..., None]).reshape(7, k)
    want = xd @ ggml_blocks.dequantize(raw, qtype, k).double().T
    ours = qlinear_reference(x, pack(raw, qtype, k), qtype, n).double()
    err, bound = (ours - want).abs(), _bound(raw, qtype, xd)
    assert (err <= bound).all(), float((err / bound).max())
    assert float(err.max()) > 0  # float32 rounding is there: the check is not vacuous
    # the bias is added last, once
    bias = torch.randn(n, generator=g)
    assert torch.equal(qlinear_reference(x, pack(raw, qtype, k), qtype, n, bias),
                       qlinear_reference(x, pack(raw, qtype, k), qtype, n) + bias)


@pytest.mark.parametrize("qtype", NEW, ids=TYPE_NAMES.get)
def test_qlinear_reference_is_close_to_llama_cpps_dot(qtype: int) -> None:
    """Against llama.cpp's own arithmetic (ggml_blocks.dot_reference on its Q8_0 / Q8_1
    activations: fp16 d, ties away from zero): what separates the two is the activation scale's
    fp16 rounding (2^-11 relative) and the odd tie, so within 2^-9 of sum |x w|."""
    n, k = 40, 1536
    raw = random_blocks(qtype, n, k, seed=21 + qtype)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    theirs = ggml_blocks.dot_reference(raw, qtype, ggml_blocks.quantize_activations_q8(x))
    ours = qlinear_reference(x, pack(raw, qtype, k), qtype, n)
    scale = x.double().abs() @ ggml_blocks.dequantize(raw, qtype, k).double().abs().T
    err = (ours - theirs).double().abs()
    assert (err <= 2.0**-9 * scale).all(), float((err / scale).max())
    assert not torch.equal(ours, theirs)  # the two quantize activations differently
