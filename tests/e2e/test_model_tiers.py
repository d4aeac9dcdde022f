"""Model tiers over real HTTP: one `kvserve serve` with three models (the default model as
`a`, two tiny random HF models as `b` and `c`), one hot slot and one warm.

- /v1/models shows every model's state as it moves: cold -> loading -> hot, hot -> draining
  -> warm, warm -> hot, and warm past --max-warm-models -> cold.
- A swap fails no request: a stream on `a` keeps streaming while `b` loads, `b`'s request
  waits for it to finish (a is torn down only then), and both complete.
- Every answer equals its own model's offline greedy output on the same weights (the
  in-process engine for `a`, kvserve.LLM for `b` and `c`), before and after swaps.
- /metrics labels each model's series with model_name, one family each, across swaps.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine
from tests.conftest import run_all
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_tensor_parallel import save_tiny

MAX_MODEL_LEN = 512
LONG = 96  # a's stream: long enough to outlast b's load (~0.1 s) on any machine
SHORT = 16
PROMPT_A = "The history of the printing press begins"
PROMPT_TINY = "t5 t17 t99 t3 t42"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, arch, seed in (("b", "llama", 11), ("c", "qwen2", 12)):
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        save_tiny(path, arch, seed)
        dirs[name] = path
    return dirs


@pytest.fixture(scope="module")
def refs(smollm2: Any, tiny_dirs: dict[str, Path]) -> dict[str, str]:
    """Each model's greedy text, offline, on the same weights as the server."""
    path, ckpt, model = smollm2
    args = EngineArgs(model=path, kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN)
    config = args.create_engine_config(path, ckpt.model_config)
    engine = LLMEngine(config, ckpt.tokenizer, model, LLMEngine.num_kv_blocks(config))
    for rid, n in (("a", LONG), ("a_short", SHORT)):
        engine.add_request(rid, PROMPT_A, SamplingParams(temperature=0, max_tokens=n,
                                                         ignore_eos=True))
    out = {rid: o.outputs[0].text for rid, o in run_all(engine).items()}
    for name, d in tiny_dirs.items():
        llm = LLM(model=str(d), kv_cache_memory="8MiB", max_model_len=MAX_MODEL_LEN)
        sp = SamplingParams(temperature=0, max_tokens=SHORT, ignore_eos=True)
        out[name] = llm.generate(PROMPT_TINY, sp, use_tqdm=False)[0].outputs[0].text
    return out


@pytest.fixture(scope="module")
def server(tiny_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    with ServerProcess("--model", "a=smollm2-135m", "--model", f"b={tiny_dirs['b']}",
                       "--model", f"c={tiny_dirs['c']}", "--max-hot-models", "1",
                       "--max-warm-models", "1", "--kv-cache-memory", "64MiB",
                       "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "info") as srv:
        yield srv


def states(server: ServerProcess) -> dict[str, str]:
    r = httpx.get(f"{server.base_url}/v1/models", headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    return {m["id"]: m["state"] for m in r.json()["data"]}


def complete(server: ServerProcess, model: str, max_tokens: int = SHORT) -> str:
    prompt = PROMPT_A if model == "a" else PROMPT_TINY
    r = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body["choices"][0]["text"]


def test_models_lists_every_model_with_its_state(server: ServerProcess) -> None:
    r = httpx.get(f"{server.base_url}/v1/models", headers=server.headers, timeout=10)
    data = {m["id"]: m for m in r.json()["data"]}
    assert list(data) == ["a", "b", "c"]
    assert {n: (m["state"], m["max_model_len"]) for n, m in data.items()} == {
        "a": ("hot", MAX_MODEL_LEN), "b": ("cold", None), "c": ("cold", None)}
    assert all(m["object"] == "model" and m["owned_by"] == "kvserve" for m in data.values())


def test_a_stream_keeps_streaming_while_another_model_loads(
        server: ServerProcess, refs: dict[str, str]) -> None:
    chunks: list[tuple[float, str]] = []  # (arrival, text) of a's stream
    events: list[Any] = []
    b_result: dict[str, Any] = {}

    def stream_a() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", headers=server.headers,
                          timeout=120, json={"model": "a", "prompt": PROMPT_A, "stream": True,
                                             "max_tokens": LONG, "temperature": 0,
                                             "ignore_eos": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if data != "[DONE]":
                        chunks.append((time.monotonic(), events[-1]["choices"][0]["text"]))

    def request_b() -> None:
        b_result["text"] = complete(server, "b")
        b_result["done"] = time.monotonic()

    a = threading.Thread(target=stream_a)
    a.start()
    deadline = time.monotonic() + 60
    while not chunks:
        assert time.monotonic() < deadline and a.is_alive(), "a's stream never started"
        time.sleep(0.01)
    b = threading.Thread(target=request_b)
    b.start()
    while (seen := states(server))["b"] != "loading":
        assert time.monotonic() < deadline, seen
        time.sleep(0.01)
    t_loading = time.monotonic()
    assert seen == {"a": "draining", "b": "loading", "c": "cold"}
    r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert r.status_code == 200  # a swap is no outage
    a.join(120)
    b.join(120)
    assert not a.is_alive() and not b.is_alive()
    # a kept streaming while b loaded, to the end and with its own model's tokens; b's
    # engine was built only once a's stream had finished.
    assert sum(1 for t, text in chunks if t > t_loading and text) >= 1
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert "".join(text for _, text in chunks) == refs["a"]
    assert b_result["text"] == refs["b"]
    assert chunks[-1][0] < b_result["done"]
    assert states(server) == {"a": "warm", "b": "hot", "c": "cold"}


def test_states_follow_lru_use_and_each_model_answers_as_itself(
        server: ServerProcess, refs: dict[str, str]) -> None:
    for model, want in (
            ("a", {"a": "hot", "b": "warm", "c": "cold"}),  # warm -> hot
            ("c", {"a": "warm", "b": "cold", "c": "hot"}),  # cold -> hot; b: warm past W
            ("b", {"a": "cold", "b": "hot", "c": "warm"}),  # cold again -> hot
            ("c", {"a": "cold", "b": "warm", "c": "hot"}),  # warm -> hot
            ("c", {"a": "cold", "b": "warm", "c": "hot"})):  # hot: nothing moves
        assert complete(server, model) == refs["a_short" if model == "a" else model]
        assert states(server) == want, model


def test_metrics_label_each_model_across_swaps(server: ServerProcess) -> None:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10).text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family each, every model's samples in it
    samples = {(s.name, s.labels.get("model_name"), s.labels.get("finished_reason")): s.value
               for f in families for s in f.samples}
    gen = "vllm:generation_tokens_total"
    assert {m: samples[(gen, m, None)] for m in "abc"} == {
        "a": LONG + SHORT, "b": 2 * SHORT, "c": 3 * SHORT}
    ok = "vllm:request_success_total"
    assert {m: samples[(ok, m, "length")] for m in "abc"} == {"a": 2, "b": 2, "c": 3}
    # Engine gauges for the hot model only; the warm and cold ones have no engine.
    assert {m for n, m, _ in samples if n == "vllm:num_requests_running"} == {"c"}


def test_unknown_model_and_each_load_warmed_up(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=10,
                   json={"model": "gpt-4", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert err["message"] == ("the model `gpt-4` does not exist; this server serves `a`, "
                              "`b`, `c`")
    log = server.log()
    # a, b, a, c, b, c: six engines built, each warmed up before it served.
    assert log.count("hot on slot") == 6
    assert log.count("warmed up in") == 6
    assert "Traceback" not in log
