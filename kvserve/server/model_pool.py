"""A server's several models (model tiers: `kvserve serve --model NAME=PATH ...`). At most
max_hot are hot (an AsyncEngine: KV cache, step loop), max_warm warm (the weights in memory,
no engine), the rest cold (on disk); placement.py decides which, LRU on use.

    acquire(m)  m hot: a Lease at once (the request holds it until its response has ended)
                else:  wait, at most load_timeout (then 503 + Retry-After), for the swapper
    swapper     one promotion at a time, in the order they were asked for:
      placement.use(m)        the new tiers
      warm -> cold            weights dropped first (before anything loads)
      hot -> warm / cold      "draining": no new leases; its requests run to their end
      m's weights             loaded if cold (a thread: the hot engines keep stepping)
      drained                 the engine shut down, its KV cache freed; weights kept if warm
      m's engine              built on the freed slot (its KV share, its cores), warmed up,
                              started: hot, and every waiting request gets its lease

A swap never fails a request: an engine is torn down only after its last lease is released,
and a request for a model that is not hot waits for it. At most max_hot engines (KV caches)
exist at any time; the weights of the model loading and of the one draining overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.async_engine import AsyncEngine
from kvserve.config import CacheConfig, parse_memory
from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine, LoadedModel
from kvserve.outputs import EngineStats
from kvserve.platform import (
    available_memory,
    default_device,
    in_own_thread,
    setup_process,
    share_cores,
)
from kvserve.server.errors import APIError, check_can_serve
from kvserve.server.placement import COLD, HOT, WARM, ModelPlacement

if TYPE_CHECKING:
    from kvserve.server.metrics import ServerMetrics
    from kvserve.tool_calling.support import ToolSupport

logger = logging.getLogger("kvserve.server")

# A model's state as /v1/models shows it: the placement's tiers, and the two on the way
# between them.
LOADING = "loading"  # becoming hot: its weights loading, or waiting for a slot to drain
DRAINING = "draining"  # leaving hot: no new requests, its running ones finishing


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args: EngineArgs  # args.model: its path; the KV budget its hot slot's (hot_slot_args)


class ModelLoader(Protocol):
    """What the pool needs to move a model up; both block (the pool runs them in threads)."""

    def load(self, spec: ModelSpec) -> Any:
        """cold -> the weights in memory (a LoadedModel)."""

    def build(self, spec: ModelSpec, weights: Any, slot: int) -> AsyncEngine:
        """The weights -> an engine on hot slot `slot` (its KV cache, warmed up, not
        started)."""


@dataclass(eq=False)
class ServedModel:
    spec: ModelSpec
    state: str = COLD
    weights: Any = None  # warm, loading (once loaded), hot, draining
    engine: AsyncEngine | None = None  # hot, draining
    slot: int | None = None  # the hot slot it holds (hot, draining)
    max_model_len: int | None = None  # known once it has loaded
    leases: int = 0
    # Set by the server each time the model goes hot, before it serves.
    tools: ToolSupport | None = None
    metrics: ServerMetrics | None = None
    waiters: list[asyncio.Future] = field(default_factory=list)
    queued: bool = False  # in the swapper's queue
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while leases == 0

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def name(self) -> str:
        return self.spec.name

    def stats(self) -> EngineStats | None:
        """Its engine's latest stats; None while it has no engine (ServerMetrics then shows
        no engine gauges for it)."""
        return self.engine.stats if self.engine is not None else None


class Lease:
    """A request's hold on a hot model: while one is held, the model's engine stays up."""

    def __init__(self, model: ServedModel) -> None:
        assert model.engine is not None
        self.model = model
        self.engine: AsyncEngine = model.engine
        self._held = True
        model.leases += 1
        model.idle.clear()

    def release(self) -> None:
        """Idempotent."""
        if self._held:
            self._held = False
            self.model.leases -= 1
            if self.model.leases == 0:
                self.model.idle.set()


class ModelPool:
    def __init__(self, specs: Sequence[ModelSpec], max_hot: int, max_warm: int,
                 loader: ModelLoader, load_timeout: float = 300.0) -> None:
        """specs: the first is the primary model, loaded at start (/health is 200 once it
        serves) and the one a request without a model field gets. load_timeout: how long a
        request waits for its model to become hot before it gets 503."""
        if not load_timeout > 0:
            raise ValueError(f"model_load_timeout must be > 0 seconds, got {load_timeout}")
        self.placement = ModelPlacement([s.name for s in specs], max_hot, max_warm)
        self.models = {s.name: ServedModel(s) for s in specs}
        self.primary = specs[0].name
        self.loader = loader
        self.load_timeout = load_timeout
        # Called on the loop as a model goes hot, before it serves (the server's metrics,
        # tools); on_dead once a hot engine has died (the server exits).
        self.on_hot: Callable[[ServedModel], None] | None = None
        self.on_dead: Callable[[str], None] | None = None
        self.started = False  # the primary has served: the server is ready
        self.load_error: str | None = None  # the primary's first load failed
        self.dead: str | None = None
        self.draining = False
        self._free_slots = list(range(max_hot))
        self._queue: asyncio.Queue[ServedModel] = asyncio.Queue()
        self._swapper: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Makes the primary hot, then starts the swapper. Returns once the primary serves,
        or with load_error set."""
        try:
            await self._promote(self.models[self.primary])
        except Exception as e:  # noqa: BLE001 - reported; /health stays 503
            logger.error("loading the model failed", exc_info=not isinstance(e, ValueError))
            self.load_error = f"{type(e).__name__}: {e}"
            return
        self.started = True
        self._swapper = asyncio.ensure_future(self._swap_loop())

    def begin_shutdown(self) -> None:
        """No new requests from now on; the waiting ones get 503."""
        self.draining = True
        for m in self.models.values():
            if m.engine is not None:
                m.engine.begin_drain()
            self._fail_waiters(m, APIError(503, "the server is shutting down",
                                           code="shutting_down", headers={"Retry-After": "5"}))

    async def shutdown(self, timeout: float) -> None:
        """Gives the running requests of every engine timeout seconds, then stops them."""
        self.begin_shutdown()
        if self._swapper is not None:
            self._swapper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._swapper
        await asyncio.gather(*(m.engine.shutdown(timeout) for m in self.models.values()
                               if m.engine is not None))

    @property
    def ready(self) -> bool:
        return (self.started and not self.draining and self.dead is None
                and all(e.is_healthy for e in self.engines()))

    @property
    def loading(self) -> bool:
        return any(m.state == LOADING for m in self.models.values())

    def engines(self) -> list[AsyncEngine]:
        """The engines that exist now: hot and draining models'."""
        return [m.engine for m in self.models.values() if m.engine is not None]

    def unhealthy_engine(self) -> AsyncEngine | None:
        return next((e for e in self.engines() if not e.is_healthy), None)

    def primary_engine(self) -> AsyncEngine:
        """The primary model's engine while it is hot (the web page's engine view), else a
        503 that says so."""
        m = self.models[self.primary]
        if m.state != HOT or m.engine is None:
            raise APIError(503, f"the model `{m.name}` is {m.state} now; the engine view "
                                f"shows it while it is hot", code="model_not_hot",
                           headers={"Retry-After": "5"})
        return m.engine

    # ---- requests -----------------------------------------------------------------------

    def check_serving(self) -> None:
        """What the single-model server checks before reading a body (api.ctx), here."""
        check_can_serve(draining=self.draining,
                        stopped=self.load_error is not None or self.dead is not None,
                        loading=not self.started)

    def find(self, name: str | None) -> ServedModel:
        """The model a request names (None: the primary); 404 naming the served ones."""
        if name is None:
            return self.models[self.primary]
        m = self.models.get(name)
        if m is None:
            served = ", ".join(f"`{n}`" for n in self.models)
            raise APIError(404, f"the model `{name}` does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")
        return m

    async def acquire(self, name: str | None) -> Lease:
        """A lease on the model, hot: at once if it is, else once the swapper has made it
        so. 404 for an unknown model; 503 with Retry-After after load_timeout seconds, or
        when its load failed. The caller must release() the lease."""
        m = self.find(name)
        self.check_serving()
        if m.state == HOT:
            moved = self.placement.use(m.name)
            assert not moved, moved  # using a hot model only reorders the hot ones
            return Lease(m)
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        m.waiters.append(fut)
        if not m.queued:
            m.queued = True
            self._queue.put_nowait(m)
        try:
            done, _ = await asyncio.wait([fut], timeout=self.load_timeout)
        except BaseException:  # the caller was cancelled (its client went away)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release()
            fut.cancel()
            raise
        if not done:
            fut.cancel()
            raise APIError(503, f"the model `{m.name}` is still loading after "
                                f"{self.load_timeout:g}s; retry shortly", code="loading",
                           headers={"Retry-After": "5"})
        return fut.result()  # raises the load's error

    def listing(self, created: int) -> list[dict[str, Any]]:
        """/v1/models' data: every model, its state, max_model_len once known."""
        return [{"id": m.name, "object": "model", "created": created, "owned_by": "kvserve",
                 "root": m.name, "parent": None, "max_model_len": m.max_model_len,
                 "state": m.state} for m in self.models.values()]

    # ---- the swapper --------------------------------------------------------------------

    async def _swap_loop(self) -> None:
        while True:
            m = await self._queue.get()
            m.queued = False
            m.waiters = [f for f in m.waiters if not f.done()]
            if m.state == HOT:
                self._grant(m)
                continue
            if not m.waiters:
                continue  # everyone who asked has gone (timed out, disconnected)
            try:
                await self._promote(m)
            except Exception:  # noqa: BLE001 - logged; its waiters get a 503
                logger.exception("loading the model `%s` failed", m.name)
                self._fail_waiters(m, APIError(
                    503, f"the model `{m.name}` could not be loaded; see the server log",
                    code="model_load_failed"))

    async def _promote(self, m: ServedModel) -> None:
        t0 = time.monotonic()
        order = self.placement.recent()
        changes = self.placement.use(m.name)
        leaving = {n: t for n, t in changes.items() if n != m.name}
        draining: list[ServedModel] = []
        for name, tier in leaving.items():
            x = self.models[name]
            if x.engine is not None:
                x.state = DRAINING  # no new leases from here on
                draining.append(x)
            elif tier == COLD:
                self._drop(x)  # warm -> cold: its memory back before anything loads
        m.state = LOADING
        loop = asyncio.get_running_loop()
        slot = None
        try:
            if m.weights is None:
                m.weights = await loop.run_in_executor(None, self.loader.load, m.spec)
            m.max_model_len = _max_model_len(m.weights)
            t_weights = time.monotonic()
            for x in draining:
                await self._demote(x, leaving[x.name])
            slot = self._free_slots.pop(0)
            engine = await loop.run_in_executor(None, self.loader.build, m.spec, m.weights,
                                                slot)
            m.engine, m.slot = engine, slot
            engine.on_dead = self._engine_died
            if self.on_hot is not None:
                self.on_hot(m)
        except BaseException:
            if slot is not None:
                self._free_slots.insert(0, slot)
            m.engine = m.slot = None  # never started: nothing to stop
            self._drop(m)
            for x in draining:  # not torn down yet: it stays hot and serves again
                if x.state == DRAINING and x.engine is not None:
                    x.state = HOT
            # The placement as it was, without m, and as the models now are: those with an
            # engine hot, those with weights warm. (Whatever use() pushed out must not stay
            # out: with no warm place, a draining model would be cold there, stuck draining.)
            order = [n for n in order if n != m.name]
            self.placement.restore(
                [n for n in order if self.models[n].engine is not None]
                + [n for n in order if self.models[n].engine is None
                   and self.models[n].weights is not None])
            raise
        m.max_model_len = engine.max_model_len
        engine.start()
        m.state = HOT
        logger.info("model `%s` hot on slot %d in %.1fs (weights %.1fs); tiers: %s", m.name,
                    slot, time.monotonic() - t0, t_weights - t0,
                    ", ".join(f"{n} {x.state}" for n, x in self.models.items()))
        self._grant(m)

    async def _demote(self, x: ServedModel, tier: str) -> None:
        """A draining model once its last request has finished: its engine shut down (the
        KV cache freed), its weights kept if it is warm now."""
        await x.idle.wait()
        engine, x.engine = x.engine, None
        assert engine is not None and x.slot is not None
        await engine.shutdown(0.0)  # nothing in flight: every lease has been released
        self._free_slots.append(x.slot)
        x.slot = None
        if tier == WARM:
            x.state = WARM
        else:
            self._drop(x)
        # Its build froze what it made (platform.setup_process): unfrozen, so that the
        # collector can free whatever of the old engine sits in reference cycles. The next
        # build, which follows at once, freezes what is left again.
        gc.unfreeze()

    def _drop(self, x: ServedModel) -> None:
        x.weights = None
        x.state = COLD

    def _grant(self, m: ServedModel) -> None:
        for f in m.waiters:
            if not f.done():
                f.set_result(Lease(m))
        m.waiters = []

    def _fail_waiters(self, m: ServedModel, err: APIError) -> None:
        for f in m.waiters:
            if not f.done():
                f.set_exception(err)
        m.waiters = []

    def _engine_died(self, message: str) -> None:
        self.dead = message
        if self.on_dead is not None:
            self.on_dead(message)


