"""The OpenAI-compatible server over real HTTP: a real `kvserve serve` process (uvicorn) with
the default model, driven by the official openai client and raw httpx.

References are independent of the server: the in-process engine's greedy output for the same
prompt, the non-streamed response for the same seed, JSON Schema validation by jsonschema.
The SIGTERM test ends the module's server, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all
from tests.e2e.server_process import ServerProcess

MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16
MAX_WAITING = 32
MAX_BODY = 64 * 1024
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests",
                        str(MAX_WAITING), "--max-body-bytes", str(MAX_BODY),
                        "--shutdown-timeout", "3")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    return make_engine(max_model_len=MAX_MODEL_LEN)


def wait_idle(server: ServerProcess, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.1)


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


def test_completion_schema_n_logprobs_stop_seed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=12,
                              temperature=0.9, seed=7, n=3, logprobs=3, user="tester")
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.object == "text_completion" and a.model == MODEL and a.id.startswith("cmpl-")
    assert isinstance(a.created, int)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed
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
    assert " 7" not in s.choices[0].text and s.choices[0].text.strip().endswith("6,")
    n = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert n.choices[0].finish_reason == "length" and n.usage.completion_tokens == 5
    e = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                  echo=True)
    assert e.choices[0].text.startswith("Hello")
    many = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3,
                                     temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]


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


def test_chat_logprobs_stop_n(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Count from 1 to 10."}]
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
    assert s.choices[0].finish_reason == "stop" and "5" not in s.choices[0].message.content
    n = client.chat.completions.create(model=MODEL, messages=msgs, temperature=1.0, n=3,
                                       max_tokens=8, seed=3)
    assert [x.index for x in n.choices] == [0, 1, 2]
    streamed = [t for ch in client.chat.completions.create(
        model=MODEL, messages=msgs, logprobs=True, top_logprobs=2, max_completion_tokens=10,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
        for c in ch.choices if c.logprobs is not None for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [
        (t.token, t.logprob) for t in c.logprobs.content]


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
    after = wait_idle(server)
    key = 'vllm:request_success_total{finished_reason="length"}'
    assert after[key] - before[key] == 32
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 512
    assert after["vllm:time_to_first_token_seconds_count"] >= 32
    assert after["vllm:inter_token_latency_seconds_count"] >= 32 * 15
    assert after["vllm:e2e_request_latency_seconds_count"] >= 32
    assert after["vllm:request_queue_time_seconds_count"] >= 32
    assert after["vllm:prefix_cache_queries_total"] > 0


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
    body = {"prompt": "Queue test", "max_tokens": 48, "ignore_eos": True, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body)
                                          for _ in range(MAX_NUM_SEQS + MAX_WAITING + 12)))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}
    # Requests queue up faster than steps admit them, so at least MAX_WAITING get in.
    assert codes.count(503) > 0 and codes.count(200) >= MAX_WAITING
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
    wait_idle(server)


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

def test_sigterm_during_stream_exits_cleanly(server: ServerProcess) -> None:
    results: dict[str, list[Any]] = {}
    started = threading.Barrier(3)

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        events: list[Any] = []
        results[name] = events
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                first = True
                for ev in sse_events(r.iter_lines()):
                    events.append(ev)
                    if first:
                        first = False
                        started.wait(30)

    threads = [threading.Thread(target=stream, args=("short", 20)),
               threading.Thread(target=stream, args=("long", 1800))]
    for t in threads:
        t.start()
    started.wait(60)
    code = server.terminate(timeout=60)
    for t in threads:
        t.join(30)
    assert code == 0, server.log()
    short, long = results["short"], results["long"]
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    # The long one cannot finish within --shutdown-timeout 3: it ends with an error event.
    assert long[-1] == "[DONE]"
    last = long[-2]
    if "error" in last:
        assert last["error"]["code"] == "shutting_down"
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in server.log()
