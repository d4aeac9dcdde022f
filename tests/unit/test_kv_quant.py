"""KV cache quantization (int8 / fp8_e4m3, one float32 scale per token, K/V and kv head).

What is held, and to what:
- the oracle (reference.quantize_kv / dequantize_kv): int8 round trips within half a step
  (scale / 2), fp8 within half an e4m3 ulp, both scales amax / qmax exactly; fp8 bytes are
  torch's own .to(torch.float8_e4m3fn) cast, checked independently of quantize_kv's code;
- write_kv's kernel: the reference's bytes and scales bit for bit (fp8 also on every range
  an e4m3 cast meets: ties, subnormals, the 448 / 464 edges);
- paged_attention's kernel reads the quantized cache as stored: bit for bit its output on a
  float32 cache holding the dequantized values (the same fp32 arithmetic), and within the
  float32 tolerance of the reference (test_attention_cpu.py's), for several shapes, GQA,
  block sizes, thread counts, and all 254 finite e4m3 codes;
- the fused layer stack writes and reads the quantized cache as the per-op path does, bit
  for bit, on each ISA;
- sizing: a block's bytes count the scales; bad dtype names are refused naming the allowed.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.config import CacheConfig
from kvserve.kv.layout import (
    KV_CACHE_DTYPES,
    QuantizedKVCache,
    bytes_per_block,
    kv_elem_size,
)
from kvserve.ops.cpu import CpuOps, runnable_isas
from kvserve.ops.reference import ReferenceOps, dequantize_kv, quantize_kv
from kvserve.ops.torch_ops import TorchOps
from tests.helpers import assert_close_exact_dtype as close
from tests.helpers import paged_model_input
from tests.unit.test_attention_cpu import ATTN_CASES, attention_on_threads, make_batch

REF = ReferenceOps()
KINDS = ("int8", "fp8_e4m3")
DATA_DTYPE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}


def _isas() -> list[str]:
    return runnable_isas(amx=False) or ["avx2"]


@pytest.fixture(scope="module", params=_isas())
def isa_ops(request: pytest.FixtureRequest) -> CpuOps:
    o = CpuOps(isa=request.param)
    assert o.uses_kernels and o.isa == request.param
    return o


def rows(seed: int, n: int = 300, d: int = 64) -> torch.Tensor:
    """Rows of very different ranges, as K and V rows are: unit normal, tiny, huge, one loud
    channel on a quiet row (a K bias like Qwen2's), and an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[::7] *= 1e-3
    x[1::7] *= 300.0
    x[2::7, 5] = 400.0
    x[3] = 0.0
    return x


# ------------------------------------------------------------------------------- the oracle


def test_int8_round_trip_within_half_a_step() -> None:
    x = rows(1)
    q, scale = quantize_kv(x, "int8")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (300,)
    amax = x.abs().amax(-1)
    assert torch.equal(scale, amax / 127)  # amax / 127, one fp32 division
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    # The row's largest element lands on +-127 exactly; the zero row stays zero.
    assert torch.equal(q.abs().amax(-1)[amax > 0], torch.full_like(q[amax > 0, 0], 127))
    assert scale[3] == 0 and not q[3].any() and not dequantize_kv(q[3], scale[3]).any()
    err = (dequantize_kv(q, scale) - x).abs()
    # Half a step, plus the fp32 roundings of x / scale and q * scale (a few ulp of x).
    bound = scale.unsqueeze(-1) / 2 * (1 + 2**-20) + x.abs() * 2**-22
    assert (err <= bound).all(), (err - bound).max()
    assert (err > scale.unsqueeze(-1) / 4).any()  # the bound is not vacuous


def test_fp8_bytes_are_torchs_cast_and_round_trip_within_half_an_ulp() -> None:
    x = rows(2)
    q, scale = quantize_kv(x, "fp8_e4m3")
    assert q.dtype == torch.uint8 and torch.equal(scale, x.abs().amax(-1) / 448)
    # Independently of quantize_kv: divide each row by its scale, let torch cast.
    den = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    assert torch.equal(q, (x / den).to(torch.float8_e4m3fn).view(torch.uint8))
    assert not ((q & 0x7f) == 0x7f).any()  # no NaN code for finite rows
    y = dequantize_kv(q, scale)
    assert torch.equal(y, q.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1))
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; below 2^-6 (times
    # the scale) the subnormal step is 2^-9, half of it 2^-10.
    err = (y - x).abs()
    s = scale.unsqueeze(-1)
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 2**-18)
    assert (err <= bound).all(), (err - bound).max()


