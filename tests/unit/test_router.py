"""The router's policy as pure functions: exact decisions, the LRU bound, health exclusion;
its block hashes against the engine's own, and its prompt ids against the server's render.

Backends are named A, B, C; hashes are small ints (the policy never looks inside them).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import (
    Decision,
    PrefixMap,
    RoutingConfig,
    choose_backend,
    least_loaded,
)
from kvserve.router.pool import BackendPool
from kvserve.router.prompt import block_hashes, prompt_token_ids
from kvserve.sampling_params import SamplingParams

CFG = RoutingConfig(block_size=4, cache_threshold=0.5, balance_abs_threshold=2,
                    balance_rel_threshold=1.5)


def choose(loads: dict[str, int], matches: dict[str, int], num_tokens: int = 20,
           owned: dict[str, int] | None = None, cfg: RoutingConfig = CFG) -> Decision:
    return choose_backend(cfg, loads, matches, num_tokens, owned or {})


# ---- choose_backend ----------------------------------------------------------------------

def test_longest_chain_wins() -> None:
    # 20 tokens = 5 blocks; A matches 4 (16 tokens), B 3: A, though B is less loaded.
    assert choose({"A": 1, "B": 0}, {"A": 4, "B": 3}) == Decision("A", "prefix_hit", 4)
    assert choose({"A": 0, "B": 1}, {"A": 3, "B": 4}) == Decision("B", "prefix_hit", 4)


def test_equal_chains_go_to_the_least_loaded_of_them() -> None:
    loads = {"A": 2, "B": 1, "C": 0}
    assert choose(loads, {"A": 4, "B": 4}) == Decision("B", "prefix_hit", 4)
    # equal loads too: fewer map entries, then --backend order
    assert choose({"A": 1, "B": 1}, {"A": 4, "B": 4}, owned={"A": 9, "B": 3}).backend == "B"
    assert choose({"A": 1, "B": 1}, {"A": 4, "B": 4}, owned={"A": 3, "B": 3}).backend == "A"


def test_a_match_at_or_below_the_cache_threshold_is_no_match() -> None:
    # 2 blocks x 4 = 8 tokens of 16: rate 0.5, not above 0.5 -> the least loaded (B).
    assert choose({"A": 0, "B": 0}, {"A": 2}, num_tokens=16, owned={"A": 2}) == \
        Decision("B", "no_match", 0)
    # of 15 tokens it is above: A
    assert choose({"A": 0, "B": 0}, {"A": 2}, num_tokens=15) == Decision("A", "prefix_hit", 2)
    assert choose({"A": 3, "B": 1}, {}) == Decision("B", "no_match", 0)


def test_overloaded_preferred_falls_back_to_the_least_loaded() -> None:
    # A - B = 3 > abs 2 and 4 > 1.5 * 1: overloaded.
    assert choose({"A": 4, "B": 1}, {"A": 4, "B": 1}) == Decision("B", "fallback", 1)
    # A - B = 2, not above abs 2: A keeps it.
    assert choose({"A": 3, "B": 1}, {"A": 4}) == Decision("A", "prefix_hit", 4)
    # A - B = 3 > 2 but 9 is not above 1.5 * 6: the relative bound holds it.
    assert choose({"A": 9, "B": 6}, {"A": 4}) == Decision("A", "prefix_hit", 4)
    # against an idle replica the relative bound is always passed (x > 1.5 * 0)
    assert choose({"A": 3, "B": 0}, {"A": 4}) == Decision("B", "fallback", 0)


def test_overload_compares_the_preferred_replica_not_the_busiest() -> None:
    # C lags (10 in flight) but the preferred A is within bounds of the least loaded B.
    assert choose({"A": 2, "B": 1, "C": 10}, {"A": 4}) == Decision("A", "prefix_hit", 4)


def test_matches_of_unhealthy_backends_are_ignored() -> None:
    # loads holds only the healthy ones: A's longer chain does not count.
    assert choose({"B": 0}, {"A": 5, "B": 2}, num_tokens=12) == Decision("B", "prefix_hit", 2)
    with pytest.raises(ValueError, match="no healthy backend"):
        choose({}, {"A": 5})


def test_least_loaded_ties() -> None:
    assert least_loaded({"A": 1, "B": 0, "C": 0}, {"B": 5, "C": 2}) == "C"
    assert least_loaded({"A": 0, "B": 0}, {}) == "A"


@pytest.mark.parametrize("field, value, allowed", [
    ("block_size", 0, ">= 1"), ("cache_threshold", 1.0, r"\[0, 1\)"),
    ("cache_threshold", -0.1, r"\[0, 1\)"), ("balance_abs_threshold", -1, ">= 0"),
    ("balance_rel_threshold", 0.9, ">= 1"), ("max_blocks", 0, ">= 1")])
def test_config_names_the_field_and_range(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be.*{allowed}"):
        RoutingConfig(**{field: value})


# ---- PrefixMap -----------------------------------------------------------------------------

def test_match_is_the_leading_run_each_backend_holds() -> None:
    m = PrefixMap(100)
    m.record([1, 2, 3, 4], "A")
    m.record([1, 2, 7], "B")
    assert m.match([1, 2, 3, 4, 5]) == {"A": 4, "B": 2}
    assert m.match([1, 2, 7, 8]) == {"A": 2, "B": 3}
    assert m.match([9, 1, 2]) == {}  # a chain starts at block 0
    assert m.owned("A") == 4 and m.owned("B") == 3 and len(m) == 5


def test_lru_bound_drops_chain_tails_first() -> None:
    m = PrefixMap(4)
    m.record([1, 2, 3], "A")  # touched 3, 2, 1: the head is the most recent
    m.record([4, 5], "B")  # 5 entries: the oldest, A's tail 3, goes
    assert len(m) == 4
    assert m.match([1, 2, 3]) == {"A": 2}
    assert m.owned("A") == 2 and m.owned("B") == 2
    m.record([1], "A")  # touches 1 again: now 2 is A's oldest entry
    m.record([6], "C")  # drops 2
    assert m.match([1, 2]) == {"A": 1}
    assert m.match([4, 5]) == {"B": 2}
    assert m.owned("A") == 1


def test_forget_drops_a_backend_from_every_entry() -> None:
    m = PrefixMap(100)
    m.record([1, 2, 3], "A")
    m.record([1, 2], "B")
    m.forget("A")
    assert m.match([1, 2, 3]) == {"B": 2}
    assert len(m) == 2 and m.owned("A") == 0 and m.owned("B") == 2
    m.forget("C")  # never recorded: nothing to do


# ---- BackendPool ---------------------------------------------------------------------------

def make_pool(cfg: RoutingConfig = CFG) -> BackendPool:
    pool = BackendPool(["A", "B"], cfg, RouterMetrics())
    for url in pool.backends:
        pool.set_health(url, True, "ok")
    return pool


def test_pool_routes_repeats_to_the_same_backend_and_records_it() -> None:
    pool = make_pool()
    first = pool.choose([11, 12, 13], 14, set())
    assert first == Decision("A", "no_match", 0)  # both idle and empty: --backend order
    pool.backends["A"].in_flight = 1  # A is busy with it; a new prompt goes to B
    assert pool.choose([21, 22, 23], 14, set()) == Decision("B", "no_match", 0)
    # the first prompt again, while A is busier: A holds its chain
    assert pool.choose([11, 12, 13], 14, set()) == Decision("A", "prefix_hit", 3)
    assert pool.prefix_map.owned("A") == 3 and pool.prefix_map.owned("B") == 3


def test_pool_excludes_unhealthy_and_tried_backends() -> None:
    pool = make_pool()
    pool.choose([1, 2, 3], 14, set())  # -> A
    assert pool.choose([1, 2, 3], 14, {"A"}) == Decision("B", "no_match", 0)  # a retry
    pool.set_health("A", False, "/health answered 503")
    assert pool.prefix_map.match([1, 2, 3]) == {"B": 3}  # A's entries forgotten
    assert pool.choose([1, 2, 3], 14, set()) == Decision("B", "prefix_hit", 3)
    assert pool.choose([1, 2, 3], 14, {"B"}) is None
    assert pool.least_loaded({"B"}) is None
    assert pool.backends["A"].reason == "/health answered 503"


def test_pool_metrics_count_decisions() -> None:
    pool = make_pool()
    pool.choose([1, 2, 3], 14, set())
    pool.choose([1, 2, 3], 14, set())
    text = pool.metrics.render().decode()
    assert 'kvserve_router_routing_decisions_total{decision="no_match"} 1.0' in text
    assert 'kvserve_router_routing_decisions_total{decision="prefix_hit"} 1.0' in text
    assert 'kvserve_router_routing_decisions_total{decision="fallback"} 0.0' in text
    assert "kvserve_router_prompt_tokens_total 28.0" in text
    assert "kvserve_router_matched_tokens_total 12.0" in text
    assert 'kvserve_router_backend_healthy{backend="A"} 1.0' in text
    assert "kvserve_router_prefix_map_blocks 3.0" in text


def test_health_polls_take_backends_out_and_put_them_back() -> None:
    """check_health against scripted /health answers: 503 or no answer takes a backend out
    (and forgets its entries), the next 200 puts it back."""
    import asyncio

    import httpx

    answers: dict[str, list[int | None]] = {"a": [200, 503, 200], "b": [200, None, None]}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        status = answers[request.url.host].pop(0)
        if status is None:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(status)

    pool = BackendPool(["http://a", "http://b"], CFG, RouterMetrics())
    assert not any(b.healthy for b in pool.backends.values())  # out until a 200

    async def rounds() -> list[tuple[bool, bool]]:
        seen = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for i in range(3):
                await pool.check_health(client, timeout=1.0)
                seen.append((pool.backends["http://a"].healthy,
                             pool.backends["http://b"].healthy))
                if i == 0:
                    pool.prefix_map.record([1, 2], "http://a")
        return seen

    assert asyncio.run(rounds()) == [(True, True), (False, False), (True, False)]
    assert pool.prefix_map.owned("http://a") == 0  # forgotten when it went out
    assert pool.backends["http://a"].reason == "ok"
    assert pool.backends["http://b"].reason.startswith("/health failed: ConnectError")


def test_pool_refuses_duplicate_backends() -> None:
    with pytest.raises(ValueError, match="given twice"):
        BackendPool(["A", "A"], CFG, RouterMetrics())


# ---- the engine's hashes, the server's prompt ----------------------------------------------

def test_block_hashes_are_the_engines() -> None:
    """The hashes the engine's KVCacheManager computes for a request (what its prefix cache
    is keyed by), not a second copy of the function."""
    tokens = list(range(100, 139))  # 39 tokens: 9 full blocks of 4, a partial one
    manager = KVCacheManager(BlockPool(32, True), 4, True)
    req = Request("r", tokens, SamplingParams(), max_tokens=4)
    manager.get_computed_blocks(req)
    engine = [h.hash_value for h in req.block_hashes]
    assert len(engine) == 9
    assert block_hashes(tokens, 4) == engine
    assert block_hashes(tokens[:8], 4) == engine[:2]  # chained: a prefix's hashes are a prefix
    assert block_hashes(tokens, 8)[:1] != engine[:1]  # another block size never matches


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from kvserve.loader import load_checkpoint, resolve_model

    return load_checkpoint(resolve_model(None)).tokenizer


def test_completion_prompts(tokenizer: Any) -> None:
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    assert prompt_token_ids(tokenizer, None, "/v1/completions", {"prompt": text}) == ids
    assert prompt_token_ids(tokenizer, None, "/v1/completions", {"prompt": [text, "x"]}) == ids
    assert prompt_token_ids(tokenizer, None, "/v1/completions", {"prompt": [5, 6]}) == [5, 6]
    assert prompt_token_ids(tokenizer, None, "/v1/completions",
                            {"prompt": [[5, 6], [7]]}) == [5, 6]
    for unreadable in ({"prompt": 3}, {"prompt": []}, {"prompt": [True, 1]}, [1, 2], "x"):
        assert prompt_token_ids(tokenizer, None, "/v1/completions", unreadable) is None


def test_chat_prompts_render_as_the_server_does(tokenizer: Any) -> None:
    """Against the server's own conversion (serving_chat.conversation of the validated
    messages) and the tokenizer's template."""
    from kvserve.server.protocol import ChatMessage
    from kvserve.server.serving_chat import conversation

    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None, "name": "bot"},
                {"role": "user", "content": "Why?", "extra_field": 1}]
    server_conv = conversation([ChatMessage.model_validate(m) for m in messages])
    want = tokenizer.apply_chat_template(server_conv, add_generation_prompt=True,
                                         tokenize=True)
    body = {"messages": messages}
    assert prompt_token_ids(tokenizer, None, "/v1/chat/completions", body) == want
    no_gen = tokenizer.apply_chat_template(server_conv, add_generation_prompt=False,
                                           tokenize=True)
    assert prompt_token_ids(tokenizer, None, "/v1/chat/completions",
                            {**body, "add_generation_prompt": False}) == no_gen
    for unreadable in ({"messages": []}, {"messages": [{"content": "x"}]}, {}):
        assert prompt_token_ids(tokenizer, None, "/v1/chat/completions", unreadable) is None
