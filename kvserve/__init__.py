"""kvserve: an LLM inference and serving engine built around a paged KV cache."""

from __future__ import annotations

from typing import Any

from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs", "LLMEngine", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import kvserve` stays cheap and pulls in no model code.
    if name == "LLM":
        from kvserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvserve.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineArgs":
        from kvserve.engine_args import EngineArgs
        return EngineArgs
    raise AttributeError(name)