def _max_model_len(weights: Any) -> int | None:
    config = getattr(weights, "config", None)
    return config.scheduler.max_model_len if config is not None else None


def hot_slot_args(args: EngineArgs, max_hot: int) -> EngineArgs:
    """The engine settings of one of max_hot hot slots: the KV budget split evenly. The
    total is --kv-cache-memory, or by default the share of free memory (CacheConfig's
    kv_cache_memory_fraction) measured once, now, before any model loads, so that no engine
    sizes its cache on what the others left. An exact --num-gpu-blocks-override is each
    engine's."""
    if args.num_gpu_blocks_override is not None:
        return args
    total = parse_memory(args.kv_cache_memory)
    if total is None:
        device = default_device() if args.device == "auto" else args.device
        total = int(available_memory(device) * CacheConfig.kv_cache_memory_fraction)
    return dataclasses.replace(args, kv_cache_memory=total // max_hot)


class EngineLoader:
    """The real ModelLoader: LLMEngine.load for the weights, AsyncEngine.build for an engine
    (both in short-lived threads: platform.in_own_thread). With several hot slots, slot
    i's engine runs on share_cores(i, max_hot), one thread per core; with one, on the
    process's threads as a single-model server does."""

    def __init__(self, max_hot: int, **engine_kwargs: Any) -> None:
        """engine_kwargs: AsyncEngine's (grammar_timeout, watchdog_timeout)."""
        self.cores = [share_cores(i, max_hot) for i in range(max_hot)] if max_hot > 1 \
            else None
        self.engine_kwargs = engine_kwargs

    def load(self, spec: ModelSpec) -> LoadedModel:
        return in_own_thread(lambda: LLMEngine.load(spec.args))

    def build(self, spec: ModelSpec, weights: LoadedModel, slot: int) -> AsyncEngine:
        # setup_process around each build: the first one sets the threads and, like every
        # later one, freezes what start-up built (platform.setup_process).
        with setup_process(spec.args.device):
            return AsyncEngine.build(lambda: LLMEngine.from_loaded(weights),
                                     cores=self.cores[slot] if self.cores else None,
                                     **self.engine_kwargs)
