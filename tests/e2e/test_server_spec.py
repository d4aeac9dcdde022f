"""`kvserve serve --speculative-config`: streaming through the real server (the official
openai client) gives the non-streaming text, which is the text without speculation, and
/metrics counts the drafts with vLLM's names. Each API key is a tenant: the suffix
proposer's cache of past answers serves the key that made them, never another."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvserve.async_engine import AsyncEngine
from kvserve.sampling_params import SamplingParams
from kvserve.server.api import ServerConfig, app_state, build_app
from kvserve.server.gate import tenant_of
from tests.conftest import run_all
from tests.e2e.server_process import ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
MESSAGES = [{"role": "user", "content": "Repeat this text exactly: The quick brown fox jumps "
             "over the lazy dog. The quick brown fox jumps over the lazy dog again."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "1024",
                       "--speculative-config", json.dumps(SPEC)) as srv:
        yield srv


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:_total)?{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_streaming_with_speculation_is_the_plain_output(client: openai.OpenAI, http: httpx.Client,
                                                       make_engine: Any) -> None:
    before = _counter(http.get("/metrics").text, "vllm:spec_decode_num_draft_tokens")
    whole = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES,  # type: ignore
                                           max_tokens=48, temperature=0)
    stream = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES,  # type: ignore
                                            max_tokens=48, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    # The same request in an engine without speculation.
    engine = make_engine(max_model_len=1024)
    plain = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                 tokenize=True)
    engine.add_request("p", {"prompt_token_ids": plain}, SamplingParams(temperature=0,
                                                                       max_tokens=48))
    assert run_all(engine)["p"].outputs[0].text == text
    metrics = http.get("/metrics").text
    drafted = _counter(metrics, "vllm:spec_decode_num_draft_tokens") - before
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    assert drafted > 0 and 0 < accepted
    assert _counter(metrics, "vllm:spec_decode_num_drafts") > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos" in metrics


def test_each_api_key_is_a_tenant_of_the_suffix_cache(make_engine: Any) -> None:
    """In process (httpx over ASGI): a server with two keys answers the same prompt for key
    one twice and then for key two. Key one's second answer is drafted from its first; key
    two's drafts are those of the first answer, and the engine sees hashes, never keys."""
    keys = ["first-key", "second-key"]
    body = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 32,
            "temperature": 0, "ignore_eos": True}

    async def run() -> list[tuple[str, int]]:
        engine = make_engine(max_model_len=1024, speculative_config={
            "method": "suffix", "num_speculative_tokens": 8, "adaptive": False})
        tenants: list[str | None] = []
        real_add = engine.add_request

        def add(*args: Any, **kw: Any) -> None:
            tenants.append(kw.get("tenant"))
            real_add(*args, **kw)

        engine.add_request = add  # type: ignore[method-assign]
        eng = AsyncEngine(engine)
        eng.start()
        app = build_app(ServerConfig(model_name="smollm2-135m", api_key=keys))
        app_state(app).engine = eng
        st = engine.runner.spec_stats
        results = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as http:
            bad = await http.post("/v1/completions", json=body,
                                  headers={"Authorization": "Bearer third-key"})
            assert bad.status_code == 401
            for key in (keys[0], keys[0], keys[1]):
                before = st.num_accepted_tokens
                r = await http.post("/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
                results.append((r.json()["choices"][0]["text"],
                                st.num_accepted_tokens - before))
        await eng.shutdown()
        assert tenants == [tenant_of(keys[0]), tenant_of(keys[0]), tenant_of(keys[1])]
        assert tenant_of(keys[0]) != tenant_of(keys[1])
        assert not any(k in str(tenants) for k in keys)
        return results

    (first, a1), (again, a2), (other, a3) = asyncio.run(run())
    assert first == again == other
    assert a2 >= 20 and a3 == a1 < a2
