"""The routing policy, as pure functions over a bounded prefix map: no I/O, no clock.

The router remembers which replicas it sent each full block of each prompt to, keyed by the
engine's own chained block hash (kvserve.kv.block_pool.hash_full_blocks), so that a hash
names a whole prefix: block i's hash covers blocks 0..i. A request's matched chain on a
replica is the number of its leading blocks that replica was sent:

    prompt blocks   |h0 |h1 |h2 |h3 |h4 |partial|
    owners          |A,B|A,B|A  |A  |-  |        matched: A 4 blocks, B 2 blocks

The decision is SGLang's cache-aware policy (sgl-router's CacheAware: a prefix match rate
above cache_threshold goes to the best-matching worker, unless load is imbalanced by both an
absolute and a relative bound, which sends it to the shortest queue), with two changes:
the imbalance test compares the preferred replica (not the busiest one) with the least
loaded, so one lagging replica of three does not switch cache routing off for the others;
and a request below the threshold goes to the least loaded replica (ties: the one the map
credits with fewer blocks, SGLang's "smallest tree"), not to the smallest tree outright.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

DecisionKind = Literal["prefix_hit", "fallback", "no_match"]
DECISION_KINDS: tuple[DecisionKind, ...] = ("prefix_hit", "fallback", "no_match")


@dataclass(frozen=True)
class RoutingConfig:
    block_size: int = 16  # the engine's --block-size: hashes only match at the same size
    # A match counts when matched tokens / prompt tokens > cache_threshold (SGLang's rule).
    cache_threshold: float = 0.5
    # The preferred replica is overloaded when both hold (in-flight requests the router sent):
    #   load[preferred] - min(load) > balance_abs_threshold
    #   load[preferred] > balance_rel_threshold * min(load)
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    max_blocks: int = 65536  # prefix-map entries (block hashes), least recently used dropped

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 <= self.cache_threshold < 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1), got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got "
                             f"{self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got "
                             f"{self.balance_rel_threshold}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")


class Decision(NamedTuple):
    backend: str
    kind: DecisionKind
    matched_blocks: int  # of the chosen backend (0 for no_match)


class PrefixMap:
    """block hash -> the backends it was routed to, LRU-bounded at max_blocks entries.

    A record touches a prompt's blocks from the last to the first, so the first blocks are
    the most recently used and a chain's tail is dropped before its head: a dropped entry
    ends every chain through it, and the shared heads (system prompts) are what routing
    needs most.
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._owners: OrderedDict[int, set[str]] = OrderedDict()  # oldest first
        self._owned: dict[str, int] = {}  # backend -> entries that name it

    def __len__(self) -> int:
        return len(self._owners)

    def owned(self, backend: str) -> int:
        return self._owned.get(backend, 0)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """backend -> its matched chain: how many leading blocks of hashes it holds."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for b in alive:
                out[b] = i + 1
        return out

    def record(self, hashes: Sequence[int], backend: str) -> None:
        """backend now holds every block of hashes (it was sent the prompt)."""
        for h in reversed(hashes):
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            if backend not in owners:
                owners.add(backend)
                self._owned[backend] = self._owned.get(backend, 0) + 1
        while len(self._owners) > self.max_blocks:
            _, dropped = self._owners.popitem(last=False)
            for b in dropped:
                self._owned[b] -= 1

    def forget(self, backend: str) -> None:
        """Drops backend from every entry (it went down: its cache may be gone). O(entries)."""
        if not self._owned.pop(backend, 0):
            return
        for h in [h for h, owners in self._owners.items() if backend in owners]:
            owners = self._owners[h]
            owners.discard(backend)
            if not owners:
                del self._owners[h]


def least_loaded(loads: Mapping[str, int], owned: Mapping[str, int]) -> str:
    """The backend with the fewest in-flight requests; ties: fewer map entries, then the
    order of loads (the --backend order)."""
    order = {b: i for i, b in enumerate(loads)}
    return min(loads, key=lambda b: (loads[b], owned.get(b, 0), order[b]))


def overloaded(cfg: RoutingConfig, load: int, min_load: int) -> bool:
    return (load - min_load > cfg.balance_abs_threshold
            and load > cfg.balance_rel_threshold * min_load)


def choose_backend(cfg: RoutingConfig, loads: Mapping[str, int], matches: Mapping[str, int],
                   num_tokens: int, owned: Mapping[str, int]) -> Decision:
    """Where one request goes.

    loads: in-flight requests of each *healthy* backend (the candidates, in --backend
    order); matches: PrefixMap.match of the prompt (backends outside loads are ignored);
    num_tokens: the prompt's length; owned: PrefixMap.owned of each backend.
    """
    if not loads:
        raise ValueError("no healthy backend to route to")
    fallback = least_loaded(loads, owned)
    best = max((n for b, n in matches.items() if b in loads), default=0)
    if best == 0 or best * cfg.block_size <= cfg.cache_threshold * num_tokens:
        return Decision(fallback, "no_match", 0)
    tied = {b: loads[b] for b in loads if matches.get(b, 0) == best}
    preferred = least_loaded(tied, owned)
    if overloaded(cfg, loads[preferred], loads[fallback]):
        return Decision(fallback, "fallback", matches.get(fallback, 0))
    return Decision(preferred, "prefix_hit", best)
