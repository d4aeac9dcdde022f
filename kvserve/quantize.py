"""`kvserve quantize MODEL --method {int8,int4,gptq,awq,smoothquant} -o DIR`: a float (or
GGUF) checkpoint written as a quantized safetensors checkpoint in a standard layout
(kvserve/quant/export.py, the tensors' layouts kvserve/quant/int4_layouts.py):

    gptq        GPTQ (kvserve/quant/gptq.py; --act-order, --static-groups as AutoGPTQ's),
                AutoGPTQ "gptq" v1 layout, bits 4 or 8
    awq         AWQ (kvserve/quant/awq.py: AutoAWQ's scale search, duo_scaling unless
                --no-awq-duo-scaling; --awq-clip adds its clip search), AutoAWQ GEMM
                layout, bits 4
    smoothquant SmoothQuant W8A8 (kvserve/quant/smoothquant.py, --alpha): norms smoothed
                into q/k/v and gate/up, int8 weights per channel, compressed-tensors
                "int-quantized" layout (activations int8 per token at run time)
    int4, int8  round to nearest on GPTQ's grid, no calibration, written in the same GPTQ
                layout (desc_act false) at 4 / 8 bits: a GPTQ reader loads them as it
                loads GPTQ. (Not rtn.py's Q4_1 arithmetic: its float per-group minimum has
                no place in a layout with integer zero points.)

`--format compressed-tensors` writes gptq / awq / int4 / int8 instead in llm-compressor's
weight-only "pack-quantized" layout (W4A16 / W8A16), which vLLM serves as it serves
llm-compressor's own.

Every linear of every decoder layer is quantized; embeddings, norms, biases and lm_head
stay float, written as float16 (the layouts' scale type, and what AutoGPTQ / AutoAWQ
checkpoints hold). `--lm-head` (gptq, int4, int8; GPTQModel's lm_head=True) quantizes
lm_head too, GPTQ from the final norm's calibration outputs: the checkpoint then holds an
untied lm_head (`tie_word_embeddings` false, the embedding kept in float16) and says so
(`lm_head: true`, or no lm_head in compressed-tensors' ignore list), as vLLM reads it;
`--lm-head-bits` quantizes it at other bits than the layers (GPTQModel's `dynamic`
override for lm_head, or a compressed-tensors config group targeting it).

The flags' rules (which method writes which layout, what each option needs) are
kvserve/quant/quantize_args.py's `QuantizeArgs`.

GPTQ quantizes sequentially, as AutoGPTQ with true_sequential: within a layer q/k/v, then
o, then gate/up, then down, each from inputs computed with everything before it already
quantized, and each layer from the quantized layers before it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.quant.quantize_args import CALIBRATED, METHODS, QuantizeArgs

if TYPE_CHECKING:
    from kvserve.quant.gptq import QuantizedLinear

log = logging.getLogger(__name__)

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
LINEARS = (*ATTN, "self_attn.o_proj", *MLP_IN, "mlp.down_proj")


def _split_rows(ql: QuantizedLinear, sizes: tuple[int, ...]) -> list[QuantizedLinear]:
    """A row-stacked QuantizedLinear (q/k/v, gate/up) back into one per linear."""
    from kvserve.quant.gptq import QuantizedLinear

    out, start = [], 0
    for n in sizes:
        out.append(QuantizedLinear(ql.q[start:start + n], ql.scales[start:start + n],
                                   ql.zeros[start:start + n], ql.g_idx, ql.bits,
                                   ql.group_size))
        start += n
    return out


def _gptq_layer(lw: dict[str, torch.Tensor], x: torch.Tensor, mc: ModelConfig,
                rope: tuple[torch.Tensor, torch.Tensor], a: QuantizeArgs
                ) -> tuple[dict[str, QuantizedLinear], torch.Tensor]:
    """GPTQ of one layer in AutoGPTQ's true-sequential order; returns (quantized linears by
    name, the layer's output computed with them). lw is updated to the dequantized weights."""
    from kvserve.quant.calibration import attention_core, mlp_core, rms_norm
    from kvserve.quant.gptq import gptq_quantize, hessian

    eps = mc.rms_norm_eps
    result: dict[str, QuantizedLinear] = {}

    def run(names: tuple[str, ...], inputs: torch.Tensor) -> None:
        ws = [lw[f"{n}.weight"] for n in names]
        ql = gptq_quantize(torch.cat(ws), hessian(inputs), a.bits, a.group_size, a.sym,
                           a.act_order, static_groups=a.static_groups, mse=a.mse)
        for n, part in zip(names, _split_rows(ql, tuple(w.shape[0] for w in ws)), strict=True):
            result[n] = part
            lw[f"{n}.weight"] = part.dequantize()

    h = rms_norm(x, lw["input_layernorm.weight"], eps)
    run(ATTN, h)
    o_in = attention_core(h, lw, mc, rope)
    run(("self_attn.o_proj",), o_in)
    x = x + F.linear(o_in, lw["self_attn.o_proj.weight"])
    h = rms_norm(x, lw["post_attention_layernorm.weight"], eps)
    run(MLP_IN, h)
    d_in = mlp_core(h, lw)
    run(("mlp.down_proj",), d_in)
    return result, x + F.linear(d_in, lw["mlp.down_proj.weight"])


