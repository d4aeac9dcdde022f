"""A schema-driven fuzz run: schemathesis generates requests from the server's own OpenAPI
document (GET /openapi.json, the request bodies declared from server/protocol.py) and sends
them to a real `kvserve serve`. No answer may be a 5xx (or a hang), every 4xx carries OpenAI's
error shape, and afterwards the server is healthy and has logged no unhandled error.

KVSERVE_FUZZ_EXAMPLES is the number of generated cases per operation and generation mode
(default small, for CI); `make fuzz` runs many more. The run is derandomized, with no example
database: the same cases in the same order on every run, so a CI failure replays locally.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import BaseSchema, Case, CheckContext, GenerationMode, Response
from schemathesis.checks import not_a_server_error

from tests.e2e.server_process import ServerProcess

EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "15"))
MAX_MODEL_LEN = 256
# A generated case costs its decode tokens, n x max_tokens, and an absent max_tokens fills
# the context. Values the server runs are cut to these (values it must refuse, such as 0,
# -3 or 10**9, are sent as generated, so the refusals are fuzzed too).
RUN_MAX_TOKENS = 4
RUN_N = 2
VOCAB = 49152  # the default model's (SmolLM2) vocabulary
# Seconds one case may take; past it the request is a hang, and a failure.
CASE_TIMEOUT = 60.0

# Every route the server declares; test_schema_declares_every_route keeps this true.
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/version"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/engine/state")]
_GENERATE = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_completion_tokens"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-num-seqs", "8")
    yield srv
    srv.stop()


def _is_int(v: Any) -> bool:
    return type(v) is int


def cheap_body(path: str, body: Any) -> Any:
    """The generated body with every cost knob that the server would honour cut to a few
    tokens. Only JSON objects for the two generation routes are touched; anything else (a
    list, a string, a knob of the wrong type) goes out as generated."""
    if path not in _GENERATE or not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if _is_int(v) and RUN_MAX_TOKENS < v <= MAX_MODEL_LEN:
            body[key] = RUN_MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body[_GENERATE[path]] = RUN_MAX_TOKENS
    for key in ("n", "best_of"):
        v = body.get(key)
        if _is_int(v) and RUN_N < v <= 1 << 16:
            body[key] = RUN_N
    return body


def _num(lo: float, hi: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _ids(max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": _int(0, VOCAB - 1), "minItems": 1, "maxItems": max_items}


_TEXT = {"type": "string", "minLength": 1, "maxLength": 64}
# The ranges that SamplingParams and the serving layer accept, costs cut as in cheap_body.
_ENGINE_FIELDS: dict[str, Any] = {
    "temperature": _num(0.0, 2.0), "top_p": {**_num(0.0, 1.0), "exclusiveMinimum": 0.0},
    "top_k": _int(-1, 100), "min_p": _num(0.0, 1.0), "repetition_penalty": _num(0.01, 2.0),
    "presence_penalty": _num(-2.0, 2.0), "frequency_penalty": _num(-2.0, 2.0),
    "n": _int(1, RUN_N), "seed": _int(0, 2**32), "priority": _int(-10, 10),
    "max_tokens": _int(1, RUN_MAX_TOKENS), "max_completion_tokens": _int(1, RUN_MAX_TOKENS),
    "min_tokens": _int(0, 1), "prompt_logprobs": _int(0, 5), "top_logprobs": _int(0, 5),
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[1-9][0-9]{0,3}$"},
                   "additionalProperties": _num(-100.0, 100.0), "maxProperties": 8},
    "stop": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": 4}]},
    "stop_token_ids": _ids(4),
}
_COMPLETION_FIELDS: dict[str, Any] = {
    "logprobs": _int(0, 5),
    "prompt": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 3},
                         _ids(32), {"type": "array", "items": _ids(16), "minItems": 1,
                                    "maxItems": 3}]},
}
# Left out so that the cases reach the engine: fields the server refuses whatever their value,
# and the tool fields, whose generated combinations are mostly refused (tool_choice without
# tools, tool_calls on a user turn; tests/e2e/test_server_tools.py runs real ones). The
# plain document's cases (test_fuzz_openapi) do send them.
_REFUSED = ("best_of", "suffix", "functions", "function_call", "continue_final_message",
            "tools", "tool_choice", "parallel_tool_calls")


def engine_schema(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """The server's document with the ranges the engine accepts declared too, so that most
    generated cases get past validation and run: sampling, logprobs, stops, logit_bias,
    response_format and streaming in generated combinations."""
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props.update({k: v for k, v in _ENGINE_FIELDS.items() if k in props})
        if name == "CompletionRequest":
            props.update(_COMPLETION_FIELDS)
        for k in _REFUSED:
            props.pop(k, None)
        props["model"] = {"enum": [model, None]}
    schemas["ChatMessage"]["properties"]["content"] = {"anyOf": [_TEXT, {
        "type": "array", "items": {"$ref": "#/components/schemas/TextPart"}, "minItems": 1,
        "maxItems": 3}]}
    schemas["ChatMessage"]["required"] = ["role", "content"]
    for k in ("tool_calls", "tool_call_id"):
        schemas["ChatMessage"]["properties"].pop(k, None)
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 4
    schemas["TextPart"]["properties"]["text"] = _TEXT
    schemas["DetokenizeRequest"]["properties"]["tokens"] = _ids(64)
    tokenize = schemas["TokenizeRequest"]
    tokenize["properties"]["prompt"] = _TEXT
    tokenize["properties"]["messages"] = {
        "type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1,
        "maxItems": 4}
    tokenize["oneOf"] = [{"required": ["prompt"], "not": {"required": ["messages"]}},
                         {"required": ["messages"], "not": {"required": ["prompt"]}}]
    for name in ("TokenizeRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"enum": [model, None]}
    return doc


@pytest.fixture(scope="module")
def openapi_doc(server: ServerProcess) -> dict[str, Any]:
    # The schema comes from the live server: what is fuzzed is what it declares.
    r = httpx.get(f"{server.base_url}/openapi.json", headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _load(doc: dict[str, Any], server: ServerProcess) -> BaseSchema:
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=server.base_url)
    return schema


@pytest.fixture(scope="module")
def api_schema(openapi_doc: dict[str, Any], server: ServerProcess) -> BaseSchema:
    return _load(openapi_doc, server)


@pytest.fixture(scope="module")
def engine_api_schema(openapi_doc: dict[str, Any], server: ServerProcess) -> BaseSchema:
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.headers, timeout=10)
    return _load(engine_schema(openapi_doc, models.json()["data"][0]["id"]), server)


def openai_error_shape(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every 4xx body is {"error": {"message": str, "type": str, "param", "code"}}."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: "
                             f"{response.text[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, \
        f"{response.status_code} body is not OpenAI's error shape: {response.text[:300]}"
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return None


def stream_intact(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """A 200 stream cannot change its status once an error happens, so the server sends it as
    an error event (a 500 inside a 200): none may come, and the stream ends with [DONE]."""
    ctype = " ".join(v for k, vs in response.headers.items() if k.lower() == "content-type"
                     for v in vs)
    if response.status_code != 200 or "text/event-stream" not in ctype:
        return None
    events = [line[len("data: "):] for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: " \
                                               f"{response.text[-300:]!r}"
    for event in events[:-1]:
        assert '"error"' not in event or "error" not in json.loads(event), \
            f"an error event in a 200 stream: {event[:300]}"
    return None


def test_schema_declares_every_route(api_schema: BaseSchema) -> None:
    """The fuzz run below covers exactly what the server declares, and the generation routes
    have their request bodies declared (else nothing but empty bodies would be generated)."""
    declared = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert declared == set(OPERATIONS)
    for method, path in OPERATIONS:
        if method == "POST":
            assert api_schema[path][method].body, path


def valid_combination(body: Any) -> Any:
    """The cross-field rules that a schema cannot say, made true: stream_options needs
    stream, top_logprobs needs logprobs, json_schema needs its schema, and a grammar takes
    no min_tokens or ignore_eos."""
    if not isinstance(body, dict):
        return body
    if body.get("stream_options") is not None:
        body["stream"] = True
    if body.get("top_logprobs") is not None and "prompt" not in body:
        body["logprobs"] = True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") != "text":
        body.pop("min_tokens", None)
        body.pop("ignore_eos", None)
        if fmt.get("type") == "json_schema" and not (fmt.get("json_schema") or {}).get("schema"):
            fmt["json_schema"] = {"name": "answer", "schema": {"type": "object"}}
    return body


def whole_floats_as_ints(value: Any) -> Any:
    """4.0 -> 4 throughout. JSON Schema counts 4.0 as an integer, and schemathesis generates
    it for "type": "integer"; the server's strict models refuse it (a 400, and a finding of
    its own: see test_fuzz_openapi), which would keep the engine cases off the engine."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: whole_floats_as_ints(v) for k, v in value.items()}
    return value


