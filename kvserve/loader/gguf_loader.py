"""GGUF checkpoints: metadata -> ModelConfig, tensors -> HF-named float32 weights.

Read with kvserve.loader.gguf_reader (a memmap, so opening costs little memory; ~15x faster
than gguf.GGUFReader on a large vocabulary) and dequantized one tensor at a time with
gguf.quants.dequantize: every type the installed gguf package can dequantize is supported
(F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, and more). With keep_quantized, every
block-quantized matrix is handed over as stored (GGUFWeight), for the layers' LinearMethod to
keep (kvserve/quant/gguf.py's KEPT_TYPES), requantize or dequantize.

Shapes: GGUF lists dims fastest-first, so a GGUF [in, out] tensor is the HF [out, in] matrix.

The default model (SmolLM2-135M-Instruct.Q4_1.gguf): arch "llama", 30 layers, hidden 576,
9 heads / 3 KV heads of head_dim 64, FFN 1536, vocab 49152, rope_theta 1e5, no output.weight
(tied embeddings); token_embd is Q8_0, norms F32, every other matrix Q4_1.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from functools import cache
from typing import Any

import gguf
import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.loader.errors import CheckpointError
from kvserve.loader.gguf_reader import GGUF_MAGIC, GGUFFile
from kvserve.loader.gguf_tokenizer import tokenizer_from_gguf
from kvserve.loader.tokenizer import Tokenizer
from kvserve.quant.gguf_weights import KEPT_TYPES, GGUFWeight, block_bytes

logger = logging.getLogger(__name__)

# general.architecture -> (HF architecture, q/k/v have a bias, q/k rows permuted by llama.cpp)
_ARCHS: dict[str, tuple[str, bool, bool]] = {
    # Mistral GGUFs also say "llama"; their converter permutes q/k for the interleaved RoPE.
    "llama": ("LlamaForCausalLM", False, True),
    # Qwen2 GGUFs keep HF's rotate-half layout (llama.cpp runs them with NEOX RoPE).
    "qwen2": ("Qwen2ForCausalLM", True, False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# Tensors that carry no HF weight: llama3 RoPE frequency factors become config.rope_scaling.
_NON_WEIGHTS = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str) -> str:
    """Map a GGUF tensor name to its HF name; CheckpointError for a name we do not know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise CheckpointError(f"unexpected GGUF tensor {name!r}: not part of a supported llama / "
                          "qwen2 model")


@cache
def can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the installed gguf package dequantizes this type, probed on one zero block."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `permute`).

    Within each head HF orders rotary pairs rotate-half style, rows [x0..x(d/2-1) | y0..],
    and llama.cpp interleaves them, rows [x0 y0 x1 y1 ...]: GGUF row h*d + 2i + j is HF row
    h*d + j*d/2 + i, for i in [0, d/2), j in {0, 1}. Works for weights [rows, in] and biases.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal its writer had: 1e-05, not 9.9999997e-06."""
    return float(str(np.float32(value)))


def open_gguf(path: str) -> GGUFFile:
    """The file's header read (kvserve.loader.gguf_reader), with CheckpointErrors for files
    that are not GGUF, corrupt, or truncated."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file: it starts with {magic!r}, "
                              f"a GGUF file starts with {GGUF_MAGIC!r}")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # bad bytes fail in many ways: ValueError, UnicodeError, ...
        raise CheckpointError(f"{path} ({size} bytes) is a truncated or corrupt GGUF file: "
                              f"{type(e).__name__}: {e}") from e
    # A short file can still parse: the memmap then yields short tensor views, or none.
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{path} is truncated: tensor {t.name!r} needs bytes "
                                  f"[{t.data_offset}, {end}) but the file has {size} bytes")
    return reader


def _rope_scaling(meta: dict[str, Any], arch: str, rope_freqs: np.ndarray | None,
                  head_dim: int, rope_theta: float) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:
        return _llama3_from_freqs(rope_freqs, head_dim, rope_theta)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 0.0, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor or 1.0)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("attn_factor", "attention_factor")):
            if (v := meta.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
                out[hf_key] = _f32(v)
        return out
    raise CheckpointError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, "
                          "linear, yarn, llama3 (rope_freqs tensor)")