def _lm_head(weights: dict[str, torch.Tensor], x: torch.Tensor | None, mc: ModelConfig,
             a: QuantizeArgs) -> QuantizedLinear:
    """lm_head (a tied model's: the embedding) quantized as the layers were: GPTQ from the
    final norm of the last layer's calibration outputs (x), else round to nearest."""
    from kvserve.quant.calibration import rms_norm
    from kvserve.quant.gptq import gptq_quantize, hessian, rtn_quantize

    assert a.group_size is not None
    w = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    if a.method != "gptq":
        return rtn_quantize(w, a.head_bits, a.group_size, a.head_sym, a.mse)
    assert x is not None
    h = rms_norm(x, weights["model.norm.weight"], mc.rms_norm_eps)
    return gptq_quantize(w, hessian(h), a.head_bits, a.group_size, a.head_sym, a.act_order,
                         static_groups=a.static_groups, mse=a.mse)


def _smoothquant(weights: dict[str, torch.Tensor], x: torch.Tensor, mc: ModelConfig,
                 rope: tuple[torch.Tensor, torch.Tensor], alpha: float
                 ) -> dict[str, torch.Tensor]:
    """SmoothQuant's tensors: every layer smoothed from its float calibration inputs, then
    each linear as int8 `weight` and float16 `weight_scale` [N, 1] (compressed-tensors);
    the rest in float16."""
    from kvserve.quant.rtn import quantize_int8
    from kvserve.quant.smoothquant import smooth_model

    t0 = time.perf_counter()
    smoothed = smooth_model(weights, x, mc, rope, alpha, progress=lambda i: log.info(
        "layer %d/%d smoothed (%.1fs)", i + 1, mc.num_hidden_layers, time.perf_counter() - t0))
    linears = {f"model.layers.{i}.{n}.weight" for i in range(mc.num_hidden_layers)
               for n in LINEARS}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in smoothed.items():
        if name in linears:
            q, s = quantize_int8(tensor)
            out[name] = q
            out[name[:-len("weight")] + "weight_scale"] = s.to(torch.float16)[:, None]
        else:
            out[name] = tensor.to(torch.float16)
    return out


