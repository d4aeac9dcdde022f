"""EngineArgs -> EngineConfig: the quantization and ops defaults a user gets, and clear errors
for combinations that cannot run."""

from __future__ import annotations

import pytest

from kvserve.config import ModelConfig
from kvserve.engine_args import EngineArgs
from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all

MC = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=128)


def config(path: str = "m.gguf", **kw: object):  # noqa: ANN201
    return EngineArgs.from_kwargs(**kw).create_engine_config(path, MC)


def test_gguf_on_cpu_runs_its_blocks_by_default() -> None:
    assert config(device="cpu").quantization == "gguf"
    assert config(device="cpu", quantization="none").quantization == "none"
    # Not on the kernels' terms: dequantize at load.
    assert config("hf_dir", device="cpu").quantization == "none"
    assert config(device="cpu", dtype="bfloat16").quantization == "none"
    assert config(device="cpu", ops_backend="reference").quantization == "none"
    assert config(device="cuda").quantization == "none"


def test_kv_cache_dtype_follows_the_arithmetic() -> None:
    """float16 KV with llama.cpp's arithmetic ("gguf") and every quantization the CPU
    kernels run, as llama.cpp; the model dtype otherwise (the float32-exact paths stay
    exact); an explicit choice always wins."""
    assert config(device="cpu").cache.kv_cache_dtype == "float16"
    for method in ("int8", "int4"):
        assert config(device="cpu", quantization=method).cache.kv_cache_dtype == "float16"
    assert config(device="cpu", quantization="none").cache.kv_cache_dtype == "auto"
    assert config(device="cpu", quantization="gguf_exact").cache.kv_cache_dtype == "auto"
    assert config("hf_dir", device="cpu").cache.kv_cache_dtype == "auto"
    assert config(device="cpu", kv_cache_dtype="float32").cache.kv_cache_dtype == "float32"


def test_impossible_quantizations_name_the_field() -> None:
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model file"):
        config("hf_dir", device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="dtype must be float32, got 'bfloat16'"):
        config(device="cpu", dtype="bfloat16", quantization="gguf")
    with pytest.raises(ValueError, match="quantization 'gguf_exact' needs a .gguf model"):
        config("hf_dir", device="cpu", quantization="gguf_exact")
    with pytest.raises(ValueError, match="quantization must be one of awq, compressed-tensors, "
                                         r"gguf, gguf_exact, gptq, int4, int8, none, w8a8 "
                                         r"\(awq_marlin: awq, gptq_marlin: gptq\), got "
                                         r"'squeezellm'"):
        config(device="cpu", quantization="squeezellm")
    with pytest.raises(ValueError, match="quantization 'awq' needs a checkpoint whose "
                                         "config.json quantization_config has quant_method "
                                         "'awq', found None"):
        config(device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="'int4' needs group_size in 32, 64, 128, got 48"):
        config(device="cpu", quantization="int4", quant_group_size=48)


def test_auto_gguf_falls_back_without_the_kernels(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """No CPU kernels (no compiler, no AVX2): the blocks would be dequantized on every call,
    so auto picks "none"; an explicit "gguf" is kept (its linears dequantized once loaded),
    with a warning."""
    import kvserve.llm_engine as le
    import kvserve.model_setup as setup
    from kvserve.ops.reference import ReferenceOps

    monkeypatch.setattr(setup, "get_ops", lambda *a: ReferenceOps())
    args = dict(model=None, device="cpu", kv_cache_memory="16MiB")
    none = le.LLMEngine.from_engine_args(EngineArgs.from_kwargs(**args))
    assert none.config.quantization == "none"
    assert none.config.cache.kv_cache_dtype == "auto"  # float16 came with "gguf"
    with caplog.at_level("WARNING", logger="kvserve"):
        engine = le.LLMEngine.from_engine_args(EngineArgs.from_kwargs(
            **args, quantization="gguf", kv_cache_dtype="auto"))
    assert engine.config.quantization == "gguf"
    assert "without kvserve's CPU kernels" in caplog.text
    assert "dequantized once loaded" in caplog.text
    # The packed blocks dequantized once are the loader's dequantized blocks: the same
    # weights as "none", so the same logprobs, bit for bit.
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = []
    for e in (none, engine):
        e.add_request("0", "The capital of France is Paris.", sp)
        (out,) = run_all(e).values()
        outs.append([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    assert outs[0] == outs[1]


def test_enforce_eager_from_kwargs_and_the_cli() -> None:
    """vLLM's switch for CUDA graphs (kvserve/graphs.py): off by default, on by keyword or
    by --enforce-eager."""
    import argparse

    assert config(device="cuda").enforce_eager is False
    assert config(device="cuda", enforce_eager=True).enforce_eager is True
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli(p.parse_args(["--enforce-eager"])).enforce_eager is True
    assert EngineArgs.from_cli(p.parse_args([])).enforce_eager is False
