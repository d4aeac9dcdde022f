"""What a request passes on the event loop before AsyncEngine hands it to the engine thread.

In cost order, so that a request refused for a full queue or a long text costs no
tokenization and no grammar compilation:

    check_queue        the waiting-queue bounds (the server's and its tier's), against the
                       stats the engine thread last published plus the adds still being
                       prepared here (they will land in that queue): 503 before any work
    check_text_chars   a text prompt longer than any max_model_len-token context can hold
    prepare            tokenize + LLMEngine.check_request in the tokenizer pool, then the
                       grammar, compiled in its own bounded pool within grammar_timeout

The engine thread applies the exact queue rule when the add reaches it (LLMEngine.add_request);
the checks here only spare the work of a request that cannot get in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from kvserve.llm_engine import LLMEngine, PromptType
from kvserve.outputs import EngineStats
from kvserve.request import DEFAULT_TIER
from kvserve.sampling_params import ParamError, SamplingParams
from kvserve.scheduler import QueueFullError

# A text prompt longer than this many characters per token of the context cannot fit: no
# token of the vocabularies we load spans more characters than its longest entry, and the
# factor leaves room for normalizers that merge characters.
_CHARS_SLACK = 2


class Admission:
    def __init__(self, engine: LLMEngine, *, tokenizer_workers: int = 2,
                 grammar_workers: int = 1, grammar_timeout: float = 10.0,
                 max_pending_grammars: int = 8) -> None:
        """grammar_*: compiling a client's JSON schema can take seconds; it runs in its own
        pool of grammar_workers threads, at most max_pending_grammars queued or running (more
        get QueueFullError), and a request whose grammar is not compiled within
        grammar_timeout seconds gets a ValueError."""
        if not grammar_timeout > 0:
            raise ValueError(f"grammar_timeout must be > 0 seconds, got {grammar_timeout}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        sc = engine.config.scheduler
        self.max_model_len = sc.max_model_len
        self.max_waiting = sc.max_waiting_requests
        self.max_prompt_chars = _CHARS_SLACK * self.max_model_len * self.tokenizer.max_token_chars
        self.tier_caps = {t.name: t.max_waiting for t in sc.tiers}
        # Event loop only; every tier's key from the start, so that a copy taken on another
        # thread never sees the dict change size.
        self.tier_rejections = dict.fromkeys([*self.tier_caps, DEFAULT_TIER], 0)
        self.grammar_timeout = grammar_timeout
        self.max_pending_grammars = max_pending_grammars
        self.grammars_pending = 0  # event loop only
        self._pool = concurrent.futures.ThreadPoolExecutor(tokenizer_workers,
                                                           thread_name_prefix="kvserve-tok")
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            grammar_workers, thread_name_prefix="kvserve-grammar")
        # Adds not yet in the engine's waiting queue: started - applied - abandoned. Each
        # counter has one writer: started and abandoned (never submitted) the event loop,
        # applied the engine thread, which counts an add before it publishes the stats that
        # show it waiting, so no add is counted twice.
        self.adds_started = 0
        self.adds_abandoned = 0
        self.adds_applied = 0

    def check_queue(self, stats: EngineStats, tier: str | None = None) -> None:
        """QueueFullError (counted against its tier) where the waiting queue is full: stats
        (the engine thread's last published) plus the adds being prepared, which count as
        waiting since that is where they will land. A tier's own bound is checked against
        the published count alone."""
        try:
            pending = self.adds_started - self.adds_applied - self.adds_abandoned
            limit = self.max_waiting
            if limit is not None and stats.num_waiting_groups + pending >= limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
            tier = tier or DEFAULT_TIER
            cap = self.tier_caps.get(tier)
            counts = stats.tiers
            if cap is not None and counts is not None and counts.get(tier, (0, 0, 0))[2] >= cap:
                raise QueueFullError(f"the waiting queue of tier {tier!r} is full ({cap} "
                                     f"requests); retry later", tier=tier)
        except QueueFullError as e:
            self.count_rejection(e)
            raise

    def count_rejection(self, err: QueueFullError) -> None:
        if err.tier is not None:
            self.tier_rejections[err.tier] = self.tier_rejections.get(err.tier, 0) + 1

    def check_text_chars(self, n: int, field: str = "prompt") -> None:
        """ValueError when n characters of text cannot fit the context, whatever they
        tokenize to (checked before tokenizing them)."""
        if n > self.max_prompt_chars:
            raise ParamError(field, f"{field} has {n} characters: more than any "
                             f"{self.max_model_len}-token context (max_model_len) can hold (at "
                             f"most {self.max_prompt_chars} characters)")

    async def run_in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenizer work off the event loop (and off the engine thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prepare(self, prompt: PromptType, params: SamplingParams
                      ) -> tuple[PromptType, Any]:
        """The prompt tokenized and checked, and its grammar compiled (None without
        structured outputs). Raises ValueError (bad input) or QueueFullError (the grammar
        pool is full)."""
        prompt = await self.run_in_pool(self._preprocess, prompt, params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self._compile_grammar(params)
        return prompt, grammar

    def _preprocess(self, prompt: PromptType, params: SamplingParams) -> PromptType:
        """Pool thread: tokenizes a text prompt and runs the engine's request checks (prompt
        length, token ids, the logprobs budget), so a bad request is refused here, before
        its grammar is compiled and without reaching the engine thread."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            self.engine.check_request(list(prompt["prompt_token_ids"]), params)
        elif isinstance(prompt, list):
            self.engine.check_request(prompt, params)
        return prompt

    async def _compile_grammar(self, params: SamplingParams) -> Any:
        """The request's grammar, compiled in the grammar pool within grammar_timeout."""
        if self.grammars_pending >= self.max_pending_grammars:
            raise QueueFullError(f"{self.grammars_pending} grammars are being compiled, the "
                                 f"most this server queues; retry later")
        self.grammars_pending += 1
        loop = asyncio.get_running_loop()

        def done(_f: Any) -> None:  # counts the thread's work, which outlives a timeout
            try:
                loop.call_soon_threadsafe(self._grammar_done)
            except RuntimeError:  # the loop is closed: nobody counts any more
                pass

        cf = self._grammar_pool.submit(self.engine.structured_output.compile,
                                       params.structured_outputs)  # type: ignore[arg-type]
        cf.add_done_callback(done)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(cf)),
                                          self.grammar_timeout)
        except asyncio.TimeoutError:
            raise ParamError("response_format", f"json_schema took longer than "
                             f"{self.grammar_timeout:g}s to compile; send a simpler schema"
                             ) from None

    def _grammar_done(self) -> None:
        self.grammars_pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
