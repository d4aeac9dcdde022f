"""CUDA graphs for decode steps: one replay instead of ~80 kernel launches a layer.

On a GPU, kvserve's torch backend runs a decode step as a few thousand small kernels, each
launched from Python. Measured on an H200 (a 1.1B Llama in bfloat16, one sequence): 33 ms a
step, of which the GPU was busy ~3.5 ms; the rest was launching. vLLM, SGLang and gpt-fast
capture decode steps as CUDA graphs; so does this.

What is captured: the model's forward and its logits for B requests that each feed Q tokens
(a decode: Q = 1; a speculative step: its token and drafts) over contexts within C blocks,
from static input buffers into static outputs. A step of b <= B such requests, each feeding
at most Q tokens, copies its inputs into the buffers, pads the rest and replays:
- padded requests read token 0 from position 0, write nowhere (slot -1: TorchOps.write_kv
  leaves the cache as it was) and attend to the first keys of a block; their outputs are
  dropped;
- a request feeding q < Q tokens gets Q - q padded queries after its own, its seq_len grown
  by as many, so the causal mask hides them from its real queries;
- a request's block table runs on to C blocks with whatever ids the buffer held there, which
  its seq_len masks, as it masks the null blocks that pad the eager path's tables.
So a real row's arithmetic is the eager path's at the padded shapes.

Graphs are captured when first needed (B rounded up to BATCH_SIZES, Q as it is, C to a
power of two of at least MIN_BLOCKS), and only while B * C * block_size stays within
MAX_GATHER_TOKENS: the torch backend's attention gathers the whole padded context, and the
graphs' pool keeps what their largest step needed. Anything else (prefill chunks, prompt
logprobs, tensor parallelism, larger shapes) runs eagerly, as does everything with
`enforce_eager`.

Memory: the graphs share one pool for what they compute, and every graph copies its hidden
states and logits into one pair of output buffers (max_num_seqs x max queries rows), so no
graph keeps memory of its own past its replay: however many shapes a server meets, the
graphs hold about what their largest step needs, plus the buffers.
"""

from __future__ import annotations

