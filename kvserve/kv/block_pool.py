"""Physical KV blocks: ref counts, an O(1) LRU free queue, chained block hashes, prefix index.

A block is in exactly one of two states:

    in use : ref_cnt > 0, not in the free queue
    free   : ref_cnt == 0, in the free queue (and may still carry a hash: a prefix-cache entry)

Free blocks keep their hash until the pool hands them out again ("lazy eviction"), so a freed
prefix stays reusable until memory pressure actually needs its blocks. The free queue is LRU:
get_new_blocks() pops from the head (least recently freed), free_blocks() appends at the tail.

Block 0 is the null block (kvserve.kv.layout.NULL_BLOCK_ID): it pads block tables, is never
handed out, never freed, never hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvserve.kv.layout import NULL_BLOCK_ID


class BlockHash(NamedTuple):
    """The identity of one full block *together with its whole prefix*.

    hash_value covers the parent's hash_value, this block's tokens and extra_keys, so equal
    hash values mean equal prefixes (up to a sha256 collision). token_ids and
    parent_hash_value are kept so that a lookup can verify the hit instead of trusting the
    hash: a hit needs the whole tuple to be equal.
    """

    hash_value: int
    token_ids: tuple[int, ...]
    parent_hash_value: int | None = None
    extra_keys: tuple[Hashable, ...] | None = None


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Hashable, ...] | None = None) -> BlockHash:
    """Chained hash of one full block.

    sha256 over a fixed encoding rather than Python's hash(): the value is stable across
    processes and Python versions (ints hash deterministically, but tuples of str do not under
    PYTHONHASHSEED), and a client cannot craft a prompt whose prefix aliases another tenant's.
    Only the block's own tokens and its parent hash are verified on a hit, so the strength of
    the chain rests on the hash. Cost is one sha256 of ~8 * block_size bytes per full block,
    paid once when the block fills.
    """
    tokens = tuple(token_ids)
    parent_value = None if parent is None else parent.hash_value
    h = hashlib.sha256()
    # 32 zero bytes stand for "no parent"; sha256 values are 256-bit so they fill 32 bytes.
    h.update(b"\0" * 32 if parent_value is None else parent_value.to_bytes(32, "big"))
    h.update(struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return BlockHash(int.from_bytes(h.digest(), "big"), tokens, parent_value, extra_keys)


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                     start_block: int = 0,
                     extra_keys: tuple[Hashable, ...] | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids from block start_block on.

    parent is the hash of block start_block - 1 (None when start_block == 0). A trailing
    partial block is not hashed: its hash is written once, when it becomes full.

        token_ids  |blk 0|blk 1|...|blk s|blk s+1|...|blk n-1|partial|
                               parent^  |<---- returned ---->|
                                        s = start_block, n = len(token_ids) // block_size
    """
    out: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   extra_keys)
        out.append(parent)
    return out


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once when the block becomes full and is registered; cleared when it is reused.
    block_hash: BlockHash | None = None
    # Free-queue links; None when not in the queue (or at the ends, next to a sentinel).
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove(any block).

    Two sentinels avoid edge cases; the blocks' own prev/next fields are the links, so no
    per-node allocation happens:

        head <-> b3 <-> b7 <-> b1 <-> tail
                 ^ popleft (evicted first)    ^ append (freed last)

    A deque cannot remove an arbitrary element in O(1); removal is needed when a prefix-cache
    hit revives a free block.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("popleft from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __contains__(self, block: KVCacheBlock) -> bool:
        # Only queued blocks (and sentinels) have links; O(1).
        return block.prev_free is not None and block.next_free is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (next evicted) to tail. O(n): for tests and integrity checks."""
        out: list[KVCacheBlock] = []
        b = self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b)
            b = b.next_free
        return out


class BlockPool:
    """All physical blocks of the KV cache, their ref counts and the prefix-cache index."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(
            b for b in self.blocks if b.block_id != NULL_BLOCK_ID)
        # hash_value -> the one block registered under it. A second block with the same
        # content (two requests computed it concurrently) is simply not registered.
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    # -- allocation -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks get_new_blocks() can hand out, including free blocks still holding a hash."""
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops num_blocks LRU blocks (ref_cnt becomes 1); evicts their stale hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num_blocks} blocks, only "
                             f"{self.get_num_free_blocks()} free")
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix-cache hit: take a reference; a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching 0 join the free queue in the given order.

        The first block given is evicted first, so callers pass a request's blocks tail first:
        the end of a prefix is less likely to be shared than its beginning.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- prefix cache -----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding exactly this prefix, or None.

        The hit is verified against the stored tokens, parent hash and extra keys: a hash
        value collision yields a miss, never somebody else's KV.
        """
        if not self.enable_caching:
            return None
        block = self.cached_block_hash_to_block.get(block_hash.hash_value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash], num_cached_blocks: int,
                          num_full_blocks: int) -> None:
        """Registers blocks[num_cached_blocks:num_full_blocks] of one request.

        blocks is the request's block table, block_hashes its chained hashes (at least
        num_full_blocks of them); blocks before num_cached_blocks are registered already.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            assert block.block_hash is None, (
                f"block {block.block_id} is already registered; hashes are written once")
            if block_hash.hash_value in self.cached_block_hash_to_block:
                # Same prefix already cached in another block (or a colliding hash): keep
                # the existing entry; this block stays an ordinary, unhashed block.
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash.hash_value] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash.hash_value]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix. Refused (False) while any block is in use, because a
        running request's blocks would lose their registration midway."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # -- metrics and invariants -------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) held by requests."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def block_states(self) -> str:
        """One character per block id, for a picture of the pool (the server's engine view):

            n  the null block (block 0)
            u  in use by one request (ref_cnt 1)
            s  in use by several: a prefix shared by concurrent requests (ref_cnt > 1)
            c  free, still holding a hash: a prefix-cache entry, reusable until evicted
            f  free, no hash

        O(num_blocks); only the thread that owns the pool may call it (the engine thread).
        """
        return "".join(["n" if b is self.null_block else "s" if b.ref_cnt > 1 else
                        "u" if b.ref_cnt else "f" if b.block_hash is None else "c"
                        for b in self.blocks])

    def check_integrity(self) -> None:
        """Raises AssertionError naming the first broken invariant. O(num_blocks)."""
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and null not in \
            self.free_block_queue, "the null block must never be used, hashed or queued"
        queued = self.free_block_queue.get_all_free_blocks()
        assert len(queued) == self.free_block_queue.num_free_blocks, (
            f"free queue holds {len(queued)} blocks but counts "
            f"{self.free_block_queue.num_free_blocks}")
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block appears twice in the free queue"
        prev = self.free_block_queue._head
        for b in queued:
            assert b.prev_free is prev and prev.next_free is b, (
                f"free queue links broken around block {b.block_id}")
            prev = b
        assert self.free_block_queue._tail.prev_free is prev, "free queue tail link broken"
        for b in self.blocks:
            if b is null:
                continue
            if b.block_id in queued_ids:
                assert b.ref_cnt == 0, f"block {b.block_id} is free but has ref_cnt {b.ref_cnt}"
            else:
                assert b.ref_cnt > 0, f"block {b.block_id} has ref_cnt {b.ref_cnt} but is " \
                    "not in the free queue (leaked)"
                assert b.prev_free is None and b.next_free is None, (
                    f"block {b.block_id} is in use but still has free-queue links")
            if b.block_hash is not None:
                assert self.cached_block_hash_to_block.get(b.block_hash.hash_value) is b, (
                    f"block {b.block_id} carries a hash the index does not map to it")
        for value, b in self.cached_block_hash_to_block.items():
            assert b.block_hash is not None and b.block_hash.hash_value == value, (
                f"index entry {value:#x} points at block {b.block_id} which carries "
                f"{b.block_hash}")
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_used + len(queued) == self.num_blocks - 1, (
            f"{num_used} used + {len(queued)} free != {self.num_blocks - 1} usable blocks")
