"""BackendPool: the replicas, their health and in-flight counts, and the prefix map.

All of it is touched from the router's one event loop only, so nothing here locks. The
decisions themselves are policy.py's pure functions; this class feeds them the current state
and records what they chose.

Health: a backend is routable while its last /health answered 200. A poll that gets any other
status (503: loading, draining, a stalled engine) or no answer takes it out, as does a request
whose connection to it fails; the first 200 puts it back. Taking a backend out forgets its
prefix-map entries: a replica that comes back may have restarted with an empty cache.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import Decision, PrefixMap, RoutingConfig, choose_backend, least_loaded

logger = logging.getLogger("kvserve.router")


@dataclass
class Backend:
    url: str  # scheme://host:port, no trailing slash
    healthy: bool = False
    reason: str = "not checked yet"  # why it is out (or "ok")
    in_flight: int = 0  # requests the router has sent it that have not finished


class BackendPool:
    def __init__(self, urls: Sequence[str], routing: RoutingConfig,
                 metrics: RouterMetrics) -> None:
        if not urls:
            raise ValueError("at least one --backend URL is needed")
        self.backends = {u: Backend(u) for u in urls}
        if len(self.backends) != len(urls):
            raise ValueError(f"a --backend URL is given twice: {list(urls)}")
        self.routing = routing
        self.prefix_map = PrefixMap(routing.max_blocks)
        self.metrics = metrics
        metrics.attach(self.backends, lambda: len(self.prefix_map))

    def _loads(self, exclude: set[str]) -> dict[str, int]:
        return {u: b.in_flight for u, b in self.backends.items()
                if b.healthy and u not in exclude}

    def choose(self, hashes: Sequence[int], num_tokens: int, exclude: set[str]
               ) -> Decision | None:
        """Routes one prompt (its block hashes) among the healthy backends not in exclude,
        and records that the chosen one now holds its blocks; None when none is left."""
        loads = self._loads(exclude)
        if not loads:
            return None
        owned = {u: self.prefix_map.owned(u) for u in loads}
        d = choose_backend(self.routing, loads, self.prefix_map.match(hashes), num_tokens,
                           owned)
        self.prefix_map.record(hashes, d.backend)
        self.metrics.decision(d, num_tokens, self.routing.block_size)
        return d

    def least_loaded(self, exclude: set[str]) -> str | None:
        """For the routes without a prompt (/v1/models, /tokenize, /detokenize)."""
        loads = self._loads(exclude)
        if not loads:
            return None
        return least_loaded(loads, {u: self.prefix_map.owned(u) for u in loads})

    def describe(self) -> str:
        return "; ".join(f"{b.url}: {b.reason}" for b in self.backends.values())

    def set_health(self, url: str, healthy: bool, reason: str) -> None:
        b = self.backends[url]
        if b.healthy and not healthy:
            logger.warning("backend %s taken out: %s", url, reason)
            self.prefix_map.forget(url)
        elif healthy and not b.healthy:
            logger.info("backend %s is healthy", url)
        b.healthy = healthy
        b.reason = reason

    async def _probe(self, client: httpx.AsyncClient, url: str, timeout: float) -> None:
        try:
            r = await client.get(f"{url}/health", timeout=timeout)
        except Exception as e:  # noqa: BLE001 - any failure is an unhealthy backend; the
            # poller itself must live on, or a backend taken out would never come back
            self.set_health(url, False, f"/health failed: {type(e).__name__}: {e}")
            return
        if r.status_code == 200:
            self.set_health(url, True, "ok")
        else:
            self.set_health(url, False, f"/health answered {r.status_code}")

    async def check_health(self, client: httpx.AsyncClient, timeout: float) -> None:
        """One round of /health polls, all backends at once."""
        await asyncio.gather(*(self._probe(client, u, timeout) for u in self.backends))

    async def poll_health(self, client: httpx.AsyncClient, interval: float,
                          timeout: float) -> None:
        """Polls forever, every interval seconds (run as a task; cancelled at shutdown)."""
        while True:
            await asyncio.sleep(interval)
            await self.check_health(client, timeout)
