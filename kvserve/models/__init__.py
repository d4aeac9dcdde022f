"""Model registry keyed by HF architecture name; model modules import lazily.

Adding an architecture is a file in this folder plus a line here.
"""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "kvserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvserve.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "kvserve.models.qwen2:Qwen2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    mod, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(mod), cls)
