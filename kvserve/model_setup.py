"""What building a model and its KV cache takes, for the engine (llm_engine.py) and for a
tensor-parallel worker (executor/worker.py) alike: the checkpoint's model on its ops
backend (load_model), the KV block count a memory budget holds (num_kv_blocks), and the
zeroed paged cache itself (allocate_kv_cache)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.distributed.group import TPGroup
from kvserve.engine_args import EngineArgs
from kvserve.kv.layout import (
    QUANTIZED_KV_DTYPES,
    QuantizedKVCache,
    kv_cache_shape,
    kv_scales_shape,
    model_block_bytes,
    resolve_kv_dtype,
)
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.platform import available_memory
from kvserve.quant import get_quant_method

logger = logging.getLogger("kvserve")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, except on the CPU: there the memory comes from calloc (numpy.zeros), i.e.
    zero pages the OS maps in on first touch. A KV cache of gigabytes then costs nothing at
    start-up (torch.zeros writes every byte: ~1.7 s for 2.4 GB here) and only the blocks in
    use take physical memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def allocate_kv_cache(config: EngineConfig, num_blocks: int) -> torch.Tensor | QuantizedKVCache:
    """The paged KV cache of this rank: every layer, num_blocks blocks, the model's KV heads
    (a tensor-parallel rank's share of them)."""
    mc = config.model_config
    cache_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, config.dtype)
    kv_heads = mc.num_key_value_heads // config.parallel.tensor_parallel_size
    shape = kv_cache_shape(mc.num_hidden_layers, num_blocks, config.cache.block_size,
                           kv_heads, mc.head_dim)
    device = torch.device(config.device)
    # Zeroed, not empty: kernels may read whole blocks past seq_len and mask them out,
    # and 0 * garbage-NaN would still be NaN (zero scales and zero fp8 bits are 0.0 too).
    if cache_dtype in QUANTIZED_KV_DTYPES:
        data_dtype = torch.int8 if cache_dtype == "int8" else torch.uint8  # e4m3fn bits
        return QuantizedKVCache(
            zeros(shape, data_dtype, device),
            zeros(kv_scales_shape(*shape[:1], *shape[2:5]), torch.float32, device))
    return zeros(shape, torch_dtype(cache_dtype), device)


def load_model(args: EngineArgs, ckpt: Any, config: EngineConfig, tp: TPGroup
               ) -> tuple[EngineConfig, Any, torch.nn.Module]:
    """The ops backend and the loaded model (tp: this rank's part of it), for the engine and
    for a tensor-parallel worker alike. The config may come back changed: a GGUF file without
    kvserve's CPU kernels is dequantized at load (quantization none)."""
    ops = get_ops(config.ops_backend, config.device)
    quant = get_quant_method(config.quant)
    if quant.needs_kernels and not getattr(ops, "uses_kernels", False):
        # Only kvserve's CPU kernels read blocks as stored; anywhere else every forward
        # would dequantize every matrix again.
        if args.quantization is None and quant.keeps_quantized:
            # A GGUF file: the loader dequantizes its blocks. Derived again from the args, so
            # every default that follows the quantization (the KV cache dtype) follows it.
            args = dataclasses.replace(args, quantization="none")
            config = args.create_engine_config(config.model, ckpt.model_config)
            quant = get_quant_method(config.quant)
        else:
            # A quantized checkpoint (GPTQ, AWQ, W8A8) or a method asked for by name.
            logger.warning("quantization %r without kvserve's CPU kernels (ops=%s): %s",
                           config.quantization, ops.name, quant.without_kernels_note)
            quant = quant.without_kernels(config.device)
    model = build_model(ckpt, ops, torch_dtype(config.dtype), quant,
                        config.scheduler.max_model_len, tp=tp).to(config.device)
    return config, ops, model



def num_kv_blocks(config: EngineConfig, extra_bytes_per_block: int = 0) -> int:
    """From --num-gpu-blocks-override, --kv-cache-memory, or a share of free memory.
    Includes the null block 0, so requests can use num_blocks - 1. extra_bytes_per_block:
    a draft model's KV in the same blocks (one budget for both)."""
    c, mc = config.cache, config.model_config
    if c.num_blocks_override is not None:
        return c.num_blocks_override
    # A quantized cache's scales (a float32 per K / V row per kv head) count too.
    per_block = model_block_bytes(mc, c.block_size, resolve_kv_dtype(
        c.kv_cache_dtype, config.dtype)) + extra_bytes_per_block
    budget = c.kv_cache_memory
    if budget is None:
        budget = int(available_memory(config.device) * c.kv_cache_memory_fraction)
        # More blocks than max_num_seqs full-length requests can use is wasted memory.
        sc = config.scheduler
        useful = sc.max_num_seqs * -(-sc.max_model_len // c.block_size) + 1
        budget = min(budget, useful * per_block)
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory ({budget} bytes) holds no KV block; one block "
                         f"of {c.block_size} tokens needs {per_block} bytes")
    return num_blocks

