"""Quantized checkpoints in the standard HF layouts (safetensors + config.json + tokenizer).

The tensors of each quantized linear are int4_layouts.py's (GPTQ v1, AWQ GEMM,
compressed-tensors pack-quantized: drawn there, beside their readers); this module writes the
rest of a checkpoint around them: config.json's quantization_config, the tokenizer, the
safetensors files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from kvserve.config import ModelConfig
from kvserve.loader.tokenizer import Tokenizer


def gptq_quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool,
                             static_groups: bool = False, damp_percent: float = 0.01,
                             mse: float = 0.0, lm_head: bool = False) -> dict[str, Any]:
    """config.json's quantization_config (and quantize_config.json), AutoGPTQ's keys (and
    GPTQModel's `mse`, the grid search's norm, 0 for none, and `lm_head`, whether lm_head is
    quantized too)."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
            "desc_act": desc_act, "sym": sym, "damp_percent": damp_percent,
            "static_groups": static_groups, "true_sequential": True, "checkpoint_format": "gptq",
            "mse": mse, "lm_head": lm_head, "model_file_base_name": "model"}


def set_lm_head_grid(qcfg: dict[str, Any], bits: int, sym: bool) -> None:
    """A GPTQ or compressed-tensors quantization_config with lm_head quantized at `bits`
    (symmetric or not) instead of the layers' own: GPTQModel's `dynamic` override for the
    module (vLLM and kvserve read it), or a config group targeting lm_head by name, which
    compressed-tensors ranks above the "Linear" target."""
    if qcfg["quant_method"] == "gptq":
        qcfg["dynamic"] = {"+:lm_head$": {"bits": bits, "sym": sym}}
        return
    layers = qcfg["config_groups"]["group_0"]
    qcfg["config_groups"]["group_1"] = {
        **layers, "targets": ["lm_head"],
        "weights": {**layers["weights"], "num_bits": bits, "symmetric": sym}}


def awq_quantization_config(group_size: int) -> dict[str, Any]:
    """AutoAWQ's AwqConfig.to_transformers_dict for GEMM."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def compressed_tensors_wna16_config(bits: int, group_size: int, sym: bool, act_order: bool,
                                    lm_head: bool = False) -> dict[str, Any]:
    """compressed-tensors' quantization_config for weight-only int weights per group
    ("pack-quantized"), lm_head left in float (ignored) as llm-compressor's W4A16 / W8A16
    recipes write it, unless lm_head (then the "Linear" target takes it too). act_order:
    GPTQ ran in activation order with static groups ("weight")."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": [] if lm_head else ["lm_head"],
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": bits, "type": "int", "symmetric": sym,
                            "strategy": "group", "group_size": group_size,
                            "block_structure": None,
                            "actorder": "weight" if act_order else None,
                            "dynamic": False, "observer": "minmax"},
                "input_activations": None, "output_activations": None}}}


def w8a8_quantization_config() -> dict[str, Any]:
    """compressed-tensors' quantization_config for int8 weights per channel and dynamic int8
    activations per token ("int-quantized": per linear `weight` int8 [N, K] and
    `weight_scale` [N, 1]), lm_head left in float, as llm-compressor writes W8A8."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
            "block_structure": None, "actorder": None, "observer": None}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False,
                            "observer": "minmax"},
                "input_activations": {**int8, "strategy": "token", "dynamic": True}}}}


def hf_config(mc: ModelConfig, source_config: dict[str, Any] | None) -> dict[str, Any]:
    """config.json for the output: the source's own when it had one (an HF directory), else
    a transformers-style config built from the ModelConfig (a GGUF file)."""
    if source_config is not None:
        cfg = dict(source_config)
        cfg.pop("quantization_config", None)
        return cfg
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2"}[mc.architecture]
    eos = list(mc.eos_token_ids)
    return {
        "architectures": [mc.architecture], "model_type": model_type,
        "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size, "num_hidden_layers": mc.num_hidden_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
        "max_position_embeddings": mc.max_position_embeddings, "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.rope_theta, "rope_scaling": mc.rope_scaling_dict,
        "tie_word_embeddings": mc.tie_word_embeddings, "attention_bias": mc.attention_bias,
        "hidden_act": "silu", "bos_token_id": mc.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "float16",
    }


def save_tokenizer(tokenizer: Tokenizer, out_dir: str) -> None:
    """tokenizer.json (the backend as it is) and a tokenizer_config.json naming the special
    tokens, add_bos_token and the chat template, which kvserve and transformers both read."""
    tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
    special = tokenizer.special_tokens_map
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                           "add_bos_token": tokenizer.add_bos_token,
                           "add_eos_token": False,
                           "clean_up_tokenization_spaces": False, **special}
    if tokenizer.chat_template is not None:
        cfg["chat_template"] = tokenizer.chat_template
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), cfg)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_checkpoint(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                     quantization_config: dict[str, Any], tokenizer: Tokenizer) -> None:
    """One model.safetensors, config.json with quantization_config, AutoGPTQ's / AutoAWQ's
    side file (quantize_config.json / quant_config.json; none for compressed-tensors) and
    the tokenizer files."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"),
                {**config, "quantization_config": quantization_config})
    if quantization_config["quant_method"] == "gptq":
        _write_json(os.path.join(out_dir, "quantize_config.json"), quantization_config)
    elif quantization_config["quant_method"] == "awq":
        _write_json(os.path.join(out_dir, "quant_config.json"), {
            "zero_point": True, "q_group_size": quantization_config["group_size"],
            "w_bit": quantization_config["bits"], "version": "GEMM"})
    save_tokenizer(tokenizer, out_dir)
