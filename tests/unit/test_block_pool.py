"""BlockPool, FreeBlockQueue and block hashing: exact block ids and free-queue order."""

from __future__ import annotations

import pytest

from kvserve.kv.block_pool import (
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_full_blocks,
)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def chain(token_blocks: list[list[int]]) -> list[BlockHash]:
    out: list[BlockHash] = []
    for toks in token_blocks:
        out.append(hash_block_tokens(out[-1] if out else None, toks))
    return out


# -- hashing ------------------------------------------------------------------------------


def test_hash_is_chained_and_deterministic() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert a.token_ids == (1, 2, 3, 4) and a.parent_hash_value is None
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b.parent_hash_value == a.hash_value
    # Same tokens under another parent: another prefix, another hash.
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(other_parent, [5, 6, 7, 8]).hash_value != b.hash_value
    assert hash_block_tokens(None, [5, 6, 7, 8]).hash_value != b.hash_value
    # Extra keys (e.g. a LoRA id) separate otherwise equal prefixes.
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 1)).hash_value != a.hash_value
    # A stable 256-bit value, not Python's per-process hash().
    assert 0 <= a.hash_value < 2**256


def test_hash_full_blocks_skips_partial_block_and_is_incremental() -> None:
    tokens = list(range(11))  # 2 full blocks of 4 + 3 tokens
    hashes = hash_full_blocks(tokens, 4)
    assert hashes == chain([[0, 1, 2, 3], [4, 5, 6, 7]])
    more = tokens + [11]
    # Continuing from block 2 with the previous hash gives the same chain as starting over.
    tail = hash_full_blocks(more[8:], 4, parent=hashes[-1])
    assert hashes + tail == hash_full_blocks(more, 4)
    # Or, without slicing: hash from block 2 on.
    assert hash_full_blocks(more, 4, parent=hashes[-1], start_block=2) == tail
    assert hash_full_blocks([1, 2, 3], 4) == []


# -- free queue ---------------------------------------------------------------------------


def test_free_queue_o1_ops() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert blocks[2] not in q and blocks[3] in q
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(KVCacheBlock(99))
    for _ in range(5):
        q.popleft()
    assert len(q) == 0
    with pytest.raises(ValueError, match="empty"):
        q.popleft()


# -- pool ---------------------------------------------------------------------------------


def test_initial_state_and_null_block() -> None:
    pool = BlockPool(10)
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9]  # block 0 is the null block
    assert pool.get_num_free_blocks() == 9 and pool.usage == 0.0
    pool.check_integrity()
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)


def test_get_new_blocks_and_lru_free_order() -> None:
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [1, 2, 3] and ids(b) == [4, 5]
    assert all(x.ref_cnt == 1 for x in a + b)
    assert free_ids(pool) == [6, 7, 8, 9]
    assert pool.usage == pytest.approx(5 / 9)
    pool.check_integrity()

    pool.free_blocks(reversed(a))  # a request frees tail first
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1]
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    pool.check_integrity()
    # Eviction reuses blocks least recently freed first.
    assert ids(pool.get_new_blocks(6)) == [6, 7, 8, 9, 3, 2]
    assert free_ids(pool) == [1, 5, 4]
    pool.check_integrity()
    with pytest.raises(ValueError, match="cannot allocate 4 blocks, only 3 free"):
        pool.get_new_blocks(4)


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    [blk] = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free_blocks([blk])


def test_cached_blocks_survive_free_until_evicted() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    hashes = chain([[1, 2, 3, 4], [5, 6, 7, 8]])
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert blocks[0].block_hash == hashes[0] and blocks[2].block_hash is None
    pool.check_integrity()

    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    # Free but still hashed: a later request can revive them.
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    pool.check_integrity()

    # Allocating 4 blocks pops [4, 5, 3, 2]: block 2 (hashes[1]) is evicted lazily now.
    assert ids(pool.get_new_blocks(4)) == [4, 5, 3, 2]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.check_integrity()


def test_touch_takes_free_block_out_of_queue_and_shares_refs() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)  # [1, 2]
    pool.cache_full_blocks(blocks, chain([[1, 1, 1, 1], [2, 2, 2, 2]]), 0, 2)
    pool.touch(blocks)  # a second request shares both
    assert [b.ref_cnt for b in blocks] == [2, 2]
    pool.free_blocks(reversed(blocks))
    assert [b.ref_cnt for b in blocks] == [1, 1] and free_ids(pool) == [3, 4, 5]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    pool.check_integrity()
    pool.touch([blocks[1]])  # a hit on a free block removes it from the middle of the queue
    assert blocks[1].ref_cnt == 1 and free_ids(pool) == [3, 4, 5, 1]
    assert blocks[1].block_hash is not None  # the hit keeps its hash
    pool.check_integrity()


def test_block_states_picture_the_pool() -> None:
    pool = BlockPool(8)
    assert pool.block_states() == "nfffffff"
    a = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.cache_full_blocks(a, chain([[1, 1, 1, 1], [2, 2, 2, 2]]), 0, 2)
    pool.touch(a[:1])  # a second request shares block 1
    assert pool.block_states() == "nsuuffff"
    pool.free_blocks(reversed(a))  # block 1 still held by the second request
    assert pool.block_states() == "nucfffff"
    pool.free_blocks(a[:1])
    assert pool.block_states() == "nccfffff"
    # Free blocks are popped in LRU order [4..7, 3, 2]: block 2 loses its hash when reused.
    pool.get_new_blocks(6)
    assert pool.block_states() == "ncuuuuuu"
    pool.check_integrity()


def test_hash_collision_is_not_a_hit() -> None:
    pool = BlockPool(6)
    [blk] = pool.get_new_blocks(1)
    real = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks([blk], [real], 0, 1)
    # Same hash value, other tokens: a collision must miss.
    assert pool.get_cached_block(BlockHash(real.hash_value, (9, 9, 9, 9))) is None
    # Same hash value and tokens, other parent: also a miss.
    assert pool.get_cached_block(BlockHash(real.hash_value, (1, 2, 3, 4), 1234)) is None
    assert pool.get_cached_block(real) is blk
    # A colliding block is not registered over the existing entry.
    [other] = pool.get_new_blocks(1)
    pool.cache_full_blocks([other], [BlockHash(real.hash_value, (9, 9, 9, 9))], 0, 1)
    assert other.block_hash is None and pool.get_cached_block(real) is blk
    pool.check_integrity()


def test_caching_disabled() -> None:
    pool = BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    h = hash_full_blocks([1, 2, 3, 4], 4)
    pool.cache_full_blocks(blocks, h, 0, 1)
    assert blocks[0].block_hash is None and pool.get_cached_block(h[0]) is None
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(1)
    h = hash_full_blocks([1, 2, 3, 4], 4)
    pool.cache_full_blocks(blocks, h, 0, 1)
    assert pool.reset_prefix_cache() is False  # refused while a block is in use
    assert pool.get_cached_block(h[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h[0]) is None and blocks[0].block_hash is None
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0  # leaked: ref 0 but not in the queue
    with pytest.raises(AssertionError, match="block 1 has ref_cnt 0 but is not in the free"):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.cached_block_hash_to_block[123] = blocks[1]  # index entry without the hash
    with pytest.raises(AssertionError, match="points at block 2"):
        pool.check_integrity()
    del pool.cached_block_hash_to_block[123]
    pool.free_block_queue.get_all_free_blocks()[0].ref_cnt = 1
    with pytest.raises(AssertionError, match="block 3 is free but has ref_cnt 1"):
        pool.check_integrity()
