"""The offline API (LLM.generate / LLM.chat) and the `kvserve generate` CLI."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import run_all


@pytest.fixture(scope="module")
def llm() -> LLM:
    # The float32-exact path: its greedy answers are HF's (test_parity_smollm2), so the
    # content checks below ("Paris") are about the API, not about int8 rounding. (On the
    # default int8 path this 135M model, like llama.cpp on the same file, answers the chat
    # question with "L'Étoile, la ...".)
    return LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="128MiB",
               max_num_batched_tokens=256, quantization="gguf_exact")


def test_generate_strings_and_token_prompts(llm: LLM, make_engine: Any) -> None:
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", {"prompt_token_ids": tok.encode("Water boils at")}]
    outs = llm.generate(prompts, sp, use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == [tok.encode("The capital of France is"),
                                                   tok.encode("Water boils at")]
    # Independent of the LLM wrapper: the engine on its own gives the same tokens.
    engine = make_engine(quantization="gguf_exact")
    engine.add_request("a", "The capital of France is", sp)
    ref = run_all(engine)["a"].outputs[0]
    assert outs[0].outputs[0].token_ids == ref.token_ids
    assert outs[0].outputs[0].text == tok.decode(ref.token_ids) == ref.text
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text.startswith(" Paris")


def test_chat_applies_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=32))[0]
    assert out.prompt_token_ids == tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert out.outputs[0].token_ids[-1] in tok.eos_token_ids


def test_chat_with_tools_renders_them_as_the_server_does(llm: LLM) -> None:
    """The default model's template ignores tools, so they are described in the system
    turn; the model is told the format the hermes parser reads."""
    tok = llm.get_tokenizer()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), tools=[tool])[0]
    prompt = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
    system, user = prompt.split("<|im_end|>")[:2]
    assert '{"type": "function", "function": {"name": "get_weather"' in system
    assert '<tool_call>\n{"name": "<function-name>", "arguments": ' in system
    assert user == "\n<|im_start|>user\nWeather in Paris?"
    plain = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4))[0]
    assert "get_weather" not in tok.decode(plain.prompt_token_ids)


def test_generate_rejects_bad_batches_whole(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", {"prompt_token_ids": [1] * 9000}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the good one was withdrawn too
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(model="smollm2-135m", max_num_sequences=4)


def test_cli_generate_streams_the_greedy_completion(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=16)
    ref = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].text
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "Once upon a time",
         "--max-tokens", "16", "--kv-cache-memory", "64MiB"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ref + "\n"
    assert "KV cache (float16):" in proc.stderr and "blocks" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--prompt", "x",
                          "--model", "no-such-model"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "no-such-model" in bad.stderr
    assert "Traceback" not in bad.stderr