import logging
from collections import Counter
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
    """Captured decode steps of one model and KV cache, by (batch, queries, context blocks).

    forward(inp, kv_cache) -> (hidden, logits) is the model's (hidden states after the final
    norm, logits of every row). run(inp) gives the same for a step in which every request
    decodes (one token, or a speculative step's token and drafts: Q = max_query_len
    queries at most), from a replay, or None (the caller runs the step eagerly). The tensors
    it returns last until the next run.

    A request with fewer queries than the step's Q is padded at its end: the padded queries
    come after its real ones (its seq_len grows by as many), so causality hides them from
    the real queries; they write nowhere and their outputs are dropped.

    capture=False runs the same padded static-buffer path without a graph (what a CPU can
    test of it)."""

    def __init__(self, forward: Callable[[ModelInput, Any], tuple[torch.Tensor, torch.Tensor]],
                 kv_cache: Any, device: torch.device, block_size: int, max_batch: int,
                 max_blocks: int, max_query_len: int = 1, max_position: int = 1 << 62,
                 capture: bool = True) -> None:
        """max_position: positions past it (a padded query's) are clamped to it."""
        self._forward = forward
        self._kv_cache = kv_cache
        self.device = device
        self.block_size = block_size
        self.max_query_len = max_query_len
        self.max_position = max_position
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
        rows = bmax * max_query_len
        with torch.device(device):
            self.input_ids = torch.zeros(rows, dtype=torch.long)
            self.positions = torch.zeros(rows, dtype=torch.long)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.long)
            self.block_tables = torch.zeros(bmax, cmax, dtype=torch.int32)
            self.seq_lens = torch.ones(bmax, dtype=torch.int32)
            self.logits_indices = torch.arange(rows, dtype=torch.long)
            # Each Q's query_start_loc, kept: a graph reads its inputs where it was captured.
            self._starts = [torch.arange(bmax + 1, dtype=torch.int32) * q
                            for q in range(max_query_len + 1)]
            self._offsets = torch.arange(max_query_len, dtype=torch.long)
        self._graphs: dict[tuple[int, int, int], Any] = {}
        # Every graph's outputs, written into at the end of its replay: (hidden, logits) of
        # up to `rows` rows, made at the first step (when their widths and dtypes are known).
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self._failed: set[tuple[int, int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays: Counter[int] = Counter()  # steps run from a graph, by Q (tests, logs)

    def shape_for(self, batch: int, queries: int, max_seq_len: int
                  ) -> tuple[int, int, int] | None:
        """The (B, Q, C) graph a step of `batch` decoding requests, the longest feeding
        `queries` tokens, contexts up to max_seq_len, would replay; None: it runs eagerly."""
        b = _bucket(batch, self.batch_sizes)
        # A request padded to Q queries may reach Q - 1 positions past the step's longest.
        c = _bucket(-(-(max_seq_len + queries - 1) // self.block_size), self.block_counts)
        if (b is None or c is None or queries > self.max_query_len
                or b * c * self.block_size > MAX_GATHER_TOKENS):
            return None
        shape = (b, queries, c)
        return None if shape in self._failed else shape

    def run(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        n, t = inp.seq_lens.shape[0], inp.input_ids.shape[0]
        shape = self.shape_for(n, inp.max_query_len, inp.max_seq_len)
        if shape is None:
            return None
        rows = self._load(inp, n, t, shape)
        if not self.capture:
            self._step(self._static_input(*shape))
        else:
            graph = self._graphs.get(shape) or self._capture(shape)
            if graph is None:
                return None
            graph.replay()
        self.replays[shape[1]] += 1
        assert self._out is not None
        hidden, logits = self._out
        if rows is None:
            return hidden[:t], logits[:t]
        return hidden[rows], logits[rows]

    def _step(self, inp: ModelInput) -> None:
        """The forward, its outputs copied into the shared buffers (what a graph holds)."""
        hidden, logits = self._forward(inp, self._kv_cache)
        if self._out is None:  # the first step: outside any capture, so not in the pool
            rows = self.input_ids.shape[0]
            self._out = (hidden.new_empty(rows, *hidden.shape[1:]),
                         logits.new_empty(rows, *logits.shape[1:]))
        m = hidden.shape[0]
        self._out[0][:m].copy_(hidden)
        self._out[1][:m].copy_(logits)

    def _static_input(self, b: int, q: int, c: int) -> ModelInput:
        return ModelInput(
            input_ids=self.input_ids[:b * q], positions=self.positions[:b * q],
            slot_mapping=self.slot_mapping[:b * q], block_tables=self.block_tables[:b, :c],
            seq_lens=self.seq_lens[:b], query_start_loc=self._starts[q][:b + 1],
            logits_indices=self.logits_indices[:b * q], max_query_len=q,
            max_seq_len=c * self.block_size)

    def _load(self, inp: ModelInput, n: int, t: int, shape: tuple[int, int, int]
              ) -> torch.Tensor | None:
        """The step's inputs into the buffers: request i's tokens at rows [i Q, i Q + q_i),
        the rest padding. Returns the rows the step's tokens landed on (None: rows [0, t)).
        A block table row keeps whatever block ids the buffer held past the request's own
        (a padded request: all of them): its seq_len masks them, as it masks the null
        blocks that pad the eager path's tables, and every id there is a block of this
        cache."""
        b, q, _ = shape
        self.block_tables[:n, :inp.block_tables.shape[1]].copy_(inp.block_tables)
        if q == 1:  # one token each: rows in order
            self.input_ids[:n].copy_(inp.input_ids)
            self.positions[:n].copy_(inp.positions)
            self.slot_mapping[:n].copy_(inp.slot_mapping)
            self.seq_lens[:n].copy_(inp.seq_lens)
            if n < b:
                self.input_ids[n:b].zero_()
                self.positions[n:b].zero_()
                self.slot_mapping[n:b].fill_(-1)
                self.seq_lens[n:b].fill_(1)
            return None
        qsl = inp.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        req = torch.repeat_interleave(torch.arange(n, device=self.device), q_lens,
                                      output_size=t)
        rows = req * q + (torch.arange(t, device=self.device) - qsl[req])
        self.input_ids[:b * q].zero_()
        self.slot_mapping[:b * q].fill_(-1)
        self.input_ids[rows] = inp.input_ids
        self.slot_mapping[rows] = inp.slot_mapping
        self.seq_lens[:n].copy_(inp.seq_lens + (q - q_lens).to(inp.seq_lens.dtype))
        self.seq_lens[n:b].fill_(q)
        # Row i Q + j sits at position seq_len_i - Q + j: a real query's own position.
        pos = (self.seq_lens[:b].long() - q).unsqueeze(1) + self._offsets[:q]
        self.positions[:b * q].copy_(pos.clamp(max=self.max_position).view(-1))
        return rows

    def _capture(self, shape: tuple[int, int, int]) -> Any:
        b, q, c = shape
        inp = self._static_input(b, q, c)
        try:
            # Warm-up on a side stream, as torch.cuda.graphs asks (lazy inits, autotuning;
            # the output buffers the first time), then the capture. The padded rows write
            # nowhere, the real rows what they will.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(inp)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of the server's other threads do not void the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step(inp)
        except RuntimeError as e:  # an op that cannot be captured: this shape runs eagerly
            logger.warning("decode step (batch %d, %d queries, %d blocks) not captured, "
                           "runs eagerly: %s", b, q, c, e)
            self._failed.add(shape)
            return None
        self._graphs[shape] = graph
        logger.info("captured a CUDA graph for decode steps of batch %d, %d queries, %d "
                    "blocks", b, q, c)
        return graph
