"""SchedulerOutput -> tensors -> model -> sampler -> ModelOutput.

The only engine component that touches device tensors (with layers/, ops/, platform.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.executor.tp import TPExecutor
from kvserve.graphs import DecodeGraphs
from kvserve.model_setup import allocate_kv_cache
from kvserve.outputs import (
    ModelInput,
    ModelOutput,
    PositionLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from kvserve.request import Request
from kvserve.sample.logprobs import compute_prompt_logprobs
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler
from kvserve.spec.base import Proposer, SpecStats
from kvserve.spec.policy import SpecPolicy
from kvserve.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, config: EngineConfig, model: Any, num_blocks: int,
                 proposer: Proposer | None = None, kv_cache: Any = None,
                 first_layers: int = 0) -> None:
        """kv_cache: a paged cache to run in (a self-draft's: the target's own); None
        allocates one of num_blocks blocks. first_layers: the model is the target's first
        this many decoder layers (a self-draft), which the other tensor-parallel ranks run
        with it; 0: the whole model."""
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model_config.vocab_size
        self.kv_cache = allocate_kv_cache(config, num_blocks) if kv_cache is None else kv_cache
        # Tensor parallelism (kvserve/executor/): set by the engine; each forward's inputs
        # go to the other ranks before this rank runs it.
        self.executor: TPExecutor | None = None
        self.first_layers = first_layers
        # The engine seed feeds the generator of requests without their own seed, so the
        # same requests in the same order sample the same tokens run after run (vLLM's
        # --seed), whatever else the process does with torch's global generator.
        self.sampler = Sampler(seed=config.seed)
        # Set by the engine (it owns the tokenizer); None: no request may use a grammar.
        self.structured_output: StructuredOutputManager | None = None
        # Speculative decoding (kvserve/spec/): None without it.
        self.proposer = proposer
        # A proposer that reads the target's hidden states (medusa) says so: after each
        # step's sampling the runner hands it, per sampled request, the final-norm hidden
        # state of the row whose logits produced its last emitted token (observe_hidden).
        self._proposer_reads_hidden = proposer is not None and proposer.needs_hidden_states
        self.spec_stats = SpecStats()
        spec = config.speculative
        # CUDA graphs for decode steps (kvserve/graphs.py); None: every step eager.
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            sched = config.scheduler
            self.graphs = DecodeGraphs(
                self._model_logits, self.kv_cache, self.device, self.block_size,
                sched.max_num_seqs, -(-sched.max_model_len // self.block_size),
                max_query_len=1 + (spec.num_speculative_tokens if spec is not None else 0),
                max_position=sched.max_model_len - 1)
            logger.info("CUDA graphs: decode steps of up to %d requests x %d queries, each shape "
                        "captured when first run (--enforce-eager: none)",
                        self.graphs.batch_sizes[-1], self.graphs.max_query_len)
        self.spec_policy = None if spec is None else SpecPolicy(
            spec.num_speculative_tokens, spec.adaptive,
            draft_forwards=proposer.draft_forwards if proposer is not None else "none")

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
        # The sampling rows, in SamplingMetadata's row order: a request's last position, or
        # with k drafts its last k + 1 (the last real token's, then each draft's).
        sample_rows = [r for b in sample_idx
                       for r in range(int(qsl[b + 1]) - 1 - len(so.scheduled[b].spec_token_ids),
                                      int(qsl[b + 1]))]
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
        t0 = time.perf_counter()
        try:
            out = self._execute(so)
        except RuntimeError:
            if self.executor is not None:
                self.executor.check(wait_s=1.0)  # a collective failed: name the dead rank
            raise
        if self.spec_policy is not None:
            prefill = not all(s.is_decode for s in so.scheduled)
            self.spec_policy.observe_step(so.num_batched_tokens, time.perf_counter() - t0,
                                          prefill)
        return out

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_drafts: list[int],
                block_tables: list[list[int]], load: int = 0) -> list[list[int]]:
        """Draft tokens for the requests' next steps: the policy's count each, the
        proposer's guesses (a draft model writes its KV through the block tables). load:
        the requests the engine holds (SpecPolicy.num_drafts)."""
        assert self.proposer is not None and self.spec_policy is not None
        ks = self.spec_policy.num_drafts(requests, max_drafts,
                                         self.proposer.catch_up_tokens(requests), load)
        if not any(ks):
            return [[] for _ in requests]
        stops = None
        if self.proposer.stops_on_confidence:
            ks, stops = self.spec_policy.draft_stops(requests, ks, max_drafts)
        drafts = self.proposer.propose(requests, ks, block_tables, stops)
        if self.proposer.last_timing:
            self.spec_policy.observe_draft(self.proposer.last_timing)
        if self.proposer.last_catch_up:
            self.spec_policy.observe_catch_up(*self.proposer.last_catch_up)
        return drafts

    def forward(self, inp: ModelInput, scheduled: list[ScheduledRequest],
                prompt_lp: dict[str, Any], logits_rows: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of every token, logits of inp.logits_indices' rows: the first
        logits_rows of them, or all), for prepare_inputs' inp and prompt_lp of `scheduled`.
        Where every request decodes (its token and drafts, each sampled, so logits_indices
        is every row in order), a CUDA graph's replay when one fits; its tensors last until
        the next step."""
        if (self.graphs is not None and self.executor is None and not prompt_lp
                and all(s.is_decode for s in scheduled)):
            ran = self.graphs.run(inp)
            if ran is not None:
                return ran
        rows = inp.logits_indices[:logits_rows]
        if self.executor is not None:
            # The other ranks run the same forward with us (a self-draft's: its first
            # layers) and hand this rank their slices of the same rows' logits.
            self.executor.send_step(dataclasses.replace(inp, logits_indices=rows),
                                    self.first_layers)
        # Logits only for the rows that sample or need prompt logprobs.
        return self._model_logits(inp, self.kv_cache, rows)

    def _model_logits(self, inp: ModelInput, kv_cache: Any, rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's hidden states of every token and the logits of `rows` of them (None:
        every row, what a decode graph holds)."""
        hidden = self.model(inp, kv_cache)
        return hidden, self.model.compute_logits(hidden if rows is None else hidden[rows])

    def _execute(self, so: SchedulerOutput) -> ModelOutput:
        inp, sample_idx, prompt_lp = self.prepare_inputs(so)
        hidden, logits = self.forward(inp, so.scheduled, prompt_lp)
        requests = [so.scheduled[b].request for b in sample_idx]
        out = ModelOutput(req_ids=[r.request_id for r in requests], sampled_token_ids=[],
                          logprobs=[])
        row = 0  # logits rows used so far: the sampling rows come first
        if requests:
            # The rows prepare_inputs computed logits for: a request's 1 + k drafts rows.
            drafts = [so.scheduled[b].spec_token_ids for b in sample_idx]
            meta = SamplingMetadata.from_requests(requests, self.vocab_size, logits.device,
                                                  spec_token_ids=drafts)
            so_mgr = self.structured_output
            if so_mgr is not None:
                # A mask per row: row j's is the grammar's after the first j drafts.
                meta.token_bitmask = so_mgr.token_bitmask(requests, meta.row_offsets, drafts)
            row = meta.num_rows
            if any(drafts):
                assert self.proposer is not None
                verified = self.sampler.verify(
                    logits[:row], meta, self.proposer.draft_probs(requests, drafts))
                out.sampled_token_ids, out.logprobs = verified.token_ids, verified.logprobs
                self.spec_stats.record(drafts, out.sampled_token_ids)
                assert self.spec_policy is not None
                self.spec_policy.observe_verify(out.req_ids, drafts, out.sampled_token_ids)
            else:
                sampled = self.sampler(logits[:row], meta)
                out.sampled_token_ids = [[t] for t in sampled.token_ids]
                out.logprobs = [None if lp is None else [lp]
                                for lp in sampled.logprobs or [None] * row]
            if self._proposer_reads_hidden:
                # The row that produced each request's last token: row_offsets[b] + (tokens
                # it emitted - 1) of the sampling rows (without drafts: its one row).
                rows = [meta.row_offsets[b] + len(t) - 1
                        for b, t in enumerate(out.sampled_token_ids)]
                assert self.proposer is not None
                self.proposer.observe_hidden(
                    requests, hidden[inp.logits_indices[rows]], out.sampled_token_ids)
            if meta.token_bitmask is not None:
                assert so_mgr is not None
                # Every sampled token is appended (aborts land only between steps), so the
                # matcher advances here rather than in the scheduler.
                for b, req in enumerate(requests):
                    for t in out.sampled_token_ids[b]:
                        so_mgr.accept(req.request_id, t)
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

    def remove_requests(self, request_ids: list[str], finished: bool = True) -> None:
        """The requests are done: finished, or (finished=False) aborted."""
        for rid in request_ids:
            self.sampler.remove(rid)
            if self.structured_output is not None:
                self.structured_output.remove(rid)
        self.preempted(request_ids)
        if self.spec_policy is not None:
            self.spec_policy.remove(request_ids, finished)

    def preempted(self, request_ids: list[str]) -> None:
        """The requests' KV is gone (preempted) or no longer needed: the proposer's too."""
        if self.proposer is not None and request_ids:
            self.proposer.remove(request_ids)
