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


def test_auto_picks_torch_off_the_cpu() -> None:
    assert get_ops("auto", device="cuda").name == "torch"
    assert get_ops("torch").name == "torch"
