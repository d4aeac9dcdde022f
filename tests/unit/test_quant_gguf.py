"""GGUF Q4_1 / Q8_0 weights run as stored (kvserve/quant/gguf.py, ops/csrc/linear*.cpp).

References: gguf-py's own dequantize (the format's reference implementation) for our torch
dequantize, and the float32 kernel on the dequantized weights for the block kernels, which
must match it bit for bit (the same floats in the same FMA order), on every ISA.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.linear import Linear
from kvserve.ops.cpu import ISAS, CpuOps, cpu_has_avx2_fma, runnable_isas
from kvserve.ops.reference import ReferenceOps
from kvserve.quant.block_pack import (
    BLOCK_BYTES,
    Q4_1,
    Q8_0,
    check_packed,
    pack,
    qlinear_reference,
    quantize_activations,
    unpack,
)
from kvserve.quant.gguf import GGUFLinearMethod
from kvserve.quant.gguf_weights import GGUFWeight, dequantize

needs_kernels = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2+FMA CPU")


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of k weights: random quants, realistic fp16 scales (and mins) of both signs."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    raw = rng.integers(0, 256, size=(n, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    raw[..., 0:2] = (rng.standard_normal((n, nb)) * 0.02).astype(np.float16).view(
        np.uint8).reshape(n, nb, 2)
    if qtype == Q4_1:
        raw[..., 2:4] = (rng.standard_normal((n, nb)) * 0.1).astype(np.float16).view(
            np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(raw.reshape(n, -1))


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_dequantize_equals_gguf_py(qtype: int) -> None:
    raw = random_blocks(qtype, 37, 96, seed=qtype)
    ref = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
    ours = dequantize(raw, qtype, 96)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, np.float32)))


@pytest.fixture(scope="module", params=[i for i in ISAS if i != "amx"])  # no K-quants
def isa_ops(request: pytest.FixtureRequest) -> CpuOps:
    if request.param not in runnable_isas():
        pytest.skip(f"needs a CPU with {request.param}")
    return CpuOps(isa=request.param)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("n,k", [(96, 576), (37, 1536), (16, 32)])
def test_block_kernel_equals_float_kernel_bit_for_bit(isa_ops: CpuOps, qtype: int, n: int,
                                                      k: int) -> None:
    raw = random_blocks(qtype, n, k, seed=n + k)
    floats = dequantize(raw, qtype, k)
    assert torch.equal(isa_ops._ext.dequantize(raw, qtype, k), floats)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(k)
    # 1: the M == 1 tile; then tiles that dequantize blocks in registers (AVX-512 up to 12
    # rows, AVX2 up to 6), and past that a weight tile dequantized once into scratch;
    # leftover rows (N % tile) in each.
    for m in (1, 2, 3, 5, 6, 7, 8, 12, 13, 31, 100):
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            ours = isa_ops._ext.linear(x, raw, qtype, b, isa_ops._avx512)
            assert torch.equal(ours, isa_ops._ext.linear(x, floats, 0, b, isa_ops._avx512)), m
            torch.testing.assert_close(ours, F.linear(x, floats, b), rtol=1e-4, atol=1e-4)


@needs_kernels
def test_block_kernel_is_batch_invariant() -> None:
    ops = CpuOps()
    raw = random_blocks(Q4_1, 64, 576, seed=3)
    x = torch.randn(40, 576)
    alone = torch.cat([ops.linear(x[i:i + 1], raw, wtype=Q4_1) for i in range(40)])
    assert torch.equal(ops.linear(x, raw, wtype=Q4_1), alone)


@needs_kernels
def test_large_m_goes_through_dequantized_gemm() -> None:
    ops = CpuOps()
    raw = random_blocks(Q8_0, 24, 64, seed=4)
    x = torch.randn(ops.small_m + 3, 64)
    torch.testing.assert_close(ops.linear(x, raw, wtype=Q8_0),
                               F.linear(x, dequantize(raw, Q8_0, 64)), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_kernel_takes_the_named_format_and_checks_its_rows() -> None:
    ops = CpuOps()
    x, q8 = torch.randn(1, 64), random_blocks(Q8_0, 4, 64)
    with pytest.raises(RuntimeError, match="wtype 3 rows of K=64 weights take 40 bytes, the "
                                           "weight has 68"):
        ops._ext.linear(x, q8, Q4_1, None, False)  # Q8_0 bytes named Q4_1
    with pytest.raises(RuntimeError,
                       match=r"wtype must be 0 \(F32\), 1 \(F16\), 3 \(Q4_1\), 8 \(Q8_0\) or 30"):
        ops._ext.linear(x, q8, 2, None, False)  # Q4_0: packed only (test_qlinear_q5.py)
    with pytest.raises(RuntimeError, match=r"for a weight read as rows, got 256"):
        ops._ext.linear(x, q8, 256, None, False)  # W8A8: packed only
    with pytest.raises(RuntimeError, match="must be uint8 GGUF blocks"):
        ops._ext.linear(x, torch.randn(4, 64), Q8_0, None, False)
    with pytest.raises(RuntimeError, match="must be float32"):
        ops._ext.linear(x, q8, 0, None, False)
    with pytest.raises(RuntimeError, match="K % 32"):
        ops._ext.linear(torch.randn(1, 48), torch.zeros(4, 30, dtype=torch.uint8), Q4_1, None,
                        False)
    with pytest.raises(RuntimeError, match="wtype 8"):
        ops._ext.dequantize(q8, Q8_0, 96)


def test_reference_linear_dequantizes_blocks() -> None:
    raw = random_blocks(Q4_1, 8, 64, seed=5)
    x = torch.randn(3, 64)
    assert torch.equal(ReferenceOps.linear(x, raw, wtype=Q4_1),
                       F.linear(x, dequantize(raw, Q4_1, 64)))


def _linear(shards: tuple[int, ...], int8_activations: bool = False) -> Linear:
    return Linear(64, sum(shards), bias=False, ops=ReferenceOps(), dtype=torch.float32,
                  shard_sizes=shards,
                  quant_method=GGUFLinearMethod(int8_activations=int8_activations))


def test_linear_method_stacks_shards_of_one_format() -> None:
    lin = _linear((8, 4, 4))
    parts = [random_blocks(Q4_1, n, 64, seed=i) for i, n in enumerate((8, 4, 4))]
    for i, p in enumerate(parts):
        lin.load_shard("weight", i, GGUFWeight(p, Q4_1, 64))
    lin.process_weights_after_loading()
    assert lin.weight.dtype == torch.uint8 and torch.equal(lin.weight, torch.cat(parts))
    assert [p.wtype for p in lin.quant_method.kernel_weights(lin)] == [Q4_1]  # told the format
    x = torch.randn(2, 64)
    ref = F.linear(x, torch.cat([dequantize(p, Q4_1, 64) for p in parts]))
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)


def test_linear_method_dequantizes_mixed_formats_and_floats() -> None:
    lin = _linear((8, 4, 4))
    q4, q8, f = random_blocks(Q4_1, 8, 64), random_blocks(Q8_0, 4, 64), torch.randn(4, 64)
    lin.load_shard("weight", 0, GGUFWeight(q4, Q4_1, 64))
    lin.load_shard("weight", 1, GGUFWeight(q8, Q8_0, 64))
    lin.load_shard("weight", 2, f)
    lin.process_weights_after_loading()
    assert lin.weight.dtype == torch.float32
    assert [p.wtype for p in lin.quant_method.kernel_weights(lin)] == [0]
    assert torch.equal(lin.weight, torch.cat([dequantize(q4, Q4_1, 64),
                                              dequantize(q8, Q8_0, 64), f]))
    with pytest.raises(ValueError, match="does not fit shard 1"):
        lin.load_shard("weight", 1, GGUFWeight(q8[:3], Q8_0, 64))


# --- int8 activations on packed weights (quantization "gguf", ops/csrc/qlinear*.cpp) ---
#
# References: an independent numpy transcription of llama.cpp's activation quantization
# (its AVX path: d = amax / 127, q = round-half-even(x * (127 / amax))); dequantize() (tested
# against gguf-py above) for what pack/unpack must preserve; and qlinear_reference, the
# torch oracle the kernels must equal bit for bit on every ISA.


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("n", [16, 37, 96])
def test_pack_keeps_every_weight_and_scale(qtype: int, n: int) -> None:
    raw = random_blocks(qtype, n, 96, seed=n)
    packed = pack(raw, qtype, 96)
    assert packed.shape == (-(-n // 16), 3, 16 * BLOCK_BYTES[qtype])
    assert packed.numel() == -(-n // 16) * 16 * raw.shape[1]  # the same bytes, padded rows aside
    q, d, m = unpack(packed, qtype)
    weights = d[..., None] * q.float() + (m[..., None] if m is not None else 0)
    assert torch.equal(weights[:n].reshape(n, 96), dequantize(raw, qtype, 96))
    assert not q[n:].any() and not d[n:].any()  # padding rows are zero blocks


def test_a_packed_weight_must_be_of_the_named_format() -> None:
    packed = pack(random_blocks(Q8_0, 16, 64), Q8_0, 64)
    with pytest.raises(ValueError, match=r"packed Q4_1 weights are uint8 \[groups, K / 32, "
                                         r"320\], got torch.uint8 \(1, 2, 544\)"):
        check_packed(packed, Q4_1)
    with pytest.raises(ValueError, match="qtype must be one of"):
        unpack(packed, 12)  # Q4_K: packed by kquant_pack.py, not here


def _llama_cpp_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_1 (AVX path) on one row, in numpy float32."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(blocks * inv[:, None]).astype(np.int8).reshape(-1), amax / np.float32(127)


@needs_kernels
def test_activation_quantization_is_llama_cpps() -> None:
    ops = CpuOps()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 576, generator=g) * 4
    x[0, :32] = 0  # an all-zero block: d = 0, q = 0
    x[1, :32] = torch.arange(32) - 15.5  # halves: x * 127 / amax lands on .5 ties
    ours = ops._ext.quantize_acts(x)
    ref = quantize_activations(x)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    for i in range(9):
        q, d = _llama_cpp_q8(x[i].numpy())
        assert np.array_equal(ref[0][i].numpy(), q) and np.array_equal(ref[1][i].numpy(), d)
    assert int(ref[0].abs().max()) == 127
    assert torch.equal(ref[3], ref[0].reshape(9, -1, 32).sum(-1, dtype=torch.int32))
    assert torch.equal(ref[2], ref[1] * ref[3].float())


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 96), (96, 576), (960, 576), (40, 1536)])
def test_qlinear_kernel_equals_reference_bit_for_bit(qlinear_ops: CpuOps, qtype: int, n: int,
                                                     k: int) -> None:
    packed = pack(random_blocks(qtype, n, k, seed=n + k), qtype, k)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(n * k)
    # every tile height of both kernels and their leftovers, and a prefill-sized M
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 17, 300):
        x = torch.randn(m, k, generator=g) * 2
        for b in (None, bias):
            ours = qlinear_ops.qlinear(x, packed, n, b, wtype=qtype)
            assert torch.equal(ours, qlinear_reference(x, packed, qtype, n, b)), (m, b is None)


@needs_kernels
def test_qlinear_is_batch_invariant_and_isa_invariant() -> None:
    """The int sums are exact and the float steps fixed, so a row's output is the same bits
    alone, in any batch, and on either ISA."""
    ops, avx2 = CpuOps(), CpuOps(isa="avx2")
    packed = pack(random_blocks(Q4_1, 64, 576, seed=3), Q4_1, 576)
    x = torch.randn(40, 576)
    alone = torch.cat([ops.qlinear(x[i:i + 1], packed, 64, wtype=Q4_1) for i in range(40)])
    assert torch.equal(ops.qlinear(x, packed, 64, wtype=Q4_1), alone)
    assert torch.equal(avx2.qlinear(x, packed, 64, wtype=Q4_1), alone)
    assert torch.equal(ReferenceOps.qlinear(x, packed, 64, wtype=Q4_1), alone)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_qlinear_is_close_to_the_float_linear(qtype: int) -> None:
    """What int8 activations cost: ~1% of the output's scale against float32 activations."""
    raw = random_blocks(qtype, 64, 576, seed=6)
    x = torch.randn(8, 576)
    ref = F.linear(x, dequantize(raw, qtype, 576))
    err = (qlinear_reference(x, pack(raw, qtype, 576), qtype, 64) - ref).abs().max()
    assert err < 0.02 * ref.abs().max(), err


