"""Llama family: Llama 1/2/3, SmolLM2, Mistral (and Qwen2, which only adds a q/k/v bias).

The model never sees paging: the runner hands it a ModelInput (flat varlen batch) and the KV
cache tensor, and each attention layer reads/writes its own slice through the ops backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed.group import TPGroup
from kvserve.layers.linear import Linear
from kvserve.layers.rotary import rope_cos_sin
from kvserve.outputs import ModelInput
from kvserve.quant.base import (
    FUSED_LINEARS,
    NoQuantization,
    QuantizedTensor,
    QuantMethod,
    dense,
    is_quantized,
)
from kvserve.quant.half_weights import exact_half

if TYPE_CHECKING:
    from kvserve.ops.reference import ReferenceOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ReferenceOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream). With a residual, x is added to it first."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


_NONE = NoQuantization()


class LlamaAttention(nn.Module):
    """With a tensor-parallel group: this rank's heads and KV heads (the KV cache it is
    handed holds those), o_proj summing over ranks."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ReferenceOps, dtype: torch.dtype,
                 quant: QuantMethod = _NONE, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.layer_idx = layer_idx
        self.num_heads = tp.shard(cfg.num_attention_heads)
        self.num_kv_heads = tp.shard(cfg.num_key_value_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.ops = ops
        prefix = f"model.layers.{layer_idx}.self_attn"
        q_all = cfg.num_attention_heads * cfg.head_dim  # the whole model's sizes
        kv_all = cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_all + 2 * kv_all,
                               bias=cfg.attention_bias, ops=ops, dtype=dtype,
                               shard_sizes=(q_all, kv_all, kv_all),
                               quant_method=quant.linear_method(f"{prefix}.qkv_proj"),
                               parallel="column", tp=tp)
        self.o_proj = Linear(q_all, cfg.hidden_size, bias=False, ops=ops, dtype=dtype,
                             quant_method=quant.linear_method(f"{prefix}.o_proj"),
                             parallel="row", tp=tp)

    def forward(self, x: torch.Tensor, inp: ModelInput, kv_cache: torch.Tensor,
                cos_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(q, k, inp.positions, cos_sin)
        layer_cache = kv_cache[self.layer_idx]
        self.ops.write_kv(k, v, layer_cache, inp.slot_mapping)
        o = self.ops.paged_attention(q, layer_cache, inp.block_tables, inp.seq_lens,
                                     inp.query_start_loc, self.scale, inp.max_query_len,
                                     inp.max_seq_len)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ReferenceOps, dtype: torch.dtype,
                 quant: QuantMethod = _NONE, prefix: str = "model.layers.0.mlp",
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.ops = ops
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, bias=False, ops=ops, dtype=dtype,
                                   shard_sizes=(i, i),
                                   quant_method=quant.linear_method(f"{prefix}.gate_up_proj"),
                                   parallel="column", tp=tp)
        self.down_proj = Linear(i, cfg.hidden_size, bias=False, ops=ops, dtype=dtype,
                                quant_method=quant.linear_method(f"{prefix}.down_proj"),
                                parallel="row", tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: ReferenceOps, dtype: torch.dtype,
                 quant: QuantMethod = _NONE, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, ops, dtype, quant, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.mlp = LlamaMLP(cfg, ops, dtype, quant, f"model.layers.{layer_idx}.mlp", tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, inp: ModelInput,
                kv_cache: torch.Tensor, cos_sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.ops.fused_llama_layer(self, x, residual, inp,
                                           kv_cache[self.self_attn.layer_idx], cos_sin)
        if fused is not None:
            return fused
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, inp, kv_cache, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused module fragment, shard index)
    stacked_params = {f".{part}.": (f".{fused}.", shard) for fused, parts in FUSED_LINEARS.items()
                      for shard, part in enumerate(parts)}

    def __init__(self, cfg: ModelConfig, ops: ReferenceOps, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, quant: QuantMethod = _NONE,
                 tp: TPGroup | None = None) -> None:
        """quant: hands every linear layer (lm_head included, tied or not) its LinearMethod.
        An embedding the loader kept as stored is looked up row by row (embed_stored);
        otherwise it is floats. tp: this rank's part of a tensor-parallel model (every rank
        keeps the whole embedding; lm_head holds its slice of the vocabulary)."""
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.tp = tp = tp or TPGroup.single()
        self.act_dtype = dtype  # the activations'; an untied embedding may be kept narrower
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size,
                                                     dtype=dtype), requires_grad=False)
        # The embedding as stored, when the loader kept it: each step dequantizes only the rows
        # it looks up, and the float table above stays an untouched placeholder (the Qwen2.5
        # 1.5B Q4_K_M file: 131 MB of Q4_K blocks instead of 933 MB of floats).
        self.embed_stored: QuantizedTensor | None = None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ops, dtype, quant, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, ops=ops, dtype=dtype,
                              quant_method=quant.linear_method("lm_head"), parallel="column",
                              tp=tp)
        if cfg.tie_word_embeddings and tp.size == 1:
            # Tied: one float tensor serves both, unless lm_head keeps the embedding's
            # quantized form (then the lookup still reads the dequantized floats).
            self.lm_head.weight = self.embed_tokens
        # RoPE table kept in float32 whatever the weights' dtype: positions need the precision.
        # A buffer, so that model.to(device) moves it; not in the state dict.
        self.register_buffer("cos_sin", rope_cos_sin(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
            cfg.rope_scaling_dict), persistent=False)

    def forward(self, inp: ModelInput, kv_cache: torch.Tensor,
                layers: nn.ModuleList | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of every token in the step (after the final norm).
        layers: the first of self.layers only (a self-drafting early exit, kv_cache holding
        just theirs); None: all of them."""
        layers = self.layers if layers is None else layers
        x = (self.embed_tokens[inp.input_ids] if self.embed_stored is None
             else self.embed_stored.rows(inp.input_ids)).to(self.act_dtype)
        stack = getattr(self.ops, "fused_llama_stack", None)
        fused = stack(layers, x, inp, kv_cache, self.cos_sin) if stack else None
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer in layers:
                x, residual = layer(x, residual, inp, kv_cache, self.cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float logits; under tensor parallelism on rank 0 only (None on the
        other ranks, which computed their slice of the vocabulary for it)."""
        return self.tp.gather_logits(self.lm_head(hidden).float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
                     ) -> None:
        """Load HF-named tensors, as floats or as the loader kept them. Every tensor of a
        linear layer goes to that layer (its LinearMethod keeps, repacks or copies it: a
        weight, or a quantized checkpoint's qweight / scales / ...); anything else gets
        floats. Raises ValueError naming unknown or missing tensors."""
        params = dict(self.named_parameters(remove_duplicate=False))
        params["model.embed_tokens.weight"] = params.pop("embed_tokens")
        linears = {n: m for n, m in self.named_modules() if isinstance(m, Linear)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if (name == "model.embed_tokens.weight" and self.config.tie_word_embeddings
                    and self.tp.size > 1 and not is_quantized(tensor)
                    and "weight" in self.lm_head.quant_method.checkpoint_names(self.lm_head)):
                # Tied, but lm_head holds only this rank's vocabulary rows: its own copy
                # (unless the checkpoint quantizes lm_head: its own tensors come then).
                self.lm_head.load_shard("weight", 0, tensor)
            if is_quantized(tensor) and name == "model.embed_tokens.weight":
                if self.config.tie_word_embeddings:
                    self.lm_head.load_shard("weight", 0, tensor)  # keeps or dequantizes
                    loaded.add("lm_head.weight#0")
                want = (self.config.vocab_size, self.config.hidden_size)
                if tuple(tensor.shape) != want:
                    raise ValueError(f"checkpoint tensor {name!r} has shape "
                                     f"{tuple(tensor.shape)}, expected {want}")
                self.embed_stored = tensor
                loaded.add("model.embed_tokens.weight")
                continue
            key, shard = self._place(name)
            owner, pname = key.rsplit(".", 1)
            if owner in linears:
                linears[owner].load_shard(pname, shard, tensor)
                loaded.add(f"{owner}.{pname}#{shard}")
                continue
            if key not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{self.config.architecture}")
            tensor = dense(tensor)
            if tuple(params[key].shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
            params[key].data.copy_(tensor)
            loaded.add(key)
        self._check_all_loaded(params, linears, loaded)
        for module in linears.values():
            module.process_weights_after_loading()
        if self.config.tie_word_embeddings and self.tp.size == 1:
            # A tied lm_head that keeps the embedding's values in a form read row by row (16-bit
            # floats, GGUF blocks packed for its kernels) serves the lookup too: one copy, not
            # a second one as stored or as float32 (dropped below), as llama.cpp looks tokens
            # up in the one tensor.
            shared = self.lm_head.quant_method.weight_rows(self.lm_head)
            if shared is not None:
                self.embed_stored = shared
        if self.embed_stored is not None and self.lm_head.weight is not self.embed_tokens:
            # Nothing reads the float table (a tied lm_head kept its own blocks): drop the
            # placeholder, so the model's parameters are what it holds.
            self.embed_tokens = nn.Parameter(torch.empty(0, self.config.hidden_size,
                                                         dtype=self.embed_tokens.dtype),
                                             requires_grad=False)
        elif self.embed_stored is None and self.lm_head.weight is not self.embed_tokens:
            # An untied float32 table whose values are all 16-bit (an HF checkpoint stored in
            # bfloat16 / float16, a quantized export's float16 embedding) is kept at that
            # width: a lookup widens its rows exactly, and the table takes half the memory
            # (Qwen2.5-0.5B's 136M-entry one: 272 MB instead of 545).
            narrow = exact_half(self.embed_tokens.data)
            if narrow is not None:
                self.embed_tokens = nn.Parameter(narrow, requires_grad=False)

    def _place(self, name: str) -> tuple[str, int]:
        """An HF tensor name -> (our parameter path, output shard): q/k/v go to qkv_proj's
        shards 0-2, gate/up to gate_up_proj's 0-1."""
        if name == "model.embed_tokens.weight":
            return name, 0
        key = name.removeprefix("model.")
        for frag, (fused, shard) in self.stacked_params.items():
            if frag in key:
                return key.replace(frag, fused), shard
        return key, 0

    def _check_all_loaded(self, params: dict[str, nn.Parameter], linears: dict[str, Linear],
                          loaded: set[str]) -> None:
        expected = {f"{owner}.{n}#{s}" for owner, m in linears.items()
                    if not (owner == "lm_head" and self.config.tie_word_embeddings)
                    for n in m.quant_method.checkpoint_names(m)
                    for s in range(len(m.shard_sizes))}
        expected |= {key for key in params if key.rsplit(".", 1)[0] not in linears}
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with GQA and (v0.1 only) a sliding window; the engine caps
    max_model_len at the window, so full attention is exact."""