def llama3_freq_factors(head_dim: int, rope_theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int
                        ) -> np.ndarray:
    """Per-frequency divisors of llama3 RoPE scaling (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
              / (high_freq_factor - low_freq_factor))
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _llama3_from_freqs(freqs: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any]:
    # GGUF keeps only the resulting factors; the parameters of released Llama 3.x models
    # (factor = the largest divisor) are tried and kept when they reproduce the tensor.
    factor = _f32(freqs.max())
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384)):
        ref = llama3_freq_factors(head_dim, rope_theta, factor, low, high, orig)
        if ref.shape == freqs.shape and np.allclose(ref, freqs, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise CheckpointError("GGUF rope_freqs tensor does not match llama3 RoPE scaling with "
                          f"factor {factor} and the usual parameters; unsupported RoPE scaling")


class GGUFCheckpoint:
    """An open GGUF file: its config, tokenizer, and a lazy weight iterator."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader = open_gguf(path)
        meta = self.reader.metadata
        arch = meta.get("general.architecture")
        if arch not in _ARCHS:
            raise CheckpointError(f"unsupported GGUF architecture {arch!r} in {path}; "
                                  f"supported: {', '.join(sorted(_ARCHS))}")
        self.arch = arch
        self.hf_arch, self.qkv_bias, self.permuted_qk = _ARCHS[arch]
        self.tensors = {t.name: t for t in self.reader.tensors}
        # A few llama-arch models carry q/k/v biases too; their presence decides.
        self.qkv_bias = self.qkv_bias or "blk.0.attn_q.bias" in self.tensors
        self.tokenizer: Tokenizer = tokenizer_from_gguf(meta)
        self.model_config = self._model_config(meta)
        self._check_tensors()

    def _key(self, meta: dict[str, Any], key: str, default: Any = None) -> Any:
        value = meta.get(f"{self.arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF {self.path} lacks metadata {self.arch}.{key}")
        if isinstance(value, list):  # e.g. per-layer head counts of hybrid models
            raise CheckpointError(f"GGUF metadata {self.arch}.{key} is per-layer ({value[:4]}"
                                  "...); only one value for all layers is supported")
        return value

    def _model_config(self, meta: dict[str, Any]) -> ModelConfig:
        hidden = int(self._key(meta, "embedding_length"))
        n_head = int(self._key(meta, "attention.head_count"))
        n_kv = int(self._key(meta, "attention.head_count_kv", n_head))
        head_dim = int(self._key(meta, "attention.key_length", hidden // n_head))
        rope_dim = int(self._key(meta, "rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise CheckpointError(f"GGUF rope.dimension_count {rope_dim} != head_dim {head_dim}: "
                                  "partial rotary embeddings are not supported")
        rope_theta = _f32(self._key(meta, "rope.freq_base", 10000.0))
        freqs = self.tensors.get("rope_freqs.weight")
        freqs_np = (gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float64)
                    .reshape(-1) if freqs is not None else None)
        vocab_size = len(meta.get("tokenizer.ggml.tokens") or [])
        tied = "output.weight" not in self.tensors
        try:
            return ModelConfig(
                architecture=self.hf_arch,
                vocab_size=vocab_size,
                hidden_size=hidden,
                intermediate_size=int(self._key(meta, "feed_forward_length")),
                num_hidden_layers=int(self._key(meta, "block_count")),
                num_attention_heads=n_head,
                num_key_value_heads=n_kv,
                head_dim=head_dim,
                max_position_embeddings=int(self._key(meta, "context_length")),
                rms_norm_eps=_f32(self._key(meta, "attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=ModelConfig.freeze_rope_scaling(
                    _rope_scaling(meta, self.arch, freqs_np, head_dim, rope_theta)),
                tie_word_embeddings=tied,
                attention_bias=self.qkv_bias,
                bos_token_id=self.tokenizer.bos_token_id,
                eos_token_ids=self.tokenizer.eos_token_ids,
            )
        except ValueError as e:
            raise CheckpointError(f"GGUF {self.path} has an invalid model config: {e}") from e

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> the HF-order shape the config implies."""
        c = self.model_config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (c.vocab_size, c.hidden_size),
            "output_norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            shapes["output.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"blk.{i}."
            shapes.update({
                p + "attn_norm.weight": (c.hidden_size,),
                p + "attn_q.weight": (q, c.hidden_size),
                p + "attn_k.weight": (kv, c.hidden_size),
                p + "attn_v.weight": (kv, c.hidden_size),
                p + "attn_output.weight": (c.hidden_size, q),
                p + "ffn_norm.weight": (c.hidden_size,),
                p + "ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                p + "ffn_up.weight": (c.intermediate_size, c.hidden_size),
                p + "ffn_down.weight": (c.hidden_size, c.intermediate_size),
            })
            if self.qkv_bias:
                shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                               p + "attn_v.bias": (kv,)})
        return shapes

    def _check_tensors(self) -> None:
        expected = self.expected_shapes()
        missing = [name for name in expected if name not in self.tensors]
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)"
                                               if len(missing) > 8 else "")
            raise CheckpointError(f"GGUF {self.path} is missing tensors: {shown}")
        for name, t in self.tensors.items():
            if name in _NON_WEIGHTS:
                continue
            gguf_to_hf_name(name)  # raises on names of unsupported layers
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if name in expected and shape != expected[name]:
                raise CheckpointError(f"GGUF tensor {name!r} has shape {list(shape)}, the "
                                      f"config implies {list(expected[name])}")
            if not can_dequantize(t.tensor_type):
                raise CheckpointError(f"GGUF tensor {name!r} has type {t.tensor_type.name}, "
                                      "which the installed gguf package cannot dequantize")

    def weights(self, keep_quantized: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        """(HF name, float32 tensor) pairs; with keep_quantized, the block-quantized matrices
        come as GGUFWeight blocks instead (rows un-permuted like the floats), for the model's
        GGUFLinearMethod layers to keep or requantize and the rest to dequantize."""
        unkept: Counter[str] = Counter()
        for t in self.reader.tensors:
            if t.name in _NON_WEIGHTS:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            # np.array copies out of the read-only memmap, so torch gets memory it owns.
            qtype = int(t.tensor_type)
            if keep_quantized and len(shape) == 2 and self._blocks(qtype, shape[1]):
                raw = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(shape[0], -1))
                if qtype not in KEPT_TYPES:
                    unkept[t.tensor_type.name] += 1
                yield gguf_to_hf_name(t.name), GGUFWeight(self._hf_rows(t.name, raw),
                                                          int(t.tensor_type), shape[1])
                continue
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                          dtype=np.float32).reshape(shape))
            yield gguf_to_hf_name(t.name), self._hf_rows(t.name, w)
        if unkept:
            logger.info("%s: %s matrices of no type kvserve's kernels read as stored: "
                        "quantization 'gguf' rewrites them for its kernels (IQ3_S, IQ3_XXS, "
                        "IQ2_XXS, IQ1_S, IQ2_XS, IQ2_S, IQ1_M exactly in IQ4_XS's quants, the "
                        "others as Q8_0, 8.5 bits a weight), 'gguf_exact' and a backend "
                        "without the kernels dequantize them", self.path,
                        ", ".join(f"{n} {name}" for name, n in sorted(unkept.items())))

    @staticmethod
    def _blocks(qtype: int, k: int) -> bool:
        """Whether a matrix of this type, k weights a row, is handed over as stored: any
        block type (not F32 / F16 / BF16) whose blocks fill its rows."""
        block = block_bytes(qtype)[0]
        return block > 1 and k % block == 0

    def _hf_rows(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The tensor's rows in HF's order: llama.cpp's q/k permutation undone (rows of blocks
        move like rows of floats)."""
        if self.permuted_qk and ".attn_q." in name:
            w = unpermute_qk(w, self.model_config.num_attention_heads)
        elif self.permuted_qk and ".attn_k." in name:
            w = unpermute_qk(w, self.model_config.num_key_value_heads)
        return w.contiguous()
