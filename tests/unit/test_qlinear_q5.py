"""GGUF Q4_0 / Q5_0 / Q5_1 / IQ4_NL kept packed for the int8-activation kernels
(kvserve/quant/gguf.py pack, ops/csrc/qlinear*.cpp).

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
import torch.nn.functional as F

from kvserve.ops.cpu import (
    ISAS,
    PACKED_WTYPES,
    ROW_WTYPES,
    CpuOps,
    cpu_has_avx2_fma,
    runnable_isas,
)
from kvserve.quant import ggml_blocks
from kvserve.quant.block_pack import (
    BLOCK_BYTES,
    IQ4_NL,
    PACKED_BYTES,
    Q4_0,
    Q4_1,
    Q4_1_128,
    Q5_0,
    Q5_1,
    Q8_0,
    TYPE_NAMES,
    W8A8,
    check_packed,
    pack,
    qlinear_reference,
    quantize_activations,
    unpack,
)

NEW = [Q4_0, Q5_0, Q5_1, IQ4_NL]
HAS_M = {Q4_1, Q5_1}
needs_kernels = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2+FMA CPU")


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
    lo, hi = {Q4_0: (-8, 7), Q5_0: (-16, 15), Q5_1: (0, 31), IQ4_NL: (-127, 113)}[qtype]
    assert int(q.min()) == lo and int(q.max()) == hi  # every quant value occurs
    weights = d[..., None] * q.float() + (m[..., None] if m is not None else 0)
    assert torch.equal(weights[:n].reshape(n, k), ggml_blocks.dequantize(raw, qtype, k))
    # padding rows are zero blocks: d = m = 0, so they compute zeros (their quants read as
    # stored 0, i.e. -8 / -16 once signed, IQ4_NL's first value -127)
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


def test_iq4_nl_packs_as_q4_0_and_reads_its_values() -> None:
    """gguf.py's layout comment: IQ4_NL's record is Q4_0's byte for byte, and unpack reads
    each nibble as the value it indexes (ggml's kvalues_iq4nl, written out here)."""
    values = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    raw = random_blocks(IQ4_NL, 16, 64, seed=5)
    raw[5, 2 + 9] = 0xA3  # row 5, block 0: quant 9 nibble 3, quant 25 nibble 10
    assert torch.equal(pack(raw, IQ4_NL, 64), pack(raw, Q4_0, 64))
    q = unpack(pack(raw, IQ4_NL, 64), IQ4_NL)[0]
    assert q[5, 0, 9] == values[3] and q[5, 0, 25] == values[10]
    nibbles = unpack(pack(raw, Q4_0, 64), Q4_0)[0] + 8
    assert torch.equal(q, torch.tensor(values)[nibbles])


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


@pytest.mark.parametrize("qtype", NEW, ids=TYPE_NAMES.get)
@pytest.mark.parametrize("n,k", [(16, 32), (37, 96), (1, 64), (96, 576), (40, 1536)])
def test_qlinear_kernel_equals_reference_bit_for_bit(qlinear_ops: CpuOps, qtype: int, n: int,
                                                     k: int) -> None:
    packed = pack(random_blocks(qtype, n, k, seed=n + k + qtype), qtype, k)
    g = torch.Generator().manual_seed(n * k + qtype)
    bias = torch.randn(n, generator=g)
    # every tile height of both kernels (AVX2 1 and 3, VNNI 1, 2 x 4 and 8) and their
    # leftovers, up past one pass
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64):
        x = torch.randn(m, k, generator=g) * 2
        for b in (None, bias):
            ours = qlinear_ops.qlinear(x, packed, n, b, wtype=qtype)
            assert torch.equal(ours, qlinear_reference(x, packed, qtype, n, b)), (m, b is None)