# ----------------------------------------------------------------------------- write_kv


def quantized_cache(kind: str, num_blocks: int, bs: int, hkv: int, d: int,
                    layers: int | None = None) -> QuantizedKVCache:
    lead = () if layers is None else (layers,)
    g = torch.Generator().manual_seed(11)
    # Garbage, not zeros, so a missed or misplaced write shows.
    data = torch.randint(0, 100, (*lead, 2, num_blocks, bs, hkv, d), generator=g).to(
        DATA_DTYPE[kind])
    return QuantizedKVCache(data, torch.rand((*lead, 2, num_blocks, bs, hkv), generator=g))


def clone(c: QuantizedKVCache) -> QuantizedKVCache:
    return QuantizedKVCache(c.data.clone(), c.scales.clone())


def same(a: QuantizedKVCache, b: QuantizedKVCache) -> bool:
    return torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.int32),
                                                       b.scales.view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [64, 128, 13])  # 13: the int8 vector path's scalar tail
def test_write_kv_kernel_bytes_equal_reference(isa_ops: CpuOps, kind: str, d: int) -> None:
    g = torch.Generator().manual_seed(d)
    t, hkv = 11, 3
    kv = torch.randn(t, 2 * hkv * d, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)
    kv[4, :hkv * d] = 0.0  # a token whose K rows are all zero
    kv[6, 2] = 1e4         # a loud channel
    key = kv[:, :hkv * d].view(t, hkv, d)  # strided views, as split from qkv
    value = kv[:, hkv * d:].view(t, hkv, d)
    slots = torch.tensor([5, -1, 17, 40, 1, 0, 63, -1, 22, 23, 2])
    mine = quantized_cache(kind, 4, 16, hkv, d)
    ref = clone(mine)
    isa_ops.write_kv(key, value, mine, slots)
    REF.write_kv(key, value, ref, slots)
    assert same(mine, ref)
    untouched = [s for s in range(64) if s not in slots.tolist()]
    fresh = quantized_cache(kind, 4, 16, hkv, d)
    assert torch.equal(mine.data[:, :].reshape(2, 64, hkv, d)[:, untouched],
                       fresh.data.reshape(2, 64, hkv, d)[:, untouched])


def fp8_cast_cases() -> torch.Tensor:
    """Values in [-448, 448] over every range an e4m3 cast meets: every finite code, the
    exact midpoints between neighbouring codes (ties to even), their float32 neighbours,
    the subnormals and below, and random floats."""
    codes = torch.arange(0, 0x7f, dtype=torch.uint8)  # 0 .. 448, no NaN
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2  # exact in float32
    g = torch.Generator().manual_seed(8)
    rnd = (torch.rand(3000, generator=g) * 2 - 1) * 448
    tiny = torch.rand(500, generator=g) * 2**-5
    special = torch.tensor([0.0, 2.0**-9, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-11, 1e-30, 1.5e-45,
                            2.0**-6, 2.0**-6 * 0.9999, 440.0, 447.99, 448.0])
    up, down = torch.full_like(mids, math.inf), torch.full_like(mids, -math.inf)
    out = torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), rnd,
                     tiny, special]).clamp(-448, 448)
    return torch.cat([out, -out])


