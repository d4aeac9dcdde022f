"""AsyncEngine's engine thread: LLMEngine's step loop, fed commands between steps.

    event loop (AsyncEngine)                 engine thread (EngineThread)
    ------------------------                 ----------------------------
    put(Add | Abort | Snapshot | None) --->  between steps: drain the commands
                                               Add: LLMEngine.add_request, the stream kept
                                               Abort: LLMEngine.abort_request
                                               Snapshot: LLMEngine.snapshot
                                               None: stop
    deliver(stream, output)  <-- posted      step() -> RequestOutput per request
    fail(stream, error)      <-- posted      (the thread died: every stream fails)
    died(message)            <-- posted
    stats (read anywhere)    <-- swapped     EngineStats after every change

The thread owns the LLMEngine (its scheduler and block pool) from start() to its end: no
other thread calls into it, so commands are applied only between steps and an abort never
lands between schedule() and the forward. Callbacks reach the event loop through
call_soon_threadsafe; the loop side owns the streams' delivery and its in-flight set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.admission import Admission
from kvserve.iteration_stats import RequestTimings, StatsListener
from kvserve.llm_engine import LLMEngine, PromptType
from kvserve.outputs import EngineSnapshot, EngineStats, RequestOutput
from kvserve.platform import configure_threads, pin_thread
from kvserve.request_stream import EngineDeadError, RequestStream
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine_thread")

# How long the idle engine thread sleeps on its command queue before checking for shutdown.
_IDLE_POLL_S = 0.5

# The requests a snapshot lists (the web page's list; the block pool's picture is whole).
SNAPSHOT_REQUESTS = 64


@dataclass
class Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    arrival: float
    stream: RequestStream
    result: concurrent.futures.Future  # None once added, or the engine's ValueError etc.
    grammar: Any = None  # params.structured_outputs compiled
    tenant: str | None = None
    tier: str | None = None


@dataclass
class Abort:
    request_id: str
    error: BaseException | None = None  # None: the caller stopped listening


@dataclass
class Snapshot:
    result: concurrent.futures.Future  # the EngineSnapshot


Command = Add | Abort | Snapshot | None  # None: stop


class EngineThread:
    """The thread that runs engine.step() while requests are unfinished, and applies the
    queued commands between steps. deliver / fail / died are called on the event loop given
    to start()."""

    def __init__(self, engine: LLMEngine, admission: Admission, *, tiered: bool,
                 deliver: Callable[[RequestStream, RequestOutput], None],
                 fail: Callable[[RequestStream, BaseException], None],
                 died: Callable[[str], None],
                 stats_listener: StatsListener | None = None) -> None:
        self.engine = engine
        self.admission = admission
        self._tiered = tiered  # tier stats only where tiers are configured
        self._deliver, self._fail, self._died = deliver, fail, died
        self.stats_listener = stats_listener  # called here with each IterationStats
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Written by this thread, read by any: when its loop last came round (monotonic s),
        # and what killed it.
        self.heartbeat = time.monotonic()
        self.dead: BaseException | None = None
        self.thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cores: list[int] | None = None
        # This thread only.
        self._streams: dict[str, RequestStream] = {}
        self._timings = RequestTimings(tiered=tiered)
        self._publish_stats()

    @property
    def stats(self) -> EngineStats:
        """The newest EngineStats: one immutable object, swapped in whole, so readers on
        other threads never see a mix."""
        return self._stats

    def start(self, loop: asyncio.AbstractEventLoop, cores: list[int] | None) -> None:
        """cores: pin the thread there (AsyncEngine.cores); None: the process's threads."""
        self._loop, self._cores = loop, cores
        self.thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.thread.start()

    @property
    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.dead is None

    def put(self, cmd: Command) -> None:
        self.commands.put(cmd)

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        # OpenMP thread counts are per thread: set ours, not only the loader thread's.
        self.engine.bind_thread()  # first: a tensor-parallel rank 0's cores set the count
        configure_threads(self.engine.config.device)
        if self._cores is not None:
            pin_thread(self._cores)
        try:
            while True:
                self.heartbeat = time.monotonic()
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
            self.dead = e
            dead = EngineDeadError(f"the engine stopped: {type(e).__name__}")
            for stream in self._streams.values():
                self._post(self._fail, stream, dead)
            self._streams.clear()
            self._fail_pending_adds(dead)
            self._post(self._died, f"{type(e).__name__}: {e}")
        finally:
            self._publish_stats()
            self.engine.shutdown()  # the other tensor-parallel ranks, if any

    def _fail_pending_adds(self, error: BaseException) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Add):
                self.admission.adds_applied += 1
            if isinstance(cmd, (Add, Snapshot)) and not cmd.result.done():
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
                cmd = self.commands.get(timeout=_IDLE_POLL_S) if block else \
                    self.commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, Add):
                self._apply_add(cmd)
            elif isinstance(cmd, Snapshot):
                cmd.result.set_result(self._take_snapshot())
            else:
                self._apply_abort(cmd)

    def _apply_add(self, cmd: Add) -> None:
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

    def _apply_abort(self, cmd: Abort) -> None:
        stream = self._streams.pop(cmd.request_id, None)
        if stream is None:
            return  # finished already, or never added
        choices = self.engine.num_choices(cmd.request_id)
        self.engine.abort_request(cmd.request_id)
        it = self._timings.abort(cmd.request_id, choices)
        if cmd.error is not None:
            self._post(self._fail, stream, cmd.error)
        if self.stats_listener is not None:
            self.stats_listener(it)
        self._publish_stats()

    def _take_snapshot(self) -> EngineSnapshot:
        """O(num_blocks + SNAPSHOT_REQUESTS)."""
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
        self._stats = self.engine.stats(tiers=self._tiered)


def _num_prompt_tokens(prompt: PromptType) -> int:
    if isinstance(prompt, dict):
        return len(prompt.get("prompt_token_ids") or ())
    return len(prompt) if isinstance(prompt, list) else 0
