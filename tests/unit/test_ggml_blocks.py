"""The packed GGML types' oracles (kvserve/quant/ggml_blocks.py, ggml_kquants.py).

References, none of them our own code: gguf-py's dequantize (the format's reference) and its
Q8_0 quantize (bit-exact with llama.cpp's quantize_row_q8_0_ref); a numpy transcription of
quantize_row_q8_K_ref, magic-number rounding included; and float64 matmuls of gguf-py's
dequantized weights. gguf-py has no K-quant quantizer, so K-quant blocks are random bytes whose
fp16 fields are overwritten with finite values; legacy blocks are built both that way and by
gguf-py quantizing random float32 weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve.quant.ggml_blocks import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    IQ4_NL,
    IQ4_XS,
    LEGACY_BYTES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_1,
    Q8_K,
    TYPE_NAMES,
    Q8Blocks,
    Q8KBlocks,
    dequantize,
    dot_reference,
    quantize_activations_for,
    quantize_activations_q8,
)
from kvserve.quant.ggml_kquants import quantize_activations_q8_k

ALL = [Q4_K, Q6_K, Q5_0, Q4_0, Q5_1, Q5_K, Q2_K, Q3_K, IQ4_XS, IQ4_NL]
HAS_MIN = {Q5_1, Q2_K, Q4_K, Q5_K}
K = 768  # three super-blocks, 24 legacy blocks
# Where each record keeps its fp16 scale d and its fp16 min (dmin, or Q5_1's m): the test's own
# reading of ggml-common.h, confirmed by gguf-py in every test that overwrites them.
FP16_AT = {Q4_0: (0, None), Q5_0: (0, None), Q5_1: (0, 2), Q2_K: (80, 82), Q3_K: (108, None),
           Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208, None), IQ4_XS: (0, None),
           IQ4_NL: (0, None)}


def ggml(qtype: int) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(qtype)


def set_fp16(raw: np.ndarray, qtype: int, d: np.ndarray | float, dmin: np.ndarray | float
             ) -> np.ndarray:
    """A copy of blocks [n, K / block * bytes] with every record's d and min replaced."""
    n = raw.shape[0]
    out = raw.copy().reshape(n, -1, BLOCK_BYTES[qtype])
    for at, value in zip(FP16_AT[qtype], (d, dmin)):
        if at is not None:
            v = np.broadcast_to(np.asarray(value, np.float16), out.shape[:2])
            out[..., at:at + 2] = np.ascontiguousarray(v).view(np.uint8).reshape(*v.shape, 2)
    return out.reshape(n, -1)


