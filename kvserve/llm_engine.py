"""The synchronous engine core: add_request / abort_request / step.

    add_request -> tokenize, validate -> Request -> Scheduler.waiting
    step()      -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update_from_output
                -> OutputProcessor.process: detokenize, stop strings -> RequestOutput
                   (cumulative) per updated request

A request with n > 1 fans out into n child requests (ids "<id>#<i>") that share the prompt's
KV blocks through the prefix cache; the OutputProcessor gathers their outputs into one
RequestOutput.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, NamedTuple

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.group import TPGroup
from kvserve.engine_args import EngineArgs
from kvserve.executor.tp import TPExecutor
from kvserve.kv.layout import resolve_kv_dtype
from kvserve.loader import load_checkpoint, resolve_model
from kvserve.loader.tokenizer import Tokenizer
from kvserve.model_runner import ModelRunner
from kvserve.model_setup import load_model, num_kv_blocks
from kvserve.output_processor import OutputProcessor
from kvserve.outputs import EngineSnapshot, EngineStats, RequestInfo, RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import MAX_LOGPROB_ENTRIES, ParamError, SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.spec.base import Proposer, SpecStats
from kvserve.spec.registry import build_proposer
from kvserve.structured_output import StructuredOutputManager

logger = logging.getLogger("kvserve")

PromptType = str | list[int] | dict[str, Any]
# The requests the warm-up runs at once (at most max_num_seqs): a burst's rows, and on a CPU
# where drafting's worth turns (Qwen2.5-Coder 1.5B + 0.5B, AVX2: 1.2x at one stream,
# break-even at 8); the policy prices larger counts from the rows measured there.
WARM_UP_ROWS = 8


class LoadedModel(NamedTuple):
    """A model in memory with what an engine around it needs; no KV cache, no threads."""

    config: EngineConfig
    tokenizer: Tokenizer
    model: torch.nn.Module


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, model: torch.nn.Module,
                 num_blocks: int, proposer: Proposer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.num_blocks = num_blocks
        if proposer is None:
            proposer = build_proposer(config, tokenizer, model)
        self.runner = ModelRunner(config, model, num_blocks, proposer)
        if proposer is not None:
            proposer.allocate_kv(num_blocks, self.runner.kv_cache)
        self.structured_output = StructuredOutputManager(
            tokenizer, config.model_config.vocab_size, config.grammar_cache_bytes)
        self.runner.structured_output = self.structured_output
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks,
                                   proposer.num_lookahead_tokens if proposer else 0)
        self.output_processor = OutputProcessor(tokenizer)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Loads the model and builds the engine. Process-wide settings (threads, gc.freeze)
        are the entry point's: kvserve.platform.setup_process."""
        t0 = time.perf_counter()
        path = resolve_model(args.model)
        ckpt = load_checkpoint(path)
        config = args.create_engine_config(path, ckpt.model_config)
        t_ckpt = time.perf_counter()
        executor = None
        tp = config.parallel.tensor_parallel_size
        if tp > 1:
            # The other ranks start now and load their shards while this one loads its own.
            executor = TPExecutor.start(args, config)
        try:
            group = executor.group if executor is not None else TPGroup.single()
            config, ops, model = load_model(args, ckpt, config, group)
            t_weights = time.perf_counter()
            engine = cls.from_loaded(LoadedModel(config, ckpt.tokenizer, model), executor)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        t_end = time.perf_counter()
        mc = config.model_config
        bs = config.cache.block_size
        logger.info("loaded %s (%s, %s, quantization=%s, ops=%s, %d threads%s) in %.1fs "
                    "(checkpoint %.1fs, model %.1fs, KV cache %.1fs); KV cache "
                    "(%s): %d blocks x %d tokens = %d tokens", path, mc.architecture,
                    config.dtype, config.quantization, ops.name, torch.get_num_threads(),
                    f", tensor_parallel_size {tp}" if tp > 1 else "",
                    t_end - t0, t_ckpt - t0, t_weights - t_ckpt, t_end - t_weights,
                    resolve_kv_dtype(config.cache.kv_cache_dtype, config.dtype),
                    engine.num_blocks - 1, bs, (engine.num_blocks - 1) * bs)
        return engine

    @staticmethod
    def load(args: EngineArgs) -> LoadedModel:
        """The model's weights in memory, no KV cache and no engine (one process only): what
        a model tier keeps warm (kvserve/server/model_pool.py); from_loaded makes it serve."""
        if args.tensor_parallel_size > 1:
            raise ValueError("LLMEngine.load is for one process; tensor_parallel_size > 1 "
                             "loads through from_engine_args")
        path = resolve_model(args.model)
        ckpt = load_checkpoint(path)
        config = args.create_engine_config(path, ckpt.model_config)
        config, _ops, model = load_model(args, ckpt, config, TPGroup.single())
        return LoadedModel(config, ckpt.tokenizer, model)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, executor: TPExecutor | None = None
                    ) -> LLMEngine:
        """An engine around a model already in memory: its proposer, and a fresh KV cache of
        the block count its config's budget holds (executor: the tensor-parallel ranks,
        which agree on that count). The model is shared, never copied: one LoadedModel may
        serve several engines in turn, one at a time."""
        config, tokenizer, model = loaded
        proposer = build_proposer(config, tokenizer, model)
        num_blocks = cls.num_kv_blocks(config, proposer.kv_bytes_per_block if proposer else 0)
        if executor is not None:
            num_blocks = executor.agree_blocks(num_blocks)
        engine = cls(config, tokenizer, model, num_blocks, proposer)
        engine.runner.executor = executor
        if proposer is not None:
            proposer.executor = executor
        return engine

    @staticmethod
    def num_kv_blocks(config: EngineConfig, extra_bytes_per_block: int = 0) -> int:
        """model_setup.num_kv_blocks (kept here: callers and tests name it on the engine)."""
        return num_kv_blocks(config, extra_bytes_per_block)

    def warm_up(self) -> float:
        """Short greedy generations through the whole path (kernels built and run, the
        first step's allocations, tensor-parallel ranks answering), run by the server before
        /health says ready, so a load balancer never hands a user the first, slow request:
        one request alone, then WARM_UP_ROWS at once (a burst's first steps run the batched
        kernels, cold until then). With speculation each pass drafts once, forced (up to K
        tokens, within the first block), and the speculative policy forgets those steps'
        times: they are the engine's first, cold ones. Then it times one more pass of
        WARM_UP_ROWS requests (a plain decode step of that many rows, the proposer's
        forwards over them, their verify step) and keeps those times, so that the first
        burst after one-stream traffic finds its row counts measured (step_costs.py). It
        leaves no other trace: no cached block (it computes fewer positions than a block of
        4+ holds), the counters at 0, no draw from the engine's generator (greedy), no
        acceptance or answer length in the policy. Returns its seconds."""
        t0 = time.perf_counter()
        policy = self.runner.spec_policy
        rows = min(WARM_UP_ROWS, self.config.scheduler.max_num_seqs)
        self._warm_up_pass(1)
        self._warm_up_pass(rows)
        if policy is not None:
            policy.forget()
            self._warm_up_pass(rows)
            policy.forget(keep_times=True)
        kv = self.scheduler.kv_cache_manager
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0
        self.runner.spec_stats = SpecStats()
        return time.perf_counter() - t0

    def _warm_up_pass(self, n: int) -> None:
        """n one-token requests at once, greedy: their prompt step, a plain decode step,
        and with speculation, k drafts each, forced (not the policy's choice), and their
        verify step."""
        ids = self.tokenizer.encode("Hello", add_special_tokens=False)[:1] or [0]
        policy, k = self.runner.spec_policy, 0
        if policy is not None:
            # The prompt's position, two decoded tokens' and k drafts' stay within a block.
            assert self.config.speculative is not None
            k = min(self.config.speculative.num_speculative_tokens,
                    max(0, self.config.cache.block_size - 4))
        for i in range(n):
            self.add_request(f"kvserve-warm-up-{i}", {"prompt_token_ids": ids},
                             SamplingParams(temperature=0, max_tokens=3 + k, ignore_eos=True))
        if policy is None:
            while self.has_unfinished_requests():
                self.step()
            return
        adaptive, k_max = policy.adaptive, policy.k_max
        try:
            policy.adaptive, policy.k_max = False, 0
            self.step()  # the prompts, and no drafts after them: the next step is plain
            policy.k_max = k_max
            while self.has_unfinished_requests():
                self.step()
        finally:
            policy.adaptive, policy.k_max = adaptive, k_max

    def bind_thread(self) -> None:
        """Called by the thread that will step the engine (AsyncEngine's): under tensor
        parallelism, pins it to rank 0's cores."""
        if self.runner.executor is not None:
            self.runner.executor.pin_thread()

    def check_health(self) -> None:
        """Raises when the engine can no longer step: a tensor-parallel rank has died."""
        if self.runner.executor is not None:
            self.runner.executor.check()

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (a no-op in one process). Idempotent."""
        if self.runner.executor is not None:
            self.runner.executor.shutdown()

    # ---- requests -----------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ParamError("prompt", f"prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def check_request(self, ids: list[int], params: SamplingParams) -> int:
        """The checks that need no engine state (any thread): ValueError naming the field;
        returns max_tokens resolved (None: the rest of the context)."""
        vocab = self.config.model_config.vocab_size
        max_len = self.config.scheduler.max_model_len
        if not ids:
            raise ParamError("prompt", "prompt must contain at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab - 1}], "
                             f"got {bad}")
        if len(ids) >= max_len:
            raise ParamError("prompt", f"prompt has {len(ids)} tokens, but the context "
                             f"(max_model_len) is {max_len}: at most {max_len - 1} prompt tokens "
                             f"leave room for one new token")
        params.validate_token_ids(vocab)
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise ParamError("max_tokens", f"prompt ({len(ids)} tokens) plus max_tokens "
                             f"({max_tokens}) is {len(ids) + max_tokens}, more than "
                             f"max_model_len ({max_len})")
        if params.logprobs is not None:
            # Every sampled token keeps logprobs + 1 entries until the request ends: bound the
            # product, not each factor (n=128 x 8k tokens x 21 is gigabytes of objects).
            per_token = params.logprobs + 1
            entries = params.n * max_tokens * per_token
            if entries > MAX_LOGPROB_ENTRIES:
                omitted = " (omitted: the rest of the context)" if params.max_tokens is None \
                    else ""
                raise ParamError(
                    "n", f"n x max_tokens x (logprobs + 1) = {params.n} x {max_tokens}{omitted} x "
                    f"{per_token} = {entries} logprob entries, more than the "
                    f"{MAX_LOGPROB_ENTRIES} one request may hold: lower n, max_tokens or "
                    f"logprobs (top_logprobs in chat)")
        return max_tokens

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, priority: int = 0,
                    arrival_time: float | None = None, grammar: Any = None,
                    tenant: str | None = None, tier: str | None = None) -> None:
        """Validate and queue a request. Raises ValueError (nothing is queued) on bad input.

        grammar: the compiled grammar of params.structured_outputs, when the caller compiled
        it ahead (off this thread, as AsyncEngine does); else it is compiled here. tenant:
        whose request it is (Request.tenant; the server passes its API key's hash); tier: its
        service tier (Request.tier; None: the default tier)."""
        params = params or SamplingParams()
        if request_id in self.output_processor:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        max_tokens = self.check_request(ids, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.structured_output.compile(params.structured_outputs)
        children: list[Request] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                # Distinct but reproducible streams for the n samples of a seeded request.
                seed = None if params.seed is None else params.seed + i
                child_params = dataclasses.replace(params, n=1, seed=seed)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(cid, ids, child_params, max_tokens=max_tokens, priority=priority,
                          arrival_time=arrival_time, prompt=text,
                          eos_token_ids=self.tokenizer.eos_token_ids, group_id=request_id,
                          tenant=tenant, tier=tier)
            req.grammar = grammar
            children.append(req)
        self.output_processor.add(request_id, text, ids, children,
                                  params.prompt_logprobs is not None)
        added: list[str] = []
        try:
            for req in children:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except Exception:
            for cid in added:  # all or nothing
                self.scheduler.abort_request(cid)
            self.output_processor.remove(request_id)
            raise

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            child_ids = self.output_processor.remove(rid)
            if not child_ids:
                continue
            for cid in child_ids:
                self.scheduler.abort_request(cid)
            self.runner.remove_requests(child_ids, finished=False)

    def num_choices(self, request_id: str) -> int:
        """How many choices (n) an unfinished request has; 0 for an unknown id."""
        return self.output_processor.num_choices(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # ---- what a serving layer reads, between steps (the engine's thread) ----------------

    def stats(self, tiers: bool = False) -> EngineStats:
        """The scheduler's counters now, and speculation's (a copy: the runner goes on
        counting into its own); tiers: the per-tier counts too."""
        s, runner = self.scheduler, self.runner
        st = runner.spec_stats
        spec = None if runner.proposer is None else dataclasses.replace(
            st, accepted_per_pos=list(st.accepted_per_pos))
        return EngineStats(s.num_running, s.num_waiting, s.num_waiting_groups,
                           s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits,
                           s.num_preemptions, spec, s.tier_counts() if tiers else None)

    def first_scheduled_times(self) -> dict[str, float]:
        """When each running request was first scheduled, by the id it was added with (an
        n > 1 request's: its first child's time)."""
        out: dict[str, float] = {}
        for req in self.scheduler.running:
            if req.first_scheduled_time is not None:
                pid = self.output_processor.parent_id(req.request_id)
                rid = req.request_id if pid is None else pid
                out.setdefault(rid, req.first_scheduled_time)
        return out

    def snapshot(self, stats: EngineStats, limit: int) -> EngineSnapshot:
        """stats beside the KV blocks' states and the first `limit` requests: running
        (schedule order), then waiting (queue order). O(num_blocks + limit)."""
        s = self.scheduler
        held = s.kv_cache_manager.req_to_blocks
        reqs = s.running[:limit] + list(itertools.islice(
            s.waiting, limit - min(len(s.running), limit)))
        return EngineSnapshot(stats, s.block_pool.block_states(), s.block_size, tuple(
            RequestInfo(r.request_id, r.tenant, r.status.name.lower(), len(r.prompt_token_ids),
                        len(r.output_token_ids), r.max_tokens, r.num_computed_tokens,
                        max(0, r.num_cached_tokens), len(held.get(r.request_id, ())))
            for r in reqs))

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        self.runner.preempted(so.preempted_ids)
        mo = self.runner.execute(so)
        for rid, (first, lps) in mo.prompt_logprobs.items():
            self.output_processor.record_prompt_logprobs(rid, first, lps)
        updated = self.scheduler.update_from_output(so, mo)
        outputs, finished_ids = self.output_processor.process(
            updated, dict(zip(mo.req_ids, mo.logprobs)), self._stop)
        self.runner.remove_requests(finished_ids)
        if self.runner.proposer is not None:
            self._propose()
        return outputs

    def _stop(self, req: Request, stop_str: str) -> None:
        self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_str)

    def _propose(self) -> None:
        """Drafts for the running requests whose next step is a decode (those that kept
        theirs because the budget skipped them keep them)."""
        sched = self.scheduler
        reqs = [r for r in sched.running
                if r.num_computed_tokens == r.num_tokens - 1 and not r.spec_token_ids]
        if reqs:
            drafts = self.runner.propose(
                reqs, [sched.max_drafts(r) for r in reqs],
                [sched.kv_cache_manager.get_block_ids(r.request_id) for r in reqs],
                min(len(sched.running) + len(sched.waiting), sched.config.max_num_seqs))
            for req, d in zip(reqs, drafts, strict=True):
                req.spec_token_ids = d
