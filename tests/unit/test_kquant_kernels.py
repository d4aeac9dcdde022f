"""Packed GGUF K-quants (kvserve/quant/kquant_pack.py) and their int8 kernels
(ops/csrc/qlinear_kquant*.cpp).

References: ggml_kquants.py's oracles (themselves held to gguf-py and to a numpy transcription
of llama.cpp in test_ggml_blocks.py): dequantize for what packing must keep, and
quantize_activations_q8_k / dot_kquant for the kernels' bytes and bits; the packed layout is
also read back here by the offsets kquant.h draws, written out independently of pack_kquant.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.ops.cpu import CpuOps, cpu_has_avx2_fma
from kvserve.ops.reference import ReferenceOps
from kvserve.quant.ggml_kquants import (
    IQ1_M16,
    IQ1_S4,
    IQ2_X16,
    IQ2_XXS4,
    IQ3_S4,
    IQ3_XXS4,
    IQ4_FAMILY,
    IQ4_XS,
    KQUANT_BYTES,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    dequantize_kquant,
    dot_kquant,
    quantize_activations_q8_k,
)
from kvserve.quant.kquant_pack import (
    PACKED_KQUANT_BYTES,
    check_packed_kquant,
    pack_kquant,
    unpack,
)

KQ = [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S4, IQ3_XXS4, IQ2_XXS4, IQ1_S4, IQ2_X16, IQ1_M16]
NAMES = {Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_XS: "IQ4_XS",
         IQ3_S4: "IQ3_S4", IQ3_XXS4: "IQ3_XXS4", IQ2_XXS4: "IQ2_XXS4", IQ1_S4: "IQ1_S4",
         IQ2_X16: "IQ2_X16", IQ1_M16: "IQ1_M16"}
# fp16 d and dmin in a stored record
D_AT = {Q2_K: (80, 82), Q3_K: (108, None), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208, None),
        **{q: (0, None) for q in IQ4_FAMILY}}
needs_kernels = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2+FMA CPU")


def random_blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random quant and scale bytes (every scale, min and quant value reachable), fp16 d ~ 0.01
    and dmin ~ 0.05 of both signs, finite."""
    rng = np.random.default_rng(seed)
    nb, rb = k // 256, KQUANT_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, nb, rb), dtype=np.uint8)
    for at, scale in zip(D_AT[qtype], (0.01, 0.05)):
        if at is not None:
            v = (rng.standard_normal((n, nb)) * scale).astype(np.float16)
            raw[..., at:at + 2] = v.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(raw.reshape(n, nb * rb))


# --- the packed layout ---


