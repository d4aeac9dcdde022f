"""Logprob values over real HTTP, held to a direct forward of the same prefix.

The reference is the in-process model (the `smollm2` fixture: the weights and quantization
the server runs by default, with the server's float16 KV cache) fed the whole sequence,
prompt plus output, in one prefill: row i of its float32 log_softmax is the distribution of
token i + 1. It shares no code with the engine's scheduling, paging, sampler, logprob
gathering or the server's formatting. The server's paged attention may sum in another order
than that one prefill, hence a tolerance of 1e-3.
kvserve reports raw logprobs (sample/sampler.py: the model's log_softmax before logit_bias,
penalties and temperature, vLLM's default), so sampled tokens are pinned to the same raw
distribution, and shown not to be the temperature-scaled one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.e2e.server_process import ServerProcess
from tests.e2e.test_server import MODEL, engine_run, sse_events
from tests.helpers import PagedSequence

TOL = 1e-3
K = 5  # top logprobs asked for
KV_DTYPE = torch.float16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "1024",
                       "--kv-cache-dtype", "float16") as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    return make_engine(max_model_len=1024, kv_cache_dtype="float16")


class Reference:
    """Direct forwards of the smollm2 fixture's model."""

    def __init__(self, smollm2: Any) -> None:
        _, ckpt, self.model = smollm2
        self.tok = ckpt.tokenizer

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float32: row i = log_softmax of the logits after ids[: i + 1]."""
        return torch.log_softmax(self.logits(ids), dim=-1)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float32: row i = the logits after ids[: i + 1]."""
        runner = PagedSequence(self.model, num_blocks=len(ids) // 16 + 2, block_size=16)
        # The KV cache in the server's dtype (float16, the default with quantization gguf):
        # the int8 activations amplify its rounding to ~0.1 in a logprob, so a float32 cache
        # would be a different model, not a tighter reference.
        runner.kv = runner.kv.to(KV_DTYPE)
        (logits,) = runner.forward({runner.new_seq(): ids})
        return logits.float()

    def decode(self, t: int) -> str:
        # How the engine names a token in logprobs (llm_engine._decorate).
        return self.tok.decode([t], skip_special_tokens=False)

    def top(self, row: torch.Tensor, token: int, k: int) -> dict[str, float]:
        """OpenAI's completion top_logprobs: the k most likely tokens plus the chosen one."""
        vals, ids = row.topk(k)
        out = {self.decode(t): v for t, v in zip(ids.tolist(), vals.tolist())}
        out.setdefault(self.decode(token), row[token].item())
        return out


@pytest.fixture(scope="module")
def ref(smollm2: Any) -> Reference:
    return Reference(smollm2)


def assert_top_close(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), (got, want)
    for key, value in want.items():
        assert abs(got[key] - value) < TOL, (key, got[key], value)


def check_generated(ref: Reference, prompt_ids: list[int], out_ids: list[int],
                    lp: dict[str, Any], k: int) -> torch.Tensor:
    """A completion choice's generated-token logprobs against the reference; returns the
    reference rows of the generated positions."""
    rows = ref.logprobs(prompt_ids + out_ids)[len(prompt_ids) - 1:-1]
    assert lp["tokens"] == [ref.decode(t) for t in out_ids]
    for j, t in enumerate(out_ids):
        assert abs(lp["token_logprobs"][j] - rows[j, t].item()) < TOL, j
        assert_top_close(lp["top_logprobs"][j], ref.top(rows[j], t, k))
    return rows


# ---- /v1/completions ------------------------------------------------------------------------

def test_completion_greedy_logprobs_equal_direct_forward(http: httpx.Client, engine: Any,
                                                         ref: Reference) -> None:
    prompt = "The capital of France is"
    ids = ref.tok.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": K,
            "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    lp = r["choices"][0]["logprobs"]
    out_ids = engine_run(engine, prompt, max_tokens=12, temperature=0,
                         ignore_eos=True).outputs[0].token_ids
    rows = check_generated(ref, ids, out_ids, lp, K)
    # Greedy: every token is the reference's argmax, so the forward and the server agree on
    # the whole sequence, not only on its logprobs.
    assert rows.argmax(dim=-1).tolist() == out_ids
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    offsets = [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(out_ids))]
    assert lp["text_offset"] == offsets

    # Streamed: the chunks' logprobs, concatenated, are the non-streamed ones (text_offset
    # too: it counts from the start of the choice's text, across chunks).
    got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        for ev in sse_events(s.iter_lines()):
            if ev != "[DONE]" and ev["choices"][0]["logprobs"] is not None:
                for key in got:
                    got[key] += ev["choices"][0]["logprobs"][key]
    assert got == {key: lp[key] for key in got}


def test_sampled_logprobs_are_raw_before_temperature(http: httpx.Client, engine: Any,
                                                     ref: Reference) -> None:
    prompt = "My favourite animal is the"
    ids = ref.tok.encode(prompt)
    temperature = 0.5
    r = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 12, "temperature": temperature, "seed": 123,
        "logprobs": K, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    out = engine_run(engine, prompt, max_tokens=12, temperature=temperature, seed=123,
                     ignore_eos=True).outputs[0]
    assert r["choices"][0]["text"] == out.text  # the same seeded draws
    rows = check_generated(ref, ids, out.token_ids, lp, K)
    # Not the distribution the token was drawn from (logits / temperature): that one differs
    # by far more than the tolerance somewhere along the output.
    # (log_softmax is shift-invariant, so rows / T is the logits / T up to a constant.)
    scaled = torch.log_softmax(rows / temperature, dim=-1)
    picked = torch.tensor(out.token_ids)
    diff = (scaled.gather(1, picked[:, None]) - rows.gather(1, picked[:, None])).abs().max()
    assert diff.item() > 100 * TOL
    assert rows.argmax(dim=-1).tolist() != out.token_ids  # it did sample, not argmax


