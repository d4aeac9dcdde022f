"""ModelPool (model tiers) on fake engines: the order of loads, drains and builds, that a
swap waits for a draining engine's requests instead of failing them, and the errors."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvserve.engine_args import EngineArgs
from kvserve.outputs import EngineStats
from kvserve.server.errors import APIError
from kvserve.server.model_pool import Lease, ModelPool, ModelSpec


class FakeEngine:
    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name = name
        self.log = log
        self.max_model_len = 100 + len(name)
        self.on_dead: Callable[[str], None] | None = None
        self.started = self.stopped = self.is_draining = False
        self.stats = EngineStats(num_running=1)

    @property
    def is_healthy(self) -> bool:
        return self.started and not self.stopped

    def start(self) -> None:
        self.started = True

    def begin_drain(self) -> None:
        self.is_draining = True

    async def shutdown(self, timeout: float) -> None:
        self.log.append(("shutdown", self.name))
        self.stopped = True


class FakeLoader:
    """Records what the pool asks for; a model in `hold` loads only once its event is set."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.hold: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def load(self, spec: ModelSpec) -> Any:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.log.append(("load", spec.name))
            if spec.name in self.hold:
                assert self.hold[spec.name].wait(10)
            if spec.name in self.fail:
                raise ValueError(f"{spec.name} is broken")
            return f"weights of {spec.name}"
        finally:
            with self._lock:
                self.active -= 1

    def build(self, spec: ModelSpec, weights: Any, slot: int) -> Any:
        assert weights == f"weights of {spec.name}"
        self.log.append(("build", spec.name, slot))
        return FakeEngine(spec.name, self.log)


def make_pool(names: str = "abc", max_hot: int = 1, max_warm: int = 1,
              load_timeout: float = 10.0) -> tuple[ModelPool, FakeLoader]:
    loader = FakeLoader()
    specs = [ModelSpec(n, EngineArgs(model=f"/models/{n}")) for n in names]
    return ModelPool(specs, max_hot, max_warm, loader, load_timeout), loader


def states(pool: ModelPool) -> dict[str, str]:
    return {n: m.state for n, m in pool.models.items()}


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())  # type: ignore[arg-type]


def test_a_swap_waits_for_the_draining_engines_requests() -> None:
    async def main() -> None:
        pool, loader = make_pool()
        await pool.start()
        assert pool.ready and states(pool) == {"a": "hot", "b": "cold", "c": "cold"}
        lease_a = await pool.acquire("a")
        engine_a = lease_a.engine
        b = asyncio.ensure_future(pool.acquire("b"))
        await until(lambda: ("load", "b") in loader.log)
        await asyncio.sleep(0.05)
        # b's weights are in; its engine waits for a's request, which runs on untouched.
        assert states(pool) == {"a": "draining", "b": "loading", "c": "cold"}
        assert not b.done() and not engine_a.stopped and pool.ready
        lease_a.release()
        lease_b = await b
        assert lease_b.engine.name == "b" and lease_b.engine.started
        assert engine_a.stopped
        assert states(pool) == {"a": "warm", "b": "hot", "c": "cold"}
        assert loader.log == [("load", "a"), ("build", "a", 0), ("load", "b"),
                              ("shutdown", "a"), ("build", "b", 0)]
        lease_b.release()
        await pool.shutdown(1.0)
    run(main)


def test_warm_is_promoted_without_a_load_and_warm_beyond_w_goes_cold() -> None:
    async def main() -> None:
        pool, loader = make_pool()
        await pool.start()
        for name, want in (("b", {"a": "warm", "b": "hot", "c": "cold"}),
                           ("c", {"a": "cold", "b": "warm", "c": "hot"}),
                           ("b", {"a": "cold", "b": "hot", "c": "warm"})):
            (await pool.acquire(name)).release()
            assert states(pool) == want
        loads = [e[1] for e in loader.log if e[0] == "load"]
        assert loads == ["a", "b", "c"]  # b came back from warm: no second load
        assert pool.models["a"].weights is None and pool.models["c"].weights is not None
        assert [m["max_model_len"] for m in pool.listing(0)] == [101, 101, 101]
        await pool.shutdown(1.0)
    run(main)


def test_a_request_for_a_draining_model_waits_and_gets_it_back() -> None:
    async def main() -> None:
        pool, loader = make_pool("ab", max_warm=1)
        await pool.start()
        lease_a = await pool.acquire("a")
        b = asyncio.ensure_future(pool.acquire("b"))
        await until(lambda: pool.models["a"].state == "draining")
        a_again = asyncio.ensure_future(pool.acquire("a"))
        await asyncio.sleep(0.05)
        assert not a_again.done()
        lease_a.release()
        lease_b = await b  # b first (asked first), and it holds b up until released
        await asyncio.sleep(0.05)
        assert states(pool) == {"a": "loading", "b": "draining"} and not a_again.done()
        lease_b.release()
        lease_a2 = await a_again
        assert states(pool) == {"a": "hot", "b": "warm"}
        assert [e for e in loader.log if e[0] != "load"] == [
            ("build", "a", 0), ("shutdown", "a"), ("build", "b", 0), ("shutdown", "b"),
            ("build", "a", 0)]
        lease_a2.release()
        await pool.shutdown(1.0)
    run(main)


def test_least_recently_used_hot_model_is_the_one_that_leaves() -> None:
    async def main() -> None:
        pool, loader = make_pool("abc", max_hot=2, max_warm=0)
        await pool.start()
        (await pool.acquire("b")).release()
        assert states(pool) == {"a": "hot", "b": "hot", "c": "cold"}
        (await pool.acquire("a")).release()  # a used after b: b is the LRU hot model
        (await pool.acquire("c")).release()
        assert states(pool) == {"a": "hot", "b": "cold", "c": "hot"}
        assert ("build", "c", 1) in loader.log  # b's slot
        await pool.shutdown(1.0)
    run(main)


