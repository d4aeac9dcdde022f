"""KVCacheManager: prefix hits, allocation, sharing and freeing, with exact block ids.

Pool of 10 blocks (block 0 is the null block, so 9 usable), block_size 4.
"""

from __future__ import annotations

import pytest

from kvserve.kv import block_pool as block_pool_mod
from kvserve.kv.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_full_blocks
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def make_manager(num_blocks: int = 10, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching), BS, enable_caching)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=16)


def ids(blocks: list[KVCacheBlock] | None) -> list[int]:
    assert blocks is not None
    return [b.block_id for b in blocks]


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def admit(m: KVCacheManager, req: Request) -> list[KVCacheBlock]:
    """What the scheduler does for a waiting request with an unlimited budget."""
    computed, num_computed = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_computed, computed)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    m.block_pool.check_integrity()
    return new


def test_fresh_allocation_registers_full_blocks_only() -> None:
    m = make_manager()
    req = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert m.get_computed_blocks(req) == ([], 0)
    assert ids(m.allocate_slots(req, 10)) == [1, 2, 3]
    blocks = m.req_to_blocks["a"]
    assert req.block_hashes == hash_full_blocks(list(range(10)), BS)
    assert [b.block_hash for b in blocks] == [req.block_hashes[0], req.block_hashes[1], None]
    assert m.num_cached_blocks["a"] == 2
    assert m.get_block_ids("a") == [1, 2, 3] and m.usage == pytest.approx(3 / 9)
    m.block_pool.check_integrity()


def test_shared_prefix_reuses_the_same_blocks() -> None:
    m = make_manager()
    a = make_request("a", list(range(10)))
    admit(m, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])  # shares 2 full blocks
    computed, n = m.get_computed_blocks(b)
    assert ids(computed) == [1, 2] and n == 8
    assert ids(m.allocate_slots(b, 3, computed)) == [4]
    assert m.get_block_ids("b") == [1, 2, 4]
    assert [blk.ref_cnt for blk in m.block_pool.blocks[1:5]] == [2, 2, 1, 1]
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10 + 11, 8)
    m.block_pool.check_integrity()

    m.free(a)  # shared blocks stay in use by b; only a's own block 3 is freed
    assert [blk.ref_cnt for blk in m.block_pool.blocks[1:5]] == [1, 1, 0, 1]
    assert free_ids(m) == [5, 6, 7, 8, 9, 3]
    m.free(b)  # tail first: 4, 2, 1
    assert free_ids(m) == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert m.req_to_blocks == {} and m.get_block_ids("b") == []
    m.block_pool.check_integrity()


def test_hit_on_freed_blocks_and_lru_eviction() -> None:
    m = make_manager()
    a = make_request("a", list(range(12)))  # 3 full blocks
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    # A request that takes 6 blocks evicts [4..9]: a's blocks are still cached.
    c = make_request("c", [100 + i for i in range(24)])
    assert ids(admit(m, c)) == [4, 5, 6, 7, 8, 9]
    b = make_request("b", list(range(12)) + [7])
    computed, n = m.get_computed_blocks(b)
    assert ids(computed) == [1, 2, 3] and n == 12
    # 4 blocks needed: 3 hits (free, so they leave the pool) + 1 new. Free: [3, 2, 1] only.
    assert m.allocate_slots(b, 1, computed) is None
    assert free_ids(m) == [3, 2, 1] and "b" not in m.req_to_blocks  # nothing changed
    m.block_pool.check_integrity()
    m.free(c)
    assert ids(m.allocate_slots(b, 1, computed)) == [9]  # c freed tail first: 9 is at the head
    assert m.get_block_ids("b") == [1, 2, 3, 9]
    assert free_ids(m) == [8, 7, 6, 5, 4]
    m.block_pool.check_integrity()


