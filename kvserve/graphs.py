"""CUDA graphs for decode steps: one replay instead of ~80 kernel launches a layer.

On a GPU, kvserve's torch backend runs a decode step as a few thousand small kernels, each
launched from Python. Measured on an H200 (a 1.1B Llama in bfloat16, one sequence): 33 ms a
step, of which the GPU was busy ~3.5 ms; the rest was launching. vLLM, SGLang and gpt-fast
capture decode steps as CUDA graphs; so does this.

What is captured: the model's forward and its logits for a batch of B one-token decodes
whose contexts fit in C blocks, from static input buffers into static outputs. A step of
b <= B decodes, each context within C blocks, copies its inputs into the buffers, pads the
rest and replays:
- padded rows read token 0 at position 0, write nowhere (slot -1: TorchOps.write_kv leaves
  the cache as it was) and attend to one key of null block 0; their outputs are ignored;
- a request's block table runs on to C blocks with whatever ids the buffer held there, which
  its seq_len masks, as it masks the null blocks that pad the eager path's tables.
So a row's arithmetic is the eager path's at the same (B, C) shapes; only the padding is more.

Graphs are captured when first needed (B rounded up to BATCH_SIZES, C to a power of two of
at least MIN_BLOCKS), and only while B * C * block_size stays within MAX_GATHER_TOKENS: the
torch backend's attention gathers the whole padded context, and a graph keeps the memory of
its largest shapes. Anything else (prefill, speculative verify steps, prompt logprobs,
tensor parallelism, larger shapes) runs eagerly, as does everything with `enforce_eager`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvserve.outputs import ModelInput

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_BLOCKS = 16
MAX_GATHER_TOKENS = 1 << 18


def _bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """Captured decode steps of one model and KV cache, by (batch, context blocks).

    forward(inp, kv_cache) -> (hidden, logits) is the model's (hidden states after the final
    norm, logits of every row). run(inp) gives the same for a one-token-per-request step that
    fits a graph, from a replay, or None (the caller runs the step eagerly). The tensors it
    returns are views of the graph's outputs, valid until the next run.

    capture=False runs the same padded static-buffer path without a graph (what a CPU can
    test of it)."""

    def __init__(self, forward: Callable[[ModelInput, Any], tuple[torch.Tensor, torch.Tensor]],
                 kv_cache: Any, device: torch.device, block_size: int, max_batch: int,
                 max_blocks: int, capture: bool = True) -> None:
        self._forward = forward
        self._kv_cache = kv_cache
        self.device = device
        self.block_size = block_size
        self.capture = capture
        sizes = tuple(s for s in BATCH_SIZES if s < max_batch) + (max_batch,)
        self.batch_sizes = tuple(sorted(set(sizes)))
        blocks = []
        c = MIN_BLOCKS
        while c < max_blocks:
            blocks.append(c)
            c *= 2
        self.block_counts = tuple(blocks) + (max_blocks,)
        bmax, cmax = self.batch_sizes[-1], self.block_counts[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(bmax, dtype=torch.long)
            self.positions = torch.zeros(bmax, dtype=torch.long)
            self.slot_mapping = torch.full((bmax,), -1, dtype=torch.long)
            self.block_tables = torch.zeros(bmax, cmax, dtype=torch.int32)
            self.seq_lens = torch.ones(bmax, dtype=torch.int32)
            self.query_start_loc = torch.arange(bmax + 1, dtype=torch.int32)
            self.logits_indices = torch.arange(bmax, dtype=torch.long)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._failed: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps run from a graph (tests, logs)

    def shape_for(self, batch: int, max_seq_len: int) -> tuple[int, int] | None:
        """The (B, C) graph a step of `batch` one-token decodes with contexts up to
        max_seq_len would replay; None: it runs eagerly."""
        b = _bucket(batch, self.batch_sizes)
        c = _bucket(-(-max_seq_len // self.block_size), self.block_counts)
        if b is None or c is None or b * c * self.block_size > MAX_GATHER_TOKENS:
            return None
        return None if (b, c) in self._failed else (b, c)

    def run(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = inp.seq_lens.shape[0]
        if inp.max_query_len != 1 or inp.input_ids.shape[0] != n:
            return None
        shape = self.shape_for(n, inp.max_seq_len)
        if shape is None:
            return None
        b, c = shape
        self._load(inp, n, b, c)
        if not self.capture:
            hidden, logits = self._forward(self._static_input(b, c), self._kv_cache)
        else:
            entry = self._graphs.get(shape) or self._capture(shape)
            if entry is None:
                return None
            graph, hidden, logits = entry
            graph.replay()
        self.replays += 1
        return hidden[:n], logits[:n]

    def _static_input(self, b: int, c: int) -> ModelInput:
        return ModelInput(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b, :c],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
            logits_indices=self.logits_indices[:b], max_query_len=1,
            max_seq_len=c * self.block_size)

    def _load(self, inp: ModelInput, n: int, b: int, c: int) -> None:
        """The step's inputs into rows [0, n) of the buffers, padding rows [n, b). A block
        table row keeps whatever block ids the buffer held past the request's own (a padded
        row: all of them): its seq_len masks them, as it masks the eager path's padding, and
        every id in the buffer is a block of this cache."""
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.slot_mapping[:n].copy_(inp.slot_mapping)
        self.seq_lens[:n].copy_(inp.seq_lens)
        self.block_tables[:n, :inp.block_tables.shape[1]].copy_(inp.block_tables)
        if n < b:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)

    def _capture(self, shape: tuple[int, int]) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
        b, c = shape
        inp = self._static_input(b, c)
        try:
            # Warm-up on a side stream, as torch.cuda.graphs asks (lazy inits, autotuning),
            # then the capture. The padded rows write nowhere, the real rows what they will.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(inp, self._kv_cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of the server's other threads do not void the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                hidden, logits = self._forward(inp, self._kv_cache)
        except RuntimeError as e:  # an op that cannot be captured: this shape runs eagerly
            logger.warning("decode step (batch %d, %d blocks) not captured, runs eagerly: %s",
                           b, c, e)
            self._failed.add(shape)
            return None
        entry = (graph, hidden, logits)
        self._graphs[shape] = entry
        logger.info("captured a CUDA graph for decode steps of batch %d, %d blocks", b, c)
        return entry
