"""The OpenAI-compatible server over real HTTP: a real `kvserve serve` process (uvicorn) with
the default model, driven by the official openai client and raw httpx.

References are independent of the server: the in-process engine's greedy output for the same
prompt, the non-streamed response for the same seed, JSON Schema validation by jsonschema.
The SIGTERM test ends the module's server, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all
from tests.e2e.server_process import ServerProcess, wait_idle

MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16
MAX_WAITING = 32
MAX_BODY = 64 * 1024
MODEL = "smollm2-135m"
SHUTDOWN_TIMEOUT = 3.0
# How long after --shutdown-timeout the cut streams and the process may take to end (about
# 0.3 s and 0.7 s measured on 2 busy cores); an unbounded drain of the SIGTERM test's 1,800
# tokens would take a minute or more.
DRAIN_MARGIN = 3.0
LENGTH = 'vllm:request_success_total{finished_reason="length"}'
STOP = 'vllm:request_success_total{finished_reason="stop"}'
ABORT = 'vllm:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests",
                       str(MAX_WAITING), "--max-body-bytes", str(MAX_BODY),
                       "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    return make_engine(max_model_len=MAX_MODEL_LEN)


def engine_run(engine: Any, prompt: Any, **params: Any) -> RequestOutput:
    """The in-process engine's final output for one prompt: the reference the server's
    output must equal exactly (same weights, same sampler, per-request seeds)."""
    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt, SamplingParams(**params))
    return run_all(engine)[rid]


def settled_metrics(server: ServerProcess, before: dict[str, float], key: str, delta: float,
                    timeout: float = 10.0) -> dict[str, float]:
    """/metrics once key has moved by delta since before. The engine thread publishes a
    step's gauges before it feeds that step's counters and histograms (the finish reasons
    last), so an idle gauge alone does not mean the last step is counted yet."""
    wait_idle(server, timeout)
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m[key] - before[key] >= delta or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield "[DONE]" if data == "[DONE]" else json.loads(data)


# ---- basics, auth, request ids ------------------------------------------------------------

def test_health_loading_version_models(server: ServerProcess, http: httpx.Client) -> None:
    assert server.saw_503_while_loading, "/health must answer 503 while the model loads"
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": "0.1.0"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    log = server.log()
    assert server.base_url in log and "KV cache" in log and "blocks" in log and "tokens" in log


def test_api_key(server: ServerProcess) -> None:
    url = server.base_url
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/nope")]:
        for headers in ({}, {"Authorization": "Bearer wrong-key"},
                        {"Authorization": f"Basic {server.api_key}"}):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["x-request-id"]
    assert httpx.get(url + "/health").status_code == 200  # no key needed
    assert httpx.get(url + "/v1/models", headers=server.headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_bench_serve_sends_its_api_key(server: ServerProcess) -> None:
    """`kvserve bench serve --api-key` reaches a server that requires one; without the key
    every request is a failed record (HTTP 401), not a crash."""
    from kvserve.bench.datasets import SampleRequest
    from kvserve.bench.serve import ServeConfig, first_model_id, run_requests

    assert asyncio.run(first_model_id(server.base_url, server.api_key)) == MODEL
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(first_model_id(server.base_url))
    reqs = [SampleRequest("The capital of France is", 6, 5)] * 2
    for key, ok in ((server.api_key, True), ("wrong-key", False), (None, False)):
        cfg = ServeConfig(base_url=server.base_url, model=MODEL, ignore_eos=True, api_key=key)
        records, _ = asyncio.run(run_requests(cfg, reqs, warmups=0))
        if ok:
            assert [(r.success, r.output_len) for r in records] == [(True, 5)] * 2
        else:
            assert [r.success for r in records] == [False] * 2
            assert all(r.error.startswith("HTTP 401") for r in records)


def test_request_id_and_routes(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                  headers={"X-Request-Id": "my-request-42"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-request-42"
    assert r.json()["id"] == "cmpl-my-request-42"
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0},
                  headers={"X-Request-Id": "bad-one-7"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-one-7"
    r = http.post("/v1/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.headers["x-request-id"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param",
                                                               "code"}


def test_tokenize_detokenize(http: httpx.Client, engine: Any) -> None:
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == engine.tokenizer.encode("Hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    msgs = [{"role": "user", "content": "Hi"}]
    r2 = http.post("/tokenize", json={"messages": msgs}).json()
    assert r2["tokens"] == engine.tokenizer.apply_chat_template(msgs, tokenize=True)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


# ---- completions and chat through the official client --------------------------------------

def test_greedy_matches_engine(client: openai.OpenAI, engine: Any) -> None:
    prompt = "The capital of France is"
    ref = engine.tokenizer
    engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=24))
    want = run_all(engine)["ref"].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(ref.encode(prompt))

    msgs = [{"role": "user", "content": "Name three colors."}]
    ids = ref.apply_chat_template(msgs, tokenize=True)
    engine.add_request("chat", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=24))
    want = run_all(engine)["chat"].outputs[0]
    got_chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                              temperature=0)
    assert got_chat.choices[0].message.content == want.text
    assert got_chat.choices[0].message.role == "assistant"
    assert got_chat.choices[0].finish_reason == want.finish_reason
    assert got_chat.usage.prompt_tokens == len(ids)
    # Token-id prompts reach the engine unchanged.
    got_ids = client.completions.create(model=MODEL, prompt=ref.encode(prompt), max_tokens=24,
                                        temperature=0)
    assert got_ids.choices[0].text == got.choices[0].text


def test_completion_schema_n_logprobs_stop_seed(client: openai.OpenAI, engine: Any) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=12,
                              temperature=0.9, seed=7, n=3, logprobs=3, user="tester")
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.object == "text_completion" and a.model == MODEL and a.id.startswith("cmpl-")
    assert isinstance(a.created, int)
    assert [c.index for c in a.choices] == [0, 1, 2]
    # Seeded samples are the in-process engine's, choice by choice (child i draws from seed
    # + i), and the same again on a second request.
    want = engine_run(engine, "Once upon a time", max_tokens=12, temperature=0.9, seed=7, n=3,
                      logprobs=3)
    assert [c.text for c in a.choices] == [c.text for c in want.outputs]
    assert [c.text for c in b.choices] == [c.text for c in want.outputs]
    assert len({c.text for c in a.choices}) > 1  # n samples differ
    total = 0
    for c in a.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert "".join(lp.tokens) == c.text or c.finish_reason == "stop"
        assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
        assert all(x <= 0 for x in lp.token_logprobs)
        total += len(lp.tokens)
    assert a.usage.completion_tokens == total
    assert a.usage.total_tokens == a.usage.prompt_tokens + total

    s = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30,
                                  temperature=0, stop=[" 7"])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == " 5, 6,"  # the stop string and what follows are cut
    assert s.choices[0].text == engine_run(engine, "1, 2, 3, 4,", max_tokens=30, temperature=0,
                                           stop=[" 7"]).outputs[0].text
    n = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert n.choices[0].finish_reason == "length" and n.usage.completion_tokens == 5
    assert n.choices[0].text == engine_run(engine, "1, 2, 3, 4,", max_tokens=5, temperature=0,
                                           ignore_eos=True).outputs[0].text
    greedy = {p: engine_run(engine, p, max_tokens=3, temperature=0).outputs[0].text
              for p in ("Hello", "Goodbye")}
    e = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                  echo=True)
    assert e.choices[0].text == "Hello" + greedy["Hello"]
    many = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3,
                                     temperature=0, n=2)
    # Choice index = prompt index * n + sample index; greedy samples are all the same.
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [greedy["Hello"]] * 2 + [greedy["Goodbye"]] * 2
    echoed = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3,
                                       temperature=0, n=2, echo=True)
    assert [c.text for c in echoed.choices] == [p + greedy[p] for p in ("Hello", "Hello",
                                                                        "Goodbye", "Goodbye")]


def test_omitted_max_tokens_fills_context(client: openai.OpenAI) -> None:
    prompt = [42] * (MAX_MODEL_LEN - 6)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == MAX_MODEL_LEN - 6


def _stream_completion_text(client: openai.OpenAI, **kw: Any) -> tuple[dict[int, str], Any]:
    texts: dict[int, str] = {}
    usage = None
    finish: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == set(texts)
    return texts, usage


def test_streamed_deltas_equal_non_streamed(client: openai.OpenAI) -> None:
    for kw in (dict(prompt="The weather today", temperature=0.8, seed=1234, max_tokens=32),
               dict(prompt="My favourite food is", temperature=1.0, seed=5, max_tokens=24,
                    n=2, stop=[" and", "."]),
               dict(prompt="Write a list:", temperature=0, max_tokens=20, stop=["\n\n"])):
        full = client.completions.create(model=MODEL, **kw)
        texts, usage = _stream_completion_text(client, model=MODEL,
                                               stream_options={"include_usage": True}, **kw)
        assert texts == {c.index: c.text for c in full.choices}, kw
        assert usage is not None and usage.completion_tokens == full.usage.completion_tokens

    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Tell me a fact."}]}]
    full_chat = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0.7,
                                               seed=99, max_completion_tokens=30, n=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0.7,
                                                 seed=99, max_completion_tokens=30, n=2,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    roles = {}
    texts: dict[int, str] = {}
    for ch in chunks:
        assert ch.object == "chat.completion.chunk"
        for c in ch.choices:
            if c.delta.role is not None:
                assert c.index not in texts, "the role must come first"
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in full_chat.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full_chat.usage.completion_tokens


def test_chat_logprobs_stop_n(client: openai.OpenAI, engine: Any) -> None:
    msgs = [{"role": "user", "content": "Count from 1 to 10."}]
    ids = engine.tokenizer.apply_chat_template(msgs, tokenize=True)
    r = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True,
                                       top_logprobs=2, max_completion_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 10
    assert len(c.logprobs.content) == 10
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert "".join(t.token for t in c.logprobs.content) == c.message.content
    # Greedy: the chosen token is the most likely one.
    assert all(t.token == t.top_logprobs[0].token for t in c.logprobs.content)
    s = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                       max_tokens=60, stop=["5"])
    want = engine_run(engine, {"prompt_token_ids": ids}, temperature=0, max_tokens=60,
                      stop=["5"]).outputs[0]
    assert s.choices[0].finish_reason == "stop" == want.finish_reason
    assert s.choices[0].message.content == want.text and "5" not in want.text
    n = client.chat.completions.create(model=MODEL, messages=msgs, temperature=1.0, n=3,
                                       max_tokens=8, seed=3)
    assert [x.index for x in n.choices] == [0, 1, 2]
    want_n = engine_run(engine, {"prompt_token_ids": ids}, temperature=1.0, n=3, max_tokens=8,
                        seed=3)
    assert [x.message.content for x in n.choices] == [o.text for o in want_n.outputs]
    streamed = [t for ch in client.chat.completions.create(
        model=MODEL, messages=msgs, logprobs=True, top_logprobs=2, max_completion_tokens=10,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
        for c in ch.choices if c.logprobs is not None for t in c.logprobs.content]

    def flat(t: Any) -> tuple[Any, ...]:
        return t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]

    assert [flat(t) for t in streamed] == [flat(t) for t in c.logprobs.content]


# ---- structured output --------------------------------------------------------------------

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pets": {"type": "array", "items": {"type": "string",
                                                            "maxLength": 20},
                                  "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_json_schema_and_json_object(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Describe a person called Ann as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf,
                                       max_tokens=150, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       client.chat.completions.create(model=MODEL, messages=msgs,
                                                      response_format=rf, max_tokens=150,
                                                      temperature=0.8, seed=11, stream=True)
                       if ch.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    ask = [{"role": "user", "content": "Give me a JSON object with a key 'color' and a value."}]
    obj = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=100,
                                         temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


# ---- load, metrics, disconnects, queue bound ------------------------------------------------

def test_32_concurrent_streams_and_metrics(server: ServerProcess, engine: Any) -> None:
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True))
    ref = run_all(engine)
    want = [ref[f"r{i}"].outputs[0].text for i in range(32)]
    before = server.metrics()
    seen: list[dict[str, float]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(server.metrics())
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        text, finish = "", None
        stream = await c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return text, finish

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1",
                                      api_key=server.api_key, max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    try:
        results = asyncio.run(run())
    finally:
        stop.set()
        poller.join()
    assert [t for t, _ in results] == want
    assert all(f == "length" for _, f in results)
    assert max(m["vllm:num_requests_running"] for m in seen) > 1
    assert max(m["vllm:num_requests_running"] for m in seen) <= MAX_NUM_SEQS
    assert max(m["vllm:num_requests_waiting"] for m in seen) > 0
    assert max(m["vllm:kv_cache_usage_perc"] for m in seen) > 0
    after = settled_metrics(server, before, LENGTH, 32)
    delta = {k: after[k] - before[k] for k in after if k in before}
    # Exactly what these 32 requests of 16 tokens each add, nothing left from earlier tests:
    # one TTFT, 15 inter-token gaps, one e2e latency and one queue time per request.
    n_prompt = sum(len(engine.tokenizer.encode(p)) for p in prompts)
    for name, want_delta in [
            (LENGTH, 32), (STOP, 0), (ABORT, 0),
            ("vllm:generation_tokens_total", 32 * 16),
            ("vllm:prompt_tokens_total", n_prompt),
            ("vllm:time_to_first_token_seconds_count", 32),
            ("vllm:inter_token_latency_seconds_count", 32 * 15),
            ("vllm:e2e_request_latency_seconds_count", 32),
            ("vllm:request_queue_time_seconds_count", 32)]:
        assert delta[name] == want_delta, (name, delta[name], want_delta)
    # Every observation is a duration >= 0 (ITLs sum to at most the e2e latencies).
    for hist in ("time_to_first_token", "inter_token_latency", "e2e_request_latency",
                 "request_queue_time"):
        assert delta[f"vllm:{hist}_seconds_sum"] >= 0, hist
    assert (delta["vllm:inter_token_latency_seconds_sum"]
            <= delta["vllm:e2e_request_latency_seconds_sum"])
    assert delta["vllm:prefix_cache_queries_total"] > 0


def test_disconnect_frees_blocks(server: ServerProcess) -> None:
    before = server.metrics()
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0}
    t0 = time.monotonic()
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            # next(), not a loop with break: closing the line iterator closes the connection.
            lines = r.iter_lines()
            n = 0
            while n < 3:
                n += next(lines).startswith("data: ")
            m = server.metrics()
            assert m["vllm:kv_cache_usage_perc"] > 0 and m["vllm:num_requests_running"] == 1
    wait_idle(server, timeout=10)
    # Not streaming: the client gives up (read timeout) and closes the connection.
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    wait_idle(server, timeout=10)
    assert time.monotonic() - t0 < 30, "the requests ran to the end instead of aborting"
    after = server.metrics()
    key = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[key] - before[key] == 2


def test_waiting_queue_full_gives_503_with_retry_after(server: ServerProcess) -> None:
    """The admission bound itself: streams of 1,500 tokens cannot finish while the burst
    lands, so at most MAX_NUM_SEQS running + MAX_WAITING waiting are admitted, and the rest
    get a 503 at once. A stream's 200 comes with its first token (serving.py), so the
    running ones have it and the waiting ones have no answer yet. (At least MAX_WAITING get
    in: the queue alone takes that many, whatever the engine has admitted to running by
    then.)"""
    body = {"prompt": "Queue test", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    burst = MAX_NUM_SEQS + MAX_WAITING + 24
    before = wait_idle(server)

    async def run() -> tuple[list[int], list[httpx.Response], list[dict[str, float]]]:
        codes: list[int] = []
        refused: list[httpx.Response] = []
        release = asyncio.Event()

        async def one(c: httpx.AsyncClient) -> None:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                codes.append(r.status_code)
                if r.status_code != 200:
                    await r.aread()
                    refused.append(r)
                else:
                    await release.wait()  # hold the stream open; leaving aborts it

        limits = httpx.Limits(max_connections=burst + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=120, limits=limits) as c:
            tasks = [asyncio.create_task(one(c)) for _ in range(burst)]
            # Nothing finishes, so every request ends up refused or held by the scheduler,
            # and the gauges settle at exactly the admitted set.
            snapshots: list[dict[str, float]] = []
            deadline = time.monotonic() + 60
            while True:
                m = (await asyncio.to_thread(server.metrics))
                snapshots.append(m)
                held = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
                if (held + len(refused) == burst and m["vllm:num_requests_running"]
                        == min(held, MAX_NUM_SEQS) == codes.count(200)) \
                        or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            for _ in range(3):
                snapshots.append(await asyncio.to_thread(server.metrics))
            release.set()
            for t in tasks:  # the waiting ones are still waiting for an answer: leave
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return codes, refused, snapshots

    codes, refused, snapshots = asyncio.run(run())
    assert set(codes) <= {200, 503}, codes
    last = snapshots[-1]
    admitted = last["vllm:num_requests_running"] + last["vllm:num_requests_waiting"]
    assert MAX_WAITING <= admitted <= MAX_NUM_SEQS + MAX_WAITING, admitted
    assert len(refused) == burst - admitted >= burst - MAX_NUM_SEQS - MAX_WAITING
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    for m in snapshots:
        assert m["vllm:num_requests_running"] <= MAX_NUM_SEQS, m
        assert m["vllm:num_requests_waiting"] <= MAX_WAITING, m
    assert last["vllm:num_requests_running"] == min(admitted, MAX_NUM_SEQS), last
    # Exactly the running streams had their 200 (and the refused their 503) by then.
    assert codes.count(200) == last["vllm:num_requests_running"], (codes, last)
    # Leaving the streams aborted every admitted request, and only those.
    after = settled_metrics(server, before, ABORT, admitted)
    assert after[ABORT] - before[ABORT] == admitted
    assert after[LENGTH] - before[LENGTH] == 0


# ---- bad input ----------------------------------------------------------------------------

C, H = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def _j(path: str, body: dict[str, Any]) -> Callable[[bool], tuple[str, bytes]]:
    """A JSON body; the streamed variant adds "stream": true."""
    def build(stream: bool) -> tuple[str, bytes]:
        return path, json.dumps({**body, "stream": True} if stream else body).encode()
    return build


def _raw(path: str, template: str) -> Callable[[bool], tuple[str, bytes]]:
    """A raw body; {s} becomes ',"stream":true' in the streamed variant."""
    def build(stream: bool) -> tuple[str, bytes]:
        return path, template.replace("{s}", ',"stream":true' if stream else "").encode()
    return build


def _deep(stream: bool) -> tuple[str, bytes]:
    inner = "[" * 5000 + "]" * 5000
    return C, ('{"prompt":"x","extra":' + inner + (',"stream":true}' if stream else "}")
               ).encode()


def _big(stream: bool) -> tuple[str, bytes]:
    return C, json.dumps({"prompt": "x " * MAX_BODY, "stream": stream}).encode()


def _c(**kw: Any) -> Callable[[bool], tuple[str, bytes]]:
    return _j(C, {"prompt": "Hello", "max_tokens": 4, **kw})


def _h(**kw: Any) -> Callable[[bool], tuple[str, bytes]]:
    return _j(H, {"messages": MSGS, "max_tokens": 4, **kw})


BAD_INPUTS: list[tuple[str, Callable[[bool], tuple[str, bytes]], int, str | None]] = [
    # wrong types
    ("prompt number", _j(C, {"prompt": 5}), 400, "prompt"),
    ("prompt mixed list", _j(C, {"prompt": ["a", 1]}), 400, "prompt"),
    ("max_tokens string", _c(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens bool", _c(max_tokens=True), 400, "max_tokens"),
    ("temperature string", _c(temperature="hot"), 400, "temperature"),
    ("n float", _c(n=2.5), 400, "n"),
    ("seed string", _c(seed="abc"), 400, "seed"),
    ("stop number", _c(stop=5), 400, "stop"),
    ("echo string", _c(echo="yes"), 400, "echo"),
    ("logit_bias list", _c(logit_bias=[1, 2]), 400, "logit_bias"),
    ("messages not a list", _j(H, {"messages": "hi"}), 400, "messages"),
    ("content number", _j(H, {"messages": [{"role": "user", "content": 5}]}), 400,
     "messages[0].content"),
    ("content part image", _j(H, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}), 400,
     "messages[0].content[0].type"),
    # out of range
    ("max_tokens 0", _c(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", _c(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens huge", _c(max_tokens=10**9), 400, "max_tokens"),
    ("temperature negative", _c(temperature=-1), 400, "temperature"),
    ("temperature huge", _c(temperature=1e6), 400, "temperature"),
    ("top_p 0", _c(top_p=0), 400, "top_p"),
    ("top_p 1.5", _c(top_p=1.5), 400, "top_p"),
    ("top_k -5", _c(top_k=-5), 400, "top_k"),
    ("min_p 2", _c(min_p=2), 400, "min_p"),
    ("n 0", _c(n=0), 400, "n"),
    ("n huge", _c(n=100000), 400, "n"),
    ("logprobs 50", _c(logprobs=50), 400, "logprobs"),
    ("presence_penalty 5", _c(presence_penalty=5), 400, "presence_penalty"),
    ("frequency_penalty -3", _c(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition_penalty 0", _c(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_tokens > max_tokens", _c(min_tokens=10), 400, "min_tokens"),
    ("priority huge", _c(priority=2**40), 400, "priority"),
    ("too many stop strings", _c(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop string too long", _c(stop=["x" * 300]), 400, "stop"),
    ("empty stop string", _c(stop=[""]), 400, "stop"),
    ("huge logit_bias", _c(logit_bias={str(i): 1.0 for i in range(2000)}), 400,
     "logit_bias"),
    ("logit_bias value", _c(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit_bias key", _c(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias oov", _c(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("stop_token_ids oov", _c(stop_token_ids=[10**8]), 400, "stop_token_ids"),
    ("best_of != n", _c(best_of=3), 400, "best_of"),
    ("suffix", _c(suffix="end"), 400, "suffix"),
    ("top_logprobs 30", _h(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("top_logprobs without logprobs", _h(top_logprobs=2), 400, "top_logprobs"),
    ("max_completion_tokens 0", _h(max_completion_tokens=0), 400, "max_completion_tokens"),
    # NaN and Infinity
    ("temperature NaN", _raw(C, '{"prompt":"x","temperature":NaN{s}}'), 400, None),
    ("top_p Infinity", _raw(C, '{"prompt":"x","top_p":Infinity{s}}'), 400, None),
    ("penalty -Infinity", _raw(H, '{"messages":[{"role":"user","content":"x"}],'
                                  '"presence_penalty":-Infinity{s}}'), 400, None),
    # empty and unknown things
    ("empty prompt", _c(prompt=""), 400, "prompt"),
    ("empty prompt list", _c(prompt=[]), 400, "prompt"),
    ("empty messages", _j(H, {"messages": []}), 400, "messages"),
    ("missing messages", _j(H, {"max_tokens": 3}), 400, "messages"),
    ("unknown role", _j(H, {"messages": [{"role": "wizard", "content": "x"}]}), 400,
     "messages[0].role"),
    ("oov token ids", _c(prompt=[1, 2, 10**7]), 400, "prompt"),
    ("negative token id", _c(prompt=[-1]), 400, "prompt"),
    ("prompt over context", _c(prompt=[42] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("chat over context", _j(H, {"messages": [{"role": "user", "content": "word " * 3000}]}),
     400, "messages"),
    ("unknown model", _c(model="gpt-17"), 404, "model"),
    ("unknown model chat", _h(model="gpt-17"), 404, "model"),
    ("response_format type", _h(response_format={"type": "yaml"}), 400,
     "response_format.type"),
    ("json_schema without schema", _h(response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema"),
    ("invalid json_schema", _h(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format"),
    # bodies
    ("oversized body", _big, 413, None),
    ("not json", _raw(C, '{"prompt": "x"{s}'), 400, None),
    ("invalid utf-8", lambda s: (C, b'{"prompt": "\xff\xfe"}'), 400, None),
    ("deeply nested", _deep, 400, None),
    ("moderately nested", _raw(C, '{"prompt":"x","a":' + "[" * 40 + "]" * 40 + "{s}}"), 400,
     None),
    ("array body", _raw(C, '[{"prompt":"x"{s}}]'), 400, None),
    ("string body", _raw(C, '"prompt{s}"'), 400, None),
    ("null body", _raw(C, "null"), 400, None),
    ("empty body", _raw(C, ""), 400, None),
]


def test_bad_inputs_table(server: ServerProcess, http: httpx.Client) -> None:
    assert len(BAD_INPUTS) >= 40
    valid = {"prompt": "Hi", "max_tokens": 1}
    for name, build, status, param in BAD_INPUTS:
        for stream in (False, True):
            path, body = build(stream)
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            label = f"{name} (stream={stream}): {r.status_code} {r.text[:300]}"
            assert r.status_code == status, label
            assert r.headers["content-type"].startswith("application/json"), label
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, label
            assert err["message"] and "Traceback" not in r.text and ".py" not in r.text, label
            if param is not None:  # the field, or a part of it (prompt[1])
                assert err["param"] == param or err["param"].startswith(
                    (param + "[", param + ".")), label
            assert r.headers["x-request-id"], label
            ok = http.post(C, json=valid)
            assert ok.status_code == 200, f"after {label}: {ok.text}"
            assert http.get("/health").status_code == 200
    # The stream_options rule only exists without stream.
    for body in ({"prompt": "x", "stream_options": {"include_usage": True}},
                 {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}):
        r = http.post(C, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    # Messages name both numbers when the prompt plus max_tokens is over the context.
    r = http.post(C, json={"prompt": [42] * 1000, "max_tokens": 1500})
    assert "1000" in r.json()["error"]["message"] and "1500" in r.json()["error"]["message"]
    r = http.post(C, json={"prompt": "x", "n": 1000})
    assert "256" in r.json()["error"]["message"] or "128" in r.json()["error"]["message"]
    wait_idle(server)


# ---- shutdown (last: it ends the module's server) ----------------------------------------------

def test_sigterm_drain_is_bounded_by_shutdown_timeout(server: ServerProcess) -> None:
    """SIGTERM with, in flight: a short stream (finishes within the drain), a long stream and a
    long non-streamed request (both cut at --shutdown-timeout), and a request whose headers
    reached the server before the signal and whose body comes during the drain (refused).

        SIGTERM ---- drain: no new requests ---- +SHUTDOWN_TIMEOUT: the rest end ---- exit
    """
    long_body = {"prompt": "Tell me a story.", "max_tokens": 1800, "ignore_eos": True,
                 "temperature": 0}
    results: dict[str, list[Any]] = {}
    times: dict[str, float] = {}
    responses: dict[str, httpx.Response] = {}
    started = threading.Barrier(3)

    def stream(name: str, max_tokens: int) -> None:
        events: list[Any] = []
        results[name] = events
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
            with c.stream("POST", "/v1/completions",
                          json={**long_body, "max_tokens": max_tokens, "stream": True}) as r:
                assert r.status_code == 200
                first = True
                for ev in sse_events(r.iter_lines()):
                    events.append(ev)
                    if first:
                        first = False
                        started.wait(30)
        times[name] = time.monotonic()

    def plain() -> None:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
            responses["plain"] = c.post("/v1/completions", json=long_body)
        times["plain"] = time.monotonic()

    headers_sent = threading.Event()
    send_body = threading.Event()

    def late_body() -> Iterator[bytes]:
        headers_sent.set()  # httpx pulls the body only after writing the headers
        send_body.wait(30)
        yield json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()

    def late() -> None:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
            responses["late"] = c.post("/v1/completions", content=late_body(),
                                       headers={"Content-Type": "application/json"})

    threads = [threading.Thread(target=stream, args=("short", 20)),
               threading.Thread(target=stream, args=("long", 1800)),
               threading.Thread(target=plain), threading.Thread(target=late)]
    for t in threads:
        t.start()
    started.wait(60)
    assert headers_sent.wait(30)
    # The non-streamed one is running too (it was sent with the streams).
    deadline = time.monotonic() + 30
    while server.metrics()["vllm:num_requests_running"] < 3:
        assert time.monotonic() < deadline, "the three requests never ran together"
        time.sleep(0.05)
    t_term = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the drain has begun, and uvicorn has closed its listening socket
    send_body.set()
    code = server.proc.wait(60)
    t_exit = time.monotonic()
    for t in threads:
        t.join(30)
    assert code == 0, server.log()

    short, long = results["short"], results["long"]
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(ev["choices"][0]["text"]) > 0 for ev in short[:-1]) > 0
    # 1,800 tokens take far longer than the drain: the stream is cut by an error event at
    # SHUTDOWN_TIMEOUT (not before: the drain waits), and the process exits soon after.
    assert long[-1] == "[DONE]"
    assert long[-2] == {"error": long[-2]["error"]} and \
        long[-2]["error"]["code"] == "shutting_down", long[-2]
    assert all(ev["choices"][0]["finish_reason"] is None for ev in long[:-2])
    assert SHUTDOWN_TIMEOUT - 0.5 <= times["long"] - t_term <= SHUTDOWN_TIMEOUT + DRAIN_MARGIN
    assert t_exit - t_term <= SHUTDOWN_TIMEOUT + DRAIN_MARGIN, t_exit - t_term
    # A request that arrives during the drain is refused with OpenAI's error shape.
    late_r = responses["late"]
    assert late_r.status_code == 503, late_r.text
    assert set(late_r.json()["error"]) == {"message", "type", "param", "code"}
    assert late_r.json()["error"]["code"] == "shutting_down"
    assert int(late_r.headers["retry-after"]) >= 1
    # The non-streamed request cut at the timeout: a 503 in OpenAI's shape, not a 500.
    plain_r = responses["plain"]
    assert SHUTDOWN_TIMEOUT - 0.5 <= times["plain"] - t_term <= SHUTDOWN_TIMEOUT + DRAIN_MARGIN
    assert plain_r.status_code == 503, plain_r.text
    err = plain_r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == "shutting_down", err
    assert "Traceback" not in server.log()
