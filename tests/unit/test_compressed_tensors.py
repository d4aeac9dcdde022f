"""compressed-tensors "pack-quantized" checkpoints (llm-compressor's W4A16 / W8A16): tiny ones
written here by the compressed-tensors library itself (its quantization config, its qparams
and its compressor), loaded by kvserve, must give the logits of the same model holding the
weights the library's own decompression returns; transformers reads the same files to the
same logits; unsupported configs and bad tensors give errors that name what was found."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.quant import detect_quantization
from tests.helpers import PagedSequence, kvserve_model_from_hf, tiny_hf_model
from tests.unit.test_int4_checkpoints import repacked_qkv

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
METHOD = "compressed-tensors"


def _tokenizer(path: Path, vocab_size: int) -> None:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


def write_checkpoint(path: Path, hf: Any, args: QuantizationArgs,
                     qc_overrides: dict[str, Any] | None = None,
                     ignore: tuple[str, ...] = ("lm_head",),
                     targets: tuple[str, ...] = ("Linear",),
                     more_groups: dict[str, QuantizationScheme] | None = None
                     ) -> dict[str, torch.Tensor]:
    """hf quantized by compressed-tensors as `args` say (min / max qparams), compressed to
    pack-quantized and written to path with its config, every float tensor (scales, norms,
    embeddings, lm_head) in bfloat16, as a bfloat16 model's export holds them; lm_head too is
    quantized where `ignore` leaves it out. Returns the state dict of the library's own
    decompression of the same model: the weights the checkpoint stands for."""
    model = copy.deepcopy(hf)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=list(targets), weights=args),
                       **(more_groups or {})},
        ignore=list(ignore), format="pack-quantized")
    apply_quantization_config(model, config)
    with torch.no_grad():
        for m in model.modules():
            if not hasattr(m, "weight_scale"):
                continue
            a = m.quantization_scheme.weights  # its config group's
            g = a.group_size if a.strategy == "group" else m.weight.shape[1]
            w = m.weight.reshape(m.weight.shape[0], -1, g)
            s, z = calculate_qparams(w.amin(-1), w.amax(-1), a)
            m.weight_scale.copy_(s.to(torch.bfloat16))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(z)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16))  # the values a bfloat16 export holds
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    hf.config.save_pretrained(str(path))
    compressor.update_config(str(path))
    if qc_overrides:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = _merged(cfg["quantization_config"], qc_overrides)
        (path / "config.json").write_text(json.dumps(cfg))
    _tokenizer(path, hf.config.vocab_size)
    compressor.decompress_model(model)
    return {k: v for k, v in model.state_dict().items()
            if not k.endswith(("weight_scale", "weight_zero_point", "weight_shape"))}


def _merged(d: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """d with dotted-key overrides ("config_groups.group_0.weights.num_bits": 3) applied."""
    d = copy.deepcopy(d)
    for key, value in overrides.items():
        *parents, last = key.split(".")
        node = d
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return d


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    runner = PagedSequence(model)
    return runner.forward({runner.new_seq(): prompt})[0]


def _reference(arch: str, weights: dict[str, torch.Tensor]) -> Any:
    """kvserve's reference-ops model holding the decompressed weights."""
    hf_deq = tiny_hf_model(arch)
    hf_deq.load_state_dict(weights)
    return kvserve_model_from_hf(hf_deq, ARCH[arch], get_ops("reference"))


