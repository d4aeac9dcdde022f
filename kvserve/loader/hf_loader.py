"""HF checkpoint directories: config.json, *.safetensors, tokenizer.json (+ its config).

Weights are read lazily with safetensors.safe_open, one tensor at a time, from a single
model.safetensors or from the shards listed in model.safetensors.index.json.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from kvserve.config import ModelConfig
from kvserve.loader.errors import CheckpointError
from kvserve.loader.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}
# Buffers some old checkpoints saved; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_optional_json(path: str) -> dict[str, Any]:
    return _read_json(path) if os.path.isfile(path) else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 4 keys (rope_theta, rope_scaling)
    or transformers 5's rope_parameters; scaling uses the key "rope_type" and is None for
    plain RoPE."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(cfg.get("rope_scaling") or params)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if not scaling or scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        if not cfg.get("use_sliding_window") or not window:
            return None
        n = int(cfg["num_hidden_layers"])
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", n)) else "full_attention"
            for i in range(n)]
        if all(t == "full_attention" for t in layer_types):
            return None
        if any(t != "sliding_attention" for t in layer_types):
            raise CheckpointError("Qwen2 config slides the attention window on some layers only "
                                  f"(layer_types {layer_types}); only all or none is supported")
        return int(window)
    return int(window) if window else None


def hf_architecture(cfg: dict[str, Any], path: str) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(str(cfg.get("model_type")))
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"unsupported architecture {arch or cfg.get('model_type')!r} in "
                              f"{path}/config.json; supported: {', '.join(SUPPORTED_ARCHS)}")
    return arch


def model_config_from_hf(cfg: dict[str, Any], path: str,
                         eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    arch = hf_architecture(cfg, path)
    try:
        hidden, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_head,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or hidden // n_head),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=ModelConfig.freeze_rope_scaling(scaling),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama only when the config says so.
            attention_bias=(arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias"))),
            sliding_window=_sliding_window(cfg, arch),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            quantization_config=_quantization_config(cfg),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}/config.json lacks {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json has an invalid value: {e}") from e


def _quantization_config(cfg: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """config.json's quantization_config frozen as sorted items: its scalar entries (bits,
    group_size, desc_act, sym, zero_point, version, checkpoint_format, ...), nested dicts
    flattened to dotted keys (compressed-tensors' config_groups.group_0.weights.num_bits),
    lists of scalars as tuples (its ignore list; GPTQ's modules_in_block_to_quantize, a
    list of lists, as tuples of tuples), and GPTQModel's `dynamic`, whose keys are regular
    expressions tried in order, as (pattern, sorted overrides) pairs in the file's order."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict) or not qc:
        return None
    items: list[tuple[str, Any]] = []

    def scalar(v: Any) -> bool:
        return v is None or isinstance(v, (str, int, float, bool))

    def walk(prefix: str, d: dict[str, Any]) -> None:
        for k, v in d.items():
            if k == "dynamic" and not prefix and isinstance(v, dict):
                # a rule's overrides: its scalar entries (a "-:" rule's may be {} or null)
                items.append((k, tuple((str(p), tuple(sorted(
                    (ok, ov) for ok, ov in (o if isinstance(o, dict) else {}).items()
                    if scalar(ov)))) for p, o in v.items())))
            elif isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif scalar(v):
                items.append((prefix + k, v))
            elif isinstance(v, list) and all(scalar(e) or isinstance(e, list)
                                             and all(map(scalar, e)) for e in v):
                items.append((prefix + k, tuple(tuple(e) if isinstance(e, list) else e
                                                for e in v)))

    walk("", qc)
    return tuple(sorted(items))


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: str, tok_cfg: dict[str, Any]) -> str | None:
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):  # newer transformers save the template here
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def tokenizer_from_hf_dir(path: str, cfg: dict[str, Any]) -> Tokenizer:
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"{path} has no tokenizer.json (slow sentencepiece / tiktoken "
                              "tokenizers are not supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise CheckpointError(f"{tok_path} cannot be read: {e}") from e
    tok_cfg = _read_optional_json(os.path.join(path, "tokenizer_config.json"))
    gen_cfg = _read_optional_json(os.path.join(path, "generation_config.json"))

    def token_id(key: str) -> int | None:
        content = _token_content(tok_cfg.get(key))
        return backend.token_to_id(content) if content is not None else None

    bos = token_id("bos_token")
    if bos is None and "bos_token" not in tok_cfg:
        bos = cfg.get("bos_token_id")
    eos = [token_id("eos_token"), *_as_id_list(cfg.get("eos_token_id")),
           *_as_id_list(gen_cfg.get("eos_token_id"))]
    if "add_bos_token" in tok_cfg:
        add_bos = bool(tok_cfg["add_bos_token"])
    else:
        # No explicit flag: the tokenizer.json post-processor tells whether BOS is added.
        probe = backend.encode("", add_special_tokens=True).ids
        add_bos = bos is not None and probe[:1] == [bos]
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=[e for e in eos if e is not None],
                     add_bos_token=add_bos, chat_template=_chat_template(path, tok_cfg),
                     all_special_ids=special, unk_token_id=token_id("unk_token"),
                     pad_token_id=token_id("pad_token"))