@pytest.mark.parametrize("qtype", KQ, ids=NAMES.get)
@pytest.mark.parametrize("n", [8, 16, 37, 96])
def test_pack_round_trips_every_byte(qtype: int, n: int) -> None:
    raw = random_blocks(qtype, n, 768, seed=n)
    packed = pack_kquant(raw, qtype, 768)
    groups = -(-n // 16)
    assert packed.shape == (groups, 3, PACKED_KQUANT_BYTES[qtype]) and packed.dtype == torch.uint8
    assert packed.numel() == groups * 16 * raw.shape[1]  # no byte added but the padding rows
    assert torch.equal(unpack(packed, qtype, n), raw)
    assert torch.equal(dequantize_kquant(unpack(packed, qtype, n), qtype, 768),
                       dequantize_kquant(raw, qtype, 768))
    pad = unpack(packed, qtype)[n:]
    assert not pad.any()  # zero records: d = dmin = 0, so they compute zeros


def _stored_offset(qtype: int, at: int) -> int:
    """Offset at in a packed record -> (row r, stored byte) as kquant.h draws it, flattened as
    r * record + byte; written from the diagram, not from pack_kquant's field table."""
    if qtype in (Q2_K, Q3_K):
        rb = KQUANT_BYTES[qtype]
        # (packed start, stored start, unit) of each field, in order, from the diagram
        q3 = ((0, 0, 4), (512, 32, 4), (1536, 96, 1), (1728, 108, 2))
        q2 = ((0, 0, 1), (256, 16, 4), (1280, 80, 2), (1312, 82, 2))
        pstart, sstart, u = [f for f in (q3 if qtype == Q3_K else q2) if f[0] <= at][-1]
        unit, rest = divmod(at - pstart, 16 * u)  # unit j of rows 0..15
        r, j = divmod(rest, u)
        return r * rb + sstart + u * unit + j
    if qtype in (Q4_K, Q5_K):
        rb = KQUANT_BYTES[qtype]
        if at < 64:  # d[16], dmin[16]
            field, r, j = divmod(at, 32)[0], (at % 32) // 2, at % 2
            return r * rb + 2 * field + j
        if at < 256:  # 12 planes of 16 bytes
            p, r = divmod(at - 64, 16)
            return r * rb + 4 + p
        # Q5_K: 8 qh chunks first (chunk l4 holds qh[4 * l4 + j]), then the qs chunks
        base, start = (48, 768) if qtype == Q5_K and at >= 768 else (16, 256)
        chunk, rest = divmod(at - start, 64)  # qs chunk 8c + l4 holds qs[4 * chunk + j]
        r, j = divmod(rest, 4)
        return r * rb + base + 4 * chunk + j
    if qtype in (IQ2_X16, IQ1_M16):
        if at < 32:  # d[16]: row r's 2 bytes at 2r
            return (at // 2) * 146 + at % 2
        if at < 288:  # 16 scale planes of 16 bytes, plane j: row r's scale j
            j, r = divmod(at - 32, 16)
            return r * 146 + 2 + j
        chunk, rest = divmod(at - 288, 64)  # qs chunk 4s + l4 holds qs[4 * chunk + j]
        r, j = divmod(rest, 4)
        return r * 146 + 18 + 4 * chunk + j
    if qtype in IQ4_FAMILY:  # one layout
        if at < 64:  # d[16], then scales_h[16]: row r's 2 bytes at 2r of each
            field, r, j = at // 32, (at % 32) // 2, at % 2
            return r * 136 + 2 * field + j
        if at < 128:  # 4 scales_l planes of 16 bytes
            p, r = divmod(at - 64, 16)
            return r * 136 + 4 + p
        chunk, rest = divmod(at - 128, 64)  # qs chunk 4s + l4 holds qs[4 * chunk + j]
        r, j = divmod(rest, 4)
        return r * 136 + 8 + 4 * chunk + j
    if at < 3072:  # 32 ql chunks, then 16 qh chunks: both byte 4 * chunk + j of their field
        base, chunk = (0, at // 64) if at < 2048 else (128, (at - 2048) // 64)
        r, j = divmod(at % 64, 4)
        return r * 210 + base + 4 * chunk + j
    if at < 3328:
        s, r = divmod(at - 3072, 16)
        return r * 210 + 192 + s
    r, j = divmod(at - 3328, 2)
    return r * 210 + 208 + j


@pytest.mark.parametrize("qtype", KQ, ids=NAMES.get)
def test_packed_record_is_kquant_h_layout(qtype: int) -> None:
    raw = random_blocks(qtype, 32, 512, seed=5)
    packed = pack_kquant(raw, qtype, 512)
    rb = KQUANT_BYTES[qtype]
    where = torch.tensor([_stored_offset(qtype, at) for at in range(16 * rb)])
    assert sorted(where.tolist()) == list(range(16 * rb))  # a permutation of the group's bytes
    for g in range(2):
        for i in range(2):
            group = raw[16 * g:16 * g + 16].reshape(16, 2, rb)[:, i].reshape(-1)
            assert torch.equal(packed[g, i], group[where])


def test_pack_refuses_what_does_not_fit() -> None:
    raw = random_blocks(Q4_K, 16, 256, seed=1)
    with pytest.raises(ValueError, match=r"packed K-quant qtype must be one of .*Q4_K \(12\)"):
        pack_kquant(raw, 15, 256)
    with pytest.raises(ValueError, match=r"Q4_K: data must be uint8 \[rows, 288\]"):
        pack_kquant(raw, Q4_K, 512)
    packed = pack_kquant(raw, Q4_K, 256)
    with pytest.raises(ValueError, match=r"packed Q6_K weights are uint8 \[groups, K / 256, "
                                         r"3360\], got torch.uint8 \(1, 1, 2304\)"):
        check_packed_kquant(packed, Q6_K)
    with pytest.raises(ValueError, match="n=17 does not fit 1 groups"):
        unpack(packed, Q4_K, 17)


# --- Q8_K activations ---


@needs_kernels
def test_q8_k_activations_are_the_oracles_byte_for_byte() -> None:
    ext = CpuOps()._ext
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 768, generator=g) * 3
    x[0, :256] = 0  # an all-zero block: d = 0, q = 0
    x[1, :256] = (torch.arange(256) - 127.5) / 2  # lands x * iscale on .5 ties
    x[2, 256:512] = torch.randn(256, generator=g) * 1e-30  # tiny: a huge iscale
    x[3, 10], x[3, 20] = 50.0, -50.0  # equal |peak|, the first positive: iscale < 0
    x[4, 10], x[4, 20] = -50.0, 50.0  # the first negative: iscale > 0
    x[5, 512:] = torch.randn(256, generator=g).sign() * 5  # every q at +-127
    x[6, 300] = -1e6  # one outlier
    ours = ext.quantize_acts_q8k(x)
    ref = quantize_activations_q8_k(x)
    assert [t.dtype for t in ours] == [torch.int8, torch.float32, torch.int16]
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    assert ref.d[3, 0] < 0 < ref.d[4, 0]  # the first peak (its sign) sets the scale: q = -127
    assert ref.q[3, 10] == ref.q[4, 10] == -127 and ref.q[3, 20] == ref.q[4, 20] == 127
    # strided rows (a view of a wider buffer) read the same values
    wide = torch.zeros(9, 1024)
    wide[:, :768] = x
    assert all(torch.equal(a, b) for a, b in zip(ext.quantize_acts_q8k(wide[:, :768]), ours))


@needs_kernels
def test_q8_k_activations_refuse_bad_input() -> None:
    ext = CpuOps()._ext
    with pytest.raises(RuntimeError, match="K % 256 == 0"):
        ext.quantize_acts_q8k(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ext.quantize_acts_q8k(torch.randn(2, 256, dtype=torch.float64))


# --- the kernels, bit for bit ---


@pytest.mark.parametrize("qtype", KQ, ids=NAMES.get)
@pytest.mark.parametrize("n,k", [(16, 256), (37, 768), (8, 512), (300, 2048)])
def test_kernel_equals_oracle_bit_for_bit(qlinear_ops: CpuOps, qtype: int, n: int, k: int) -> None:
    packed = pack_kquant(random_blocks(qtype, n, k, seed=n + k), qtype, k)
    raw = unpack(packed, qtype, n)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(n * k)
    # every tile height of both kernels and their leftovers, and prefill-sized Ms: at k = 2048
    # 600 rows are two passes of the AVX2 wide records (~1 MB of activations each)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33, 300, 600):
        x = torch.randn(m, k, generator=g) * 2
        expect = dot_kquant(raw, qtype, quantize_activations_q8_k(x))
        assert torch.equal(qlinear_ops.qlinear_kquant(x, packed, n, wtype=qtype), expect), m
        with_bias = qlinear_ops.qlinear_kquant(x, packed, n, bias, wtype=qtype)
        assert torch.equal(with_bias, expect + bias), m
        assert torch.equal(with_bias, ReferenceOps.qlinear_kquant(x, packed, n, bias,
                                                                  wtype=qtype)), m


@pytest.mark.parametrize("qtype", KQ, ids=NAMES.get)
def test_kernel_at_the_integer_bounds(qlinear_ops: CpuOps, qtype: int) -> None:
    """Every quant at its largest (Q2_K 3, Q3_K 3 or -4, Q4_K 15, Q5_K 31, Q6_K 31 or -32,
    IQ4_XS -127 and 113, IQ3_S4 -15 and 15, IQ3_XXS4 -62 and 62, IQ2_XXS4 -43 and 43, IQ1_S4
    -9 and 9, IQ2_X16 -43 and 43, IQ1_M16 -9 and 9) and every activation at +-127: the AVX2
    kernel's int16
    partial sums at their limits (Q4_K 30480, Q5_K 31496, Q6_K 32004, IQ4_XS's pairs 32258),
    every scale and min at its largest (Q3_K and IQ4_XS: 31 and -32; IQ2_X16 127 and -128)."""
    n, k = 32, 512
    rb = KQUANT_BYTES[qtype]
    raw = random_blocks(qtype, n, k, seed=9).reshape(n, 2, rb)
    if qtype == Q2_K:
        raw[..., 0:16] = 255  # every scale and min 15
        raw[: n // 2, :, 16:80] = 255  # quants 3
        raw[n // 2:, :, 16:80] = 0
    elif qtype == Q3_K:
        raw[: n // 2, :, 0:108] = 255  # q = 3, scales 63 - 32 = 31
        raw[n // 2:, :, 0:108] = 0  # q = -4, scales -32
    elif qtype in (Q4_K, Q5_K):
        raw[..., 4:16] = 255  # every scale and min 63
        raw[: n // 2, :, 16:] = 255  # quants 15 (Q5_K: qh too, 31)
        raw[n // 2:, :, 16:] = 0
    elif qtype in (IQ2_X16, IQ1_M16):
        raw[: n // 2, :, 2:] = 0  # every index 0 (-43, -9), every scale 0
        raw[: n // 2, :, 2:18] = 128  # every scale -128
        raw[n // 2:, :, 2:18] = 127  # every scale 127
        raw[n // 2:, :, 18:] = 0x0F  # index 15 (43, 9) low, 0 (-43, -9) high
    elif qtype in IQ4_FAMILY:
        raw[: n // 2, :, 2:] = 0  # every index 0 (-127), every scale 0 - 32
        raw[n // 2:, :, 2:8] = 255  # every scale 63 - 32 = 31
        raw[n // 2:, :, 8:] = 0x0F  # index 15 (113) in the low nibbles, 0 (-127) in the high
    else:
        raw[: n // 2, :, :192] = 255  # q = 31
        raw[n // 2:, :, :192] = 0  # q = -32
        raw[..., 192:208] = torch.tensor([127, 128], dtype=torch.uint8).repeat(8)  # +127, -128
    raw = raw.reshape(n, -1)
    packed = pack_kquant(raw, qtype, k)
    signs = torch.tensor([1.0, -1.0]).repeat(k // 2)
    # the VNNI / AVX2 packed tiles (AVX2: 1 row; 2 rows, Q6_K 2 to 5; Q4_K 2 to 8, tiles
    # of up to 5 rows), AVX2's wide records (Q4_K 9+ rows, Q2_K, Q3_K, Q5_K 3+, Q6_K 6+),
    # and AMX's tiles (32+ rows) where the ISA is amx
    for rows in (1, 2, 3, 5, 6, 8, 9, 40):
        for x in (torch.ones(rows, k), -torch.ones(rows, k), torch.ones(rows, k) * signs):
            expect = dot_kquant(raw, qtype, quantize_activations_q8_k(x))
            assert torch.equal(qlinear_ops.qlinear_kquant(x, packed, n, wtype=qtype), expect)


@needs_kernels
@pytest.mark.parametrize("qtype", KQ, ids=NAMES.get)
def test_kernel_is_batch_invariant_and_isa_invariant(qtype: int) -> None:
    """The int sums are exact and the float steps fixed, so a row's output is the same bits
    alone, in any batch, and on either ISA."""
    ops, avx2 = CpuOps(), CpuOps(isa="avx2")
    packed = pack_kquant(random_blocks(qtype, 80, 1024, seed=3), qtype, 1024)
    x = torch.randn(40, 1024)
    alone = torch.cat([ops.qlinear_kquant(x[i:i + 1], packed, 80, wtype=qtype)
                       for i in range(40)])
    assert torch.equal(ops.qlinear_kquant(x, packed, 80, wtype=qtype), alone)
    assert torch.equal(avx2.qlinear_kquant(x, packed, 80, wtype=qtype), alone)
    if ops.isa == "amx":  # 40 rows: AMX tiles (Q4_K, Q5_K, Q6_K) against VNNI alone
        vnni = CpuOps(isa="avx512")
        assert torch.equal(vnni.qlinear_kquant(x, packed, 80, wtype=qtype), alone)
    assert torch.equal(avx2.qlinear_kquant(x[7:20], packed, 80, wtype=qtype), alone[7:20])
    assert torch.equal(ReferenceOps.qlinear_kquant(x, packed, 80, wtype=qtype), alone)
    # leading dims are rows
    assert torch.equal(ops.qlinear_kquant(x.view(4, 10, 1024), packed, 80, wtype=qtype),
                       alone.view(4, 10, 80))


@pytest.mark.parametrize("qtype", KQ, ids=NAMES.get)
def test_oracle_is_close_to_the_float_linear(qtype: int) -> None:
    """What Q8_K activations cost against float32: about 1% of the output's scale (measured
    0.7% median, 1.4% worst over 20 activation seeds for each type). x has its own generator:
    drawn from torch's global one it depended on the tests run before it."""
    raw = random_blocks(qtype, 64, 1024, seed=6)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(qtype))
    ref = F.linear(x.double(), dequantize_kquant(raw, qtype, 1024).double())
    ours = ReferenceOps.qlinear_kquant(x, pack_kquant(raw, qtype, 1024), 64, wtype=qtype)
    assert (ours.double() - ref).abs().max() < 0.02 * ref.abs().max()


@needs_kernels
def test_kernel_refuses_bad_shapes_and_formats_by_name() -> None:
    ext = CpuOps()._ext
    packed = pack_kquant(random_blocks(Q4_K, 20, 512, seed=7), Q4_K, 512)
    x = torch.randn(1, 512)
    with pytest.raises(RuntimeError, match="must have K = 512 for this packed weight, got K=256"):
        ext.qlinear_kquant(torch.randn(1, 256), packed, Q4_K, 20, None, False)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ext.qlinear_kquant(x.double(), packed, Q4_K, 20, None, False)
    with pytest.raises(RuntimeError, match="contiguous in its last dimension"):
        ext.qlinear_kquant(torch.randn(1, 1024)[:, ::2], packed, Q4_K, 20, None, False)
    with pytest.raises(RuntimeError, match="N=33 does not fit 2 groups of 16 rows"):
        ext.qlinear_kquant(x, packed, Q4_K, 33, None, False)
    with pytest.raises(RuntimeError, match="N=16 does not fit"):
        ext.qlinear_kquant(x, packed, Q4_K, 16, None, False)
    with pytest.raises(RuntimeError, match="packed wtype 14 records take 3360 bytes, the "
                                           "weight's have 2304"):
        ext.qlinear_kquant(x, packed, Q6_K, 20, None, False)
    with pytest.raises(RuntimeError, match=r"must be 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), "
                                           r"13 \(Q5_K\), 14 \(Q6_K\), 23 \(IQ4_XS\), 257 "
                                           r"\(IQ3_S4\), 258 \(IQ3_XXS4\), 259 \(IQ2_XXS4\), "
                                           r"260 \(IQ1_S4\), 261 \(IQ2_X16\) or 262 "
                                           r"\(IQ1_M16\), got 3"):
        ext.qlinear_kquant(x, packed, 3, 20, None, False)
    with pytest.raises(RuntimeError, match="contiguous uint8 \\[groups, K / 256"):
        ext.qlinear_kquant(x, packed.view(-1), Q4_K, 20, None, False)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        ext.qlinear_kquant(x, packed, Q4_K, 20, torch.zeros(16), False)
    # CpuOps routes formats it has no kernel for to the reference, which names them
    with pytest.raises(ValueError, match="packed K-quant qtype must be one of"):
        CpuOps().qlinear_kquant(x, packed, 20, wtype=15)
