"""Which of a server's models are hot, warm or cold (model tiers): LRU on use, bookkeeping
only (kvserve/server/model_pool.py moves the engines and weights to match).

    recency (most recently used first)     tier
    | m0 .. m(H-1) | mH .. m(H+W-1) | ...  hot: an engine with its KV cache; warm: weights in
    |     hot      |      warm      | cold memory, no engine; cold: on disk (never used, or
                                           pushed past H + W)

H = max_hot, W = max_warm. Using a hot model only reorders the hot ones, so it never moves a
model between tiers; using another one moves it to the front and pushes the last hot model
to warm and the last warm one to cold.
"""

from __future__ import annotations

from collections.abc import Sequence

HOT, WARM, COLD = "hot", "warm", "cold"


class ModelPlacement:
    def __init__(self, names: Sequence[str], max_hot: int, max_warm: int) -> None:
        """names: every model the server knows, all cold at first."""
        if not names:
            raise ValueError("model tiers need at least one model")
        if len(set(names)) != len(names):
            dup = next(n for n in names if list(names).count(n) > 1)
            raise ValueError(f"model names must be unique; {dup!r} is given twice")
        if max_hot < 1:
            raise ValueError(f"max_hot_models must be >= 1, got {max_hot}")
        if max_warm < 0:
            raise ValueError(f"max_warm_models must be >= 0, got {max_warm}")
        self.names = tuple(names)
        self.max_hot = max_hot
        self.max_warm = max_warm
        self._recent: list[str] = []  # hot, then warm; most recently used first

    def tier(self, name: str) -> str:
        self._check(name)
        if name not in self._recent:
            return COLD
        return HOT if self._recent.index(name) < self.max_hot else WARM

    def tiers(self) -> dict[str, str]:
        """Every model's tier, in the order the models were given."""
        return {n: self.tier(n) for n in self.names}

    def hot(self) -> list[str]:
        """The hot models, most recently used first."""
        return self._recent[:self.max_hot]

    def use(self, name: str) -> dict[str, str]:
        """name was used: it becomes hot (the most recently used). Returns the models whose
        tier changed, each with its new tier (empty for a model that was hot already)."""
        before = self.tiers()
        self._check(name)
        if name in self._recent:
            self._recent.remove(name)
        self._recent.insert(0, name)
        del self._recent[self.max_hot + self.max_warm:]
        return self._changes(before)

    def forget(self, name: str) -> dict[str, str]:
        """name is cold again (its load failed): the models behind it move up a place.
        Returns the models whose tier changed, as use() does."""
        before = self.tiers()
        if name in self._recent:
            self._recent.remove(name)
        return self._changes(before)

    def recent(self) -> list[str]:
        """The hot then warm models, most recently used first (restore's argument)."""
        return list(self._recent)

    def restore(self, recent: Sequence[str]) -> None:
        """Puts back an order that recent() returned (a swap that failed), at most the hot
        and warm places."""
        for name in recent:
            self._check(name)
        self._recent = list(dict.fromkeys(recent))[:self.max_hot + self.max_warm]

    def _changes(self, before: dict[str, str]) -> dict[str, str]:
        after = self.tiers()
        return {n: t for n, t in after.items() if before[n] != t}

    def _check(self, name: str) -> None:
        if name not in self.names:
            raise KeyError(f"unknown model {name!r}; known: {', '.join(self.names)}")
