"""4-bit GPTQ and AWQ checkpoints: tiny ones written here with AutoGPTQ's and AutoAWQ's own
packing (transcribed in this file, independently of kvserve's unpacking), loaded by kvserve,
must give the logits of the same model with the dequantized weights; bad checkpoints give
errors that name what was found."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import save_file

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.quant.block_pack import Q4_1, Q4_1_128, Q8_0, unpack, widen
from kvserve.quant.int4_checkpoints import Int4CheckpointLinearMethod
from tests.helpers import PagedSequence, kvserve_model_from_hf, tiny_hf_model

GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: nibble i <- column order[i]


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def quantize_groups(w: torch.Tensor, g_idx: torch.Tensor, bits: int = 4, sym: bool = False
                    ) -> tuple[torch.Tensor, ...]:
    """AutoGPTQ's quantizer per group (columns by g_idx): asymmetric, scale = (max - min) /
    maxq and zero = round(-min / scale); symmetric, scale = 2 amax / maxq and zero =
    (maxq + 1) / 2; q = clamp(round(w / scale) + zero, 0, maxq); scales fp16.
    Returns q [K, N] int, zeros [G, N] int, scales [G, N] float32 (fp16-exact), and the
    dequantized weight [N, K] the checkpoint stands for."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    q = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    scales = torch.empty(groups, n)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        lo, hi = wg.min(1).values.clamp(max=0), wg.max(1).values.clamp(min=0)
        if sym:
            s = (2 * torch.maximum(-lo, hi) / maxq).clamp(min=1e-8).half().float()
            z = torch.full_like(s, (maxq + 1) // 2)
        else:
            s = ((hi - lo) / maxq).clamp(min=1e-8).half().float()
            z = torch.round(-lo / s).clamp(0, maxq)
        q[cols] = torch.clamp(torch.round(wg / s[:, None]) + z[:, None], 0, maxq).long().T
        zeros[g], scales[g] = z.long(), s
    deq = (scales[g_idx] * (q - zeros[g_idx])).T.contiguous()
    return q, zeros, scales, deq


def gptq_pack(q: torch.Tensor, zeros: torch.Tensor, bits: int = 4
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack (v1): P = 32 / bits rows of q per int32 word of qweight
    [K / P, N]; zeros minus 1 (wrapping), P columns per word of qzeros [G, N / P]."""
    p, mask = 32 // bits, (1 << bits) - 1
    qn = q.numpy().astype(np.uint64)
    zn = (zeros.numpy() - 1).astype(np.int64) & mask
    zn = zn.astype(np.uint64)
    qweight = np.zeros((qn.shape[0] // p, qn.shape[1]), np.uint64)
    for j in range(p):
        qweight |= qn[j::p] << np.uint64(bits * j)
    qzeros = np.zeros((zn.shape[0], zn.shape[1] // p), np.uint64)
    for j in range(p):
        qzeros |= zn[:, j::p] << np.uint64(bits * j)
    return _int32(qweight), _int32(qzeros)


def awq_pack(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM.from_linear: 8 columns per int32 word, nibble i holding column
    AWQ_PACK_ORDER[i] of the 8, for qweight [K, N / 8] and qzeros [G, N / 8]."""
    def pack_cols(a: np.ndarray) -> torch.Tensor:
        a = a.astype(np.uint64)
        out = np.zeros((a.shape[0], a.shape[1] // 8), np.uint64)
        for i, col in enumerate(AWQ_PACK_ORDER):
            out |= a[:, col::8] << np.uint64(4 * i)
        return _int32(out)

    return pack_cols(q.numpy()), pack_cols(zeros.numpy())


def write_checkpoint(path: Path, hf: Any, fmt: str, act_order: bool = False, bits: int = 4,
                     qc_overrides: dict[str, Any] | None = None, group: int = GROUP,
                     lm_head: bool = False,
                     stored: Callable[[str], tuple[int, int] | None] | None = None
                     ) -> dict[str, torch.Tensor]:
    """The tiny model as a GPTQ / AWQ directory (group -1: one group per row; lm_head:
    quantized too, GPTQModel's `lm_head: true`; stored: a linear module's name -> the (bits,
    group) it is written with instead, None for a float16 weight); returns the dequantized
    weights by name (a float16 weight's values too)."""
    rng = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        module = name.removesuffix(".weight")
        quantized = name.endswith(".weight") and (any(f".{lin}." in name for lin in LINEARS)
                                                  or lm_head and name == "lm_head.weight")
        setting = (bits, group) if stored is None or not quantized else stored(module)
        if quantized and setting is None:
            deq[name] = t.detach().half().float()
        if not quantized or setting is None:
            tensors[name] = t.detach().half()
            continue
        mbits, mgroup = setting
        k = t.shape[1]
        size = k if mgroup == -1 else mgroup
        g_idx = torch.arange(k) // size
        if act_order:  # AutoGPTQ's desc_act: column perm[j] joins group j // G
            layer_in = name.rsplit(".", 2)[0].rsplit(".", 1)[0]  # q/k/v share their inputs
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(
                zlib.crc32(f"{layer_in}{k}".encode())))
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[perm] = torch.arange(k) // size
        q, zeros, scales, w = quantize_groups(t.detach().float(), g_idx, mbits,
                                              sym=mbits == 8)
        deq[name] = w
        if fmt == "gptq":
            qweight, qzeros = gptq_pack(q, zeros, mbits)
            tensors[module + ".g_idx"] = g_idx.to(torch.int32)
        else:
            qweight, qzeros = awq_pack(q, zeros)
        tensors[module + ".qweight"], tensors[module + ".qzeros"] = qweight, qzeros
        tensors[module + ".scales"] = scales.half()
    del rng
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = hf.config.to_dict()
    qc: dict[str, Any] = ({"quant_method": "gptq", "bits": bits, "group_size": group,
                           "desc_act": act_order, "sym": bits == 8,
                           "checkpoint_format": "gptq"}
                          if fmt == "gptq" else
                          {"quant_method": "awq", "bits": 4, "group_size": group,
                           "zero_point": True, "version": "gemm"})
    if lm_head:
        qc["lm_head"] = True
    cfg["quantization_config"] = {**qc, **(qc_overrides or {})}
    (path / "config.json").write_text(json.dumps(cfg))
    vocab = {f"t{i}": i for i in range(hf.config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    return deq


def repacked_qkv(model: Any, bits: int) -> tuple[Any, torch.Tensor]:
    """Layer 1's qkv_proj, loaded from a 4- or 8-bit checkpoint, and its repacked Q4_1 / Q8_0
    blocks as floats [out, in]: d q + m per block."""
    lin = model.layers[1].self_attn.qkv_proj
    wtype = Q4_1 if bits == 4 else Q8_0
    assert isinstance(lin.quant_method, Int4CheckpointLinearMethod)
    assert lin.quant_method.wtype == wtype
    q, d, m = unpack(lin.weight, wtype)
    got = (d[..., None] * q.float() + (m[..., None] if m is not None else 0)).reshape(
        -(-lin.out_features // 16) * 16, -1)
    return lin, got[:lin.out_features]


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    runner = PagedSequence(model)
    return runner.forward({runner.new_seq(): prompt})[0]


PROMPT = list(range(5, 45))


def near_dequantized(model: Any, hf: Any, deq: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loaded model's logits on PROMPT, asserted within 2% (of the largest) of the tiny
    llama's float model holding hf's weights with `deq` in place (int8 activations and
    float16 m: ~0.5% here)."""
    hf_deq = tiny_hf_model("llama")
    hf_deq.load_state_dict({**hf.state_dict(), **deq})
    ref = kvserve_model_from_hf(hf_deq, "LlamaForCausalLM", get_ops("reference"))
    ours, theirs = _logits(model, PROMPT), _logits(ref, PROMPT)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err < 0.02, err
    return ours


@pytest.mark.parametrize("fmt, act_order, bits", [("gptq", False, 4), ("gptq", True, 4),
                                                 ("awq", False, 4), ("gptq", False, 8),
                                                 ("gptq", True, 8)])
def test_checkpoint_loads_to_the_dequantized_model(tmp_path: Path, fmt: str, act_order: bool,
                                                   bits: int) -> None:
    hf = tiny_hf_model("llama")
    deq = write_checkpoint(tmp_path, hf, fmt, act_order, bits)
    ckpt = load_checkpoint(str(tmp_path))
    assert dict(ckpt.model_config.quantization_config)["quant_method"] == fmt
    ops = get_ops("auto")
    model = build_model(ckpt, ops, torch.float32, fmt)
    # The repacked blocks are the checkpoint's weights: d = scale, m = -scale * zero (m
    # rounded to float16, the only change), in the layer's own input order.
    lin, got = repacked_qkv(model, bits)
    method = lin.quant_method
    want = torch.cat([deq[f"model.layers.1.self_attn.{p}.weight"]
                      for p in ("q_proj", "k_proj", "v_proj")])
    if act_order:
        assert method.perm is not None and method.kernel_weights(lin)[0].perm is method.perm
        want = want[:, method.perm]
    assert torch.allclose(got, want, rtol=0, atol=2e-3 * want.abs().max())
    # The float output layer stays at the checkpoint's float16 (half the bytes a decode
    # step streams), its values as written.
    head = hf.state_dict().get("lm_head.weight", hf.state_dict()["model.embed_tokens.weight"])
    assert model.lm_head.weight.dtype == torch.float16
    assert torch.equal(model.lm_head.weight, head.half())
    # The whole model: the logits of the float model holding the dequantized weights.
    near_dequantized(model, hf, deq)


@pytest.mark.parametrize("isa", ["avx2", None], ids=["avx2", "native"])
def test_act_order_layers_run_in_the_fused_stack(tmp_path: Path, isa: str | None) -> None:
    """An act-order checkpoint's layers gather their inputs in group order inside the C++
    layer stack (KernelWeight.perm) as in the Python layers (index_select): the same logits
    bit for bit, on each ISA, a prefill and a decode step."""
    from kvserve.ops.cpu import CpuOps

    hf = tiny_hf_model("llama")
    write_checkpoint(tmp_path, hf, "gptq", act_order=True)
    ckpt = load_checkpoint(str(tmp_path))
    fused_ops, plain_ops = CpuOps(isa=isa), CpuOps(isa=isa, fuse_layers=False)
    logits = []
    for ops in (fused_ops, plain_ops):
        model = build_model(ckpt, ops, torch.float32, "gptq")
        assert model.layers[0].mlp.down_proj.quant_method.perm is not None
        runner = PagedSequence(model)
        seq = runner.new_seq()
        logits.append((runner.forward({seq: PROMPT})[0], runner.forward({seq: [7]})[0]))
    assert [s for s in fused_ops._stacks.values() if s is not None]  # the stack ran them
    assert not plain_ops._stacks
    assert all(torch.equal(a, b) for a, b in zip(*logits))


def test_groups_of_128_run_with_their_scales_once(tmp_path: Path) -> None:
    """A per-channel GPTQ checkpoint (group_size -1): the linears of 128 inputs (down_proj)
    are held as Q4_1_128, one (d, m) per 4 blocks, those of 64 as Q4_1. The model gives the
    dequantized float model's logits within the int8 activations' error, and the very bits of
    the same model with those weights widened back to Q4_1 (fused layer stack included)."""
    hf = tiny_hf_model("llama")
    deq = write_checkpoint(tmp_path, hf, "gptq", group=-1)
    ckpt = load_checkpoint(str(tmp_path))
    model, widened = (build_model(ckpt, get_ops("auto"), torch.float32, "gptq")
                      for _ in range(2))
    for layer in model.layers:
        assert layer.mlp.down_proj.quant_method.wtype == Q4_1_128
        assert layer.mlp.gate_up_proj.quant_method.wtype == Q4_1
        assert layer.self_attn.qkv_proj.quant_method.wtype == Q4_1
    ours = near_dequantized(model, hf, deq)
    for layer in widened.layers:
        lin = layer.mlp.down_proj
        lin.weight = torch.nn.Parameter(widen(lin.weight), requires_grad=False)
        lin.quant_method.wtype = Q4_1
    assert torch.equal(_logits(widened, PROMPT), ours)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_quantized_lm_head_loads_to_the_dequantized_model(tmp_path: Path, fmt: str) -> None:
    """`lm_head: true` (GPTQModel's; vLLM reads it for GPTQ and AWQ): lm_head's tensors are in
    the format's layout, held 4-bit, and the model gives the dequantized model's logits."""
    hf = tiny_hf_model("llama")
    deq = write_checkpoint(tmp_path, hf, fmt, lm_head=True)
    assert "lm_head.weight" in deq  # quantized: the dequantized values differ from hf's
    assert not torch.equal(deq["lm_head.weight"], hf.state_dict()["lm_head.weight"])
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, fmt)
    assert isinstance(model.lm_head.quant_method, Int4CheckpointLinearMethod)
    assert model.lm_head.quant_method.wtype == Q4_1 and model.lm_head.weight.dtype == torch.uint8
    near_dequantized(model, hf, deq)


# GPTQModel's `dynamic`: the first pattern that matches a module's name decides.
DYNAMIC = {r"-:.*\.0\.self_attn\.o_proj": None,  # float (GPTQModel writes {}: below)
           # layer 1's MLP at 8 bits (its down_proj too); keys vLLM's override_config does not
           # take, or of another type, are ignored as there
           r"+:.*\.1\.mlp\.": {"bits": 8, "group_size": None, "damp_percent": 0.1},
           r".*down_proj": {"group_size": 64}}  # no prefix: positive


def _dynamic_as_written(module: str) -> tuple[int, int] | None:
    """DYNAMIC read by hand for the tiny llama's modules: what each is written with."""
    if module == "model.layers.0.self_attn.o_proj":
        return None
    if module.startswith("model.layers.1.mlp."):
        return 8, GROUP
    return (4, 64) if module.endswith("down_proj") else (4, GROUP)


def _held(model: Any) -> dict[str, tuple[str, int] | torch.dtype]:
    """Each decoder layer's linears as held: (format, group) quantized, else the float dtype."""
    from kvserve.quant.base import UnquantizedLinearMethod

    held: dict[str, tuple[str, int] | torch.dtype] = {}
    for i, layer in enumerate(model.layers):
        for name, lin in (("qkv_proj", layer.self_attn.qkv_proj),
                          ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", layer.mlp.gate_up_proj),
                          ("down_proj", layer.mlp.down_proj)):
            m = lin.quant_method
            if isinstance(m, UnquantizedLinearMethod):
                held[f"{i}.{name}"] = lin.weight.dtype
            else:
                assert isinstance(m, Int4CheckpointLinearMethod)
                held[f"{i}.{name}"] = ({Q4_1: "Q4_1", Q8_0: "Q8_0"}[m.wtype], m.group_size)
    return held


def test_gptqmodel_dynamic_overrides_are_followed(tmp_path: Path) -> None:
    """A GPTQModel checkpoint whose `dynamic` keeps one module in float and quantizes others
    at other bits and group sizes, in pattern order (vLLM reads it the same way): each layer
    is held as written, the float one at float16, and the model gives the logits of the float
    model holding the dequantized weights, through the fused layer stack."""
    hf = tiny_hf_model("llama")
    deq = write_checkpoint(tmp_path, hf, "gptq", qc_overrides={"dynamic": DYNAMIC},
                           stored=_dynamic_as_written)
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, "gptq")
    assert _held(model) == {
        "0.qkv_proj": ("Q4_1", 32), "0.o_proj": torch.float16, "0.gate_up_proj": ("Q4_1", 32),
        "0.down_proj": ("Q4_1", 64), "1.qkv_proj": ("Q4_1", 32), "1.o_proj": ("Q4_1", 32),
        "1.gate_up_proj": ("Q8_0", 32), "1.down_proj": ("Q8_0", 32)}
    o_proj = model.layers[0].self_attn.o_proj.weight
    assert torch.equal(o_proj.float(), deq["model.layers.0.self_attn.o_proj.weight"])
    near_dequantized(model, hf, deq)


@pytest.mark.parametrize("fmt, overrides, floats, held_float", [
    # transformers' GPTQConfig: only the modules named (whole names or fragments) quantized
    ("gptq", {"modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.q_proj"], ["mlp.down_proj"]]},
     ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"),
     {"0.o_proj", "1.o_proj", "0.gate_up_proj", "1.gate_up_proj"}),
    # AutoAWQ: a module whose name contains an entry stays float
    ("awq", {"modules_to_not_convert": ["layers.1.self_attn"]},
     ("1.self_attn.q_proj", "1.self_attn.k_proj", "1.self_attn.v_proj", "1.self_attn.o_proj"),
     {"1.qkv_proj", "1.o_proj"}),
])
def test_modules_a_checkpoint_keeps_in_float_load_as_float(
        tmp_path: Path, fmt: str, overrides: dict[str, Any], floats: tuple[str, ...],
        held_float: set[str]) -> None:
    hf = tiny_hf_model("llama")
    deq = write_checkpoint(tmp_path, hf, fmt, qc_overrides=overrides, stored=lambda m: (
        None if m.endswith(floats) else (4, GROUP)))
    model = build_model(load_checkpoint(str(tmp_path)), get_ops("auto"), torch.float32, fmt)
    held = _held(model)
    assert {k for k, v in held.items() if v == torch.float16} == held_float
    assert all(v == ("Q4_1", GROUP) for k, v in held.items() if k not in held_float)
    near_dequantized(model, hf, deq)


def test_a_fused_layer_whose_modules_differ_is_named(tmp_path: Path) -> None:
    """kvserve runs q / k / v as one layer: a checkpoint that keeps only q_proj in float is
    refused, naming the layer and what each module is."""
    write_checkpoint(tmp_path, tiny_hf_model("llama"), "gptq",
                     qc_overrides={"dynamic": {r"-:.*\.1\.self_attn\.q_proj": {}}},
                     stored=lambda m: None if m == "model.layers.1.self_attn.q_proj"
                     else (4, GROUP))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj: kvserve runs 3 "
                                         r"checkpoint modules as this one layer, and the "
                                         r"checkpoint stores them differently \(q_proj float, "
                                         r"k_proj 4-bit group 32, v_proj 4-bit group 32\)"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, "gptq")


@pytest.mark.parametrize("fmt, alias", [("gptq", "gptq_marlin"), ("awq", "awq_marlin")])
def test_vllms_marlin_names_run_the_checkpoint(tmp_path: Path, fmt: str, alias: str) -> None:
    """vLLM's names for GPTQ / AWQ on its Marlin kernels, which scripts pass, run the
    checkpoint as the method's own name does (CLI and API)."""
    import argparse

    from kvserve import LLM, SamplingParams
    from kvserve.engine_args import EngineArgs

    write_checkpoint(tmp_path, tiny_hf_model("llama"), fmt)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for name in (alias, fmt):
        llm = LLM(model=str(tmp_path), quantization=name, max_model_len=64)
        assert llm.llm_engine.config.quant.method == fmt
        tokens[name] = llm.generate(["t5 t6 t7"], params)[0].outputs[0].token_ids
    assert tokens[alias] == tokens[fmt] and len(tokens[fmt]) == 6
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert p.parse_args(["--quantization", alias]).quantization == alias


@pytest.mark.parametrize("fmt, overrides, match", [
    ("gptq", {"bits": 3}, "kvserve loads 4 and 8-bit GPTQ"),
    ("awq", {"bits": 8}, "AWQ checkpoint has bits=8; kvserve loads 4-bit AWQ"),
    ("gptq", {"group_size": 48}, "group_size=48; kvserve needs -1 or a positive multiple"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ("awq", {"version": "gemv"}, "version='gemv'; kvserve loads the GEMM layout"),
    ("awq", {"zero_point": False}, "zero_point=false"),
    # a per-module override kvserve does not run is named with its module
    ("gptq", {"dynamic": {r"+:.*\.1\.mlp\.down_proj": {"bits": 2}}},
     r"model.layers.1.mlp.down_proj: GPTQ checkpoint has bits=2; kvserve loads 4 and 8-bit"),
])
def test_unsupported_settings_name_what_was_found(tmp_path: Path, fmt: str,
                                                  overrides: dict[str, Any], match: str) -> None:
    write_checkpoint(tmp_path, tiny_hf_model("llama"), fmt, qc_overrides=overrides)
    with pytest.raises(ValueError, match=match):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, fmt)


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    write_checkpoint(tmp_path, tiny_hf_model("llama"), "gptq")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.qzeros"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="missing tensors: model.layers.0.mlp.up_proj.qzeros"):
        load_checkpoint(str(tmp_path))
    bad = dict(tensors)
    bad["model.layers.1.self_attn.o_proj.scales"] = torch.zeros(3, 64, dtype=torch.float16)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj shard 0: scales must be torch.float16 "
                                         r"\[2, 64\], found torch.float\d+ \[3, 64\]"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, "gptq")


def test_an_unquantized_load_of_a_quantized_checkpoint_says_why(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_hf_model("llama"), "awq")
    with pytest.raises(ValueError, match="'qweight' has no place .* needs its quantization "
                                         "method"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, "none")


def test_asymmetric_8_bit_that_int8_blocks_cannot_hold_is_named(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama")
    write_checkpoint(tmp_path, hf, "gptq", bits=8)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    # An asymmetric 8-bit export: q from 0, zeros at 1 (stored 0): q - zero up to 254.
    name = "model.layers.0.self_attn.o_proj"
    tensors[f"{name}.qzeros"] = torch.zeros_like(tensors[f"{name}.qzeros"])
    tensors[f"{name}.qweight"] = torch.full_like(tensors[f"{name}.qweight"], -1)  # all 255
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj: 8-bit weights q - zero span \[254, 254\]; "
                                         r"kvserve runs 8-bit weights as int8 blocks"):
        build_model(load_checkpoint(str(tmp_path)), get_ops("reference"), torch.float32, "gptq")
