"""SchedulerOutput -> tensors -> model -> sampler -> ModelOutput.

The only engine component that touches device tensors (with layers/, ops/, platform.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.kv.layout import (
    QUANTIZED_KV_DTYPES,
    QuantizedKVCache,
    kv_cache_shape,
    kv_scales_shape,
    resolve_kv_dtype,
)
from kvserve.outputs import ModelInput, ModelOutput, PositionLogprobs, SchedulerOutput
from kvserve.sample.logprobs import compute_prompt_logprobs
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler
from kvserve.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

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


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Any, num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model_config.vocab_size
        mc = config.model_config
        cache_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, config.dtype)
        shape = kv_cache_shape(mc.num_hidden_layers, num_blocks, self.block_size,
                               mc.num_key_value_heads, mc.head_dim)
        # Zeroed, not empty: kernels may read whole blocks past seq_len and mask them out,
        # and 0 * garbage-NaN would still be NaN (zero scales and zero fp8 bits are 0.0 too).
        self.kv_cache: torch.Tensor | QuantizedKVCache
        if cache_dtype in QUANTIZED_KV_DTYPES:
            data_dtype = torch.int8 if cache_dtype == "int8" else torch.uint8  # e4m3fn bits
            self.kv_cache = QuantizedKVCache(
                zeros(shape, data_dtype, self.device),
                zeros(kv_scales_shape(*shape[:1], *shape[2:5]), torch.float32, self.device))
        else:
            self.kv_cache = zeros(shape, torch_dtype(cache_dtype), self.device)
        # The engine seed feeds the generator of requests without their own seed, so the
        # same requests in the same order sample the same tokens run after run (vLLM's
        # --seed), whatever else the process does with torch's global generator.
        self.sampler = Sampler(seed=config.seed)
        # Set by the engine (it owns the tokenizer); None: no request may use a grammar.
        self.structured_output: StructuredOutputManager | None = None

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[ModelInput, list[int], dict[str, Any]]:
        """Flatten the step into one varlen batch.

        Returns the ModelInput, the batch indices b of requests that sample, and for requests
        that want prompt logprobs: request_id -> (request, target token ids, first target
        position) of this chunk.
        """
        bs = self.block_size
        n_req = len(so.scheduled)
        qsl = np.zeros(n_req + 1, dtype=np.int64)
        seq_lens = np.zeros(n_req, dtype=np.int64)
        max_blocks = max(len(sr.block_ids) for sr in so.scheduled)
        block_tables = np.zeros((n_req, max_blocks), dtype=np.int32)
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_idx: list[int] = []
        prompt_lp: dict[str, Any] = {}
        lp_rows: list[int] = []
        for b, sr in enumerate(so.scheduled):
            n, start = sr.num_tokens, sr.start_pos
            qsl[b + 1] = qsl[b] + n
            seq_lens[b] = start + n
            blocks = np.asarray(sr.block_ids, dtype=np.int64)
            block_tables[b, : len(blocks)] = blocks
            pos = np.arange(start, start + n, dtype=np.int64)
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            input_ids.extend(sr.token_ids)
            if sr.sample:
                sample_idx.append(b)
            req = sr.request
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                # Row r (position start + r) predicts the token at position start + r + 1.
                last = min(start + n, req.num_prompt_tokens - 1)  # last target position
                targets = req.all_token_ids[start + 1: last + 1]
                prompt_lp[req.request_id] = (req, targets, start + 1)
                lp_rows.extend(range(int(qsl[b]), int(qsl[b]) + len(targets)))
        # The sampling rows, in SamplingMetadata's row order: one per request, its last
        # position (a chunk ending in k drafts would give its last k + 1).
        sample_rows = [int(qsl[b + 1]) - 1 for b in sample_idx]
        dev = self.device
        inp = ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            logits_indices=torch.tensor(sample_rows + lp_rows, dtype=torch.long, device=dev),
            max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
        )
        return inp, sample_idx, prompt_lp

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        inp, sample_idx, prompt_lp = self.prepare_inputs(so)
        hidden = self.model(inp, self.kv_cache)
        # Logits only for the rows that sample or need prompt logprobs.
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        requests = [so.scheduled[b].request for b in sample_idx]
        out = ModelOutput(req_ids=[r.request_id for r in requests], sampled_token_ids=[],
                          logprobs=[])
        row = 0  # logits rows used so far: the sampling rows come first
        if requests:
            # The rows prepare_inputs computed logits for: one per request, no drafts yet.
            meta = SamplingMetadata.from_requests(requests, self.vocab_size, logits.device)
            so_mgr = self.structured_output
            grammar = None if so_mgr is None else so_mgr.token_bitmask(requests)
            if grammar is not None:
                # A grammar's mask is for the token after the request's own tokens: its row 0.
                reqs_with_grammar, masks = grammar
                first_rows = [meta.row_offsets[b] for b in reqs_with_grammar.tolist()]
                meta.token_bitmask = (torch.tensor(first_rows, dtype=torch.int64), masks)
            row = meta.num_rows
            sampled = self.sampler(logits[:row], meta)
            # Each request's rows' tokens, in row order. With one row per request that is
            # the request's next token; with drafts, rejection sampling will choose the kept ones.
            out.sampled_token_ids = meta.per_request(sampled.token_ids)
            if grammar is not None:
                assert so_mgr is not None
                # Every sampled token is appended (aborts land only between steps), so the
                # matcher advances here rather than in the scheduler.
                for b in grammar[0].tolist():
                    for t in out.sampled_token_ids[b]:
                        so_mgr.accept(requests[b].request_id, t)
            # None: no row asked for logprobs; a request's rows all ask, or none does.
            row_lps = meta.per_request(sampled.logprobs or [None] * row)
            out.logprobs = [None if r[0] is None else r for r in row_lps]
        for req_id, (req, targets, first_pos) in prompt_lp.items():
            k = len(targets)
            lps: list[PositionLogprobs | None] = compute_prompt_logprobs(
                logits[row: row + k], torch.tensor(targets, device=logits.device),
                req.sampling_params.prompt_logprobs)
            if first_pos == 1:
                lps, first_pos = [None] + lps, 0  # the first prompt token has no logprob
            out.prompt_logprobs[req_id] = (first_pos, lps)
            row += k
        return out

    def remove_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.sampler.remove(rid)
            if self.structured_output is not None:
                self.structured_output.remove(rid)
