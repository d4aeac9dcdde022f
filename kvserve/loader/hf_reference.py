"""An HF transformers model holding a checkpoint's weights: the independent reference that the
parity tests and the benchmarks' HF peer run. Needs `transformers` (the test and bench
extras), imported only here."""

from __future__ import annotations

from typing import Any

from kvserve.loader.checkpoint import Checkpoint


def hf_model_from_checkpoint(ckpt: Checkpoint) -> Any:
    """transformers.LlamaForCausalLM in float32 with the weights kvserve loaded (dequantized
    from GGUF), so a comparison tests our math, not two loaders."""
    import transformers

    mc = ckpt.model_config
    if mc.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"hf_model_from_checkpoint supports the Llama family, got "
                         f"{mc.architecture}")
    cfg = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
        rope_scaling=mc.rope_scaling_dict, tie_word_embeddings=mc.tie_word_embeddings,
        bos_token_id=mc.bos_token_id, eos_token_id=list(mc.eos_token_ids) or None,
        pad_token_id=(mc.eos_token_ids or (None,))[0])
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(dict(ckpt.weights()), strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