@needs_kernels
def test_qlinear_rejects_bad_shapes() -> None:
    ext = CpuOps()._ext
    packed = pack(random_blocks(Q8_0, 20, 64, seed=7), Q8_0, 64)
    with pytest.raises(RuntimeError, match="K = 64"):
        ext.qlinear(torch.randn(1, 96), packed, Q8_0, 20, None, False)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        ext.qlinear(torch.randn(1, 64, dtype=torch.float64), packed, Q8_0, 20, None, False)
    with pytest.raises(RuntimeError, match="contiguous in its last dimension"):
        ext.qlinear(torch.randn(1, 128)[:, ::2], packed, Q8_0, 20, None, False)
    with pytest.raises(RuntimeError, match="does not fit"):
        ext.qlinear(torch.randn(1, 64), packed, Q8_0, 33, None, False)
    with pytest.raises(RuntimeError, match="packed wtype 3 records take 320 bytes, the "
                                           "weight's have 544"):
        ext.qlinear(torch.randn(1, 64), packed, Q4_1, 20, None, False)
    with pytest.raises(RuntimeError, match="needs a block format"):
        ext.qlinear(torch.randn(1, 64), packed, 0, 20, None, False)


def test_linear_method_packs_for_int8_activations() -> None:
    lin = _linear((8, 4, 4), int8_activations=True)
    parts = [random_blocks(Q8_0, n, 64, seed=i) for i, n in enumerate((8, 4, 4))]
    for i, p in enumerate(parts):
        lin.load_shard("weight", i, GGUFWeight(p, Q8_0, 64))
    lin.process_weights_after_loading()
    assert torch.equal(lin.weight, pack(torch.cat(parts), Q8_0, 64))
    x = torch.randn(2, 64)
    assert [p.wtype for p in lin.quant_method.kernel_weights(lin)] == [Q8_0]
    assert torch.equal(lin(x), qlinear_reference(x, lin.weight, Q8_0, 16))