def test_last_token_is_always_computed() -> None:
    m = make_manager()
    a = make_request("a", list(range(8)))  # exactly 2 full blocks
    admit(m, a)
    same = make_request("same", list(range(8)))
    computed, n = m.get_computed_blocks(same)
    # A full hit would leave nothing to run; the last block is recomputed instead.
    assert ids(computed) == [1] and n == 4
    assert ids(m.allocate_slots(same, 4, computed)) == [3]
    assert m.get_block_ids("same") == [1, 3]
    # Block 3 holds the same prefix as block 2, which keeps the index entry.
    assert m.block_pool.blocks[3].block_hash is None
    longer = make_request("longer", list(range(9)))
    assert m.get_computed_blocks(longer)[1] == 8
    m.block_pool.check_integrity()


def test_decode_hashes_incrementally(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = block_pool_mod.hash_block_tokens

    def counting(parent: BlockHash | None, token_ids: object, extra_keys: object = None
                 ) -> BlockHash:
        calls.append(tuple(token_ids))  # type: ignore[arg-type]
        return real(parent, token_ids, extra_keys)  # type: ignore[arg-type]

    monkeypatch.setattr(block_pool_mod, "hash_block_tokens", counting)
    m = make_manager()
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(m, req)
    assert calls == [(1, 2, 3, 4)]
    for tok in range(7, 15):  # decode 8 tokens one at a time
        req.append_output_token(tok)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        m.block_pool.check_integrity()
    # Each block hashed exactly once, when it filled: no rehash of the prefix per step.
    assert calls == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    monkeypatch.undo()
    assert req.block_hashes == hash_full_blocks(req.all_token_ids, BS)
    assert m.get_block_ids("a") == [1, 2, 3, 4]
    assert m.num_cached_blocks["a"] == 3


def test_forced_hash_collision_gives_no_false_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    real = block_pool_mod.hash_block_tokens

    def colliding(parent: BlockHash | None, token_ids: object, extra_keys: object = None
                  ) -> BlockHash:
        h = real(parent, token_ids, extra_keys)  # type: ignore[arg-type]
        return h._replace(hash_value=42)  # every block collides

    monkeypatch.setattr(block_pool_mod, "hash_block_tokens", colliding)
    m = make_manager()
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(m, a)
    assert m.block_pool.blocks[1].block_hash.hash_value == 42  # type: ignore[union-attr]
    b = make_request("b", [9, 9, 9, 9, 5])
    assert m.get_computed_blocks(b) == ([], 0)
    assert ids(m.allocate_slots(b, 5)) == [3, 4]
    assert m.block_pool.blocks[3].block_hash is None  # not registered over block 1
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10, 0)
    m.block_pool.check_integrity()


def test_caching_disabled_never_hits() -> None:
    m = make_manager(enable_caching=False)
    a = make_request("a", list(range(10)))
    admit(m, a)
    b = make_request("b", list(range(10)))
    assert m.get_computed_blocks(b) == ([], 0)
    assert ids(m.allocate_slots(b, 10)) == [4, 5, 6]
    assert a.block_hashes == [] and m.prefix_cache_queries == 0
    m.block_pool.check_integrity()


def test_allocation_failure_changes_nothing() -> None:
    m = make_manager()
    a = make_request("a", list(range(30)))  # 8 blocks
    admit(m, a)
    b = make_request("b", [70] * 6)  # 2 blocks, 1 free
    assert m.allocate_slots(b, 6) is None
    assert free_ids(m) == [9] and m.get_block_ids("b") == []
    assert ids(m.allocate_slots(b, 3)) == [9]  # a smaller chunk fits
    # Growing a (30 -> 33 tokens) needs a 9th block: none left.
    a.append_output_token(1)
    a.append_output_token(2)
    a.append_output_token(3)
    assert m.allocate_slots(a, 2) is not None  # 32 tokens still fit in 8 blocks
    a.num_computed_tokens += 2
    assert m.allocate_slots(a, 1) is None
    assert len(m.req_to_blocks["a"]) == 8
    m.block_pool.check_integrity()
