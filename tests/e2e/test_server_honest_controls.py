"""What the sampling controls do, over real HTTP, not only that they validate: logit_bias,
min_tokens, stop_token_ids and the three penalties change greedy output exactly as a direct
forward with the processor's formula (or the in-process engine with the same SamplingParams)
says; structured output holds for every one of n choices; aborting or disconnecting an n > 1,
multi-prompt request frees every choice's KV blocks and counts each choice as aborted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.e2e.server_process import ServerProcess
from tests.e2e.test_server import ABORT, MODEL, PERSON, engine_run, settled_metrics, wait_idle
from tests.e2e.test_server_honest_logprobs import Reference


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                       "--kv-cache-dtype", "float16") as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    return make_engine(max_model_len=2048, kv_cache_dtype="float16")


@pytest.fixture(scope="module")
def ref(smollm2: Any) -> Reference:
    return Reference(smollm2)


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---- logit_bias, min_tokens, stop_token_ids --------------------------------------------------

def test_logit_bias_steers_greedy_output(http: httpx.Client, engine: Any,
                                         ref: Reference) -> None:
    prompt = "The capital of France is"
    ids = ref.tok.encode(prompt)
    (blue,) = ref.tok.encode(" blue")
    r = complete(http, prompt=prompt, max_tokens=4, logit_bias={str(blue): 100})
    assert r["choices"][0]["text"] == ref.tok.decode([blue] * 4)
    assert r["usage"]["completion_tokens"] == 4

    # -100 on the greedy token: the direct forward's second most likely comes instead.
    row = ref.logits(ids)[-1]
    first, second = row.topk(2).indices.tolist()
    r = complete(http, prompt=prompt, max_tokens=6, logit_bias={str(first): -100})
    want = engine_run(engine, prompt, max_tokens=6, temperature=0,
                      logit_bias={first: -100}).outputs[0]
    assert want.token_ids[0] == second
    assert r["choices"][0]["text"] == want.text
    assert r["choices"][0]["text"].startswith(ref.tok.decode([second]))
    unbiased = complete(http, prompt=prompt, max_tokens=6)["choices"][0]["text"]
    assert unbiased.startswith(ref.tok.decode([first])) and unbiased != want.text


def test_min_tokens_holds_eos_back(client: openai.OpenAI, engine: Any) -> None:
    msgs = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    ids = engine.tokenizer.apply_chat_template(msgs, tokenize=True)
    free = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                          max_tokens=30)
    assert free.choices[0].finish_reason == "stop"
    early = free.usage.completion_tokens
    assert early < 8, "the prompt must stop early for the test to mean anything"
    held = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                          max_tokens=30, extra_body={"min_tokens": 8})
    assert held.usage.completion_tokens >= 8
    want = engine_run(engine, {"prompt_token_ids": ids}, temperature=0, max_tokens=30,
                      min_tokens=8).outputs[0]
    assert held.choices[0].message.content == want.text
    assert held.usage.completion_tokens == len(want.token_ids)
    assert held.choices[0].finish_reason == want.finish_reason


def test_stop_token_ids_end_at_the_first_occurrence(http: httpx.Client, engine: Any) -> None:
    prompt = "The capital of France is"
    greedy = engine_run(engine, prompt, max_tokens=24, temperature=0,
                        ignore_eos=True).outputs[0].token_ids
    j = 4
    stop = greedy[j]
    assert stop not in greedy[:j] and stop in greedy[j + 1:], greedy
    r = complete(http, prompt=prompt, max_tokens=24, stop_token_ids=[stop])
    c = r["choices"][0]
    assert c["finish_reason"] == "stop"
    # The stop token is the last one generated (and counted); nothing after it comes.
    assert r["usage"]["completion_tokens"] == j + 1
    want = engine_run(engine, prompt, max_tokens=24, temperature=0,
                      stop_token_ids=[stop]).outputs[0]
    assert want.token_ids == greedy[:j + 1] and want.stop_reason == stop
    assert c["text"] == want.text
    # (vLLM leaves the stop token's own text out unless include_stop_str_in_output; kvserve
    # keeps it today. Either way the text ends there.)
    assert c["text"] in (engine.tokenizer.decode(greedy[:j]),
                         engine.tokenizer.decode(greedy[:j + 1]))


# ---- penalties ------------------------------------------------------------------------------

def penalized_greedy(ref: Reference, prompt_ids: list[int], n: int, *, presence: float = 0.0,
                     frequency: float = 0.0, repetition: float = 1.0) -> list[int]:
    """Greedy decoding with the penalties' formulas applied to a direct forward's logits:
    repetition (HF/vLLM) over prompt and output tokens, frequency and presence (OpenAI) over
    output tokens only."""
    out: list[int] = []
    for _ in range(n):
        logits = ref.logits(prompt_ids + out)[-1].clone()
        for t in set(prompt_ids + out):
            if repetition != 1.0:
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(torch.argmax(logits)))
    return out


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 0.7},
                                     {"repetition_penalty": 1.8}])
def test_penalties_change_greedy_output(http: httpx.Client, engine: Any, ref: Reference,
                                        penalty: dict[str, float]) -> None:
    prompt = "1 1 1 1 1"
    ids = ref.tok.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True}
    plain = complete(http, **body)["choices"][0]["text"]
    assert plain == " 1" * 6  # 12 tokens (" ", "1"): the repetition penalties must break
    got = complete(http, **body, **penalty)["choices"][0]["text"]
    assert got != plain
    name, value = next(iter(penalty.items()))
    want = engine_run(engine, prompt, max_tokens=12, temperature=0, ignore_eos=True,
                      **penalty).outputs[0]
    assert got == want.text
    formula = penalized_greedy(ref, ids, 12, **{name.removesuffix("_penalty"): value})
    assert want.token_ids == formula


# ---- structured output with n > 1 ---------------------------------------------------------

def test_json_schema_holds_for_every_choice(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Describe a person called Ann as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, n=3,
                                       max_tokens=150, temperature=0.9, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one thrice
    texts: dict[int, str] = {}
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf,
                                             n=2, max_tokens=150, temperature=0.9, seed=6,
                                             stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert set(texts) == {0, 1}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


# ---- abort and disconnect of n > 1, multi-prompt requests ------------------------------------

PROMPTS = ["Tell me a very long story.", "Write a long essay about rivers."]
N = 3
CHOICES = len(PROMPTS) * N


def test_disconnect_aborts_every_choice_of_a_streamed_request(server: ServerProcess) -> None:
    before = wait_idle(server)
    body = {"prompt": PROMPTS, "n": N, "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0.8, "seed": 1, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # next(), not break: closing the iterator disconnects
            seen: set[int] = set()
            while len(seen) < CHOICES:
                line = next(lines)
                if line.startswith("data: "):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
            m = server.metrics()
            assert m["vllm:num_requests_running"] == CHOICES
            assert m["vllm:kv_cache_usage_perc"] > 0
    after = settled_metrics(server, before, ABORT, CHOICES)
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after[ABORT] - before[ABORT] == CHOICES


def test_disconnect_aborts_every_choice_of_a_plain_request(server: ServerProcess) -> None:
    before = wait_idle(server)
    body = {"prompt": PROMPTS, "n": N, "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0}
    t0 = time.monotonic()
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    after = settled_metrics(server, before, ABORT, CHOICES)
    assert time.monotonic() - t0 < 30, "the choices ran to the end instead of aborting"
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after[ABORT] - before[ABORT] == CHOICES
    # A chat request with n > 1 the same way.
    before = after
    chat = {"messages": [{"role": "user", "content": PROMPTS[0]}], "n": N, "max_tokens": 1500,
            "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=chat)
    after = settled_metrics(server, before, ABORT, N)
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after[ABORT] - before[ABORT] == N
