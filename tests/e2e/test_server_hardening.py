"""Hardening over real HTTP: a real `kvserve serve` process (uvicorn) on the default model,
attacked the way the advisories of vLLM and llama.cpp describe. Each test names the item of
the hardening issue it holds. References are independent of the server: the in-process
engine's greedy output, the chat template rendered here, the prefix cache's block size.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all
from tests.e2e.fault_server import FAULT_TRIGGER
from tests.e2e.server_process import ServerProcess, wait_idle

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 32
MAX_WAITING = 512
MODEL = "smollm2-135m"
C, H = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests",
                       str(MAX_WAITING)) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    return make_engine(max_model_len=MAX_MODEL_LEN)


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    label = f"{r.status_code} {r.text[:300]}"
    assert r.status_code == status, label
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, label
    if param is not None:
        assert err["param"] == param, label
    for w in words:
        assert w in err["message"], label


def greedy(engine: Any, prompt: Any, **kw: Any) -> Any:
    engine.add_request("ref", prompt, SamplingParams(temperature=0, **kw))
    return run_all(engine)["ref"].outputs[0]


# ---- 2. validation-error amplification -----------------------------------------------------

def test_huge_bad_bodies_get_one_error_and_health_stays_live(server: ServerProcess,
                                                             http: httpx.Client) -> None:
    bodies = [
        (C, {"prompt": [1.5] * 150_000}, "prompt", "prompt[0]"),
        (H, {"messages": [{"role": "user", "content": [{}] * 250}] * 1000},
         "messages[0].content[0].type", "Field required"),
        (C, {"prompt": [7] * 200_000}, "prompt", "at most 131072 token ids"),
        ("/detokenize", {"tokens": [1] * 200_000}, "tokens", "at most 131072"),
    ]
    stop = threading.Event()
    health: list[tuple[int, float]] = []

    def poll() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                health.append((c.get("/health").status_code, time.monotonic() - t0))
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for path, body, param, words in bodies:
            assert_error(http.post(path, json=body), 400, param, words)
    finally:
        stop.set()
        poller.join()
    assert health and all(code == 200 for code, _ in health)
    # Liveness, not speed: formatting 450k errors held /health for 1.5 s on this machine.
    assert max(t for _, t in health) < 1.0, max(t for _, t in health)


# ---- 3. the memory budget of one request ------------------------------------------------------

def test_n_times_tokens_times_logprobs_is_bounded(http: httpx.Client) -> None:
    r = http.post(H, json={"messages": MSGS, "n": 100, "logprobs": True, "top_logprobs": 20})
    assert_error(r, 400, "n", "n x max_tokens x (logprobs + 1) = 100 x", "x 21 =",
                 "lower n, max_tokens or logprobs")
    r = http.post(C, json={"prompt": "Hi", "n": 128, "logprobs": 20, "max_tokens": 500})
    assert_error(r, 400, "n", "128 x 500 x 21 = 1344000")
    # Under the bound it runs (one token keeps 6 entries).
    r = http.post(C, json={"prompt": "Hi", "n": 2, "logprobs": 5, "max_tokens": 3})
    assert r.status_code == 200
    assert all(len(c["logprobs"]["tokens"]) == 3 for c in r.json()["choices"])


# ---- 5. continue_final_message -------------------------------------------------------------

def test_continue_final_message_cuts_at_the_content(client: openai.OpenAI, http: httpx.Client,
                                                    engine: Any) -> None:
    msgs = [{"role": "user", "content": "Spell the word 'time'."},
            {"role": "assistant", "content": "ti"}]
    r = http.post(H, json={"messages": msgs, "continue_final_message": True})
    assert_error(r, 400, "continue_final_message", "add_generation_prompt")
    r = http.post(H, json={"messages": MSGS, "continue_final_message": True,
                           "add_generation_prompt": False})
    assert_error(r, 400, "continue_final_message", "assistant message last")
    tok = engine.tokenizer
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    want_prompt = tok.encode(text[:text.rindex("ti") + 2], add_special_tokens=False)
    want = greedy(engine, {"prompt_token_ids": want_prompt}, max_tokens=8)
    got = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert got.usage.prompt_tokens == len(want_prompt)
    assert got.choices[0].message.content == want.text


# ---- 6. lone surrogates --------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    (C, '{"prompt": "a\\ud800b"}', "prompt"),
    (C, '{"prompt": ["ok", "\\udfff"]}', "prompt"),
    (H, '{"messages": [{"role": "user", "content": "x\\uDBFF"}]}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    (C, '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
])
def test_lone_surrogates_are_a_400(http: httpx.Client, path: str, body: str, param: str
                                   ) -> None:
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 400, param, "lone UTF-16 surrogate")
    assert http.get("/health").status_code == 200


def test_a_surrogate_pair_is_text(http: httpx.Client, engine: Any) -> None:
    r = http.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"] == engine.tokenizer.encode("\U0001F600")


# ---- 7. backpressure before work -------------------------------------------------------------

def test_text_far_past_the_context_is_refused_before_tokenizing(http: httpx.Client) -> None:
    t0 = time.monotonic()
    r = http.post(C, json={"prompt": "word " * 600_000, "max_tokens": 1})
    assert_error(r, 400, "prompt", "3000000 characters", "max_model_len")
    r = http.post(H, json={"messages": [{"role": "user", "content": "word " * 600_000}]})
    assert_error(r, 400, "messages", "3000000 characters")
    # Tokenizing 3 MB takes seconds here; refusing it takes a length check.
    assert time.monotonic() - t0 < 5.0


def _open_stream(server: ServerProcess, body: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """A request on a raw socket, left open; returns the socket and its first bytes."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall((f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
               f"{server.api_key}\r\nContent-Type: application/json\r\nContent-Length: "
               f"{len(data)}\r\n\r\n").encode() + data)
    return s, s.recv(64)