def random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """Random quant and scale bytes; d ~ 0.01 and min ~ 0.05, finite, of both signs."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // BLOCK_SIZE[qtype] * BLOCK_BYTES[qtype]),
                       dtype=np.uint8)
    shape = (n, k // BLOCK_SIZE[qtype])
    return set_fp16(raw, qtype, rng.standard_normal(shape) * 0.01,
                    rng.standard_normal(shape) * 0.05)


def gguf_dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    return np.ascontiguousarray(gguf.quants.dequantize(raw, ggml(qtype)), np.float32)


def fp16_fields(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Each record's d and min as float32 [n, blocks] (min None where the type has none)."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype])
    return tuple(None if at is None else np.ascontiguousarray(blocks[..., at:at + 2])
                 .view(np.float16)[..., 0].astype(np.float32) for at in FP16_AT[qtype])


def test_type_ids_and_record_sizes_are_ggmls() -> None:
    for qtype in ALL:
        assert gguf.GGMLQuantizationType[TYPE_NAMES[qtype]] == qtype
        assert gguf.GGML_QUANT_SIZES[ggml(qtype)] == (BLOCK_SIZE[qtype], BLOCK_BYTES[qtype])
    assert (Q8_0, Q8_1, Q8_K) == tuple(gguf.GGMLQuantizationType[t] for t in ("Q8_0", "Q8_1",
                                                                            "Q8_K"))
    assert gguf.GGML_QUANT_SIZES[ggml(Q8_K)] == (256, 4 + 256 + 2 * 16)


@pytest.mark.parametrize("qtype", ALL, ids=TYPE_NAMES.get)
def test_dequantize_random_blocks_equals_gguf_py(qtype: int) -> None:
    raw = random_blocks(qtype, 37, K, seed=qtype)
    ours = dequantize(torch.from_numpy(raw), qtype, K)
    assert ours.dtype == torch.float32 and ours.shape == (37, K)
    assert torch.equal(ours, torch.from_numpy(gguf_dequantize(raw, qtype)))


# gguf-py has no IQ4_NL quantizer (NotImplementedError): its blocks are random ones only.
@pytest.mark.parametrize("qtype", [t for t in LEGACY_BYTES if t != IQ4_NL], ids=TYPE_NAMES.get)
def test_dequantize_quantized_weights_equals_gguf_py(qtype: int) -> None:
    w = np.random.default_rng(qtype).standard_normal((9, 256)).astype(np.float32) * 0.03
    w[3] = 0  # all-zero blocks: d = 0
    w[5, 7] = 4.0  # one outlier sets its block's scale
    raw = gguf.quants.quantize(w, ggml(qtype))
    ours = dequantize(torch.from_numpy(raw), qtype, 256)
    assert torch.equal(ours, torch.from_numpy(gguf_dequantize(raw, qtype)))
    assert ours[3].abs().max() == 0  # and the blocks hold the weights they were made from
    assert (ours - torch.from_numpy(w)).abs().max() < 0.1


def test_dequantize_names_what_is_wrong() -> None:
    data = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qtype must be one of"):
        dequantize(data, 3, 256)  # Q4_1 stays in quant/gguf.py
    with pytest.raises(ValueError, match=r"Q4_K: data must be uint8 \[rows, 288\]"):
        dequantize(data, Q4_K, 512)
    with pytest.raises(ValueError, match="k must be a positive multiple of 256"):
        dequantize(data, Q4_K, 128)


def test_q8_activations_equal_gguf_py_q8_0() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 128)).astype(np.float32) * 3
    x[1, 32:64] = 0  # a block of zeros: d = 0, q = 0
    # amax 127 makes d = 1 and id = 1 exactly, so the halves are ties: roundf goes away from 0
    x[2, 0:32] = rng.integers(-254, 255, size=32) / 2
    x[2, 0:5] = [127, 2.5, -2.5, 0.5, np.nextafter(np.float32(0.5), np.float32(0))]
    xq = quantize_activations_q8(torch.from_numpy(x))
    ref = gguf.quants.quantize(x, ggml(Q8_0)).reshape(4, 4, 34)
    assert np.array_equal(xq.q.numpy(), ref[..., 2:].view(np.int8).reshape(4, 128))
    ref_d = np.ascontiguousarray(ref[..., :2]).view(np.float16)[..., 0]
    assert np.array_equal(xq.d.numpy(), ref_d.astype(np.float32))
    assert xq.q[2, :5].tolist() == [127, 3, -3, 1, 0]  # 0.49999997 + 0.5 would round to 1
    # Q8_1's s: fp16(sum(q) * d), d before its own fp16 rounding
    d32 = np.abs(x.reshape(4, 4, 32)).max(-1) / np.float32(127)
    sums = ref[..., 2:].view(np.int8).astype(np.int32).sum(-1)
    assert np.array_equal(xq.s.numpy(), (sums.astype(np.float32) * d32).astype(np.float16)
                          .astype(np.float32))


def q8_k_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref transcribed: a scan for the peak, float32 operations, and
    nearest_int's magic-number rounding (f + 1.5 * 2^23, the low mantissa bits)."""
    m, k = x.shape
    q = np.zeros((m, k), np.int8)
    d = np.zeros((m, k // 256), np.float32)
    for r in range(m):
        for i in range(k // 256):
            block = x[r, 256 * i:256 * (i + 1)]
            amax, peak = np.float32(0), np.float32(0)
            for v in block:
                if abs(v) > amax:
                    amax, peak = abs(v), v
            if amax == 0:
                continue
            iscale = np.float32(-127) / peak
            biased = (iscale * block + np.float32(12582912)).astype(np.float32)
            v = (biased.view(np.int32) & 0x007FFFFF) - 0x00400000
            q[r, 256 * i:256 * (i + 1)] = np.minimum(127, v)
            d[r, i] = np.float32(1) / iscale
    return q, d, q.astype(np.int32).reshape(m, -1, 16).sum(-1).astype(np.int16)


def test_q8_k_activations_equal_the_scalar_reference() -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 1024)) * 2).astype(np.float32)
    x[0, 256:512] = 0  # zeros: d = 0
    x[1, 0:256] = rng.integers(-254, 255, size=256) / 2  # peak -127: iscale = 1, q = x, halves tie
    x[1, 0:3] = [-127, 2.5, 3.5]  # ties go to even: 2, 4
    x[1, 256:512] *= 0.1
    x[1, 300], x[1, 400] = -9.0, 9.0  # equal |x|: the first (negative) one is the peak
    x[2, 512:768] = np.abs(x[2, 512:768])  # a positive peak: d < 0, q = -x / |d|
    xq = quantize_activations_q8_k(torch.from_numpy(x))
    q, d, bsums = q8_k_numpy(x)
    assert np.array_equal(xq.q.numpy(), q)
    assert np.array_equal(xq.d.numpy(), d)
    assert np.array_equal(xq.bsums.numpy(), bsums)
    assert xq.q[1, :3].tolist() == [-127, 2, 4] and xq.d[1, 0] == 1
    assert xq.d[1, 1] > 0 and xq.d[2, 2] < 0 and xq.d[0, 1] == 0
    err = (xq.q.float().reshape(3, 4, 256) * xq.d[..., None] - torch.from_numpy(x).reshape(3, 4,
                                                                                           256))
    assert (err.abs() <= xq.d.abs()[..., None] * 0.5001).all()