def fuzz(operation: Any, mode: GenerationMode, server: ServerProcess,
         valid: bool = False) -> list[int]:
    """Sends EXAMPLES generated cases of one operation; returns their status codes. valid:
    whole floats go out as integers, and the cross-field rules are kept."""
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Case) -> None:
        case.body = cheap_body(case.path, case.body)
        if valid:
            case.body = valid_combination(whole_floats_as_ints(case.body))
        seen = len(server.log())
        try:
            r = case.call_and_validate(headers=server.headers, timeout=CASE_TIMEOUT,
                                       checks=[not_a_server_error, openai_error_shape,
                                               stream_intact])
        except BaseException:
            # The server's side of this case, shown with the failure.
            sys.stderr.write(f"--- server log for {case.method} {case.path}:\n"
                             f"{server.log()[seen:][-6000:]}\n")
            raise
        statuses.append(r.status_code)
        if r.status_code >= 400:
            sys.stdout.write(f"{r.status_code} {case.method} {case.path}: {r.text[:300]}\n")

    run()
    return statuses


@pytest.mark.parametrize(("method", "path", "mode"), [
    (method, path, mode) for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if method == "POST" or mode is GenerationMode.POSITIVE])
def test_fuzz_openapi(api_schema: BaseSchema, server: ServerProcess, method: str, path: str,
                      mode: GenerationMode) -> None:
    """The document as the server declares it. Positive cases follow it, negative ones break
    it (wrong types, missing fields, values past the declared bounds); most end in a 400."""
    statuses = fuzz(api_schema[path][method], mode, server)
    assert statuses


@pytest.mark.parametrize("path", [path for method, path in OPERATIONS if method == "POST"])
def test_fuzz_engine(engine_api_schema: BaseSchema, server: ServerProcess, path: str) -> None:
    """The document with the engine's ranges declared too: these cases are valid requests, so
    they run on the engine (sampling, logprobs, stops, logit_bias, grammars, streaming). A
    few may still be refused: a text prompt that tokenizes to nothing, say."""
    statuses = fuzz(engine_api_schema[path]["POST"], GenerationMode.POSITIVE, server, valid=True)
    assert statuses.count(200) >= 0.9 * len(statuses), statuses


def test_healthy_after_fuzzing(server: ServerProcess) -> None:
    """After the run: alive, /health 200, no unhandled error logged, and nothing left behind
    (no request running or waiting, no KV block held), the engine cases having run."""
    assert server.proc.poll() is None, server.log()[-6000:]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    log = server.log()
    assert "unhandled error" not in log and "Traceback" not in log, log[-6000:]
    deadline = time.monotonic() + 10
    while True:  # the gauges are the engine's last stats snapshot: give it a step to land
        m = server.metrics()
        idle = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, m
    assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) > 0, m
