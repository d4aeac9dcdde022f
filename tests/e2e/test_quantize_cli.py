"""`kvserve quantize` end to end on a tiny random Llama saved as an HF directory: each method
writes the layout's tensors and configs, the checkpoint reads back (kvserve's loader for the
4-bit ones, transformers' config and tokenizer classes), its weights unpacked by this file's
own reader stand close to the float ones, and bad flags are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch
from safetensors import safe_open

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops import get_ops
from tests.helpers import PagedSequence, kvserve_model_from_hf, tiny_hf_model

CALIB = Path(__file__).resolve().parents[3] / "shared" / "reference" / "GPL-3.txt"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
HIDDEN, FFN, N_HEADS, N_KV, HEAD_DIM = 64, 128, 4, 2, 16  # tiny_hf_model's sizes


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: byte b -> the character byte-level BPE writes for it
    (printable Latin-1 as itself, the rest shifted to U+0100 on)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def _byte_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE without merges: token id = byte value, one token per byte of text."""
    vocab = {c: b for b, c in enumerate(_byte_symbols())}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    hf = tiny_hf_model("llama", seed=3)
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(str(path), safe_serialization=True)
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": _byte_symbols()[0]}))
    return path, hf


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """tiny_dir's model with its lm_head tied to the embedding (as SmolLM2's and Qwen2.5's)."""
    hf = tiny_hf_model("llama", seed=4, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny_tied")
    hf.save_pretrained(str(path), safe_serialization=True)
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": _byte_symbols()[0]}))
    return path, hf


def _quantize(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "quantize", *args],
                          capture_output=True, text=True, timeout=300)


def _unpack(words: torch.Tensor, bits: int, dim: int, order: list[int] | None = None
            ) -> torch.Tensor:
    """int32 words -> their 32 / bits fields along dim (field i = bits [b*i, b*i + b)),
    field i landing at position order[i] of its run when an order is given (AWQ)."""
    per = 32 // bits
    u = words.to(torch.int64) & 0xFFFFFFFF
    fields = [(u >> (bits * i)) & (2**bits - 1) for i in range(per)]
    if order is not None:
        placed: list[torch.Tensor] = [torch.empty(0)] * per
        for i, pos in enumerate(order):
            placed[pos] = fields[i]
        fields = placed
    stacked = torch.stack(fields, dim=dim + 1)  # [..., words, per, ...]
    shape = list(words.shape)
    shape[dim] *= per
    return stacked.reshape(shape)


def _dequantize(t: dict[str, torch.Tensor], prefix: str, method: str, bits: int
                ) -> torch.Tensor:
    """The float weight [N, K] a GPTQ (v1: zeros stored minus 1) or AWQ GEMM linear holds."""
    scales = t[f"{prefix}.scales"].float()  # [K / G, N]
    if method == "awq":
        q = _unpack(t[f"{prefix}.qweight"], 4, 1, [0, 2, 4, 6, 1, 3, 5, 7])  # [K, N]
        z = _unpack(t[f"{prefix}.qzeros"], 4, 1, [0, 2, 4, 6, 1, 3, 5, 7])
        g = torch.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    else:
        q = _unpack(t[f"{prefix}.qweight"], bits, 0)  # [K, N]
        z = _unpack(t[f"{prefix}.qzeros"], bits, 1) + 1
        g = t[f"{prefix}.g_idx"].long()
    return (scales[g] * (q - z[g]).float()).T


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    runner = PagedSequence(model)
    return runner.forward({runner.new_seq(): prompt})[0]


