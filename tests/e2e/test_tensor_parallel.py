"""Tensor parallelism on the CPU (the shared-memory all-reduce, and gloo's): the same tokens
as one process, and logits within a stated tolerance of HF transformers and of TP=1.

- Tiny random models whose heads divide by 2 (Llama untied; Qwen2 with q/k/v biases and a tied
  embedding), TP=2: greedy tokens equal TP=1's, prompt logprobs within 1e-4 of HF's.
- The default model at TP=3 (9 heads / 3 KV heads) on its GGUF blocks as stored
  (gguf_exact, float32 arithmetic): greedy tokens equal TP=1's with prefix caching, chunked
  prefill and preemption all at work; and with speculation (a draft model whole in rank 0's
  process, or n-gram lookup), greedy tokens equal TP=1's without it.
- The default int8-activation path (gguf): the all-reduce sums partial outputs in another order
  than one process does, and this path rounds activations to int8, so a 1e-7 change in one
  layer moves its logprobs by up to ~0.3 (measured in BENCHMARKS.md): it is held to a
  tolerance, not to equal tokens. So is W8A8 (int8 activations per token), at TP=2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch

from kvserve import LLM, SamplingParams
from tests.helpers import tiny_hf_model

V = 256
CALIB = Path(__file__).resolve().parents[3] / "shared" / "reference" / "GPL-3.txt"
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 1], [200, 201, 202, 203, 9, 9, 9], list(range(60, 100))]


def save_tiny(path: Path, arch: str, seed: int) -> Any:
    hf = tiny_hf_model(arch, seed=seed, vocab_size=V)
    hf.save_pretrained(str(path), safe_serialization=True)
    vocab = {f"t{i}": i for i in range(V)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t255"}))
    return hf


def _run(llm: LLM, prompts: list[Any], max_tokens: int = 24) -> tuple[list[list[int]], Any]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    lps = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], lps


def _llm(model: str, tp: int, **kw: Any) -> LLM:
    return LLM(model=model, tensor_parallel_size=tp, dtype="float32", **kw)


@pytest.mark.parametrize("arch, all_reduce", [("llama", "gloo"), ("qwen2", "shm")])
def test_tp2_tiny_model_is_tp1_and_hf(tmp_path: Path, arch: str, all_reduce: str) -> None:
    hf = save_tiny(tmp_path, arch, seed=3)
    one = _llm(str(tmp_path), 1, kv_cache_memory="16MiB")
    want_tokens, _ = _run(one, PROMPTS)
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    two = _llm(str(tmp_path), 2, kv_cache_memory="16MiB", tp_all_reduce=all_reduce)
    try:
        tokens, lps = _run(two, PROMPTS)
    finally:
        two.llm_engine.shutdown()
    # Rank 0's pinning was this thread's only while the engine ran: a thread left on one
    # core would hand that to every process it starts later.
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
    assert "KVSERVE_NUM_THREADS" not in os.environ
    assert tokens == want_tokens
    with torch.no_grad():  # HF's log-probability of each next prompt token
        for p, ours in zip(PROMPTS, lps):
            logp = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
            theirs = [float(logp[i, p[i + 1]]) for i in range(len(p) - 1)]
            assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4


@pytest.mark.parametrize("arch, fmt, group", [("llama", "gptq", 32), ("qwen2", "gptq", -1),
                                              ("llama", "awq", 32)])
def test_tp2_int4_checkpoint_is_tp1(tmp_path: Path, arch: str, fmt: str, group: int) -> None:
    """GPTQ / AWQ checkpoints (AutoGPTQ's / AutoAWQ's packing; groups of 32, or one group a
    row; lm_head quantized too, and for qwen2 tied to the embedding in the config, with q / k
    / v biases) at TP=2: each rank unpacks the whole tensors and keeps its output rows (q / k
    / v, gate / up, lm_head's vocabulary) or its input columns in whole groups (o_proj,
    down_proj). The int8-activation blocks are TP=1's (each rank's inputs are whole blocks),
    so only the all-reduce's order of summing differs: greedy tokens and prompt logprobs as
    TP=1's, and the logprobs near those of the float model holding the dequantized
    weights."""
    from tests.unit.test_int4_checkpoints import write_checkpoint

    hf = tiny_hf_model(arch, seed=3, vocab_size=V)
    deq = write_checkpoint(tmp_path, hf, fmt, group=group, lm_head=True)
    want_tokens, want = _run(_llm(str(tmp_path), 1, kv_cache_memory="16MiB"), PROMPTS)
    two = _llm(str(tmp_path), 2, kv_cache_memory="16MiB")
    try:
        assert two.llm_engine.config.quant.method == fmt
        tokens, got = _run(two, PROMPTS)
    finally:
        two.llm_engine.shutdown()
    assert tokens == want_tokens
    diffs = [abs(x - y) for a, b in zip(got, want) for x, y in zip(a, b)]
    assert max(diffs) < 1e-3, max(diffs)
    hf_deq = tiny_hf_model(arch, seed=3, vocab_size=V, tie_word_embeddings=False)
    hf_deq.load_state_dict({**hf.state_dict(), **deq})  # its lm_head: the checkpoint's own
    with torch.no_grad():
        for p, ours in zip(PROMPTS, got):
            logp = torch.log_softmax(hf_deq(torch.tensor([p])).logits[0].double(), -1)
            theirs = [float(logp[i, p[i + 1]]) for i in range(len(p) - 1)]
            assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.05


def test_tp2_refuses_an_act_order_checkpoint_by_name(tmp_path: Path) -> None:
    """An act-order layer's groups gather inputs from every rank's share of a row-parallel
    split: refused, naming the layer, not run wrong."""
    from tests.unit.test_int4_checkpoints import write_checkpoint

    write_checkpoint(tmp_path, tiny_hf_model("llama", seed=3, vocab_size=V), "gptq",
                     act_order=True)
    with pytest.raises(Exception, match=r"self_attn.o_proj: an act-order layer's groups "
                                        r"\(g_idx\) mix inputs that tensor parallelism gives "
                                        r"to different ranks"):
        _llm(str(tmp_path), 2, kv_cache_memory="16MiB")


@pytest.mark.parametrize("source", ["checkpoint", "at_load"])
def test_tp2_w8a8_is_tp1_within_tolerance(tmp_path: Path, source: str) -> None:
    """W8A8 at TP=2: a SmoothQuant checkpoint (`kvserve quantize --method smoothquant`: int8
    `weight` and a `weight_scale` per output row, which a column-parallel rank cuts to its
    rows), or a float checkpoint quantized at load (`--quantization w8a8`). A row-parallel
    rank quantizes its own share of x per token, so the activations round differently from
    TP=1's (as vLLM's): prompt logprobs are held to a tolerance of TP=1's, and to the float
    model no further than TP=1 is (measured: at most 0.006 from TP=1's; with every rank
    keeping rank 0's scales, 0.095)."""
    from kvserve.quant.quantize_args import QuantizeArgs
    from kvserve.quantize import quantize_checkpoint

    hf = save_tiny(tmp_path / "float", "llama", seed=3)
    model, kw = str(tmp_path / "float"), {"quantization": "w8a8"}
    if source == "checkpoint":
        model, kw = str(tmp_path / "w8a8"), {}
        quantize_checkpoint(str(tmp_path / "float"), model, QuantizeArgs(
            method="smoothquant", bits=8, calib=str(CALIB), calib_tokens=256, seq_len=64))
    _, want = _run(_llm(model, 1, kv_cache_memory="16MiB", **kw), PROMPTS, max_tokens=1)
    two = _llm(model, 2, kv_cache_memory="16MiB", **kw)
    try:
        assert two.llm_engine.config.quant.method == "w8a8"
        _, got = _run(two, PROMPTS, max_tokens=1)
    finally:
        two.llm_engine.shutdown()
    diffs = [abs(x - y) for a, b in zip(got, want) for x, y in zip(a, b)]
    assert max(diffs) < 0.02 and sum(diffs) / len(diffs) < 0.005, (max(diffs), diffs)
    with torch.no_grad():
        for p, ours, tp1 in zip(PROMPTS, got, want):
            logp = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
            theirs = [float(logp[i, p[i + 1]]) for i in range(len(p) - 1)]
            err = max(abs(a - b) for a, b in zip(ours, theirs))
            assert err < 2 * max(abs(a - b) for a, b in zip(tp1, theirs)) + 0.02, err


@pytest.fixture(scope="module")
def default_tp1() -> LLM:
    # Small blocks and budget: prefix hits, chunked prefill and (below) preemption happen.
    return LLM(model="smollm2-135m", quantization="gguf_exact", max_model_len=512,
               block_size=8, max_num_batched_tokens=48, kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def default_tp3() -> Any:
    # The shared-memory all-reduce (the default). Three ranks share the 2 cores here, which
    # gloo's TCP all-reduce pays ~4 ms a call for (252 ms a token against 36 through shared
    # memory: the preemption test below took 140 s of CI over gloo); gloo's path is held to
    # TP=1 and HF by test_tp2_tiny_model_is_tp1_and_hf[llama-gloo].
    llm = LLM(model="smollm2-135m", quantization="gguf_exact", max_model_len=512,
              block_size=8, max_num_batched_tokens=48, kv_cache_memory="32MiB",
              tensor_parallel_size=3)
    yield llm
    llm.llm_engine.shutdown()


SHARED = "The history of the city begins with a small settlement on the river, where"
TEXTS = [SHARED + " traders met", SHARED + " farmers lived", "def add(a, b):\n    return",
         "Water boils at"]


def test_tp3_default_model_blocks_are_tp1(default_tp1: LLM, default_tp3: LLM) -> None:
    """Prefix caching (the shared prefix is found in the cache: cached tokens > 0) and
    chunked prefill (48-token steps, prompts up to ~20 tokens in a batch of four)."""
    tok = default_tp1.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    want, want_lp = _run(default_tp1, prompts)
    got, got_lp = _run(default_tp3, prompts)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    sp = SamplingParams(temperature=0, max_tokens=4)
    again = default_tp3.generate([TEXTS[0]], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prefix cache served rank 0's scheduler
    # The fused C++ layer stack ran, its all-reduces through the communication hook.
    ops = default_tp3.llm_engine.model.ops
    assert getattr(ops, "fuse_layers", False) is False or any(
        s is not None for s in ops._stacks.values())


def test_tp3_preemption_gives_the_same_tokens(default_tp3: LLM) -> None:
    """Eight long generations in a KV cache that holds about two of them: requests are
    preempted and recomputed, on every rank alike; the tokens are those of running each
    request alone at TP=3."""
    engine = default_tp3.llm_engine
    tok = default_tp3.get_tokenizer()
    prompts = [tok.encode(f"Story number {i}: once upon a time") for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    together = default_tp3.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                    use_tqdm=False)
    assert engine.scheduler.num_preemptions > before
    alone = [default_tp3.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
             for p in prompts[:2]]
    assert [o.outputs[0].token_ids for o in together[:2]] == [
        o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("spec", [
    # The draft (whole, in rank 0's process) on the int8-activation kernels, the target on
    # float arithmetic: most drafts accepted, some rejected.
    {"method": "draft_model", "model": "smollm2-135m", "quantization": "gguf",
     "num_speculative_tokens": 3, "adaptive": False},
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    # The target's first layers, split across the ranks as the target's steps are.
    {"method": "self_draft", "num_speculative_tokens": 3, "num_layers": 20,
     "adaptive": False}])
def test_tp3_speculation_gives_tp1_tokens(default_tp1: LLM, spec: dict[str, Any]) -> None:
    """Greedy speculation at TP=3: each verify step's K+1 rows run on every rank, and the
    tokens are TP=1's without speculation, with drafts both accepted and rejected."""
    tok = default_tp1.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS] + [tok.encode("Repeat: one two three four, "
                                                           "one two three four, one two")]
    want, _ = _run(default_tp1, prompts, max_tokens=32)
    llm = LLM(model="smollm2-135m", quantization="gguf_exact", max_model_len=512,
              block_size=8, kv_cache_memory="32MiB", tensor_parallel_size=3,
              speculative_config=spec)
    try:
        got, _ = _run(llm, prompts, max_tokens=32)
        st = llm.llm_engine.runner.spec_stats
    finally:
        llm.llm_engine.shutdown()
    assert got == want
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st


def test_tp3_int8_activation_path_is_within_tolerance() -> None:
    tok_llm = LLM(model="smollm2-135m", max_model_len=512, kv_cache_memory="32MiB")
    tok = tok_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    _, want = _run(tok_llm, prompts, max_tokens=1)
    tp3 = LLM(model="smollm2-135m", max_model_len=512, kv_cache_memory="32MiB",
              tensor_parallel_size=3)
    try:
        _, got = _run(tp3, prompts, max_tokens=1)
    finally:
        tp3.llm_engine.shutdown()
    diffs = [abs(x - y) for a, b in zip(got, want) for x, y in zip(a, b)]
    assert max(diffs) < 0.75 and sum(diffs) / len(diffs) < 0.1, (max(diffs), diffs)


def test_heads_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's "
                                         r"9 attention heads \(model: 9 attention heads, 3 KV"):
        LLM(model="smollm2-135m", tensor_parallel_size=2)