def _linear_names(qc: dict[str, Any]) -> tuple[str, ...]:
    """What a checkpoint stores for each linear: a weight, or a GPTQ / AWQ / compressed-tensors
    pack-quantized layout's tensors instead, those every such checkpoint has (its format's
    TENSORS; the layer's LinearMethod checks the optional ones and the rest)."""
    from kvserve.quant.int4_layouts import COMPRESSED_TENSORS, TENSORS

    method = qc.get("quant_method")
    if method == COMPRESSED_TENSORS and qc.get("format") != "pack-quantized":
        return ("weight",)  # int-quantized W8A8: an int8 weight beside its scale
    return TENSORS[method][0] if method in TENSORS else ("weight",)


def _stored_tensors(qc: dict[str, Any]) -> Callable[[str], tuple[str, ...]]:
    """Checkpoint module name -> the tensors stored for that linear: _linear_names where its
    method quantizes the module (`quantizes`: lm_head only where the checkpoint says so, and
    not the modules its per-module settings keep in float), else a float weight."""
    from kvserve.quant import get_quant_method_class

    linear_names = _linear_names(qc)
    if linear_names == ("weight",):
        return lambda module: linear_names
    method = get_quant_method_class(qc["quant_method"])
    return lambda module: linear_names if method.quantizes(qc, module) else ("weight",)


def expected_hf_names(c: ModelConfig) -> list[str]:
    stored = _stored_tensors(c.quantization_dict or {})
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not c.tie_word_embeddings:
        names += [f"lm_head.{t}" for t in stored("lm_head")]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm")]
        names += [p + n + "." + t for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") for t in stored(p + n)]
        if c.attention_bias:
            names += [p + f"self_attn.{n}.bias" for n in ("q_proj", "k_proj", "v_proj")]
    return names


class HFCheckpoint:
    def __init__(self, path: str) -> None:
        self.path = path
        cfg = _read_json(os.path.join(path, "config.json"))
        hf_architecture(cfg, path)  # an unsupported model fails before anything else is read
        self.tokenizer = tokenizer_from_hf_dir(path, cfg)
        self.model_config = model_config_from_hf(cfg, path, self.tokenizer.eos_token_ids)
        self.files = self._weight_files()
        self._check_names()

    def _weight_files(self) -> dict[str, list[str]]:
        """safetensors file -> the tensor names it holds, in file order."""
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = _read_json(index).get("weight_map") or {}
            files: dict[str, list[str]] = {}
            for name, fname in weight_map.items():
                files.setdefault(fname, []).append(name)
            absent = [f for f in files if not os.path.isfile(os.path.join(self.path, f))]
            if absent:
                raise CheckpointError(f"{index} lists shards that are missing: {absent}")
        else:
            shards = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"{self.path} has no *.safetensors weights "
                                      "(.bin / .pt checkpoints are not supported)")
            files = {}
            for fname in shards:
                with safe_open(os.path.join(self.path, fname), framework="pt") as f:
                    files[fname] = list(f.keys())
        return files

    def _check_names(self) -> None:
        have = {n for names in self.files.values() for n in names}
        missing = [n for n in expected_hf_names(self.model_config) if n not in have]
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)"
                                               if len(missing) > 8 else "")
            raise CheckpointError(f"checkpoint {self.path} is missing tensors: {shown}")

    def weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Float tensors converted to float32; integer ones (a GPTQ / AWQ checkpoint's packed
        qweight, qzeros, g_idx) as stored, for the layer's LinearMethod. keep_quantized is
        accepted for the Checkpoint interface."""
        for fname, names in self.files.items():
            with safe_open(os.path.join(self.path, fname), framework="pt") as f:
                for name in names:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    t = f.get_tensor(name)
                    yield name, t.to(torch.float32) if t.is_floating_point() else t