def test_uvicorn_limits_concurrency() -> None:
    srv = ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", "512",
                        "--limit-concurrency", "3")
    socks: list[socket.socket] = []
    try:
        body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        heads = []
        for _ in range(5):  # one at a time, each left open
            s, head = _open_stream(srv, body)
            socks.append(s)
            heads.append(head.split(b"\r\n", 1)[0])
        # uvicorn counts open connections (>= the limit: 503), so the third is turned away.
        assert heads == [b"HTTP/1.1 200 OK"] * 2 + [b"HTTP/1.1 503 Service Unavailable"] * 3, \
            heads
        for s in socks:
            s.close()
        socks.clear()
        deadline = time.monotonic() + 20
        while httpx.post(srv.base_url + C, headers=srv.headers, json={
                "prompt": "Hi", "max_tokens": 1}).status_code != 200:
            assert time.monotonic() < deadline, "the server did not recover"
            time.sleep(0.2)
        assert httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()


# ---- 9. silent semantic drops ---------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 5}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
])
def test_fields_that_would_be_dropped_or_corrupt_are_refused(http: httpx.Client,
                                                             extra: dict[str, Any],
                                                             param: str) -> None:
    assert_error(http.post(H, json={"messages": MSGS, "max_tokens": 8, **extra}), 400, param)


