"""Qwen2 / Qwen2.5: the Llama architecture with a bias on the q/k/v projections
(ModelConfig.attention_bias, set by the loader)."""

from __future__ import annotations

from kvserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
