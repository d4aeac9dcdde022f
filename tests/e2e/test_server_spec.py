"""`kvserve serve --speculative-config`: streaming through the real server (the official
openai client) gives the non-streaming text, which is the text without speculation, and
/metrics counts the drafts with vLLM's names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvserve.sampling_params import SamplingParams
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
