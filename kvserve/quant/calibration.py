"""Calibration for GPTQ / AWQ: text -> token windows, and a Llama-family decoder layer as
small pure torch functions over HF-named weights, so the quantizers can run one layer (or one
sub-block of it) at a time on a whole calibration batch and read any linear's inputs.

This is not the serving model (models/llama.py, paged KV, fused projections): the quantizers
need the layer split at every linear and many sequences of equal length at once, with nothing
cached. tests/unit/test_gptq_awq.py holds it to the serving model's logits.

Shapes: S sequences of T tokens, hidden H; x [S, T, H]. A layer's weights are a dict keyed
by the HF name after "model.layers.{i}." ("self_attn.q_proj.weight", "input_layernorm.weight",
"self_attn.q_proj.bias" for Qwen2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.layers.rotary import rope_cos_sin
from kvserve.loader.tokenizer import Tokenizer

LayerWeights = dict[str, torch.Tensor]


DEFAULT_TOKENS = 8192  # calibration tokens when the user names none (or the text's all)


def calibration_batch(tokenizer: Tokenizer, text: str, num_tokens: int | None, seq_len: int
                      ) -> torch.Tensor:
    """Token windows of the text, int64 [S, T]: T = seq_len, S = num_tokens // T (at least
    one window; a BOS counted where the model adds one to each window), spread evenly from
    the text's start to its end, so they sample all of it rather than its first pages (a
    text's opening is rarely like the rest). num_tokens None: DEFAULT_TOKENS, or as many
    whole windows as the text holds where that is fewer. ValueError when the text is too
    short for the windows asked (or for one)."""
    if seq_len < 2 or num_tokens is not None and num_tokens < seq_len:
        raise ValueError(f"calibration needs seq_len >= 2 and num_tokens >= seq_len, got "
                         f"seq_len {seq_len}, num_tokens {num_tokens}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if (tokenizer.add_bos_token
                                       and tokenizer.bos_token_id is not None) else []
    body = seq_len - len(bos)
    n = (num_tokens or DEFAULT_TOKENS) // seq_len
    if num_tokens is None:
        n = max(1, min(n, len(ids) // body))
    if len(ids) < n * body:
        raise ValueError(f"the calibration text has {len(ids)} tokens; {n} windows of "
                         f"{seq_len} need {n * body}: give a longer text or fewer tokens")
    # Window i starts at round(i * (len - body) / (n - 1)): the first at 0, the last ending
    # at the text's end, consecutive starts >= body apart (len >= n * body): no overlap.
    starts = [0] if n == 1 else [round(i * (len(ids) - body) / (n - 1)) for i in range(n)]
    return torch.tensor([bos + ids[s:s + body] for s in starts], dtype=torch.long)


def rope_tables(cfg: ModelConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 [T, D / 2] for positions 0..T-1 (kvserve's RoPE table)."""
    cs = rope_cos_sin(cfg.head_dim, seq_len, cfg.rope_theta, cfg.rope_scaling_dict)
    half = cfg.head_dim // 2
    return cs[:, :half], cs[:, half:]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [S, heads, T, D], rotate-half (HF / NeoX) convention.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _linear(x: torch.Tensor, w: LayerWeights, name: str) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def attention_core(h: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
                   rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The normed input h [S, T, H] -> o_proj's input [S, T, heads * D]: q/k/v projections,
    RoPE, causal attention (each kv head serving heads / kv_heads query heads)."""
    s, t, _ = h.shape
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = _linear(h, w, "self_attn.q_proj").view(s, t, nh, d).transpose(1, 2)
    k = _linear(h, w, "self_attn.k_proj").view(s, t, nkv, d).transpose(1, 2)
    v = _linear(h, w, "self_attn.v_proj").view(s, t, nkv, d).transpose(1, 2)
    cos, sin = rope
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(s, t, nh * d)


def attention(h: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
              rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """self_attn(h): the attention block's output [S, T, H]."""
    return _linear(attention_core(h, w, cfg, rope), w, "self_attn.o_proj")


def mlp_core(h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """down_proj's input silu(gate(h)) * up(h) [S, T, I]."""
    return F.silu(_linear(h, w, "mlp.gate_proj")) * _linear(h, w, "mlp.up_proj")


def mlp(h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    return _linear(mlp_core(h, w), w, "mlp.down_proj")


def layer_forward(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One decoder layer on the residual stream x [S, T, H] (pre-norm, two residual adds)."""
    x = x + attention(rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps), w, cfg, rope)
    return x + mlp(rms_norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps), w)


def layer_weights(weights: dict[str, torch.Tensor], i: int) -> LayerWeights:
    """Layer i's tensors out of an HF-named dict, keyed without "model.layers.{i}."."""
    prefix = f"model.layers.{i}."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