def _echo_expected(ref: Reference, ids: list[int], out_ids: list[int]) -> dict[str, Any]:
    """The full echo+logprobs lists the reference predicts: the prompt's (first token None),
    then the output's."""
    seq = ids + out_ids
    rows = ref.logprobs(seq)
    want: dict[str, list[Any]] = {"tokens": [ref.decode(t) for t in seq],
                                  "token_logprobs": [None], "top_logprobs": [None]}
    for i in range(1, len(seq)):
        want["token_logprobs"].append(rows[i - 1, seq[i]].item())
        want["top_logprobs"].append(ref.top(rows[i - 1], seq[i], K))
    return want


def _assert_echo_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert len(got["token_logprobs"]) == len(want["token_logprobs"])
    for i in range(1, len(want["tokens"])):
        assert abs(got["token_logprobs"][i] - want["token_logprobs"][i]) < TOL, i
        assert_top_close(got["top_logprobs"][i], want["top_logprobs"][i])


def test_echo_prompt_logprobs_equal_direct_forward(http: httpx.Client, engine: Any,
                                                   ref: Reference) -> None:
    prompt = "In 1969, Neil Armstrong walked on the"
    ids = ref.tok.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": K, "echo": True,
            "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    choice = r["choices"][0]
    out_ids = engine_run(engine, prompt, max_tokens=6, temperature=0,
                         ignore_eos=True).outputs[0].token_ids
    want = _echo_expected(ref, ids, out_ids)
    lp = choice["logprobs"]
    _assert_echo_close(lp, want)
    assert choice["text"] == prompt + ref.tok.decode(out_ids)
    assert lp["text_offset"] == [sum(len(t) for t in want["tokens"][:i])
                                 for i in range(len(want["tokens"]))]

    # Streamed, the prompt's logprobs come too (with the echoed prompt), then the output's.
    got: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    text = ""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        for ev in sse_events(s.iter_lines()):
            if ev == "[DONE]":
                continue
            text += ev["choices"][0]["text"]
            if ev["choices"][0]["logprobs"] is not None:
                for key in got:
                    got[key] += ev["choices"][0]["logprobs"][key]
    assert text == choice["text"]
    _assert_echo_close(got, want)
    assert got == {key: lp[key] for key in got}


def test_prompt_logprobs_of_token_id_prompt(http: httpx.Client, ref: Reference) -> None:
    """Token ids in, echo with logprobs=0: each prompt token's own logprob (plus nothing
    else), and no generation needed to see them."""
    ids = ref.tok.encode("def fibonacci(n):\n    return")
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0,
                                           "logprobs": 0, "echo": True}).json()
    lp = r["choices"][0]["logprobs"]
    rows = ref.logprobs(ids)
    n = len(ids)
    assert lp["token_logprobs"][0] is None
    for i in range(1, n):
        assert abs(lp["token_logprobs"][i] - rows[i - 1, ids[i]].item()) < TOL, i
        assert set(lp["top_logprobs"][i]) == {ref.decode(ids[i])}
    assert abs(lp["token_logprobs"][n] - rows[n - 1].max().item()) < TOL  # greedy output


# ---- /v1/chat/completions -------------------------------------------------------------------

def test_chat_logprobs_equal_direct_forward_streamed_or_not(client: openai.OpenAI,
                                                            engine: Any,
                                                            ref: Reference) -> None:
    msgs = [{"role": "user", "content": "Name three colors."}]
    ids = ref.tok.apply_chat_template(msgs, tokenize=True)
    kw: dict[str, Any] = dict(model=MODEL, messages=msgs, logprobs=True, top_logprobs=K,
                              max_completion_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    out = engine_run(engine, {"prompt_token_ids": ids}, max_tokens=12, temperature=0).outputs[0]
    assert r.choices[0].message.content == out.text
    rows = ref.logprobs(ids + out.token_ids)[len(ids) - 1:-1]
    assert len(content) == len(out.token_ids)
    for j, (t, entry) in enumerate(zip(out.token_ids, content)):
        assert entry.token == ref.decode(t)
        assert entry.bytes == list(ref.decode(t).encode())
        assert abs(entry.logprob - rows[j, t].item()) < TOL, j
        vals, top_ids = rows[j].topk(K)
        # Chat's top_logprobs is a list in order: the k most likely, best first.
        assert [x.token for x in entry.top_logprobs] == [ref.decode(i) for i in top_ids.tolist()]
        for x, v in zip(entry.top_logprobs, vals.tolist()):
            assert abs(x.logprob - v) < TOL, (j, x.token)

    streamed = [t for ch in client.chat.completions.create(stream=True, **kw)
                for c in ch.choices if c.logprobs is not None for t in c.logprobs.content]

    def flat(t: Any) -> tuple[Any, ...]:
        return t.token, t.logprob, t.bytes, [(x.token, x.logprob) for x in t.top_logprobs]

    assert [flat(t) for t in streamed] == [flat(t) for t in content]


def test_logprobs_unchanged_by_logit_bias(http: httpx.Client, ref: Reference) -> None:
    """A bias steers the choice, not the reported logprobs (raw: before any processor)."""
    prompt = "The capital of France is"
    ids = ref.tok.encode(prompt)
    row = ref.logprobs(ids)[-1]
    second = int(row.topk(2).indices[1])
    r = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
        "logit_bias": {str(int(row.argmax())): -100}}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [ref.decode(second)]
    assert abs(lp["token_logprobs"][0] - row[second].item()) < TOL
    assert_top_close(lp["top_logprobs"][0], ref.top(row, second, 1))
