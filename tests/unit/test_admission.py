"""Admission's cheap checks, before any work: the waiting-queue bounds with the adds still
being prepared counted as waiting, a tier's own bound and its rejection count, and the text
length bound. The same checks through AsyncEngine and the server: test_server_async_engine.py,
test_server_tiers.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvserve.admission import Admission
from kvserve.request import DEFAULT_TIER
from kvserve.sampling_params import ParamError
from kvserve.scheduler import QueueFullError


def test_adds_being_prepared_count_as_waiting(make_engine: Any) -> None:
    engine = make_engine(max_waiting_requests=3)
    adm = Admission(engine)
    try:
        idle = engine.stats()
        adm.check_queue(idle)
        adm.adds_started = 3  # three adds between their checks and the engine thread
        with pytest.raises(QueueFullError, match=r"waiting queue is full \(3 requests\)"):
            adm.check_queue(idle)
        adm.adds_abandoned = 1  # one refused while being prepared: a place again
        adm.check_queue(idle)
        adm.adds_applied = 1  # one reached the engine, which now counts it waiting
        with pytest.raises(QueueFullError):
            adm.check_queue(dataclasses.replace(idle, num_waiting_groups=2))
        adm.check_queue(dataclasses.replace(idle, num_waiting_groups=1))
        # The server's own bound names no tier: no tier's rejection is counted for it.
        assert set(adm.tier_rejections.values()) == {0}
    finally:
        adm.shutdown()


def test_a_full_tier_is_refused_and_counted_alone(make_engine: Any) -> None:
    engine = make_engine(tiers={"paid": {"weight": 8}, "free": {"weight": 1, "max_waiting": 2}})
    adm = Admission(engine)
    try:
        stats = engine.stats(tiers=True)
        assert stats.tiers is not None
        full = dataclasses.replace(stats, tiers={**stats.tiers, "free": (0, 2, 2)})
        adm.check_queue(dataclasses.replace(stats, tiers={**stats.tiers, "free": (0, 1, 1)}),
                        "free")
        for _ in range(2):
            with pytest.raises(QueueFullError, match="tier 'free' is full") as e:
                adm.check_queue(full, "free")
            assert e.value.tier == "free"
        adm.check_queue(full, "paid")
        adm.check_queue(full)  # the default tier
        assert adm.tier_rejections == {"paid": 0, "free": 2, DEFAULT_TIER: 0}
    finally:
        adm.shutdown()


def test_text_longer_than_any_context_is_refused_by_field(make_engine: Any) -> None:
    engine = make_engine(max_model_len=64)
    adm = Admission(engine)
    try:
        n = adm.max_prompt_chars
        assert n == 2 * 64 * engine.tokenizer.max_token_chars
        adm.check_text_chars(n)
        with pytest.raises(ParamError, match=f"messages has {n + 1} characters") as e:
            adm.check_text_chars(n + 1, "messages")
        assert e.value.param == "messages"
    finally:
        adm.shutdown()


def test_grammar_timeout_must_be_positive(make_engine: Any) -> None:
    with pytest.raises(ValueError, match="grammar_timeout must be > 0 seconds, got 0"):
        Admission(make_engine(), grammar_timeout=0)