@pytest.mark.parametrize("arch, bits, sym, strategy", [
    ("llama", 4, True, "group"), ("llama", 4, False, "group"), ("qwen2", 4, False, "group"),
    ("llama", 4, False, "channel"), ("llama", 8, True, "channel"), ("qwen2", 8, True, "group"),
])
def test_checkpoint_loads_to_the_decompressed_model(tmp_path: Path, arch: str, bits: int,
                                                    sym: bool, strategy: str) -> None:
    hf = tiny_hf_model(arch)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=32 if strategy == "group" else None)
    deq = write_checkpoint(tmp_path, hf, args)
    ckpt = load_checkpoint(str(tmp_path))
    qc = ckpt.model_config.quantization_dict
    assert detect_quantization(str(tmp_path), "cpu", "float32", "cpu", qc) == METHOD
    model = build_model(ckpt, get_ops("auto"), torch.float32, METHOD)
    # The repacked blocks hold the library's dequantized weights (m = -s z rounded to
    # float16, the only change).
    _, got = repacked_qkv(model, bits)
    want = torch.cat([deq[f"model.layers.1.self_attn.{p}.weight"]
                      for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.allclose(got, want, rtol=0, atol=2e-3 * want.abs().max())
    # lm_head, in the ignore list, stays 16-bit (half the bytes of float32), as written.
    head = deq.get("lm_head.weight", deq["model.embed_tokens.weight"])
    assert model.lm_head.weight.dtype in (torch.float16, torch.bfloat16)
    assert torch.equal(model.lm_head.weight.float(), head)
    prompt = list(range(5, 45))
    ours, theirs = _logits(model, prompt), _logits(_reference(arch, deq), prompt)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 0.02, err  # int8 activations and float16 m: ~0.5% here


def test_transformers_reads_the_same_checkpoint_to_the_same_logits(tmp_path: Path) -> None:
    """The files written above are what transformers' own compressed-tensors loader reads,
    and kvserve agrees with it on them."""
    import transformers

    hf = tiny_hf_model("llama")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32)
    write_checkpoint(tmp_path, hf, args)
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, METHOD)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                               dtype=torch.float32)
    prompt = list(range(5, 45))
    with torch.no_grad():
        ref = theirs(torch.tensor([prompt])).logits[0]
    ours = _logits(model, prompt)
    assert ((ours - ref).abs().max() / ref.abs().max()) < 0.02


@pytest.mark.parametrize("sym", [True, False])
def test_a_quantized_lm_head_loads_to_the_decompressed_model(tmp_path: Path, sym: bool
                                                             ) -> None:
    """A checkpoint whose ignore list leaves lm_head out: the library quantizes lm_head too
    (the "Linear" target takes it); kvserve holds it 4-bit and gives the logits of the model
    holding the library's decompressed weights, and (symmetric) transformers' own."""
    from kvserve.quant.int4_checkpoints import Int4CheckpointLinearMethod

    hf = tiny_hf_model("llama")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group",
                            group_size=32)
    deq = write_checkpoint(tmp_path, hf, args, ignore=())
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight_packed" in stored and "lm_head.weight" not in stored
    assert not torch.equal(deq["lm_head.weight"], hf.state_dict()["lm_head.weight"])
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, METHOD)
    assert isinstance(model.lm_head.quant_method, Int4CheckpointLinearMethod)
    assert model.lm_head.weight.dtype == torch.uint8
    prompt = list(range(5, 45))
    ours, theirs = _logits(model, prompt), _logits(_reference("llama", deq), prompt)
    assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02
    if sym:
        import transformers

        hf_theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                                      dtype=torch.float32)
        with torch.no_grad():
            ref = hf_theirs(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max() / ref.abs().max() < 0.02


def _near_library_and_transformers(model: Any, deq: dict[str, torch.Tensor], path: Path
                                   ) -> None:
    """The model's logits within 2% of the reference model holding the library's
    decompressed weights, and of transformers' own read of the checkpoint at path."""
    import transformers

    prompt = list(range(5, 45))
    ours, theirs = _logits(model, prompt), _logits(_reference("llama", deq), prompt)
    assert (ours - theirs).abs().max() / theirs.abs().max() < 0.02
    hf_theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                                  dtype=torch.float32)
    with torch.no_grad():
        ref = hf_theirs(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() < 0.02


@pytest.mark.parametrize("targets, ignore, held_float", [
    (("re:.*self_attn.*",), ("lm_head",), {"0.mlp.gate_up_proj", "0.mlp.down_proj",
                                           "1.mlp.gate_up_proj", "1.mlp.down_proj"}),
    (("Linear",), ("lm_head", "re:.*layers.1.mlp.down_proj"), {"1.mlp.down_proj"}),
])
def test_modules_the_checkpoint_keeps_in_float_load_as_float(
        tmp_path: Path, targets: tuple[str, ...], ignore: tuple[str, ...],
        held_float: set[str]) -> None:
    """Linears that no target names, or that the ignore list names, are written in float by
    the library; kvserve holds them at their bfloat16 width and quantizes the rest, to the
    decompressed model's logits and transformers' own."""

    from kvserve.quant.base import UnquantizedLinearMethod

    hf = tiny_hf_model("llama")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32)
    deq = write_checkpoint(tmp_path, hf, args, ignore=ignore, targets=targets)
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, METHOD)
    floats = set()
    for i, layer in enumerate(model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            lin = layer.get_submodule(name)
            if isinstance(lin.quant_method, UnquantizedLinearMethod):
                assert lin.weight.dtype == torch.bfloat16
                floats.add(f"{i}.{name}")
    assert floats == held_float
    down = model.layers[1].mlp.down_proj.weight
    assert "1.mlp.down_proj" in held_float  # float in both cases, as written
    assert torch.equal(down.float(), deq["model.layers.1.mlp.down_proj.weight"])
    _near_library_and_transformers(model, deq, tmp_path)


def test_config_groups_quantize_their_own_modules(tmp_path: Path) -> None:
    """Two config groups: attention 8-bit per channel (a regular expression's target), the
    rest 4-bit in groups of 32 ("Linear", which compressed-tensors ranks after a regular
    expression). Each layer is held as its group says, and the model gives the decompressed
    model's logits and transformers' own."""

    hf = tiny_hf_model("llama")
    # symmetric: transformers reads asymmetric pack-quantized zero points at the wrong shape
    four = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32)
    eight = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    deq = write_checkpoint(tmp_path, hf, four, more_groups={"group_1": QuantizationScheme(
        targets=["re:.*self_attn.*"], weights=eight)})
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, METHOD)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            assert (lin.quant_method.bits, lin.quant_method.group_size) == (8, -1)
        for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert (lin.quant_method.bits, lin.quant_method.group_size) == (4, 32)
    _near_library_and_transformers(model, deq, tmp_path)


