"""Parity of the torch backend's batched paged attention against ReferenceOps (the oracle),
on the CPU here; tests/cuda/ runs the same backend on a GPU.

Tolerance: both sides are float32 softmax-weighted means of unit-normal values; they differ
only in summation order (one padded SDPA against one einsum per request), ~1e-6.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.ops import get_ops
from kvserve.ops.reference import ReferenceOps
from kvserve.ops.torch_ops import TorchOps
from tests.unit.test_attention_cpu import ATTN_CASES, make_batch

REF = ReferenceOps()
OPS = TorchOps()


@pytest.mark.parametrize("q_lens,seq_lens", ATTN_CASES)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_paged_attention_matches_reference(q_lens: list[int], seq_lens: list[int],
                                           block_size: int, heads: int, kv_heads: int) -> None:
    d = 64
    q, cache, tables, sl, qsl = make_batch(q_lens, seq_lens, heads, kv_heads, d, block_size,
                                           seed=sum(seq_lens) + block_size + heads)
    args = (q, cache, tables, sl, qsl, d**-0.5, max(q_lens), max(seq_lens))
    torch.testing.assert_close(OPS.paged_attention(*args), REF.paged_attention(*args),
                               atol=1e-5, rtol=1e-5)


def test_paged_attention_ignores_stale_blocks_and_null_padding() -> None:
    """Keys past seq_len (stale data in a partly filled block, the null block behind padded
    table entries) must get zero weight: poison them with huge values and compare."""
    q, cache, tables, sl, qsl = make_batch([3, 1], [6, 9], 4, 2, 32, 4, seed=11)
    cache[:, 0] = 1e4  # the null block, which padded table entries point at
    for b, n in enumerate(sl.tolist()):
        last = int(tables[b, (n - 1) // 4])
        cache[:, last, n % 4 or 4:] = 1e4  # slots after the last token of the last block
    args = (q, cache, tables, sl, qsl, 0.125, 3, 9)
    out = OPS.paged_attention(*args)
    assert out.abs().max() < 10
    torch.testing.assert_close(out, REF.paged_attention(*args), atol=1e-5, rtol=1e-5)


def test_paged_attention_bfloat16_tracks_float32() -> None:
    q, cache, tables, sl, qsl = make_batch([5, 1, 1], [12, 40, 7], 6, 2, 64, 16, seed=3)
    args32 = (q, cache, tables, sl, qsl, 0.125, 5, 40)
    args16 = (q.bfloat16(), cache.bfloat16(), tables, sl, qsl, 0.125, 5, 40)
    out = OPS.paged_attention(*args16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), REF.paged_attention(*args32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_write_kv_matches_reference_bit_for_bit(kv: str) -> None:
    """The torch backend writes every row (no host-side mask, so a CUDA graph can hold it);
    a slot -1 row must still change nothing, the null block included."""
    from kvserve.kv.layout import QuantizedKVCache

    g = torch.Generator().manual_seed(5)
    nb, bs, hkv, d = 6, 4, 2, 8
    data = torch.randn(2, nb, bs, hkv, d, generator=g)
    if kv == "int8":
        init = [data.mul(40).round().clamp(-127, 127).to(torch.int8), torch.rand(2, nb, bs, hkv)]
    elif kv == "fp8_e4m3":
        init = [data.to(torch.float8_e4m3fn).view(torch.uint8), torch.rand(2, nb, bs, hkv)]
    else:
        init = [data.to(getattr(torch, kv)).view(torch.uint8 if kv == "bfloat16" else data.dtype)]

    def cache(bufs: list[torch.Tensor]) -> torch.Tensor | QuantizedKVCache:
        if len(bufs) == 2:
            return QuantizedKVCache(*bufs)
        return bufs[0].view(torch.bfloat16) if kv == "bfloat16" else bufs[0]

    ref, ours = [t.clone() for t in init], [t.clone() for t in init]
    key, value = torch.randn(2, 7, hkv, d, generator=g)
    slots = torch.tensor([-1, 5, 9, -1, 23, 4, -1])  # none in null block 0 (slots 0..3)
    REF.write_kv(key, value, cache(ref), slots)
    OPS.write_kv(key, value, cache(ours), slots)
    for r, o, i in zip(ref, ours, init, strict=True):
        assert torch.equal(r, o)
        assert not torch.equal(r, i)  # the four real rows did land
        assert torch.equal(r[:, 0], i[:, 0])  # the null block is as it was


def test_auto_picks_torch_off_the_cpu() -> None:
    assert get_ops("auto", device="cuda").name == "torch"
    assert get_ops("torch").name == "torch"