def quantize_checkpoint(model: str, out_dir: str, a: QuantizeArgs) -> None:
    """Reads MODEL (a .gguf file or HF directory, or the default model's name), quantizes it
    as `a` says and writes out_dir (which must not exist or be empty)."""
    from kvserve.loader import load_checkpoint, resolve_model
    from kvserve.quant import export, int4_layouts
    from kvserve.quant.awq import awq_clip_layer, awq_group_quantize, awq_scale_layer
    from kvserve.quant.calibration import (
        calibration_batch,
        layer_forward,
        layer_weights,
        rope_tables,
    )
    from kvserve.quant.gptq import rtn_quantize

    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"output {out_dir!r} exists and is not an empty directory")
    path = resolve_model(model)
    ckpt = load_checkpoint(path)
    mc = ckpt.model_config
    a = a.for_model(mc)
    source_cfg = None
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            source_cfg = json.load(f)
    weights = {k: v.float() for k, v in ckpt.weights()}

    x = rope = None
    if a.method in CALIBRATED:
        assert a.calib is not None
        with open(a.calib, encoding="utf-8") as f:
            ids = calibration_batch(ckpt.tokenizer, f.read(), a.calib_tokens, a.seq_len)
        log.info("calibration: %d windows of %d tokens from %s", ids.shape[0], ids.shape[1],
                 a.calib)
        widest = max(mc.hidden_size, mc.intermediate_size, mc.num_attention_heads * mc.head_dim)
        if a.method == "gptq" and ids.numel() < widest:
            # Measured on Qwen2.5-0.5B (down_proj 4864 inputs), 2048 tokens: GPTQ's error on
            # its calibration text 5-25x below RTN's, on other text up to 2x above it.
            log.warning("GPTQ on %d calibration tokens for linears of up to %d inputs: "
                        "their Hessians are rank-deficient and GPTQ fits the calibration text, "
                        "possibly worse than round to nearest on other text; give --calib a "
                        "longer text like the model's traffic (and --calib-tokens)",
                        ids.numel(), widest)
        x = weights["model.embed_tokens.weight"][ids]
        rope = rope_tables(mc, ids.shape[1])
    if a.method == "smoothquant":
        assert x is not None and rope is not None
        out = _smoothquant(weights, x, mc, rope, a.alpha)
        export.write_checkpoint(out_dir, out, export.hf_config(mc, source_cfg),
                                export.w8a8_quantization_config(), ckpt.tokenizer)
        log.info("wrote %s (smoothquant W8A8, alpha %.2f)", out_dir, a.alpha)
        return
    assert a.group_size is not None

    sym = a.sym and a.method != "awq"  # AWQ's grid always has zero points

    def pack(ql: QuantizedLinear, sym: bool = sym) -> dict[str, torch.Tensor]:
        """One linear's tensors in the layout (sym: its grid's, compressed-tensors)."""
        if a.format == "awq":
            return int4_layouts.pack_awq(ql)
        if a.format == "gptq":
            return int4_layouts.pack_gptq(ql)
        return int4_layouts.pack_compressed_tensors(ql, sym)

    out: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    for i in range(mc.num_hidden_layers):
        lw = layer_weights(weights, i)
        if a.method == "gptq":
            assert x is not None and rope is not None
            qls, x = _gptq_layer(lw, x, mc, rope, a)
        elif a.method == "awq":
            assert x is not None and rope is not None
            scaled = awq_scale_layer(lw, x, mc, rope, a.bits, a.group_size,
                                     duo_scaling=a.awq_duo_scaling)
            if a.awq_clip:
                scaled = awq_clip_layer(scaled, x, mc, rope, a.bits, a.group_size)
            x = layer_forward(x, lw, mc, rope)  # AWQ: the next layer sees float inputs
            lw = scaled
            qls = {n: awq_group_quantize(lw[f"{n}.weight"], a.bits, a.group_size)
                   for n in LINEARS}
        else:
            qls = {n: rtn_quantize(lw[f"{n}.weight"], a.bits, a.group_size, a.sym, a.mse)
                   for n in LINEARS}
        prefix = f"model.layers.{i}."
        for name, tensor in lw.items():
            if name.endswith(".weight") and name[:-len(".weight")] in qls:
                continue
            out[prefix + name] = tensor.to(torch.float16)  # norms, biases
        for name, ql in qls.items():
            for suffix, tensor in pack(ql).items():
                out[f"{prefix}{name}.{suffix}"] = tensor
        log.info("layer %d/%d quantized (%.1fs)", i + 1, mc.num_hidden_layers,
                 time.perf_counter() - t0)
    if a.lm_head:
        for suffix, tensor in pack(_lm_head(weights, x, mc, a), a.head_sym).items():
            out[f"lm_head.{suffix}"] = tensor
        log.info("lm_head quantized (%.1fs)", time.perf_counter() - t0)
    for name, tensor in weights.items():
        if not name.startswith("model.layers.") and not (a.lm_head and name == "lm_head.weight"):
            out[name] = tensor.to(torch.float16)  # embeddings, final norm, a float lm_head

    if a.format == "compressed-tensors":
        qcfg = export.compressed_tensors_wna16_config(a.bits, a.group_size, sym, a.act_order,
                                                      lm_head=a.lm_head)
    elif a.method == "awq":
        qcfg = export.awq_quantization_config(a.group_size)
    else:
        qcfg = export.gptq_quantization_config(a.bits, a.group_size, a.sym, a.act_order,
                                               a.static_groups, mse=a.mse, lm_head=a.lm_head)
    if a.lm_head and (a.head_bits, a.head_sym) != (a.bits, sym):
        export.set_lm_head_grid(qcfg, a.head_bits, a.head_sym)
    config = export.hf_config(mc, source_cfg)
    if a.lm_head:  # its own quantized tensor; the embedding stays float
        config["tie_word_embeddings"] = False
    export.write_checkpoint(out_dir, out, config, qcfg, ckpt.tokenizer)
    log.info("wrote %s (%s, %d bits, group %d, %s layout%s)", out_dir, a.method, a.bits,
             a.group_size, a.format,
             f", lm_head quantized ({a.head_bits} bits)" if a.lm_head else "")


