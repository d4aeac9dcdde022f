"""Per-request view of the KV cache: which blocks a request holds, prefix hits, allocation.

The scheduler asks two questions: "how much of this request is cached already?"
(get_computed_blocks) and "give it room for n more tokens" (allocate_slots). The BlockPool
below owns the physical blocks; this class owns the mapping request -> block table.

A request's block table covers its computed tokens plus the tokens scheduled this step:

    tokens        |==== computed ====|=== new this step ===|... not yet ...|
    blocks        |b0 |b1 |b2 |b3 |b4 |b5 |b6 |
                  |<-- registered -->|       full blocks get a hash as soon as they are
                   (num_cached_blocks)        allocated for, the partial tail block never
"""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool, KVCacheBlock, hash_full_blocks
from kvserve.kv.layout import cdiv
from kvserve.request import Request


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool = True
                 ) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching and block_pool.enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Mirror of req_to_blocks as ints, extended in step with it, so that handing the
        # block table to the runner is a C-level list copy, not a Python loop per step.
        self._req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix index.
        self.num_cached_blocks: dict[str, int] = {}
        # Running totals, in tokens, for metrics (hit rate = hits / queries).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds none)."""
        return list(self._req_to_block_ids.get(request_id, ()))

    def _update_block_hashes(self, request: Request) -> None:
        """Extends request.block_hashes to every full block of the known tokens.

        Incremental: only blocks that filled since the last call are hashed, so a decode step
        costs one hash every block_size tokens, independent of the context length.
        """
        hashes = request.block_hashes
        start = len(hashes)
        if (start + 1) * self.block_size > request.num_tokens:
            return
        tokens = request.all_token_ids[start * self.block_size:]
        hashes.extend(hash_full_blocks(tokens, self.block_size,
                                       parent=hashes[-1] if hashes else None))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of request's full blocks, and its length in tokens.

        The last token is never reported computed: the step must run it to get the logits
        that sample the next token. So a hit is capped at (num_tokens - 1) // block_size
        blocks; on a full hit of a block-aligned prompt the last block is recomputed.

            tokens  |blk0|blk1|blk2|    num_tokens = 12, block_size = 4
            hit     |blk0|blk1|         at most (12 - 1) // 4 = 2 blocks = 8 tokens

        The blocks are not touched here; allocate_slots() takes the references, so a caller
        that then fails to allocate leaves nothing to undo.
        """
        if not self.enable_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: compute them all.
            # The request's own full blocks are still registered for others to hit.
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return computed, num_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Makes room for num_new_tokens more tokens; returns the newly allocated blocks.

        new_computed_blocks are prefix-cache hits from get_computed_blocks() for a request
        that holds no blocks yet; they count as computed tokens in front of the new ones:

            |== request.num_computed_tokens ==|== new_computed_blocks ==|== num_new_tokens ==|
            0                                                                           total

        Returns None, changing nothing, when the pool cannot supply the blocks. Hit blocks
        that are free (ref_cnt 0) are in the free queue, so touching them shrinks the pool:
        they are counted against the free blocks too.
        """
        new_computed_blocks = new_computed_blocks or []
        rid = request.request_id
        req_blocks = self.req_to_blocks.setdefault(rid, [])
        req_block_ids = self._req_to_block_ids.setdefault(rid, [])
        if new_computed_blocks:
            assert not req_blocks, (
                f"request {rid} already holds blocks; prefix hits only apply to a fresh table")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_required = cdiv(total, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                # Drop the empty entries setdefault made: nothing is held.
                self.req_to_blocks.pop(rid)
                self._req_to_block_ids.pop(rid)
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            req_block_ids.extend(b.block_id for b in new_computed_blocks)
            # Hits are registered blocks already.
            self.num_cached_blocks[rid] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        req_block_ids.extend(b.block_id for b in new_blocks)

        if self.enable_caching:
            # Only tokens whose ids are known can be hashed: with speculative decoding the
            # step may reach past num_tokens (draft positions).
            num_full_blocks = min(total, request.num_tokens) // self.block_size
            num_cached = self.num_cached_blocks.get(rid, 0)
            if num_full_blocks > num_cached:
                self._update_block_hashes(request)
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes,
                                                  num_cached, num_full_blocks)
                self.num_cached_blocks[rid] = num_full_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so the end of its prefix is evicted
        before the beginning (which other requests are likelier to share).

        request.block_hashes are kept: the tokens did not change, and a preempted request
        reuses them to find its own blocks again.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self._req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))