def test_narrow_cuts_tensor_parallel_shards_as_stored() -> None:
    """Rows and whole-block columns as stored (bit for bit the slice of the dequantized
    matrix); columns that cut a K-quant super-block requantized to Q8_0 (32-weight blocks),
    within Q8_0's rounding of the slice; a cut inside a 32-weight block refused (None)."""
    from kvserve.quant.ggml_kquants import Q4_K
    from tests.unit.test_kquant_kernels import random_blocks as kquant_blocks

    w = GGUFWeight(random_blocks(Q4_1, 8, 192, seed=3), Q4_1, 192)
    full = w.dequantize()
    rows = w.narrow(0, 2, 4)
    cols = w.narrow(1, 64, 64)
    assert rows is not None and torch.equal(rows.dequantize(), full[2:6])
    assert cols is not None and cols.qtype == Q4_1 and torch.equal(cols.dequantize(),
                                                                      full[:, 64:128])
    assert w.narrow(1, 16, 32) is None
    q4k = GGUFWeight(kquant_blocks(Q4_K, 4, 512, seed=5), Q4_K, 512)
    whole = q4k.narrow(1, 256, 256)
    assert whole is not None and whole.qtype == Q4_K
    assert torch.equal(whole.dequantize(), q4k.dequantize()[:, 256:])
    cut = q4k.narrow(1, 0, 224)  # 224: no multiple of 256
    assert cut is not None and cut.qtype == Q8_0 and cut.k == 224
    want = q4k.dequantize()[:, :224]
    step = want.reshape(4, -1, 32).abs().amax(-1, keepdim=True) / 127  # Q8_0's d per block
    err = (cut.dequantize().reshape(4, -1, 32) - want.reshape(4, -1, 32)).abs()
    assert (err <= step * 0.6 + 1e-6).all()  # half a step, and d stored as float16
