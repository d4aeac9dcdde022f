"""THE KV cache layout, documented once; every ops backend uses it.

One tensor for the whole model:

    kv_cache[layer, 0 = K | 1 = V, block_id, offset_in_block, kv_head, head_dim]
    shape    [L,     2,            num_blocks, block_size,    n_kv,    head_dim]

A token at position p of a request lives at block_table[p // block_size], offset
p % block_size, i.e. at the flat slot  block_id * block_size + offset  of
kv_cache[layer, i].view(-1, n_kv, head_dim).  Block 0 is the null block: it is never handed
to a request, pads block tables, and slot -1 means "do not write".
"""

from __future__ import annotations

NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


def kv_cache_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    elem_size: int) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem_size


def slot_for(block_ids: list[int], pos: int, block_size: int) -> int:
    return block_ids[pos // block_size] * block_size + pos % block_size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
