"""The quantization seam: the registry's names and errors, the default each checkpoint gets,
and a method's LinearMethod reaching every linear layer of a model by its checkpoint name
(the model file names no format)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve.config import QuantConfig
from kvserve.layers.linear import Linear
from kvserve.models import get_model_class
from kvserve.ops import get_ops
from kvserve.quant import detect_quantization, get_quant_method, quant_method_names
from kvserve.quant.base import NoQuantization, QuantMethod, UnquantizedLinearMethod
from kvserve.quant.gguf import GGUFLinearMethod
from tests.helpers import PagedSequence, kvserve_model_from_hf, model_config_from_hf, tiny_hf_model


def test_registry_names_and_errors() -> None:
    assert quant_method_names() == ["awq", "compressed-tensors", "gguf", "gguf_exact", "gptq",
                                    "int4", "int8", "none", "w8a8"]
    assert isinstance(get_quant_method(QuantConfig()), NoQuantization)
    gguf = get_quant_method(QuantConfig(method="gguf"))
    exact = get_quant_method(QuantConfig(method="gguf_exact"))
    assert gguf.keeps_quantized and gguf.needs_kernels and exact.keeps_quantized
    lm = gguf.linear_method("lm_head")
    assert isinstance(lm, GGUFLinearMethod) and lm.int8_activations
    assert not exact.linear_method("lm_head").int8_activations  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="quantization must be one of awq, compressed-tensors, "
                                         r"gguf, gguf_exact, gptq, int4, int8, none, w8a8 "
                                         r"\(awq_marlin: awq, gptq_marlin: gptq\), got "
                                         r"'marlin'"):
        get_quant_method(QuantConfig(method="marlin"))


@pytest.mark.parametrize("path, device, dtype, ops, want", [
    ("m.gguf", "cpu", "float32", "auto", "gguf"),
    ("m.GGUF", "cpu", "float32", "cpu", "gguf"),
    ("m.gguf", "cpu", "bfloat16", "auto", "none"),
    ("m.gguf", "cpu", "float32", "reference", "none"),
    ("m.gguf", "cuda", "float32", "auto", "none"),
    ("hf_dir", "cpu", "float32", "auto", "none"),
])
def test_each_checkpoint_gets_its_default(path: str, device: str, dtype: str, ops: str,
                                          want: str) -> None:
    assert detect_quantization(path, device, dtype, ops) == want


class _Recording(QuantMethod):
    """A method that hands out the unquantized LinearMethod and records who asked."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.prefixes: list[str] = []

    def linear_method(self, prefix: str) -> Any:
        self.prefixes.append(prefix)
        return UnquantizedLinearMethod()


def test_every_linear_gets_its_method_by_checkpoint_name() -> None:
    hf = tiny_hf_model("llama")
    ref = kvserve_model_from_hf(hf, "LlamaForCausalLM", get_ops("reference"))
    cfg = model_config_from_hf(hf.config, "LlamaForCausalLM")
    quant = _Recording()
    model = get_model_class("LlamaForCausalLM")(cfg, get_ops("reference"), torch.float32,
                                                quant=quant)
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    want = {f"model.layers.{i}.{p}" for i in range(cfg.num_hidden_layers)
            for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                      "mlp.down_proj")} | {"lm_head"}
    assert sorted(quant.prefixes) == sorted(want)
    # The names are the modules' own paths in the model, checkpoint-style.
    assert {f"model.{n}" if n.startswith("layers.") else n for n in linears} == want
    model.load_weights((k, v.detach().clone()) for k, v in hf.state_dict().items())
    prompt = list(range(3, 20))
    runs = []
    for m in (model.eval(), ref):
        runner = PagedSequence(m)
        runs.append(runner.forward({runner.new_seq(): prompt})[0])
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_half_unquantized_layer_keeps_exact_halves_and_float32_results(backend: str) -> None:
    """UnquantizedLinearMethod(half=True) keeps a weight whose values are all float16 values
    as float16, else all bfloat16 values as bfloat16 (1e6 has no float16), else float32; the
    outputs are the float32 layer's bit for bit."""
    ops = get_ops(backend)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g)
    base = torch.randn(40, 64, generator=g) / 8
    cases = [(base.half().float(), torch.float16),
             ((base * 1e6).bfloat16().float(), torch.bfloat16), (base, torch.float32)]
    for w, want in cases:
        outs = []
        for method in (UnquantizedLinearMethod(half=True), UnquantizedLinearMethod()):
            lin = Linear(64, 40, bias=False, ops=ops, dtype=torch.float32, quant_method=method)
            lin.load_shard("weight", 0, w)
            lin.process_weights_after_loading()
            outs.append(lin(x))
            if method.half:
                assert lin.weight.dtype == want
                assert torch.equal(lin.weight.float(), w)
        assert torch.equal(outs[0], outs[1])