def _run(ns: argparse.Namespace) -> int:
    bits = ns.bits if ns.bits is not None else (8 if ns.method in ("int8", "smoothquant")
                                                 else 4)
    a = QuantizeArgs(method=ns.method, bits=bits, group_size=ns.group_size, sym=ns.sym,
                     act_order=ns.act_order, static_groups=ns.static_groups, mse=ns.mse,
                     calib=ns.calib,
                     calib_tokens=ns.calib_tokens, seq_len=ns.seq_len, alpha=ns.alpha,
                     awq_clip=ns.awq_clip, awq_duo_scaling=ns.awq_duo_scaling,
                     format=ns.format, lm_head=ns.lm_head or ns.lm_head_bits is not None,
                     lm_head_bits=ns.lm_head_bits)
    with torch.inference_mode():
        quantize_checkpoint(ns.model, ns.output, a)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a GPTQ / AWQ / int4 / int8 / SmoothQuant W8A8 "
                       "safetensors checkpoint of a model")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, an HF directory, or smollm2-135m (the default)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--format", default=None, choices=["gptq", "awq", "compressed-tensors"],
                   help="the checkpoint layout: gptq (AutoGPTQ v1; the default of gptq, int4, "
                   "int8), awq (AutoAWQ GEMM; awq's default) or compressed-tensors "
                   "(llm-compressor's pack-quantized W4A16 / W8A16; smoothquant's int-quantized "
                   "W8A8, its only one)")
    p.add_argument("--bits", type=int, default=None,
                   help="4 or 8 (default: 8 for int8, else 4; awq: 4 only)")
    p.add_argument("--group-size", type=int, default=None,
                   help="inputs per scale / zero point; must divide every linear's input "
                   "width (default: the largest of 128, 64, 32 that does)")
    p.add_argument("--sym", action="store_true",
                   help="symmetric grid (zero point at the middle); default asymmetric")
    p.add_argument("--act-order", action="store_true",
                   help="gptq: quantize columns in descending Hessian diagonal (desc_act)")
    p.add_argument("--static-groups", action="store_true",
                   help="gptq: fix every group's grid from the weights before any update, "
                   "groups being runs of --group-size input columns also with --act-order "
                   "(AutoGPTQ's static_groups; the checkpoint's g_idx stays in order)")
    p.add_argument("--mse", type=float, default=0.0, metavar="NORM",
                   help="gptq, int4, int8: choose each group's range by the shrink (1 down to "
                   "0.21 of min / max) whose rounding error |w - w_q|^NORM is least, as GPTQ's "
                   "own quantizer with mse=True (GPTQModel's mse; 2.4 is GPTQ's norm); "
                   "default 0: the plain min / max range. Qwen2.5-Coder-0.5B at group 128, "
                   "GPL-3 perplexity: int4 6.99 -> 6.79, gptq 5.94 -> 6.08 (BENCHMARKS.md)")
    p.add_argument("--awq-clip", action="store_true",
                   help="awq: after the scale search, AutoAWQ's per-group clip search (off by "
                   "default: on Qwen2.5-Coder-0.5B it lowered each block's error yet raised "
                   "the model's perplexity; BENCHMARKS.md)")
    p.add_argument("--awq-duo-scaling", action=argparse.BooleanOptionalAction, default=True,
                   help="awq: scale candidates from the activations' and the weights' "
                   "magnitudes (AutoAWQ's duo_scaling, the default); --no-awq-duo-scaling: "
                   "from the activations' alone (the paper's)")
    p.add_argument("--lm-head", action="store_true",
                   help="gptq, int4, int8: quantize lm_head too (GPTQModel's lm_head=True), "
                   "written untied beside a float16 embedding. A decode step reads the "
                   "output layer in full: on Qwen2.5-Coder-0.5B at group 128 it is most of "
                   "the step (BENCHMARKS.md)")
    p.add_argument("--lm-head-bits", type=int, default=None, choices=(4, 8),
                   help="--lm-head at these bits instead of --bits (implies --lm-head): "
                   "GPTQModel's `dynamic` override for lm_head, or a compressed-tensors "
                   "config group of its own. Qwen2.5-Coder-0.5B, 4-bit layers: lm_head at 8 "
                   "bits adds 0.03%% perplexity to the float16 lm_head's, at 4 bits 1%% "
                   "(BENCHMARKS.md)")
    p.add_argument("--calib", default=None,
                   help="calibration text file (gptq, awq, smoothquant)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="smoothquant: how much of the activations' range moves into the "
                   "weights, in [0, 1] (default 0.5, the paper's)")
    p.add_argument("--calib-tokens", type=int, default=None,
                   help="calibration tokens, in windows of --seq-len spread over the text "
                   "(default: 8192, or all the text's whole windows where it holds fewer)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("-o", "--output", required=True, help="the directory to write")
    p.set_defaults(func=_run)