def integer_weights(raw: np.ndarray, qtype: int, d: float, dmin: float) -> np.ndarray:
    """gguf-py's weights with every d and min overwritten: with (1, 0) each weight is its
    scale * q, with (0, 1) it is -min; exact integers either way."""
    w = gguf_dequantize(set_fp16(raw, qtype, d, dmin), qtype)
    assert np.array_equal(w, np.round(w))
    return w.astype(np.int64)


def contract(raw: np.ndarray, qtype: int, xq: Q8Blocks | Q8KBlocks) -> np.ndarray:
    """The float order dot_reference documents, written again in numpy float32 (one rounding
    per operation) over integer sums built from gguf-py's decoding and numpy int64."""
    m, k = xq.q.shape
    block = BLOCK_SIZE[qtype]
    qx = xq.q.numpy().astype(np.int64).reshape(m, k // block, block)
    isum = np.einsum("mbj,nbj->mnb", qx, integer_weights(raw, qtype, 1, 0).reshape(
        -1, k // block, block)).astype(np.float32)
    if qtype in HAS_MIN and qtype != Q5_1:
        msum = np.einsum("mbj,nbj->mnb", qx, -integer_weights(raw, qtype, 0, 1).reshape(
            -1, k // block, block)).astype(np.float32)
    wd, wm = fp16_fields(raw, qtype)
    xd = xq.d.numpy()
    acc = np.zeros(isum.shape[:2], np.float32)
    mins = np.zeros_like(acc)
    for b in range(k // block):
        dw, dx, sb = wd[None, :, b], xd[:, b, None], isum[..., b]
        if qtype == Q4_0:
            acc = acc + (sb * dw) * dx
        elif qtype in (Q5_0, IQ4_NL):
            acc = acc + (dw * dx) * sb
        elif qtype == Q5_1:
            acc = acc + ((dw * dx) * sb + wm[None, :, b] * xq.s.numpy()[:, b, None])
        elif qtype in (Q3_K, Q6_K, IQ4_XS):
            acc = acc + (dw * dx) * sb
        elif qtype == Q2_K:
            acc = acc + ((dx * dw) * sb - (dx * wm[None, :, b]) * msum[..., b])
        else:  # Q4_K, Q5_K: the C code's two accumulators
            acc = acc + (dw * dx) * sb
            mins = mins - (wm[None, :, b] * dx) * msum[..., b]
    return mins + acc


@pytest.mark.parametrize("large", [False, True], ids=["random", "large sums"])
@pytest.mark.parametrize("qtype", ALL, ids=TYPE_NAMES.get)
def test_dot_reference_follows_its_stated_order(qtype: int, large: bool) -> None:
    """Bit for bit. Realistic sums are often small enough that float(isum) * dw is exact and
    every order gives the same bits; "large sums" (quant and scale bytes from {0x00, 0x01,
    0x10, 0x11}, activations of one sign) makes the products round, so the order shows."""
    raw = random_blocks(qtype, 37, K, seed=10 + qtype)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(qtype)) * 1.5
    if large:
        rng = np.random.default_rng(qtype)
        narrow = rng.choice(np.array([0x00, 0x01, 0x10, 0x11], np.uint8), size=raw.shape)
        wd, wm = fp16_fields(raw, qtype)
        raw = set_fp16(narrow, qtype, wd, 0 if wm is None else wm)
        x = 0.5 + x.abs() / (1 + x.abs())  # in [0.5, 1): every |qx| is 64..127
    xq = quantize_activations_for(qtype, x)
    ours = dot_reference(torch.from_numpy(raw), qtype, xq)
    assert ours.dtype == torch.float32 and ours.shape == (3, 37)
    assert torch.equal(ours, torch.from_numpy(contract(raw, qtype, xq)))


def dequantized_activations(xq: Q8Blocks | Q8KBlocks) -> torch.Tensor:
    m, k = xq.q.shape
    nb = xq.d.shape[1]
    return (xq.q.double().reshape(m, nb, -1) * xq.d.double()[..., None]).reshape(m, k)


@pytest.mark.parametrize("qtype", ALL, ids=TYPE_NAMES.get)
def test_dot_reference_is_exact_where_the_arithmetic_is(qtype: int) -> None:
    """Power-of-two scales and small activations keep every float32 operation exact, so the
    oracle must equal the float64 product of the dequantized operands exactly: this checks
    which scale, min and bsum meets which quant, independently of the float order."""
    raw = set_fp16(random_blocks(qtype, 21, K, seed=20 + qtype), qtype, 2.0 ** -6, 2.0 ** -5)
    rng = np.random.default_rng(qtype)
    q = torch.from_numpy(rng.integers(-4, 5, size=(5, K), dtype=np.int8))
    block = BLOCK_SIZE[qtype]
    d = torch.full((5, K // block), 2.0 ** -7)
    if block == 256:
        xq = Q8KBlocks(q, d, q.reshape(5, -1, 16).sum(-1, dtype=torch.int16))
    else:  # |sum(q)| <= 128, exact in fp16
        xq = Q8Blocks(q, d, d * q.reshape(5, -1, 32).sum(-1).float())
    ref = dequantized_activations(xq) @ torch.from_numpy(gguf_dequantize(raw, qtype)).double().T
    assert torch.equal(dot_reference(torch.from_numpy(raw), qtype, xq).double(), ref)


@pytest.mark.parametrize("qtype", ALL, ids=TYPE_NAMES.get)
def test_dot_reference_is_close_to_float64(qtype: int) -> None:
    """Realistic operands: the oracle within float32's rounding of the float64 product of
    the dequantized operands (Q5_1's min term taken, as llama.cpp takes it, from the fp16 s)."""
    raw = random_blocks(qtype, 64, K, seed=30 + qtype)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(100 + qtype))
    xq = quantize_activations_for(qtype, x)
    xd = dequantized_activations(xq)
    scale_part = torch.from_numpy(gguf_dequantize(set_fp16(raw, qtype, fp16_fields(raw, qtype)[0],
                                                           0), qtype)).double()
    min_part = torch.from_numpy(gguf_dequantize(raw, qtype)).double() - scale_part
    ref = xd @ scale_part.T
    bound = xd.abs() @ scale_part.abs().T
    if qtype == Q5_1:  # sum_b m_b * s_b, per llama.cpp; gguf-py's m part is m on every weight
        m_blocks = torch.from_numpy(fp16_fields(raw, qtype)[1]).double()
        ref = ref + xq.s.double() @ m_blocks.T
        bound = bound + xq.s.double().abs() @ m_blocks.abs().T
    else:
        ref = ref + xd @ min_part.T
        bound = bound + xd.abs() @ min_part.abs().T
    # Each block adds at most 4 float32 roundings (relative 2^-24 of its own terms) and one
    # to the running sum: (blocks + 4) * 2^-24 of the sum of |terms| bounds the error.
    tol = (K // BLOCK_SIZE[qtype] + 4) * 2.0 ** -24 * bound
    err = (dot_reference(torch.from_numpy(raw), qtype, xq).double() - ref).abs()
    assert (err <= tol).all(), float((err / tol).max())
    assert ref.abs().max() > 1  # not a product of zeros


def test_dot_reference_names_the_activations_it_needs() -> None:
    raw = torch.from_numpy(random_blocks(Q4_K, 2, 256, seed=0))
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="K-quant weights take Q8KBlocks"):
        dot_reference(raw, Q4_K, quantize_activations_q8(x))
    with pytest.raises(ValueError, match="Q5_0 weights take Q8Blocks"):
        dot_reference(torch.zeros(2, 8 * 22, dtype=torch.uint8), Q5_0,
                      quantize_activations_q8_k(x))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_activations_q8_k(torch.randn(1, 96))