SYM4 = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                        group_size=32)
ASYM4 = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                         group_size=32)


@pytest.mark.parametrize("args, written, match", [
    # an export that ignores up_proj alone
    (SYM4, {"ignore": ("lm_head", "re:.*layers.1.mlp.up_proj")},
     r"model.layers.1.mlp.gate_up_proj: kvserve runs 2 checkpoint modules as this one layer, "
     r"and the checkpoint stores them differently \(gate_proj 4-bit group 32 symmetric, "
     r"up_proj float\)"),
    # q_proj from a symmetric group (no zero points stored), k / v from an asymmetric one of
    # the same bits and group size
    (ASYM4, {"more_groups": {"group_1": QuantizationScheme(targets=["re:.*self_attn.q_proj"],
                                                           weights=SYM4)}},
     r"model.layers.0.self_attn.qkv_proj: .* stores them differently \(q_proj 4-bit group 32 "
     r"symmetric, k_proj 4-bit group 32 with zero points, v_proj 4-bit group 32 with zero "
     r"points\)"),
])
def test_a_fused_layer_whose_modules_differ_is_named(tmp_path: Path, args: QuantizationArgs,
                                                      written: dict[str, Any], match: str
                                                      ) -> None:
    """kvserve runs gate / up, and q / k / v, as one layer each: a checkpoint that stores the
    modules of one differently is refused, naming the layer and what each module is."""
    write_checkpoint(tmp_path, tiny_hf_model("llama"), args, **written)
    with pytest.raises(ValueError, match=match):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, METHOD)


def test_actorder_group_index_is_followed(tmp_path: Path) -> None:
    """An export with actorder "group" (older llm-compressor) stores weight_g_idx, the group
    of each input column. Made here from a plain export by moving columns: with q'[:, j] =
    q[:, pi(j)] and g_idx[j] = pi(j) // G the checkpoint stands for W[:, pi]; unpacked and
    packed again by the library."""
    hf = tiny_hf_model("llama")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=32)
    deq = write_checkpoint(tmp_path, hf, args)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for layer in range(hf.config.num_hidden_layers):
        inputs = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
        for block, names in inputs.items():  # linears sharing an input share its order
            k = deq[f"model.layers.{layer}.{block}.{names[0]}.weight"].shape[1]
            pi = torch.randperm(k, generator=gen)
            for n in names:
                base = f"model.layers.{layer}.{block}.{n}"
                shape = tensors[f"{base}.weight_shape"]
                q = unpack_from_int32(tensors[f"{base}.weight_packed"], 4, torch.Size(shape))
                tensors[f"{base}.weight_packed"] = pack_to_int32(q[:, pi].contiguous(), 4)
                tensors[f"{base}.weight_g_idx"] = (pi // 32).to(torch.int32)
                deq[f"{base}.weight"] = deq[f"{base}.weight"][:, pi]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, METHOD)
    method = model.layers[0].mlp.gate_up_proj.quant_method
    assert method.perm is not None  # the layer gathers its inputs in group order
    prompt = list(range(5, 45))
    ours, theirs = _logits(model, prompt), _logits(_reference("llama", deq), prompt)
    assert ((ours - theirs).abs().max() / theirs.abs().max()) < 0.02


