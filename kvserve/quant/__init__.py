"""Quantized weights: a registry of QuantMethods keyed by name (kvserve/quant/base.py is the
seam they implement; models never mention a format).

    none        NoQuantization: every weight in the model's dtype
    gguf        GGUF Q4_1 / Q8_0 blocks kept, int8 activations, exact int dot products
                (llama.cpp's arithmetic); the default for a .gguf file in float32 on the CPU
    gguf_exact  the same blocks, dequantized in registers: the float32 model bit for bit
    int8, int4  weight-only round to nearest at load (per channel; per group of 32/64/128),
                written as Q8_0 / Q4_1 blocks for the same kernels (kvserve/quant/rtn.py)
    gptq, awq   4-bit GPTQ / AWQ checkpoints (GPTQ also 8-bit), repacked at load as Q4_1
                blocks (Q8_0) (kvserve/quant/int4_checkpoints.py); found by config.json's
                quantization_config; vLLM's gptq_marlin / awq_marlin are aliases
    compressed-tensors
                llm-compressor's weight-only "pack-quantized" checkpoints (W4A16, W8A16),
                repacked the same way (kvserve/quant/compressed_tensors.py)
    w8a8        int8 weights per channel x int8 activations per token (SmoothQuant's W8A8,
                kvserve/quant/smoothquant.py): quantized at load from floats, or a
                compressed-tensors checkpoint (`kvserve quantize --method smoothquant`)

Adding a method is a file in this folder plus a line in _METHODS. Methods import lazily, so
`--quantization`'s choices cost no import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvserve.config import QuantConfig

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.quant.base import QuantMethod

_METHODS: dict[str, str] = {
    "awq": "kvserve.quant.int4_checkpoints:AWQQuantMethod",
    "compressed-tensors": "kvserve.quant.compressed_tensors:CompressedTensorsWNA16Method",
    "gptq": "kvserve.quant.int4_checkpoints:GPTQQuantMethod",
    "gguf": "kvserve.quant.gguf:GGUFQuantMethod",
    "gguf_exact": "kvserve.quant.gguf:GGUFExactQuantMethod",
    "int4": "kvserve.quant.rtn:Int4QuantMethod",
    "int8": "kvserve.quant.rtn:Int8QuantMethod",
    "none": "kvserve.quant.base:NoQuantization",
    "w8a8": "kvserve.quant.smoothquant:W8A8QuantMethod",
}


# Other names of these methods: vLLM's GPTQ and AWQ on its Marlin GPU kernels, which vLLM
# picks for such checkpoints and scripts name; here they load the same checkpoints.
QUANT_METHOD_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


def quant_method_names() -> list[str]:
    return sorted(_METHODS)


def canonical_quant_method(name: str) -> str:
    """The registry's name of a method named by an alias (QUANT_METHOD_ALIASES), else name."""
    return QUANT_METHOD_ALIASES.get(name, name)


def get_quant_method_class(name: str) -> type[QuantMethod]:
    name = canonical_quant_method(name)
    if name not in _METHODS:
        aliases = ", ".join(f"{a}: {m}" for a, m in QUANT_METHOD_ALIASES.items())
        raise ValueError(f"quantization must be one of {', '.join(quant_method_names())} "
                         f"({aliases}), got {name!r}")
    mod, cls = _METHODS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def quant_config(method: str = "none", group_size: int | None = None,
                 checkpoint_config: tuple[tuple[str, Any], ...] | None = None) -> QuantConfig:
    """A QuantConfig checked by its method (ValueError naming the method or the knob), with
    the method's default group size filled in."""
    method = canonical_quant_method(method)
    cls = get_quant_method_class(method)
    if group_size is None:
        group_size = cls.default_group_size
    config = QuantConfig(method, group_size, checkpoint_config)
    cls.check_quant_config(config)
    return config


def check_engine_config(config: EngineConfig) -> EngineConfig:
    """The engine config's quantization checked by its method (the model file, dtype and layer
    widths it needs); returns the config."""
    cls = get_quant_method_class(config.quant.method)
    cls.check_quant_config(config.quant)
    cls.validate(config)
    return config


def get_quant_method(config: QuantConfig) -> QuantMethod:
    cls = get_quant_method_class(config.method)
    cls.check_quant_config(config)
    return cls(config)


def detect_quantization(model_path: str, device: str, dtype: str, ops_backend: str,
                        quantization_config: dict[str, Any] | None = None) -> str:
    """The default method for a checkpoint and target: the first that finds itself, else
    "none"."""
    for name in quant_method_names():
        if get_quant_method_class(name).detect(model_path, device, dtype, ops_backend,
                                               quantization_config):
            return name
    return "none"