def test_tool_choice_none_and_empty_tools_are_plain_chat(http: httpx.Client) -> None:
    for extra in ({"tool_choice": "none"}, {"tools": []}, {"parallel_tool_calls": False}):
        r = http.post(H, json={"messages": MSGS, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text


# ---- 10. disconnects at any point ------------------------------------------------------------

def _raw_post(server: ServerProcess, path: str, body: dict[str, Any], read: int) -> None:
    """Sends the request on a raw socket, reads `read` bytes of the answer, then hangs up."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + data)
        s.settimeout(2.0)  # a non-streamed answer comes only at the end: hang up waiting
        got = b""
        try:
            while len(got) < read:
                chunk = s.recv(read - len(got))
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass


def test_a_disconnect_at_any_point_frees_the_request(server: ServerProcess) -> None:
    long = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}
    cases = [
        (C, {"prompt": "Once upon a time", "stream": True, **long}),
        (C, {"prompt": ["One", "Two", "Three"], "stream": True, **long}),
        (C, {"prompt": "Once upon a time", "n": 3, "stream": True, **long}),
        (H, {"messages": MSGS, "stream": True, **long}),
        (H, {"messages": MSGS, "n": 2, "stream": True, **long}),
        (C, {"prompt": "Once upon a time", "n": 2, **long}),
    ]
    before = server.metrics()
    key = 'vllm:request_success_total{finished_reason="abort"}'
    aborted = unsure = 0
    t0 = time.monotonic()
    for path, body in cases:
        n_children = len(body.get("prompt", [0])) if isinstance(body.get("prompt"), list) \
            else 1
        n_children *= body.get("n", 1)
        for read in (0, 40, 400):  # before the headers, inside them, a few events in
            _raw_post(server, path, body, read)
            wait_idle(server)  # its KV blocks are free again, however early it hung up
            if read:
                aborted += n_children
            else:  # gone before the engine took it: never started, so never aborted
                unsure += n_children
    assert time.monotonic() - t0 < 120, "requests ran to the end instead of aborting"
    after = server.metrics()
    # One abort per choice of every request that started.
    assert aborted <= after[key] - before[key] <= aborted + unsure


# ---- 11. browser-origin abuse ------------------------------------------------------------------

def test_only_json_bodies_and_loopback_hosts(server: ServerProcess) -> None:
    url = server.base_url + C
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  None):
        headers = {**server.headers, **({"Content-Type": ctype} if ctype else {})}
        r = httpx.post(url, content=body, headers=headers)
        assert_error(r, 415, "Content-Type", "application/json")
    r = httpx.post(url, content=body, headers={**server.headers,
                                               "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.1"):
        r = httpx.post(url, content=body, headers={**server.headers, "Host": host,
                                                   "Content-Type": "application/json"})
        assert_error(r, 421, None, "Host header")
        assert httpx.get(server.base_url + "/v1/models", headers={
            **server.headers, "Host": host}).status_code == 421
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "127.0.0.2",
                 f"[::1]:{server.port}"):
        r = httpx.get(server.base_url + "/v1/models", headers={**server.headers, "Host": host})
        assert r.status_code == 200, (host, r.text)


# ---- 15. small OpenAI mismatches ---------------------------------------------------------------

def test_developer_role_max_tokens_name_cached_tokens_openapi(client: openai.OpenAI,
                                                             http: httpx.Client) -> None:
    def ask(role: str) -> Any:
        return client.chat.completions.create(
            model=MODEL, max_tokens=12, temperature=0,
            messages=[{"role": role, "content": "Answer in French."},  # type: ignore[misc]
                      {"role": "user", "content": "What is a cat?"}])

    dev, system = ask("developer"), ask("system")
    assert dev.choices[0].message.content == system.choices[0].message.content
    assert dev.usage.prompt_tokens == system.usage.prompt_tokens
    assert_error(http.post(H, json={"messages": MSGS, "max_tokens": 0}), 400, "max_tokens")
    assert_error(http.post(H, json={"messages": MSGS, "max_completion_tokens": 0}), 400,
                 "max_completion_tokens")
    # The prefix cache's hits are reported: whole 16-token blocks of a repeated prompt.
    prompt = "The history of the printing press, told in detail: " * 12
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    n = again.usage.prompt_tokens
    assert cached % 16 == 0 and n - 16 <= cached <= n - 1, (cached, n)
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schemas = doc["components"]["schemas"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "developer" in json.dumps(schemas["ChatMessage"])
    assert httpx.get(http.base_url.join("/openapi.json")).status_code == 401  # behind the key


# ---- load with faults ------------------------------------------------------------------------

def test_256_streams_with_a_quarter_disconnecting(server: ServerProcess, engine: Any) -> None:
    prompts = [f"Write about topic number {i}:" for i in range(8)]
    want = {p: greedy(engine, p, max_tokens=16, ignore_eos=True).text for p in prompts}
    rng = random.Random(1234)
    plan = [(prompts[i % 8], rng.randrange(0, 12) if i % 4 == 0 else None)
            for i in range(256)]  # (prompt, disconnect after that many events, or never)
    before = server.metrics()

    async def one(c: httpx.AsyncClient, prompt: str, cut: int | None
                  ) -> tuple[int, list[Any]]:
        body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0,
                "stream": True}
        events: list[Any] = []
        async with c.stream("POST", C, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, [r.text]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if cut is not None and len(events) > cut:
                        break  # leaving the block closes the connection mid-stream
        return r.status_code, events

    async def run() -> list[tuple[int, list[Any]]]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=300, limits=limits) as c:
            return await asyncio.gather(*(one(c, p, cut) for p, cut in plan))

    results = asyncio.run(run())
    assert [code for code, _ in results if code >= 500] == []
    survivors = 0
    for (prompt, cut), (code, events) in zip(plan, results):
        assert code == 200, events
        if cut is not None:
            continue
        survivors += 1
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) \
            == want[prompt]
    assert survivors == 192
    after = wait_idle(server, timeout=60)
    done = 'vllm:request_success_total{finished_reason="length"}'
    assert after[done] - before[done] >= survivors
    # Greedy output after the storm is what it was.
    r = httpx.post(server.base_url + C, headers=server.headers, timeout=60,
                   json={"prompt": prompts[0], "max_tokens": 16, "ignore_eos": True,
                         "temperature": 0})
    assert r.json()["choices"][0]["text"] == want[prompts[0]]


# ---- 8. a dead engine ends the process ----------------------------------------------------------

def test_a_dead_engine_thread_ends_the_process_non_zero() -> None:
    srv = ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", "512",
                        module="tests.e2e.fault_server")
    try:
        with httpx.Client(base_url=srv.base_url, headers=srv.headers, timeout=60) as c:
            with c.stream("POST", C, json={"prompt": "A long one", "max_tokens": 400,
                                           "ignore_eos": True, "stream": True}) as victim:
                lines = victim.iter_lines()
                assert next(lines).startswith("data: ")
                r = c.post(C, json={"prompt": f"Hi {FAULT_TRIGGER}", "max_tokens": 5})
                assert_error(r, 503, None)
                assert r.json()["error"]["code"] == "engine_dead"
                rest = [x for x in lines if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
        code = srv.proc.wait(20)  # without a supervisor's help: it exits by itself
        assert code == 1, srv.log()
        assert "engine stopped" in srv.log()
    finally:
        srv.stop()
