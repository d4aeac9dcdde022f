"""The asyncio front of LLMEngine: the step loop runs in its own thread beside the event loop.

    event loop                               engine thread
    ----------                               -------------
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
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from kvserve.admission import Admission
from kvserve.engine_args import EngineArgs
from kvserve.iteration_stats import RequestTimings, StatsListener
from kvserve.llm_engine import LLMEngine, PromptType
from kvserve.outputs import EngineSnapshot, EngineStats, RequestOutput
from kvserve.platform import configure_threads, in_own_thread, pin_thread
from kvserve.request_stream import EngineDeadError, EngineShuttingDown, RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import QueueFullError

logger = logging.getLogger("kvserve.async_engine")

# How long the idle engine thread sleeps on its command queue before checking for shutdown.
_IDLE_POLL_S = 0.5


SNAPSHOT_REQUESTS = 64


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    arrival: float
    stream: RequestStream
    result: concurrent.futures.Future
    grammar: Any = None  # params.structured_outputs compiled
    tenant: str | None = None
    tier: str | None = None


@dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None  # None: the caller stopped listening


@dataclass
class _Snapshot:
    result: concurrent.futures.Future


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
        self.stats_listener = stats_listener
        self.on_dead: Callable[[str], None] | None = None  # called on the loop
        self.watchdog_timeout = watchdog_timeout
        self._commands: queue.SimpleQueue[_Add | _Abort | _Snapshot | None] = \
            queue.SimpleQueue()
        # Engine thread writes, anyone reads: when its loop last came round (monotonic s).
        self._heartbeat = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Engine thread only.
        self._streams: dict[str, RequestStream] = {}
        self._timings = RequestTimings(tiered=self._tiered)
        # Event loop only: requests accepted and not yet finished, for draining.
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._snapshot: asyncio.Future | None = None  # the one being taken, shared
        self._publish_stats()
        self._dead: BaseException | None = None
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
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """The engine thread runs (it may still be stalled; see is_healthy)."""
        return (self._thread is not None and self._thread.is_alive() and self._dead is None
                and not self._stopping)

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
        return max(0.0, time.monotonic() - self._heartbeat)

    @property
    def stats(self) -> EngineStats:
        if not self._tiered:
            return self._stats
        return replace(self._stats, tier_rejections=dict(self.admission.tier_rejections))

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
            self._commands.put(_Abort(rid, EngineShuttingDown("the server is shutting down")))
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
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
        admission.check_queue(self._stats, tier)
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
        self._commands.put(_Add(request_id, prompt, params, priority, arrival, stream, result,
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
                if self._dead is not None or self._thread is None \
                        or not self._thread.is_alive():
                    raise EngineDeadError("the engine has stopped")
        except asyncio.CancelledError:
            # Cancelled while the engine thread was adding it: make sure it does not run.
            self._commands.put(_Abort(request_id))
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
                self._commands.put(_Abort(stream.request_id))
            self._mark_done(stream.request_id)

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def snapshot(self, timeout: float = 5.0) -> EngineSnapshot:
        """The block pool's picture and the requests, taken on the engine thread between two
        steps: that thread owns the scheduler and the pool, so no other thread reads them.
        Costs the engine nothing while nobody asks; callers asking at once share one snapshot
        (at most one per step however many ask). Raises EngineDeadError (also before start()
        and after shutdown), or TimeoutError when the loop has not come round within timeout
        seconds (a long step)."""
        if self._dead is not None or self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine has stopped")
        if self._snapshot is None or self._snapshot.done():
            cf: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(_Snapshot(cf))
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
            if self._dead is not None or self._thread is None or not self._thread.is_alive():
                raise EngineDeadError("the engine has stopped")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the engine loop has not come round in {timeout:g}s")

    def _check_accepting(self) -> None:
        if self._dead is not None or (self._thread is not None and not self._thread.is_alive()):
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

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        # OpenMP thread counts are per thread: set ours, not only the loader thread's.
        self.engine.bind_thread()  # first: a tensor-parallel rank 0's cores set the count
        configure_threads(self.engine.config.device)
        if self.cores is not None:
            pin_thread(self.cores)
        try:
            while True:
                self._heartbeat = time.monotonic()
                self.engine.check_health()  # a dead tensor-parallel rank ends the engine
                if not self._drain_commands(block=not self.engine.has_unfinished_requests()):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                t_step = time.monotonic()
                outputs = self.engine.step()
                self._dispatch(outputs, t_step)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine thread died")
            self._dead = e
            dead = EngineDeadError(f"the engine stopped: {type(e).__name__}")
            for stream in self._streams.values():
                self._post(self._deliver_error, stream, dead)
            self._streams.clear()
            self._fail_pending_adds(dead)
            if self.on_dead is not None:
                self._post(self.on_dead, f"{type(e).__name__}: {e}")
        finally:
            self._publish_stats()
            self.engine.shutdown()  # the other tensor-parallel ranks, if any

    def _fail_pending_adds(self, error: BaseException) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self.admission.adds_applied += 1
            if isinstance(cmd, (_Add, _Snapshot)) and not cmd.result.done():
                cmd.result.set_exception(error)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _drain_commands(self, block: bool) -> bool:
        """Applies queued adds and aborts; False once asked to stop."""
        while True:
            try:
                cmd = self._commands.get(timeout=_IDLE_POLL_S) if block else \
                    self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            elif isinstance(cmd, _Snapshot):
                cmd.result.set_result(self._take_snapshot())
            else:
                self._apply_abort(cmd)

    def _apply_add(self, cmd: _Add) -> None:
        self.admission.adds_applied += 1  # before any stats publish (see Admission)
        if cmd.result.cancelled():
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    priority=cmd.priority, arrival_time=cmd.arrival,
                                    grammar=cmd.grammar, tenant=cmd.tenant, tier=cmd.tier)
        except Exception as e:  # ValueError, QueueFullError: the caller's problem
            cmd.result.set_exception(e)
            return
        self._streams[cmd.request_id] = cmd.stream
        self._timings.add(cmd.request_id, cmd.arrival, _num_prompt_tokens(cmd.prompt),
                          cmd.tier)
        cmd.result.set_result(None)
        self._publish_stats()

    def _apply_abort(self, cmd: _Abort) -> None:
        stream = self._streams.pop(cmd.request_id, None)
        if stream is None:
            return  # finished already, or never added
        choices = self.engine.num_choices(cmd.request_id)
        self.engine.abort_request(cmd.request_id)
        it = self._timings.abort(cmd.request_id, choices)
        if cmd.error is not None:
            self._post(self._deliver_error, stream, cmd.error)
        if self.stats_listener is not None:
            self.stats_listener(it)
        self._publish_stats()

    def _take_snapshot(self) -> EngineSnapshot:
        """Engine thread. O(num_blocks + SNAPSHOT_REQUESTS)."""
        return self.engine.snapshot(self._stats, SNAPSHOT_REQUESTS)

    def _dispatch(self, outputs: list[RequestOutput], t_step: float) -> None:
        it = self._timings.step(outputs, t_step, time.monotonic(),
                                self.engine.first_scheduled_times())
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            self._post(self._deliver, stream, out)
        self._publish_stats()
        if self.stats_listener is not None:
            self.stats_listener(it)

    def _publish_stats(self) -> None:
        # One immutable object, swapped in whole: readers on other threads never see a mix.
        self._stats = self.engine.stats(tiers=self._tiered)


def _num_prompt_tokens(prompt: PromptType) -> int:
    if isinstance(prompt, dict):
        return len(prompt.get("prompt_token_ids") or ())
    return len(prompt) if isinstance(prompt, list) else 0