def test_write_kv_fp8_encodes_as_torchs_cast(ops: CpuOps) -> None:
    """A row holding 448 has scale 448 / 448 = 1 exactly, so its other values are cast as
    they are: the kernel's round-to-nearest-even encoder against torch's cast, bit for bit."""
    vals = fp8_cast_cases()
    d = 16
    n = -(-vals.numel() // (d - 1))
    body = torch.cat([vals, torch.zeros(n * (d - 1) - vals.numel())]).view(n, d - 1)
    key = torch.cat([torch.full((n, 1), 448.0), body], dim=1).view(n, 1, d)
    cache = QuantizedKVCache(torch.zeros(2, -(-n // 16), 16, 1, d, dtype=torch.uint8),
                             torch.zeros(2, -(-n // 16), 16, 1))
    ops.write_kv(key, -key, cache, torch.arange(n))
    for i, src in enumerate((key, -key)):
        assert torch.equal(cache.scales[i].reshape(-1)[:n], torch.ones(n)), i
        got = cache.data[i].reshape(-1, d)[:n]
        assert torch.equal(got, src.view(n, d).to(torch.float8_e4m3fn).view(torch.uint8)), i


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_layer_view_of_model_cache(ops: CpuOps, kind: str) -> None:
    """Indexing the model's cache by layer gives that layer's data and scales: a write there
    touches nothing else."""
    full = quantized_cache(kind, 4, 4, 2, 8, layers=3)
    ref = clone(full)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    slots = torch.tensor([3, 9])
    ops.write_kv(key, value, full[1], slots)
    REF.write_kv(key, value, ref[1], slots)
    assert same(full, ref)
    assert not same(full, quantized_cache(kind, 4, 4, 2, 8, layers=3))


# ------------------------------------------------------------------------ paged_attention


def quantize_cache(cache: torch.Tensor, kind: str) -> QuantizedKVCache:
    return QuantizedKVCache(*quantize_kv(cache, kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("q_lens,seq_lens", ATTN_CASES)
@pytest.mark.parametrize("block_size", [16, 4, 1])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_paged_attention_reads_quantized_cache(ops: CpuOps, kind: str, q_lens: list[int],
                                               seq_lens: list[int], block_size: int,
                                               heads: int, kv_heads: int) -> None:
    d = 64
    q, cache, tables, sl, qsl = make_batch(q_lens, seq_lens, heads, kv_heads, d, block_size,
                                           seed=sum(seq_lens) + block_size + heads)
    qc = quantize_cache(cache, kind)
    meta = (tables, sl, qsl, d**-0.5, max(q_lens), max(seq_lens))
    mine = ops.paged_attention(q, qc, *meta)
    close(mine, REF.paged_attention(q, qc, *meta), atol=1e-5, rtol=1e-5)
    # Exact: the same arithmetic as on a float32 cache of the dequantized values.
    assert torch.equal(mine, ops.paged_attention(q, dequantize_kv(qc.data, qc.scales), *meta))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("q_lens,seq_lens,heads,kv_heads,d", [
    ([1], [300], 9, 3, 64),          # one decode row split across threads, per kv head
    ([1, 1], [700, 64], 4, 4, 128),  # a long row split with all kv heads per part
    ([1, 5], [1000, 40], 6, 2, 16),  # a split decode beside a prefill chunk
])
def test_paged_attention_quantized_split_decode(ops: CpuOps, kind: str, threads: int,
                                                q_lens: list[int], seq_lens: list[int],
                                                heads: int, kv_heads: int, d: int) -> None:
    q, cache, tables, sl, qsl = make_batch(q_lens, seq_lens, heads, kv_heads, d, 16, seed=7)
    qc = quantize_cache(cache, kind)
    args = (q, qc, tables, sl, qsl, 0.125, max(q_lens), max(seq_lens))
    mine = attention_on_threads(ops, args, threads)
    close(mine, REF.paged_attention(*args), atol=1e-5, rtol=1e-5)
    deq = (q, dequantize_kv(qc.data, qc.scales)) + args[2:]
    assert torch.equal(mine, attention_on_threads(ops, deq, threads))


def test_paged_attention_every_fp8_code(ops: CpuOps) -> None:
    """The kernel's 256-entry decode table against torch's float8_e4m3fn values: a cache of
    every finite code (both signs) under random scales."""
    q, cache, tables, sl, qsl = make_batch([3, 1], [254, 254], 4, 2, 64, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    finite = torch.tensor([c for c in range(256) if c & 0x7f != 0x7f], dtype=torch.uint8)
    assert finite.numel() == 254
    data = finite[torch.randint(0, 254, cache.shape, generator=g)]
    data.view(-1)[:254] = finite  # each code at least once
    qc = QuantizedKVCache(data, torch.rand(cache.shape[:-1], generator=g) / 448)
    args = (tables, sl, qsl, 0.125, 3, 254)
    mine = ops.paged_attention(q, qc, *args)
    decoded = data.view(torch.float8_e4m3fn).float() * qc.scales.unsqueeze(-1)
    assert torch.equal(mine, ops.paged_attention(q, decoded, *args))
    close(mine, REF.paged_attention(q, qc, *args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_backend_reads_quantized_cache(kind: str) -> None:
    q, cache, tables, sl, qsl = make_batch([40, 1, 7, 1], [40, 129, 50, 33], 9, 3, 64, 16,
                                           seed=5)
    qc = quantize_cache(cache, kind)
    args = (q, qc, tables, sl, qsl, 0.125, 40, 129)
    close(TorchOps().paged_attention(*args), REF.paged_attention(*args), atol=1e-5, rtol=1e-5)


def test_quantized_caches_route_to_the_kernels(ops: CpuOps,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 / fp8 caches go to the kernels, never to the reference; a quantized tensor
    without its scales is refused by the kernel, naming what is missing."""
    for name in ("paged_attention", "write_kv"):
        def fail(*args: object, _name: str = name) -> object:
            raise AssertionError(f"{_name} fell back to the reference")

        monkeypatch.setattr(ReferenceOps, name, staticmethod(fail))
    q, cache, tables, sl, qsl = make_batch([3, 1], [10, 37], 4, 2, 64, 4, seed=5)
    for kind in KINDS:
        qc = quantize_cache(cache, kind)
        ops.write_kv(q[:, :2], q[:, 2:], qc, torch.tensor([1, 2, 3, 5]))
        ops.paged_attention(q, qc, tables, sl, qsl, 0.125, 3, 37)
        with pytest.raises(RuntimeError, match="needs its kv_scales"):
            ops._ext.paged_attention(q, qc.data, tables, sl, qsl, 0.125)
        with pytest.raises(RuntimeError, match="kv_scales must be contiguous float32"):
            ops._ext.write_kv(q[:, :2], q[:, 2:], qc.data, torch.tensor([1, 2, 3, 5]),
                              qc.scales[:, :, :2])
    with pytest.raises(RuntimeError, match="kv_scales are for an int8 / fp8 kv_cache only"):
        ops._ext.paged_attention(q, cache, tables, sl, qsl, 0.125, qc.scales)


# ------------------------------------------------------------------------- fused stack


@pytest.mark.parametrize("kind", KINDS)
def test_fused_stack_equals_per_op_layers_on_quantized_cache(isa_ops: CpuOps,
                                                             kind: str) -> None:
    """The fused stack (two layers in one C++ call) writes and reads a quantized cache as the
    Python layers on the per-op kernels do: outputs, cache bytes and scales bit for bit, a
    prefill step then a decode beside a prefill chunk; and the result is within float
    tolerance of the float32-cache model (the quantization error is small)."""
    from kvserve.config import ModelConfig
    from kvserve.layers.rotary import rope_cos_sin
    from kvserve.models.llama import LlamaDecoderLayer

    plain = CpuOps(isa=isa_ops.isa, fuse_layers=False)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      attention_bias=True)
    g = torch.Generator().manual_seed(2)
    stacks = [torch.nn.ModuleList(LlamaDecoderLayer(cfg, i, o, torch.float32)
                                  for i in range(2)) for o in (isa_ops, plain)]
    for p_f, p_p in zip((p for la in stacks[0] for p in la.parameters()),
                        (p for la in stacks[1] for p in la.parameters())):
        w = torch.randn(p_f.shape, generator=g) / math.sqrt(p_f.shape[-1])
        p_f.data.copy_(w + 1 if p_f.dim() == 1 else w)
        p_p.data.copy_(p_f.data)
    cos_sin = rope_cos_sin(16, 64, 10000.0, None)
    bs = 4
    tables = torch.tensor([[3, 7, 1, 0], [10, 2, 5, 0]], dtype=torch.int32)
    shape = (2, 2, 12, bs, 2, 16)
    caches = [QuantizedKVCache(torch.zeros(shape, dtype=DATA_DTYPE[kind]),
                               torch.zeros(shape[:-1])) for _ in range(2)]

    float_cache = torch.zeros(shape)
    for seq_lens, q_lens in (([5, 9], [5, 9]), ([6, 12], [1, 3])):
        inp = paged_model_input(tables, bs, seq_lens, q_lens)
        x = torch.randn(sum(q_lens), 64, generator=g)
        fused = isa_ops.fused_llama_stack(stacks[0], x, inp, caches[0], cos_sin)
        assert fused is not None  # the fused stack took the quantized cache
        h, residual = x, None
        for layer in stacks[1]:
            h, residual = layer(h, residual, inp, caches[1], cos_sin)
        assert torch.equal(fused[0], h) and torch.equal(fused[1], residual)
        hf, rf = x, None
        for layer in stacks[1]:
            hf, rf = layer(hf, rf, inp, float_cache, cos_sin)
        close(h, hf, atol=0.1, rtol=0.1)
    assert same(caches[0], caches[1]) and caches[0].scales.abs().sum() > 0


# ------------------------------------------------------------------- config and sizing


def test_bad_kv_cache_dtype_is_refused_naming_the_allowed() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, "
                                         r"float16, bfloat16, int8, fp8_e4m3 \(fp8: fp8_e4m3\), "
                                         r"got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")
    for name in KV_CACHE_DTYPES:
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's name


def test_cli_offers_the_kv_cache_dtypes() -> None:
    import argparse

    from kvserve.engine_args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert EngineArgs.from_cli(ns).kv_cache_dtype == "fp8_e4m3"
    ns = p.parse_args(["--kv-cache-dtype", "fp8"])  # vLLM's spelling
    assert CacheConfig(kv_cache_dtype=EngineArgs.from_cli(ns).kv_cache_dtype).kv_cache_dtype \
        == "fp8_e4m3"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp8_e5m2"])


def test_block_bytes_count_the_scales() -> None:
    # The default model: 30 layers, 3 kv heads of 64. A token costs 30 * 2 * 3 * (64 + 4)
    # bytes in int8 / fp8 against 30 * 2 * 3 * 128 in float16: 1.88x the tokens.
    f16 = bytes_per_block(30, 16, 3, 64, kv_elem_size("float16"))
    q8 = bytes_per_block(30, 16, 3, 64, kv_elem_size("int8"), 4)
    assert (f16, q8) == (16 * 30 * 2 * 3 * 128, 16 * 30 * 2 * 3 * 68)
    assert f16 / q8 == pytest.approx(1.882, abs=1e-3)


@pytest.mark.parametrize("kind,per_token", [("float16", 23040), ("int8", 12240),
                                            ("fp8_e4m3", 12240), ("float32", 46080)])
def test_num_kv_blocks_from_memory(kind: str, per_token: int) -> None:
    """LLMEngine.num_kv_blocks divides the budget by a block's bytes, scales included (the
    default model's shape: 30 layers, 3 kv heads of 64)."""
    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.llm_engine import LLMEngine

    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
    budget = 64 << 20
    cfg = EngineConfig(model="m", model_config=mc,
                       cache=CacheConfig(kv_cache_memory=budget, kv_cache_dtype=kind))
    assert LLMEngine.num_kv_blocks(cfg) == budget // (16 * per_token)
