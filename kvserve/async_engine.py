"""The asyncio front of LLMEngine: the step loop runs in its own thread beside the event loop.

    event loop (AsyncEngine)                 engine thread (engine_thread.py)
    ------------------------                 --------------------------------
    add_request: Admission (admission.py):
      queue bound (503 before any work), text length,
      tokenize + request checks (tokenizer pool),
      compile grammar (its own bounded pool, with a timeout)
      -> command queue  ------------------>  between steps: drain commands
                                               add_request / abort_request (LLMEngine)
    RequestStream  <-- call_soon_threadsafe    step() -> RequestOutput (cumulative)
    (latest output wins)                       -> stats snapshot, IterationStats, heartbeat

Commands are drained only between steps, so an abort never lands between schedule() and the
forward. Outputs are cumulative, so a stream keeps only the newest one: a slow reader skips
intermediate states instead of queueing them, and its deltas stay exact (the reader diffs
against what it last sent).

When the engine thread dies, every stream ends with EngineDeadError, is_healthy turns False
and on_dead is called. When the loop is alive but has not come round for watchdog_timeout
seconds while requests are in flight (a hung step), is_healthy is False too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from kvserve.admission import Admission
from kvserve.engine_args import EngineArgs
from kvserve.engine_thread import Abort, Add, EngineThread, Snapshot
from kvserve.iteration_stats import StatsListener
from kvserve.llm_engine import LLMEngine, PromptType
from kvserve.outputs import EngineSnapshot, EngineStats, RequestOutput
from kvserve.platform import in_own_thread, pin_thread
from kvserve.request_stream import EngineDeadError, EngineShuttingDown, RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import QueueFullError

logger = logging.getLogger("kvserve.async_engine")


class AsyncEngine:
    # The cores the engine thread is pinned to, one intra-op thread each, when the process
    # runs several engines side by side (a server's hot models: platform.share_cores); None:
    # the process's threads (configure_threads).
    cores: list[int] | None = None

    def __init__(self, engine: LLMEngine, *, stats_listener: StatsListener | None = None,
                 tokenizer_workers: int = 2, grammar_workers: int = 1,
                 grammar_timeout: float = 10.0, max_pending_grammars: int = 8,
                 watchdog_timeout: float = 60.0) -> None:
        """tokenizer_workers, grammar_*: the Admission's (admission.py). watchdog_timeout:
        see is_healthy."""
        if not watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0 seconds, got {watchdog_timeout}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler.max_model_len
        self.admission = Admission(engine, tokenizer_workers=tokenizer_workers,
                                   grammar_workers=grammar_workers,
                                   grammar_timeout=grammar_timeout,
                                   max_pending_grammars=max_pending_grammars)
        # tier stats and metrics only where tiers are configured
        self._tiered = bool(engine.config.scheduler.tiers)
        self.on_dead: Callable[[str], None] | None = None  # called on the loop
        self.watchdog_timeout = watchdog_timeout
        self.engine_thread = EngineThread(engine, self.admission, tiered=self._tiered,
                                          deliver=self._deliver, fail=self._deliver_error,
                                          died=self._died, stats_listener=stats_listener)
        # Event loop only: requests accepted and not yet finished, for draining.
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._snapshot: asyncio.Future | None = None  # the one being taken, shared
        self._draining = False
        self._stopping = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncEngine:
        """Loads the model and builds the LLMEngine (build: in a short-lived thread)."""
        return cls.build(lambda: LLMEngine.from_engine_args(args), **kwargs)

    @classmethod
    def build(cls, make: Callable[[], LLMEngine], cores: list[int] | None = None,
              **kwargs: Any) -> AsyncEngine:
        """Runs make() and the engine's warm-up in a short-lived thread of its own
        (in_own_thread), then wraps the engine (not started). A server is ready only after
        the warm-up. cores: the engine's share of the cores when it is one of several in the
        process (see AsyncEngine.cores); the build and warm-up run there too."""

        def build() -> LLMEngine:
            if cores is not None:
                pin_thread(cores)  # this thread only, and it ends here
            engine = make()
            # In this thread too (see in_own_thread).
            logger.info("warmed up in %.2fs", engine.warm_up())
            return engine

        async_engine = cls(in_own_thread(build), **kwargs)
        async_engine.cores = cores
        return async_engine

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will read the streams."""
        if self.engine_thread.thread is not None:
            return
        self._idle.set()
        self.engine_thread.start(asyncio.get_running_loop(), self.cores)

    @property
    def is_alive(self) -> bool:
        """The engine thread runs (it may still be stalled; see is_healthy)."""
        return self.engine_thread.is_alive and not self._stopping

    @property
    def is_healthy(self) -> bool:
        """Alive, and not stalled: with requests in flight, the engine loop has come round
        within watchdog_timeout seconds (a hung step keeps the thread alive forever)."""
        return self.is_alive and self.stalled_for() <= self.watchdog_timeout

    @property
    def is_draining(self) -> bool:
        return self._draining

    def stalled_for(self) -> float:
        """Seconds since the engine loop last came round, while requests are in flight."""
        if not self._in_flight:
            return 0.0
        return max(0.0, time.monotonic() - self.engine_thread.heartbeat)

    @property
    def stats(self) -> EngineStats:
        stats = self.engine_thread.stats
        if not self._tiered:
            return stats
        return replace(stats, tier_rejections=dict(self.admission.tier_rejections))

    @property
    def stats_listener(self) -> StatsListener | None:
        """Called on the engine thread with each step's (and abort's) IterationStats."""
        return self.engine_thread.stats_listener

    @stats_listener.setter
    def stats_listener(self, listener: StatsListener | None) -> None:
        self.engine_thread.stats_listener = listener

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Takes no new requests, waits up to timeout s for in-flight ones, ends the rest with
        EngineShuttingDown, then stops the engine thread."""
        self._draining = True
        if self._in_flight and timeout > 0:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning("shutdown: %d request(s) still running after %.1fs; ending them",
                               len(self._in_flight), timeout)
        for rid in list(self._in_flight):
            self.engine_thread.put(Abort(rid, EngineShuttingDown("the server is shutting down")))
        self._stopping = True
        self.engine_thread.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self.engine_thread.join, 10.0)
        self.admission.shutdown()

    def begin_drain(self) -> None:
        """Refuse new requests from now on (the first step of a graceful shutdown)."""
        self._draining = True

    # ---- requests (event loop) ----------------------------------------------------------

    async def run_in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenizer work off the event loop (and off the engine thread)."""
        return await self.admission.run_in_pool(fn, *args)

    def check_text_chars(self, n: int, field: str = "prompt") -> None:
        """ValueError when n characters of text cannot fit the context (Admission's)."""
        self.admission.check_text_chars(n, field)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, *, tenant: str | None = None,
                          tier: str | None = None) -> RequestStream:
        """Queues a request and returns its stream once the engine has accepted it. tenant:
        whose request it is (LLMEngine.add_request; the server's hash of its API key); tier:
        its service tier (None: the default).

        Raises ValueError (bad input), QueueFullError, EngineDeadError or EngineShuttingDown;
        nothing is queued then. The cheap checks come first, so a request refused for a full
        queue or a long text costs no tokenization and no grammar compilation.
        """
        self._check_accepting()
        admission = self.admission
        admission.check_queue(self.engine_thread.stats, tier)
        if isinstance(prompt, str):
            admission.check_text_chars(len(prompt))
        arrival = time.monotonic()
        admission.adds_started += 1
        submitted = False
        try:
            prompt, grammar = await admission.prepare(prompt, params)
            self._check_accepting()
            submitted = True  # _submit queues the command before it first awaits
            return await self._submit(request_id, prompt, params, priority, arrival, grammar,
                                      tenant, tier)
        except QueueFullError as e:  # the engine thread's exact check
            admission.count_rejection(e)
            raise
        finally:
            if not submitted:
                admission.adds_abandoned += 1

    async def _submit(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      priority: int, arrival: float, grammar: Any,
                      tenant: str | None = None, tier: str | None = None) -> RequestStream:
        stream = RequestStream(request_id)
        result: concurrent.futures.Future = concurrent.futures.Future()
        # In flight before the engine can see it: its first output may reach the loop before
        # this coroutine resumes.
        self._in_flight.add(request_id)
        self._idle.clear()
        self.engine_thread.put(Add(request_id, prompt, params, priority, arrival, stream, result,
                                   grammar, tenant, tier))
        fut = asyncio.wrap_future(result)
        try:
            while True:
                # Polls for a dead engine: a command queued just as the thread died has no
                # one left to answer it.
                done, _ = await asyncio.wait([fut], timeout=1.0)
                if done:
                    fut.result()  # raises the engine's ValueError / QueueFullError
                    break
                if not self.engine_thread.is_alive:
                    raise EngineDeadError("the engine has stopped")
        except asyncio.CancelledError:
            # Cancelled while the engine thread was adding it: make sure it does not run.
            self.engine_thread.put(Abort(request_id))
            self._mark_done(request_id)
            raise
        except BaseException:
            self._mark_done(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, *, tenant: str | None = None,
                       tier: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished. Leaving the loop early (break, cancellation,
        client disconnect) aborts the request and frees its KV blocks."""
        stream = await self.add_request(request_id, prompt, params, priority, tenant=tenant,
                                        tier=tier)
        try:
            async for out in stream:
                yield out
        finally:
            self.release(stream)

    def release(self, stream: RequestStream) -> None:
        """The caller is done with a stream: aborts the request if it has not finished."""
        if stream.request_id in self._in_flight:
            if not stream.finished:
                self.engine_thread.put(Abort(stream.request_id))
            self._mark_done(stream.request_id)

    async def abort(self, request_id: str) -> None:
        self.engine_thread.put(Abort(request_id))

    async def snapshot(self, timeout: float = 5.0) -> EngineSnapshot:
        """The block pool's picture and the requests, taken on the engine thread between two
        steps: that thread owns the scheduler and the pool, so no other thread reads them.
        Costs the engine nothing while nobody asks; callers asking at once share one snapshot
        (at most one per step however many ask). Raises EngineDeadError (also before start()
        and after shutdown), or TimeoutError when the loop has not come round within timeout
        seconds (a long step)."""
        if not self.engine_thread.is_alive:
            raise EngineDeadError("the engine has stopped")
        if self._snapshot is None or self._snapshot.done():
            cf: concurrent.futures.Future = concurrent.futures.Future()
            self.engine_thread.put(Snapshot(cf))
            self._snapshot = asyncio.wrap_future(cf)
        fut = self._snapshot
        deadline = time.monotonic() + timeout
        while True:
            # wait() never cancels fut: one caller's cancellation (its client gone) leaves it
            # to the others.
            done, _ = await asyncio.wait([fut], timeout=min(1.0, max(0.0, deadline
                                                                     - time.monotonic())))
            if done:
                return fut.result()
            if not self.engine_thread.is_alive:
                raise EngineDeadError("the engine has stopped")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the engine loop has not come round in {timeout:g}s")

    def _check_accepting(self) -> None:
        started = self.engine_thread.thread is not None
        if started and not self.engine_thread.is_alive:
            raise EngineDeadError("the engine has stopped")
        if self._draining or self._stopping:
            raise EngineShuttingDown("the server is shutting down")

    def _mark_done(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        if not self._in_flight:
            self._idle.set()

    def _deliver(self, stream: RequestStream, output: RequestOutput) -> None:
        stream.put(output)
        if output.finished:
            self._mark_done(stream.request_id)

    def _deliver_error(self, stream: RequestStream, error: BaseException) -> None:
        stream.fail(error)
        self._mark_done(stream.request_id)

    def _died(self, message: str) -> None:
        if self.on_dead is not None:
            self.on_dead(message)
