"""Model registry keyed by HF architecture name; model modules import lazily.

Adding an architecture is a file in this folder plus a line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvserve.quant import get_quant_method, quant_config

if TYPE_CHECKING:
    import torch

    from kvserve.distributed.group import TPGroup
    from kvserve.ops.reference import ReferenceOps
    from kvserve.quant.base import QuantMethod

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "kvserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvserve.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "kvserve.models.qwen2:Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def build_model(ckpt: Any, ops: ReferenceOps, dtype: torch.dtype, quant: QuantMethod | str = "none",
                max_positions: int | None = None, tp: TPGroup | None = None) -> Any:
    """A checkpoint's model with its weights loaded, in eval mode, on the CPU. quant: a
    QuantMethod, or a method name of kvserve.quant's registry ("gguf" keeps a GGUF file's
    Q4_1 / Q8_0 matrices as blocks). tp: build this rank's part of a tensor-parallel model."""
    mc = ckpt.model_config
    if isinstance(quant, str):
        quant = get_quant_method(quant_config(quant, checkpoint_config=mc.quantization_config))
    model = get_model_class(mc.architecture)(mc, ops, dtype, max_positions=max_positions,
                                             quant=quant, tp=tp)
    model.load_weights(ckpt.weights(keep_quantized=quant.keeps_quantized))
    return model.eval()


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    mod, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(mod), cls)