G0 = "config_groups.group_0."


@pytest.mark.parametrize("overrides, match", [
    ({G0 + "weights.num_bits": 3}, r"weights.num_bits=3; kvserve loads 4 or 8"),
    ({G0 + "weights.type": "float"}, r"weights.type='float'; kvserve loads 'int'"),
    ({G0 + "weights.strategy": "tensor"}, r"weights.strategy='tensor'; kvserve loads 'group' "
                                          r"or 'channel'"),
    ({G0 + "weights.group_size": 48}, r"weights.group_size=48; kvserve needs a positive "
                                      r"multiple of 32"),
    ({G0 + "input_activations": {"num_bits": 8, "type": "int"}},
     r"quantizes input_activations \(num_bits=8\)"),
    # lm_head said quantized (left out of the ignore list) but stored in float
    ({"ignore": []}, r"lm_head.weight_packed"),
])
def test_unsupported_configs_name_what_was_found(tmp_path: Path, overrides: dict[str, Any],
                                                 match: str) -> None:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32)
    write_checkpoint(tmp_path, tiny_hf_model("llama"), args, overrides)
    with pytest.raises(ValueError, match=match):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, METHOD)


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=32)
    write_checkpoint(tmp_path, tiny_hf_model("llama"), args)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    zp = "model.layers.0.mlp.up_proj.weight_zero_point"
    save_file({k: v for k, v in tensors.items() if k != zp}, str(tmp_path / "model.safetensors"))
    # gate_up_proj's shard 1 is up_proj
    with pytest.raises(ValueError, match=r"missing 1 tensors: layers.0.mlp.gate_up_proj."
                                         r"weight_zero_point#1"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, METHOD)
    bad = dict(tensors)
    bad["model.layers.1.self_attn.o_proj.weight_shape"] = torch.tensor([64, 96])
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj shard 0: weight_shape is \[64, 96\], the "
                                         r"layer's weight is \[64, 64\]"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, METHOD)
    bad = dict(tensors)
    bad["model.layers.1.self_attn.o_proj.weight_scale"] = torch.zeros(64, 3)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj shard 0: weight_scale must be torch.float16 "
                                         r"\[64, 2\], found torch.float32 \[64, 3\]"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, METHOD)


def test_the_engine_finds_the_format_and_w8a8_stays_w8a8(tmp_path: Path) -> None:
    """An engine on the directory runs it as compressed-tensors without being told (its
    config checked at start-up); detection tells the two compressed-tensors formats apart."""
    from kvserve import LLM, SamplingParams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=32)
    write_checkpoint(tmp_path, tiny_hf_model("llama"), args)
    llm = LLM(model=str(tmp_path), max_model_len=64)
    assert llm.llm_engine.config.quant.method == METHOD
    out = llm.generate(["t5 t6 t7"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    assert detect_quantization(str(tmp_path), "cpu", "float32", "cpu", qc) == "w8a8"


def test_a_target_two_groups_name_goes_to_the_later_numbered_one() -> None:
    """compressed-tensors maps a target to the last config group naming it, in the file's
    order, which its writers number group_0, group_1, ...: group_10 comes after group_2 (a
    sort by name put it first), and an exact name outranks "Linear" in any group."""
    from kvserve.quant.compressed_tensors import _group_of

    qc = {f"config_groups.group_{i}.targets": ("Linear",) for i in (0, 2, 10)}
    assert _group_of(qc, "model.layers.0.mlp.up_proj") == "group_10"
    qc["config_groups.group_2.targets"] = ("model.layers.0.mlp.up_proj",)
    assert _group_of(qc, "model.layers.0.mlp.up_proj") == "group_2"
    assert _group_of({**qc, "ignore": ("re:.*up_proj",)}, "model.layers.0.mlp.up_proj") is None
