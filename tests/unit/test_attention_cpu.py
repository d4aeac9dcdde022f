"""Parity of the CPU (AVX2/FMA) attention and K/V-cache kernels against ReferenceOps.

Tolerances (see test_ops_cpu.py for the other ops):
- paged_attention: outputs are softmax-weighted means of unit-normal V, |out| <~ 3; scores
  are reordered dot products (~1e-6) and our exp() is within ~2 ulp -> atol = rtol = 1e-5.
- write_kv does the reference's exact roundings, so it must match bit for bit.
- a float16 KV cache: the kernels widen each half exactly and run the float32 arithmetic, so
  attention on it equals attention on a float32 cache holding the same values bit for bit
  (and the reference within the float32 tolerance); write_kv rounds as torch's cast does.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.ops.cpu import CpuOps, cpu_has_avx2_fma
from kvserve.ops.reference import ReferenceOps
from tests.helpers import assert_close_exact_dtype as close

REF = ReferenceOps()

# ------------------------------------------------------------------------- paged_attention


def make_batch(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, d: int,
               block_size: int, seed: int) -> tuple:
    """Random cache with shuffled blocks (block 0 = null, never used) and a block table that
    scatters each request over non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(need) + 2, dtype=torch.int32)
    for b, nb in enumerate(need):
        tables[b, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    t = sum(q_lens)
    # q as a strided view, the way the model splits it off the fused qkv output.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, :heads * d].view(t, heads, d)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


ATTN_CASES = [
    # (q_lens, seq_lens): decodes (q_len 1), prefill chunks, block-boundary crossings
    ([1], [1]),
    ([1, 1, 1], [17, 16, 300]),
    ([40, 1, 7, 1], [40, 129, 50, 33]),
    ([5, 0, 1, 33], [20, 9, 2048, 33]),  # a request with no queries this step
    ([16, 17, 3], [16, 100, 3]),
]


@pytest.mark.parametrize("q_lens,seq_lens", ATTN_CASES)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_paged_attention_matches_reference(ops: CpuOps, q_lens: list[int], seq_lens: list[int],
                                           block_size: int, heads: int, kv_heads: int) -> None:
    d = 64
    q, cache, tables, sl, qsl = make_batch(q_lens, seq_lens, heads, kv_heads, d, block_size,
                                           seed=sum(seq_lens) + block_size + heads)
    args = (q, cache, tables, sl, qsl, d**-0.5, max(q_lens), max(seq_lens))
    close(ops.paged_attention(*args), REF.paged_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens,seq_lens", ATTN_CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_paged_attention_fp16_cache(ops: CpuOps, q_lens: list[int], seq_lens: list[int],
                                    heads: int, kv_heads: int) -> None:
    """A float16 cache: within float32 tolerance of the reference (which upcasts the cache),
    and bit for bit the output of a float32 cache holding the same values, on 1 to 3 threads
    (which split long decodes differently)."""
    d = 64
    q, cache, tables, sl, qsl = make_batch(q_lens, seq_lens, heads, kv_heads, d, 16,
                                           seed=sum(seq_lens) + heads)
    half = cache.half()
    args = (q, half, tables, sl, qsl, d**-0.5, max(q_lens), max(seq_lens))
    close(ops.paged_attention(*args), REF.paged_attention(*args), atol=1e-5, rtol=1e-5)
    as_f32 = (q, half.float()) + args[2:]
    for threads in (1, 2, 3):
        assert torch.equal(attention_on_threads(ops, args, threads),
                           attention_on_threads(ops, as_f32, threads)), threads


def attention_on_threads(ops: CpuOps, args: tuple, threads: int) -> torch.Tensor:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return ops.paged_attention(*args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_paged_attention_any_thread_count(ops: CpuOps, threads: int) -> None:
    # The kernel splits work by kv head only when requests are few per thread: both layouts.
    q, cache, tables, sl, qsl = make_batch([1, 1, 9, 1], [33, 64, 20, 5], 9, 3, 64, 4, seed=9)
    args = (q, cache, tables, sl, qsl, 0.125, 9, 64)
    close(attention_on_threads(ops, args, threads), REF.paged_attention(*args), atol=1e-5,
          rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("q_lens,seq_lens,heads,kv_heads", [
    ([1], [300], 9, 3),             # one decode row: its keys split into parts, per kv head
    ([1, 1], [700, 64], 4, 4),      # a long row split (all kv heads per part), a short one
    ([1, 5], [1000, 40], 6, 2),     # a split decode beside a prefill chunk (never split)
    ([17], [1000], 9, 3),           # the chunk's last query (qn = 1) is split too
])
def test_paged_attention_split_decode_matches_reference(ops: CpuOps, threads: int,
                                                        q_lens: list[int], seq_lens: list[int],
                                                        heads: int, kv_heads: int,
                                                        dtype: torch.dtype) -> None:
    """Few decode rows with long contexts are split along the keys across threads and their
    segments merged afterwards (flash-decoding); a split needs more than one thread."""
    q, cache, tables, sl, qsl = make_batch(q_lens, seq_lens, heads, kv_heads, 64, 16, seed=7)
    args = (q, cache.to(dtype), tables, sl, qsl, 0.125, max(q_lens), max(seq_lens))
    close(attention_on_threads(ops, args, threads), REF.paged_attention(*args), atol=1e-5,
          rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_row_is_batch_invariant(ops: CpuOps, dtype: torch.dtype) -> None:
    """A row's output depends on its own context only, bit for bit: alone on 1 or 2 threads
    (split across threads), beside 9 other decodes (not split), and as the last query of a
    prefill chunk. The engine's greedy batch invariance rests on this."""
    seq_len, hkv = 700, 3
    q, cache, tables, sl, qsl = make_batch([9], [seq_len], 9, hkv, 64, 16, seed=12)
    cache = cache.to(dtype)
    chunk = ops.paged_attention(q, cache, tables, sl, qsl, 0.125, 9, seq_len)
    last = q[-1:]  # the chunk's last query is a decode at position seq_len - 1
    one = (last, cache, tables[:1], sl[:1], torch.tensor([0, 1], dtype=torch.int32), 0.125,
           1, seq_len)
    alone2 = attention_on_threads(ops, one, 2)
    alone1 = attention_on_threads(ops, one, 1)
    others = make_batch([1] * 9, [100 + 37 * i for i in range(9)], 9, hkv, 64, 16, seed=13)
    # The row again, first of 10 decodes, its blocks appended to the others' cache.
    n_blocks = others[1].shape[1]
    cache10 = torch.cat([others[1].to(dtype), cache], dim=1)
    tables10 = torch.zeros(10, max(others[2].shape[1], tables.shape[1]), dtype=torch.int32)
    tables10[0, :tables.shape[1]] = tables[0] + n_blocks
    tables10[1:, :others[2].shape[1]] = others[2]
    sl10 = torch.cat([sl[:1], others[3]])
    qsl10 = torch.arange(11, dtype=torch.int32)
    batched = attention_on_threads(ops, (torch.cat([last, others[0]]), cache10, tables10, sl10,
                                         qsl10, 0.125, 1, seq_len), 2)
    for out in (alone2, alone1, batched[:1]):
        assert torch.equal(out, chunk[-1:])


@pytest.mark.parametrize("d", [16, 128])
def test_paged_attention_sharp_softmax_and_head_dims(ops: CpuOps, d: int) -> None:
    # scale 1 makes scores ~N(0, d): the running max moves often, exercising the rescale.
    q, cache, tables, sl, qsl = make_batch([1, 20], [70, 90], 6, 2, d, 16, seed=d)
    args = (q, cache, tables, sl, qsl, 1.0, 20, 90)
    close(ops.paged_attention(*args), REF.paged_attention(*args), atol=1e-5, rtol=1e-5)


def test_paged_attention_int64_metadata_and_odd_head_dim(ops: CpuOps) -> None:
    q, cache, tables, sl, qsl = make_batch([3, 1], [10, 37], 4, 2, 64, 4, seed=5)
    args = (q, cache, tables.long(), sl.long(), qsl.long(), 0.125, 3, 37)
    close(ops.paged_attention(*args), REF.paged_attention(*args), atol=1e-5, rtol=1e-5)
    q, cache, tables, sl, qsl = make_batch([2], [9], 2, 1, 12, 4, seed=6)  # D % 8: reference
    args = (q, cache, tables, sl, qsl, 0.3, 2, 9)
    close(ops.paged_attention(*args), REF.paged_attention(*args), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 13])
def test_write_kv_matches_reference(ops: CpuOps, dtype: torch.dtype, d: int) -> None:
    """float32 and float16 caches take the kernel (float16: round to nearest even, as the
    reference's cast), bfloat16 the reference; d = 13 runs the float16 scalar tail too."""
    g = torch.Generator().manual_seed(3)
    t, hkv = 7, 3
    kv = torch.randn(t, 2 * hkv * d, generator=g)
    key = kv[:, :hkv * d].view(t, hkv, d)  # strided views, as split from qkv
    value = kv[:, hkv * d:].view(t, hkv, d)
    slots = torch.tensor([5, -1, 17, 40, -1, 0, 63])
    mine = torch.randn(2, 4, 16, hkv, d, generator=g).to(dtype)
    ref = mine.clone()
    ops.write_kv(key, value, mine, slots)
    REF.write_kv(key, value, ref, slots)
    assert torch.equal(mine.view(torch.int16), ref.view(torch.int16))


def fp16_rounding_cases() -> torch.Tensor:
    """float32 values over every range a float -> half cast meets: random bit patterns (all
    exponents, float subnormals), exact ties between neighbouring halves and their float32
    neighbours (round half to even), half subnormals, the overflow threshold 65520, +-0, inf."""
    g = torch.Generator().manual_seed(16)
    bits = torch.randint(-2**31, 2**31, (4000,), generator=g, dtype=torch.int64)
    rnd = bits.to(torch.int32).view(torch.float32)
    rnd = rnd[~rnd.isnan()]
    halves = torch.randint(0, 0x7bff, (2000,), generator=g, dtype=torch.int16)  # finite, >= 0
    lo = halves.view(torch.float16).float()
    hi = (halves + 1).view(torch.float16).float()
    ties = (lo + hi) / 2  # exact in float32
    up, down = torch.full_like(ties, math.inf), torch.full_like(ties, -math.inf)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 65504.0, 65519.99, 65520.0, 65536.0,
                            2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 3 * 2.0**-25,
                            2.0**-14, 2.0**-14 * 0.99999, 1e-30, 1.5e-45])
    vals = torch.cat([rnd, ties, torch.nextafter(ties, up), torch.nextafter(ties, down),
                      special])
    return torch.cat([vals, -vals])


@pytest.mark.parametrize("d", [8, 5, 13])  # F16C lanes only, scalar only, both
def test_write_kv_fp16_rounds_as_torch(ops: CpuOps, d: int) -> None:
    vals = fp16_rounding_cases()
    t = -(-vals.numel() // d)
    key = torch.cat([vals, torch.zeros(t * d - vals.numel())]).view(t, 1, d)
    cache = torch.zeros(2, -(-t // 16), 16, 1, d, dtype=torch.float16)
    ops.write_kv(key, -key, cache, torch.arange(t))
    for i, src in enumerate((key, -key)):
        got = cache[i].reshape(-1, d)[:t].view(torch.int16)
        assert torch.equal(got, src.view(t, d).half().view(torch.int16)), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_layer_view_of_model_cache(ops: CpuOps, dtype: torch.dtype) -> None:
    full = torch.zeros(3, 2, 4, 4, 2, 8, dtype=dtype)
    ref = full.clone()
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    slots = torch.tensor([3, 9])
    ops.write_kv(key, value, full[1], slots)
    REF.write_kv(key, value, ref[1], slots)
    assert torch.equal(full, ref)


@pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2+FMA CPU")
def test_kv_cache_dtypes_route(ops: CpuOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and float16 caches go to the kernels, any other (bfloat16) to the reference."""
    used = []
    for name in ("paged_attention", "write_kv"):
        def spy(*args: object, _name: str = name, _f: object = getattr(REF, name)) -> object:
            used.append((_name, args[1 if _name == "paged_attention" else 2].dtype))
            return _f(*args)

        monkeypatch.setattr(ReferenceOps, name, staticmethod(spy))
    q, cache, tables, sl, qsl = make_batch([3, 1], [10, 37], 4, 2, 64, 4, seed=5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        c = cache.to(dtype)
        ops.write_kv(q[:, :2], q[:, 2:], c, torch.tensor([1, 2, 3, 5]))
        ops.paged_attention(q, c, tables, sl, qsl, 0.125, 3, 37)
    assert used == [("write_kv", torch.bfloat16), ("paged_attention", torch.bfloat16)]
