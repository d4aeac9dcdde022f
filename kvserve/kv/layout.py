"""THE KV cache layout, documented once; every ops backend uses it.

One tensor for the whole model:

    kv_cache[layer, 0 = K | 1 = V, block_id, offset_in_block, kv_head, head_dim]
    shape    [L,     2,            num_blocks, block_size,    n_kv,    head_dim]

A token at position p of a request lives at block_table[p // block_size], offset
p % block_size, i.e. at the flat slot  block_id * block_size + offset  of
kv_cache[layer, i].view(-1, n_kv, head_dim).  Block 0 is the null block: it is never handed
to a request, pads block tables, and slot -1 means "do not write".

A quantized cache (kv_cache_dtype int8 / fp8_e4m3, QuantizedKVCache) keeps that tensor, its
elements int8 or the e4m3fn bit patterns as uint8, and beside it one float32 scale per
written K row and V row of each kv head, indexed like the tensor without head_dim:

    scales[layer, 0 = K | 1 = V, block_id, offset_in_block, kv_head]    (the same slot)

so element [.., slot, h, d] stands for data[.., slot, h, d] * scales[.., slot, h]
(kvserve/ops/reference.py quantize_kv / dequantize_kv hold the arithmetic).

Why one scale per token and head, written once with the token: a row's scale is its own
amax, so the row never shares a range with a louder neighbour. Qwen2's K bias puts some
channels in the hundreds in its first and last layers, far above its other layers' and
tokens' ranges: a per-tensor (or per-layer) scale sized for those rows rounds every quiet
row to a few steps, one sized for the quiet rows clips the loud ones. With per-row scales
only a row's own outliers coarsen its step (amax / 127 of that row; a per-channel K scale
would do better still for such a bias, at the cost of a calibration pass). Never
re-quantizing when a block fills (a per-block scale would have to grow as louder tokens
arrive) keeps each stored value a function of its own token alone: no error is compounded by
rounding twice, a full block's bytes do not depend on which tokens came after, so a prefix-
cache hit reads exactly what a recompute would write, and greedy output stays independent of
the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1

# --kv-cache-dtype values: auto (the model dtype), the float types, and the quantized ones.
FLOAT_KV_DTYPES = ("float32", "float16", "bfloat16")
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
KV_CACHE_DTYPES = ("auto",) + FLOAT_KV_DTYPES + QUANTIZED_KV_DTYPES
# Other names taken for them: vLLM's "fp8" is e4m3 (on NVIDIA GPUs, and so here).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
SCALE_BYTES = 4  # one float32 scale per K / V row per kv head of a quantized cache


def kv_cache_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


def kv_scales_shape(num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, block_size, num_kv_heads)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """CacheConfig.kv_cache_dtype with auto resolved to the model dtype."""
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def kv_elem_size(kv_dtype: str) -> int:
    """Bytes per cached element of a resolved (not auto) kv_cache_dtype."""
    return {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}[kv_dtype]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    elem_size: int, scale_bytes: int = 0) -> int:
    """Bytes one block takes over all layers, K and V; scale_bytes per row of head_dim
    elements (SCALE_BYTES for a quantized cache, 0 for a float one)."""
    return num_layers * 2 * block_size * num_kv_heads * (head_dim * elem_size + scale_bytes)


def model_block_bytes(mc: Any, block_size: int, cache_dtype: str) -> int:
    """bytes_per_block of a model (a ModelConfig) whose cache has the resolved cache_dtype,
    a quantized cache's scales included."""
    return bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads,
                           mc.head_dim, kv_elem_size(cache_dtype),
                           SCALE_BYTES if cache_dtype in QUANTIZED_KV_DTYPES else 0)


@dataclass(frozen=True)
class QuantizedKVCache:
    """A quantized KV cache: data in the layout above (int8, or uint8 holding e4m3fn bits)
    and its float32 scales. Indexing by layer gives that layer's pair, as indexing the float
    cache tensor does, so the model hands either on to the ops unchanged."""

    data: torch.Tensor    # [L, 2, num_blocks, block_size, Hkv, D] (or one layer: [2, ...])
    scales: torch.Tensor  # [L, 2, num_blocks, block_size, Hkv]   (or one layer: [2, ...])

    def __post_init__(self) -> None:
        import torch

        if self.data.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"QuantizedKVCache.data must be int8 or uint8 (fp8_e4m3 bits), "
                             f"got {self.data.dtype}")
        if self.scales.dtype != torch.float32 or self.scales.shape != self.data.shape[:-1]:
            raise ValueError(f"QuantizedKVCache.scales must be float32 {self.data.shape[:-1]}, "
                             f"got {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def kv_dtype(self) -> str:
        """int8, or fp8_e4m3 (its bit patterns held as uint8)."""
        import torch

        return "int8" if self.data.dtype == torch.int8 else "fp8_e4m3"

    def __getitem__(self, layer: int) -> QuantizedKVCache:
        return QuantizedKVCache(self.data[layer], self.scales[layer])

    def unsqueeze(self, dim: int) -> QuantizedKVCache:
        return QuantizedKVCache(self.data.unsqueeze(dim), self.scales.unsqueeze(dim))

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous() and self.scales.is_contiguous()


def slot_for(block_ids: list[int], pos: int, block_size: int) -> int:
    return block_ids[pos // block_size] * block_size + pos % block_size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