def test_one_load_at_a_time() -> None:
    async def main() -> None:
        pool, loader = make_pool("abcd", max_hot=3, max_warm=0)
        await pool.start()
        leases = await asyncio.gather(*(pool.acquire(n) for n in "bcd"))
        assert loader.max_active == 1
        assert {lease.engine.name for lease in leases} == set("bcd")
        for lease in leases:
            lease.release()
        await pool.shutdown(1.0)
    run(main)


def test_a_load_past_the_timeout_is_a_503_with_retry_after() -> None:
    async def main() -> None:
        pool, loader = make_pool(load_timeout=0.2)
        await pool.start()
        loader.hold["b"] = threading.Event()
        with pytest.raises(APIError) as e:
            await pool.acquire("b")
        assert e.value.status == 503 and e.value.code == "loading"
        assert int(e.value.headers["Retry-After"]) > 0
        assert "the model `b` is still loading after 0.2s" in str(e.value.message)
        loader.hold["b"].set()
        await until(lambda: pool.models["b"].state == "hot")
        lease = await pool.acquire("b")  # hot now: at once
        lease.release()
        await pool.shutdown(1.0)
    run(main)


def test_a_failed_load_is_a_503_and_the_drained_model_serves_again() -> None:
    async def main() -> None:
        pool, loader = make_pool()
        await pool.start()
        loader.fail.add("b")
        with pytest.raises(APIError) as e:
            await pool.acquire("b")
        assert e.value.status == 503 and e.value.code == "model_load_failed"
        assert states(pool) == {"a": "hot", "b": "cold", "c": "cold"}
        assert pool.placement.tiers() == {"a": "hot", "b": "cold", "c": "cold"}
        lease = await pool.acquire("a")
        assert not lease.engine.stopped
        lease.release()
        loader.fail.clear()
        (await pool.acquire("b")).release()  # a later request tries again
        assert states(pool) == {"a": "warm", "b": "hot", "c": "cold"}
        await pool.shutdown(1.0)
    run(main)


def test_unknown_model_before_start_and_shutting_down() -> None:
    async def main() -> None:
        pool, loader = make_pool()
        with pytest.raises(APIError) as e:
            await pool.acquire("a")
        assert (e.value.status, e.value.code) == (503, "loading")
        await pool.start()
        with pytest.raises(APIError) as e:
            await pool.acquire("x")
        assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found",
                                                                  "model")
        assert "the model `x` does not exist; this server serves `a`, `b`, `c`" in \
            e.value.message
        lease = await pool.acquire(None)  # no model field: the primary
        assert lease.model.name == "a"
        loader.hold["b"] = threading.Event()
        waiting = asyncio.ensure_future(pool.acquire("b"))
        await until(lambda: ("load", "b") in loader.log)
        pool.begin_shutdown()
        with pytest.raises(APIError) as e:
            await waiting
        assert (e.value.status, e.value.code) == (503, "shutting_down")
        assert not pool.ready
        loader.hold["b"].set()
        lease.release()
        await pool.shutdown(1.0)
    run(main)


def test_a_cancelled_waiter_leaves_no_lease_behind() -> None:
    async def main() -> None:
        pool, loader = make_pool()
        await pool.start()
        lease_a = await pool.acquire("a")
        waiting = asyncio.ensure_future(pool.acquire("b"))
        await until(lambda: pool.models["b"].state == "loading")
        waiting.cancel()  # the client went away
        lease_a.release()
        await until(lambda: pool.models["b"].state == "hot")
        assert pool.models["b"].leases == 0
        await pool.shutdown(1.0)
    run(main)


def test_lease_release_is_idempotent() -> None:
    async def main() -> None:
        pool, _ = make_pool()
        await pool.start()
        lease: Lease = await pool.acquire("a")
        lease.release()
        lease.release()
        assert pool.models["a"].leases == 0 and pool.models["a"].idle.is_set()
        await pool.shutdown(1.0)
    run(main)


def test_the_primarys_failed_load_is_the_servers_load_error() -> None:
    async def main() -> None:
        pool, loader = make_pool()
        loader.fail.add("a")
        await pool.start()
        assert pool.load_error == "ValueError: a is broken" and not pool.ready
        with pytest.raises(APIError) as e:
            await pool.acquire("b")
        assert (e.value.status, e.value.code) == (503, "engine_dead")
    run(main)


def test_a_failed_load_with_no_warm_place_puts_the_draining_model_back() -> None:
    """max_warm 0: use(c) pushes a straight to cold while it drains. When c's load fails, a
    must be hot and serving again (not stuck draining, with its slot), and the pool must
    still swap afterwards."""
    async def main() -> None:
        pool, loader = make_pool(max_warm=0)
        await pool.start()
        loader.fail.add("c")
        with pytest.raises(APIError) as e:
            await pool.acquire("c")
        assert e.value.code == "model_load_failed"
        assert states(pool) == {"a": "hot", "b": "cold", "c": "cold"}
        assert pool.placement.tiers() == {"a": "hot", "b": "cold", "c": "cold"}
        lease = await pool.acquire("a")
        assert lease.engine.name == "a" and not lease.engine.stopped
        lease.release()
        (await pool.acquire("b")).release()
        assert states(pool) == {"a": "cold", "b": "hot", "c": "cold"}
        assert ("build", "b", 0) in loader.log
        await pool.shutdown(1.0)
    run(main)
