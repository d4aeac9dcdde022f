"""ModelPlacement: the LRU tiers of a server's models, exact tiers after each use."""

from __future__ import annotations

import pytest

from kvserve.server.placement import COLD, HOT, WARM, ModelPlacement


def test_one_hot_one_warm_three_models() -> None:
    p = ModelPlacement(["a", "b", "c"], max_hot=1, max_warm=1)
    assert p.tiers() == {"a": COLD, "b": COLD, "c": COLD}
    assert p.use("a") == {"a": HOT}
    assert p.use("a") == {}  # hot already: nothing moves
    assert p.use("b") == {"b": HOT, "a": WARM}
    assert p.tiers() == {"a": WARM, "b": HOT, "c": COLD}
    assert p.use("c") == {"a": COLD, "b": WARM, "c": HOT}  # warm beyond W -> cold
    assert p.use("a") == {"a": HOT, "b": COLD, "c": WARM}  # cold -> hot
    assert p.use("c") == {"a": WARM, "c": HOT}  # warm -> hot; b stays cold
    assert p.tiers() == {"a": WARM, "b": COLD, "c": HOT}
    assert p.hot() == ["c"]


def test_using_a_hot_model_reorders_the_hot_ones_only() -> None:
    p = ModelPlacement(["a", "b", "c", "d"], max_hot=2, max_warm=1)
    for name in "abc":
        p.use(name)
    assert p.tiers() == {"a": WARM, "b": HOT, "c": HOT, "d": COLD}
    assert p.use("b") == {}
    assert p.hot() == ["b", "c"]
    # c is now the least recently used hot model: d pushes it to warm, a to cold.
    assert p.use("d") == {"a": COLD, "c": WARM, "d": HOT}
    assert p.hot() == ["d", "b"]


def test_no_warm_tier() -> None:
    p = ModelPlacement(["a", "b"], max_hot=1, max_warm=0)
    p.use("a")
    assert p.use("b") == {"a": COLD, "b": HOT}


def test_forget_moves_the_others_up() -> None:
    p = ModelPlacement(["a", "b", "c"], max_hot=1, max_warm=1)
    p.use("a")
    p.use("b")
    assert p.forget("b") == {"a": HOT, "b": COLD}
    assert p.forget("c") == {}  # cold already


@pytest.mark.parametrize("kwargs, match", [
    (dict(names=[], max_hot=1, max_warm=1), "at least one model"),
    (dict(names=["a", "a"], max_hot=1, max_warm=1), "'a' is given twice"),
    (dict(names=["a"], max_hot=0, max_warm=1), r"max_hot_models must be >= 1, got 0"),
    (dict(names=["a"], max_hot=1, max_warm=-1), r"max_warm_models must be >= 0, got -1"),
])
def test_bad_settings_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelPlacement(**kwargs)


def test_unknown_model() -> None:
    p = ModelPlacement(["a"], max_hot=1, max_warm=1)
    with pytest.raises(KeyError, match="unknown model 'x'; known: a"):
        p.use("x")