@pytest.mark.parametrize("method, extra", [
    ("int4", []), ("int8", []), ("gptq", []), ("gptq", ["--act-order", "--sym"]),
    ("gptq", ["--act-order", "--static-groups"]), ("gptq", ["--bits", "8"]), ("awq", []),
    ("awq", ["--awq-clip"]), ("awq", ["--no-awq-duo-scaling"]), ("gptq", ["--mse", "2.4"]),
    ("int4", ["--mse", "2.4"]),
])
def test_quantize_writes_a_complete_checkpoint(tiny_dir: tuple[Path, Any], tmp_path: Path,
                                               method: str, extra: list[str]) -> None:
    src, hf = tiny_dir
    out = tmp_path / "q"
    calib = ["--calib", str(CALIB), "--calib-tokens", "512", "--seq-len", "128"]
    r = _quantize(str(src), "--method", method, "--group-size", "32", "-o", str(out),
                  *(calib if method in ("gptq", "awq") else []), *extra)
    assert r.returncode == 0, r.stderr
    bits = 8 if method == "int8" or "8" in extra else 4
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == HIDDEN and cfg["num_key_value_heads"] == N_KV
    if method == "awq":
        assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                      "version": "gemm", "modules_to_not_convert": None}
    else:
        assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym",
                                   "static_groups", "checkpoint_format", "mse")} == {
            "quant_method": "gptq", "bits": bits, "group_size": 32,
            # 8 bits are always symmetric: q - zero must fit int8 blocks
            "desc_act": "--act-order" in extra, "sym": "--sym" in extra or bits == 8,
            "static_groups": "--static-groups" in extra, "checkpoint_format": "gptq",
            "mse": 2.4 if "--mse" in extra else 0.0}
        assert json.loads((out / "quantize_config.json").read_text()) == qc

    t = _tensors(out)
    per = 32 // bits
    float_names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        float_names |= {f"model.layers.{i}.input_layernorm.weight",
                        f"model.layers.{i}.post_attention_layernorm.weight"}
    want = {n: torch.float16 for n in float_names}
    sizes = {"self_attn.q_proj": (N_HEADS * HEAD_DIM, HIDDEN),
             "self_attn.k_proj": (N_KV * HEAD_DIM, HIDDEN),
             "self_attn.v_proj": (N_KV * HEAD_DIM, HIDDEN),
             "self_attn.o_proj": (HIDDEN, N_HEADS * HEAD_DIM), "mlp.gate_proj": (FFN, HIDDEN),
             "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(2):
        for lin, (n, k) in sizes.items():
            p = f"model.layers.{i}.{lin}"
            if method == "awq":
                shapes[p + ".qweight"] = (k, n // 8)
            else:
                shapes[p + ".qweight"] = (k // per, n)
                shapes[p + ".g_idx"] = (k,)
            shapes[p + ".qzeros"] = (k // 32, n // per)
            shapes[p + ".scales"] = (k // 32, n)
            want |= {p + ".qweight": torch.int32, p + ".qzeros": torch.int32,
                     p + ".scales": torch.float16}
            if method != "awq":
                want[p + ".g_idx"] = torch.int32
    assert {k: v.dtype for k, v in t.items()} == want
    assert {k: tuple(t[k].shape) for k in shapes} == shapes
    for p in shapes:
        if p.endswith(".g_idx"):
            # Act-order permutes the groups unless they are static (runs of 32 columns).
            in_order = torch.equal(t[p], torch.arange(len(t[p]), dtype=torch.int32) // 32)
            assert in_order == ("--act-order" not in extra or "--static-groups" in extra), p

    # The unpacked weights are the float ones to within the grid's half step (the scales).
    float_sd = hf.state_dict()
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            w = float_sd[p + ".weight"]
            deq = _dequantize(t, p, method, bits)
            if method in ("gptq", "awq") or "--mse" in extra:
                # GPTQ moves weights off their nearest grid point to cut the output error,
                # AWQ moved scales into the norms / v / up, and --mse clips a group's
                # extremes: all judged as a model below.
                continue
            step = t[p + ".scales"].float().max()
            # A hair over half a step (the top of the grid moves with s's float16 rounding);
            # a symmetric grid (2 amax / maxq, zero (maxq + 1) / 2) clamps its top value, up
            # to a whole step.
            limit = 1.01 if qc.get("sym") else 0.51
            assert (deq - w).abs().max() <= limit * step, p

    # transformers reads the directory's config and tokenizer; its model with the unpacked
    # weights predicts what the float model does.
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("the licence").input_ids == list(b"the licence")
    deq_sd = {k: v.float() for k, v in t.items() if k in float_names}
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            deq_sd[p + ".weight"] = _dequantize(t, p, method, bits)
    hf_q = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    hf_q.load_state_dict(deq_sd)
    ids = torch.tensor([list(b"This License applies to any program or other work")])
    with torch.no_grad():
        ref = hf(ids).logits[0]
        got = hf_q(ids).logits[0]
    rel = (got - ref).norm() / ref.norm()
    assert rel < (0.15 if bits == 4 else 0.015), rel  # here ~0.06-0.09 / ~0.005

    # kvserve's own GPTQ / AWQ loader (config.json's quantization_config) runs it: the
    # logits of the float model holding the unpacked weights (int8 activations there).
    ckpt = load_checkpoint(str(out))
    fmt = "awq" if method == "awq" else "gptq"
    model = build_model(ckpt, get_ops("auto"), torch.float32, fmt)
    hf_deq = tiny_hf_model("llama", seed=3)
    hf_deq.load_state_dict(deq_sd)
    ref_q = kvserve_model_from_hf(hf_deq, "LlamaForCausalLM", get_ops("reference"))
    prompt = list(b"Everyone is permitted to copy")
    ours, theirs = _logits(model, prompt), _logits(ref_q, prompt)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 0.02, err  # int8 activations, float16 Q4_1 minimum there: ~0.006


@pytest.mark.parametrize("method, extra", [
    ("gptq", ["--sym"]), ("gptq", []), ("awq", []), ("int8", []),
    ("gptq", ["--act-order", "--static-groups"]),
])
def test_compressed_tensors_format_holds_the_same_quantization(
        tiny_dir: tuple[Path, Any], tmp_path: Path, method: str, extra: list[str]) -> None:
    """--format compressed-tensors writes the very integers and scales of the method's own
    layout: the compressed-tensors library's unpacking of its tensors gives the GPTQ / AWQ
    directory's weights (this file's reader), kvserve runs both directories to the same
    logits bit for bit, and transformers reads a symmetric one to them too."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src, _ = tiny_dir
    calib = ["--calib", str(CALIB), "--calib-tokens", "512", "--seq-len", "128"]
    dirs = {}
    for fmt in (None, "compressed-tensors"):
        out = tmp_path / (fmt or "native")
        r = _quantize(str(src), "--method", method, "--group-size", "32", "-o", str(out),
                      *(calib if method in ("gptq", "awq") else []), *extra,
                      *(["--format", fmt] if fmt else []))
        assert r.returncode == 0, r.stderr
        dirs[fmt] = out
    bits = 8 if method == "int8" else 4
    sym = "--sym" in extra or bits == 8
    qc = json.loads((dirs["compressed-tensors"] / "config.json").read_text())[
        "quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == (
        "compressed-tensors", "pack-quantized", ["lm_head"])
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"],
            weights["actorder"]) == (bits, 32, sym, "weight" if "--act-order" in extra
                                     else None)
    native, ct = _tensors(dirs[None]), _tensors(dirs["compressed-tensors"])
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            shape = torch.Size(ct[p + ".weight_shape"].tolist())
            q = unpack_from_int32(ct[p + ".weight_packed"], bits, shape).float()
            scale = ct[p + ".weight_scale"].float()  # [N, K / G]
            zp = (torch.zeros_like(scale) if sym else unpack_from_int32(
                ct[p + ".weight_zero_point"], bits, scale.shape, packed_dim=0).float())
            w = (q - zp.repeat_interleave(32, dim=1)) * scale.repeat_interleave(32, dim=1)
            assert torch.equal(w, _dequantize(native, p, "awq" if method == "awq" else "gptq",
                                              bits)), p
            assert (p + ".weight_zero_point" in ct) == (not sym)
    prompt = list(b"Everyone is permitted to copy")
    logits = {}
    for fmt, path in dirs.items():
        ckpt = load_checkpoint(str(path))
        name = fmt or ("awq" if method == "awq" else "gptq")
        logits[fmt] = _logits(build_model(ckpt, get_ops("auto"), torch.float32, name), prompt)
    assert torch.equal(logits[None], logits["compressed-tensors"])
    if sym and bits == 4:
        import transformers

        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(dirs["compressed-tensors"]), dtype=torch.float32)
        with torch.no_grad():
            ref = theirs(torch.tensor([prompt])).logits[0]
        ours = logits["compressed-tensors"]
        assert (ours - ref).abs().max() / ref.abs().max() < 0.02


def _near_unpacked(model: Any, t: dict[str, torch.Tensor], head: torch.Tensor,
                   prompt: list[int]) -> torch.Tensor:
    """The model's logits on prompt, asserted within 2% of the untied float model holding
    the GPTQ export t's unpacked 4-bit layers and `head` as its lm_head."""
    deq_sd = {k: v.float() for k, v in t.items() if not k.rsplit(".", 1)[0].endswith(
        LINEARS) and not k.startswith("lm_head.")}
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            deq_sd[p + ".weight"] = _dequantize(t, p, "gptq", 4)
    deq_sd["lm_head.weight"] = head
    hf_deq = tiny_hf_model("llama", seed=4)  # untied, as the checkpoint now is
    hf_deq.load_state_dict(deq_sd)
    ref = kvserve_model_from_hf(hf_deq, "LlamaForCausalLM", get_ops("reference"))
    ours, theirs = _logits(model, prompt), _logits(ref, prompt)
    assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02
    return ours


@pytest.mark.parametrize("method, extra", [("gptq", []), ("int4", []), ("gptq", ["--sym"])])
def test_lm_head_is_quantized_with_the_layers(tied_dir: tuple[Path, Any], tmp_path: Path,
                                              method: str, extra: list[str]) -> None:
    """--lm-head on a tied model: lm_head written in the layout (the embedding's values,
    quantized: int4 within half a grid step) beside the float16 embedding, untied, with
    `lm_head: true`; kvserve holds it 4-bit and gives the logits of the float model holding
    the unpacked weights. --format compressed-tensors of the same run holds the same
    integers (kvserve: the same logits bit for bit), and transformers reads a symmetric one
    to them too."""
    src, hf = tied_dir
    calib = ["--calib", str(CALIB), "--calib-tokens", "512", "--seq-len", "128"]
    dirs = {}
    for fmt in ("gptq", "compressed-tensors"):
        dirs[fmt] = tmp_path / fmt
        r = _quantize(str(src), "--method", method, "--group-size", "32", "--lm-head",
                      "--format", fmt, "-o", str(dirs[fmt]),
                      *(calib if method == "gptq" else []), *extra)
        assert r.returncode == 0, r.stderr
    cfg = json.loads((dirs["gptq"] / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["lm_head"] is True
    ct_cfg = json.loads((dirs["compressed-tensors"] / "config.json").read_text())
    assert ct_cfg["quantization_config"]["ignore"] == []
    t = _tensors(dirs["gptq"])
    assert "lm_head.weight" not in t
    assert {k: t[f"lm_head.{k}"].dtype for k in ("qweight", "qzeros", "scales", "g_idx")} == {
        "qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16,
        "g_idx": torch.int32}
    embed = hf.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(t["model.embed_tokens.weight"], embed.half())
    head = _dequantize(t, "lm_head", "gptq", 4)
    if method == "int4":
        step = t["lm_head.scales"].float().max()
        assert (head - embed).abs().max() <= 0.51 * step

    ckpt = load_checkpoint(str(dirs["gptq"]))
    model = build_model(ckpt, get_ops("auto"), torch.float32, "gptq")
    assert model.lm_head.weight.dtype == torch.uint8  # 4-bit blocks, not the embedding
    prompt = list(b"Everyone is permitted to copy")
    ours = _near_unpacked(model, t, head, prompt)

    ct_model = build_model(load_checkpoint(str(dirs["compressed-tensors"])), get_ops("auto"),
                           torch.float32, "compressed-tensors")
    assert torch.equal(_logits(ct_model, prompt), ours)
    if "--sym" in extra:
        import transformers

        hf_ct = transformers.AutoModelForCausalLM.from_pretrained(
            str(dirs["compressed-tensors"]), dtype=torch.float32)
        with torch.no_grad():
            got = hf_ct(torch.tensor([prompt])).logits[0]
        assert (ours - got).abs().max() / got.abs().max() < 0.02


def test_lm_head_at_8_bits_beside_4_bit_layers(tied_dir: tuple[Path, Any], tmp_path: Path
                                               ) -> None:
    """--lm-head-bits 8 with 4-bit GPTQ layers: lm_head written as a symmetric 8-bit GPTQ
    linear under GPTQModel's `dynamic` override (compressed-tensors: a config group of its
    own that targets lm_head); kvserve holds it as int8 blocks, the layers 4-bit, and gives
    the logits of the float model holding the unpacked weights, the same bits from both
    layouts; transformers reads the compressed-tensors one to them too."""
    import transformers

    src, hf = tied_dir
    calib = ["--calib", str(CALIB), "--calib-tokens", "512", "--seq-len", "128"]
    dirs = {}
    for fmt in ("gptq", "compressed-tensors"):
        dirs[fmt] = tmp_path / fmt
        r = _quantize(str(src), "--method", "gptq", "--group-size", "32", "--sym",
                      "--lm-head-bits", "8", "--format", fmt, "-o", str(dirs[fmt]), *calib)
        assert r.returncode == 0, r.stderr
    qc = json.loads((dirs["gptq"] / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 4 and qc["lm_head"] is True
    assert qc["dynamic"] == {"+:lm_head$": {"bits": 8, "sym": True}}
    groups = json.loads((dirs["compressed-tensors"] / "config.json").read_text())[
        "quantization_config"]["config_groups"]
    assert groups["group_1"]["targets"] == ["lm_head"]
    assert groups["group_1"]["weights"]["num_bits"] == 8
    t = _tensors(dirs["gptq"])
    vocab, hidden = hf.config.vocab_size, hf.config.hidden_size
    assert t["lm_head.qweight"].shape == (hidden // 4, vocab)  # 4 fields a word: 8 bits
    head = _dequantize(t, "lm_head", "gptq", 8)
    embed = hf.state_dict()["model.embed_tokens.weight"]
    assert (head - embed).abs().max() < 0.03 * embed.abs().max()  # a step: ~0.8% of it

    model = build_model(load_checkpoint(str(dirs["gptq"])), get_ops("auto"), torch.float32,
                        "gptq")
    assert (model.lm_head.quant_method.bits, model.layers[0].mlp.down_proj.quant_method.bits
            ) == (8, 4)
    prompt = list(b"Everyone is permitted to copy")
    ours = _near_unpacked(model, t, head, prompt)
    ct_model = build_model(load_checkpoint(str(dirs["compressed-tensors"])), get_ops("auto"),
                           torch.float32, "compressed-tensors")
    assert torch.equal(_logits(ct_model, prompt), ours)
    hf_ct = transformers.AutoModelForCausalLM.from_pretrained(str(dirs["compressed-tensors"]),
                                                              dtype=torch.float32)
    with torch.no_grad():
        got = hf_ct(torch.tensor([prompt])).logits[0]
    assert (ours - got).abs().max() / got.abs().max() < 0.02


def test_smoothquant_writes_compressed_tensors_w8a8(tiny_dir: tuple[Path, Any],
                                                   tmp_path: Path) -> None:
    """--method smoothquant: compressed-tensors "int-quantized" tensors and config; the
    checkpoint's weights (int8 x per-channel scale, norms smoothed) make a float model close
    to the source (smoothing exact, int8 weights), and kvserve finds the method by the config
    and runs it with per-token int8 activations near that model."""
    src, hf = tiny_dir
    out = tmp_path / "sq"
    r = _quantize(str(src), "--method", "smoothquant", "--alpha", "0.5", "--calib", str(CALIB),
                  "--calib-tokens", "512", "--seq-len", "128", "-o", str(out))
    assert r.returncode == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == (
        "compressed-tensors", "int-quantized", ["lm_head"])
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy")} == {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    assert {k: group["input_activations"][k] for k in ("num_bits", "strategy", "dynamic")} == {
        "num_bits": 8, "strategy": "token", "dynamic": True}
    t = _tensors(out)
    float_sd = hf.state_dict()
    deq_sd = {}
    for name, tensor in t.items():
        if name.endswith(".weight_scale"):
            continue
        lin = name.endswith(".weight") and name[:-len(".weight")] + ".weight_scale" in t
        if lin:
            scale = t[name[:-len(".weight")] + ".weight_scale"]
            assert tensor.dtype == torch.int8 and tuple(tensor.shape) == tuple(
                float_sd[name].shape) and int(tensor.min()) >= -127
            assert scale.dtype == torch.float16 and tuple(scale.shape) == (tensor.shape[0], 1)
            deq_sd[name] = tensor.float() * scale.float()
        else:
            assert tensor.dtype == torch.float16, name
            deq_sd[name] = tensor.float()
    assert sum(n.endswith(".weight_scale") for n in t) == 2 * len(LINEARS)
    # The norms were smoothed (not the source's), yet the model computes the same function.
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(deq_sd[norm], float_sd[norm], rtol=1e-2)
    hf_q = tiny_hf_model("llama", seed=3)
    hf_q.load_state_dict(deq_sd)
    ids = torch.tensor([list(b"This License applies to any program or other work")])
    with torch.no_grad():
        ref, got = hf(ids).logits[0], hf_q(ids).logits[0]
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.02, rel  # int8 weights per channel, float16 tensors: ~0.004
    ckpt = load_checkpoint(str(out))
    assert dict(ckpt.model_config.quantization_config or ())["quant_method"] == (
        "compressed-tensors")
    model = build_model(ckpt, get_ops("auto"), torch.float32, "w8a8")
    ref_q = kvserve_model_from_hf(hf_q, "LlamaForCausalLM", get_ops("reference"))
    prompt = list(b"Everyone is permitted to copy")
    ours, theirs = _logits(model, prompt), _logits(ref_q, prompt)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 0.05, err  # per-token int8 activations


@pytest.mark.parametrize("args, message", [
    (["--method", "gptq", "--bits", "3"], "--bits must be 4 or 8, got 3"),
    (["--method", "smoothquant", "--bits", "4"], "--method smoothquant writes 8-bit weights"),
    (["--method", "smoothquant", "--alpha", "1.5"], "--alpha must be in [0, 1], got 1.5"),
    (["--method", "smoothquant"], "--method smoothquant needs calibration text"),
    (["--method", "awq", "--bits", "8"], "--method awq writes the 4-bit AWQ GEMM layout"),
    (["--method", "int4", "--group-size", "48"],
     "--group-size 48 does not divide the model's hidden_size (64)"),
    (["--method", "gptq", "--calib", "/nonexistent/calib.txt"],
     "--calib file '/nonexistent/calib.txt' does not exist"),
    (["--method", "awq"], "--method awq needs calibration text: --calib FILE"),
    (["--method", "int8", "--act-order"], "--act-order (desc_act) is a GPTQ option"),
    (["--method", "awq", "--static-groups"], "--static-groups is a GPTQ option; --method is awq"),
    (["--method", "gptq", "--awq-clip"], "--awq-clip is an AWQ option; --method is gptq"),
    (["--method", "int4", "--no-awq-duo-scaling"],
     "--no-awq-duo-scaling is an AWQ option; --method is int4"),
    (["--method", "awq", "--mse", "2.4"], "--mse is a gptq / int4 / int8 option"),
    (["--method", "gptq", "--format", "awq", "--calib", str(CALIB)],
     "--method gptq writes --format gptq or compressed-tensors, got 'awq'"),
    (["--method", "gptq", "--act-order", "--format", "compressed-tensors", "--calib",
      str(CALIB)], "--act-order needs --static-groups there"),
    (["--method", "int4", "--mse", "-1"], "--mse must be >= 0"),
    (["--method", "int4", "--lm-head-bits", "3"],
     "argument --lm-head-bits: invalid choice: 3 (choose from 4, 8)"),
    (["--method", "awq", "--lm-head", "--calib", str(CALIB)],
     "--lm-head quantizes the output layer with gptq, int4, int8; --method awq keeps it in "
     "float"),
])
def test_bad_flags_are_refused_by_name(tiny_dir: tuple[Path, Any], tmp_path: Path,
                                       args: list[str], message: str) -> None:
    r = _quantize(str(tiny_dir[0]), *args, "-o", str(tmp_path / "q"))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "q").exists()


def test_output_directory_is_not_overwritten(tiny_dir: tuple[Path, Any], tmp_path: Path
                                             ) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    r = _quantize(str(tiny_dir[0]), "--method", "int4", "-o", str(tmp_path))
    assert r.returncode == 2 and "exists and is not an empty directory" in r.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"