@pytest.mark.parametrize("qtype", NEW + [Q4_1], ids=TYPE_NAMES.get)
def test_qlinear_kernel_exact_at_the_extreme_quants(qlinear_ops: CpuOps, qtype: int) -> None:
    """Every weight quant at its largest stored value (15, or 31 with bit 4; IQ4_NL's
    largest value in magnitude, -127 at nibble 0) against activation quants all +127 or all
    -127: the largest int sums the kernels meet (the AVX2 kernel's int16 partial sums would
    wrap if widened too late), exactly d_w * d_x * isum."""
    k = 64
    raw = torch.zeros(16, k // 32, BLOCK_BYTES[qtype], dtype=torch.uint8)
    raw[..., 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # d = 1.0
    qh_at, qs_at = {Q4_0: (None, 2), Q4_1: (None, 4), Q5_0: (2, 6), Q5_1: (4, 8),
                    IQ4_NL: (None, 2)}[qtype]
    raw[..., qs_at:qs_at + 16] = 0x00 if qtype == IQ4_NL else 0xFF
    if qh_at is not None:
        raw[..., qh_at:qh_at + 4] = 0xFF
    packed = pack(raw.reshape(16, -1), qtype, k)
    x = torch.cat([torch.full((1, k), 0.5), torch.full((1, k), -0.5)])  # q = +-127, d = 0.5/127
    ours = qlinear_ops.qlinear(x, packed, 16, wtype=qtype)
    assert torch.equal(ours, qlinear_reference(x, packed, qtype, 16))
    top = {Q4_0: 7, Q4_1: 15, Q5_0: 15, Q5_1: 31, IQ4_NL: -127}[qtype]
    d_x = torch.tensor(0.5) / 127
    want = torch.tensor(float(top * 127 * 32)) * d_x + torch.tensor(float(top * 127 * 32)) * d_x
    assert torch.equal(ours[0], want.expand(16)) and torch.equal(ours[1], -want.expand(16))


@needs_kernels
def test_qlinear_is_batch_invariant_and_isa_invariant() -> None:
    ops, avx2 = CpuOps(), CpuOps(isa="avx2")
    for qtype in NEW:
        packed = pack(random_blocks(qtype, 72, 576, seed=3), qtype, 576)
        x = torch.randn(40, 576)
        alone = torch.cat([ops.qlinear(x[i:i + 1], packed, 72, wtype=qtype) for i in range(40)])
        assert torch.equal(ops.qlinear(x, packed, 72, wtype=qtype), alone)
        assert torch.equal(avx2.qlinear(x, packed, 72, wtype=qtype), alone)


@needs_kernels
def test_kernels_name_the_formats_they_read() -> None:
    """The packed kernels take all six block formats (and W8A8, Q8_0 records against
    per-token activations); the row kernels (ops.linear, gguf_exact) still only Q4_1 / Q8_0,
    and say so."""
    assert ROW_WTYPES == (0, 1, 30, Q4_1, Q8_0)  # F32, F16, BF16 and two block formats
    assert set(PACKED_WTYPES) == {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, W8A8, Q4_1_128}
    ops = CpuOps()
    raw = random_blocks(Q5_0, 20, 64, seed=7)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"wtype must be 0 \(F32\), 1 \(F16\), 3 \(Q4_1\), "
                                           r"8 \(Q8_0\) or 30 \(BF16\) for a weight read "
                                           r"as rows, got 6 \(Q4_0 / Q5_0 / "
                                           r"Q5_1 / IQ4_NL / W8A8 / Q4_1_128 run packed "
                                           r"only: qlinear\)"):
        ops._ext.linear(x, raw, Q5_0, None, False)
    with pytest.raises(RuntimeError, match="got 7"):
        ops._ext.dequantize(random_blocks(Q5_1, 4, 64), Q5_1, 64)
    # CpuOps routes a row weight of a packed-only format to the reference (dequantized)
    assert torch.equal(ops.linear(x, raw, wtype=Q5_0),
                       F.linear(x, ggml_blocks.dequantize(raw, Q5_0, 64)))
    packed = pack(raw, Q5_0, 64)
    with pytest.raises(RuntimeError, match="packed wtype 7 records take 384 bytes, the "
                                           "weight's have 352"):
        ops._ext.qlinear(x, packed, Q5_1, 20, None, False)
    with pytest.raises(RuntimeError, match=r"wtype must be 0 \(F32\), 1 \(F16\), 2 \(Q4_0\), "
                                           r"3 \(Q4_1\), 6 \(Q5_0\), 7 \(Q5_1\), 8 \(Q8_0\), "
                                           r"20 \(IQ4_NL\), 30 \(BF16\), 256 \(W8A8\) or "
                                           r"263 \(Q4_1_128\), got 5"):
        ops._ext.qlinear(x, packed, 5, 20, None, False)


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "amx"])  # no K-quants
def test_fused_layer_runs_the_packed_formats(isa: str) -> None:
    """A decoder layer whose linears are packed Q5_0 (qkv, with bias), Q4_0 (o), Q5_1
    (gate_up) and IQ4_NL (down): the fused C++ layer (llama_stack.cpp, quantized_linear) equals
    the Python layer on the same kernels bit for bit."""
    from kvserve.config import ModelConfig
    from kvserve.layers.rotary import rope_cos_sin
    from kvserve.models.llama import LlamaDecoderLayer
    from kvserve.quant.gguf import GGUFQuantMethod
    from kvserve.quant.gguf_weights import GGUFWeight
    from tests.helpers import paged_model_input

    if isa not in runnable_isas(amx=False):  # CpuOps(isa=) refuses an ISA the CPU lacks
        pytest.skip(f"needs a CPU with {isa} (and AVX2+FMA)")
    fused, plain = (CpuOps(isa=isa, fuse_layers=f) for f in (True, False))
    if isa == "avx512" and not fused._vnni:
        pytest.skip("needs an AVX-512 VNNI CPU")
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=96,
                      intermediate_size=160, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
                      attention_bias=True)
    g = torch.Generator().manual_seed(4)
    formats = {("self_attn", "qkv_proj"): Q5_0, ("self_attn", "o_proj"): Q4_0,
               ("mlp", "gate_up_proj"): Q5_1, ("mlp", "down_proj"): IQ4_NL}
    layers = [LlamaDecoderLayer(cfg, 0, o, torch.float32, GGUFQuantMethod())
              for o in (fused, plain)]
    for (part, name), qtype in formats.items():
        lins = [getattr(getattr(la, part), name) for la in layers]
        shards = [random_blocks(qtype, n, lins[0].in_features, seed=qtype + i)
                  for i, n in enumerate(lins[0].shard_sizes)]
        for lin in lins:  # loaded as the loader hands GGUF tensors over
            for i, raw in enumerate(shards):
                lin.load_shard("weight", i, GGUFWeight(raw, qtype, lin.in_features))
            lin.process_weights_after_loading()
            assert lin.weight.dim() == 3  # kept packed
    bias = torch.randn(layers[0].self_attn.qkv_proj.out_features, generator=g)
    for la in layers:
        la.self_attn.qkv_proj.bias.data.copy_(bias)
        for norm in (la.input_layernorm, la.post_attention_layernorm):
            norm.weight.data.copy_(torch.linspace(0.5, 1.5, cfg.hidden_size))
    cos_sin = rope_cos_sin(24, 64, 10000.0, None)
    tables = torch.tensor([[3, 7, 1, 0], [10, 2, 5, 0]], dtype=torch.int32)
    caches = [torch.zeros(1, 2, 12, 4, 2, 24) for _ in layers]
    for seq_lens, q_lens, with_residual in (([5, 9], [5, 9], False), ([6, 10], [1, 1], True)):
        inp = paged_model_input(tables, 4, seq_lens, q_lens)
        x = torch.randn(sum(q_lens), cfg.hidden_size, generator=g)
        residual = torch.randn(x.shape, generator=g) if with_residual else None
        out_f = fused.fused_llama_layer(layers[0], x, residual, inp, caches[0][0], cos_sin)
        assert out_f is not None  # the stack took every packed format
        out_p = layers[1](x, residual, inp, caches[1], cos_sin)
        for a, b in zip(out_f, out_p):
            assert torch.equal(a, b) and a.isfinite().all()
    assert torch.equal(caches[0], caches[1]) and caches[0].abs().sum() > 0
