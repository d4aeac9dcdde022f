"""Quantized checkpoints on a backend without kvserve's CPU kernels: the torch backend here,
CUDA in tests/cuda/test_cuda_quant.py, which runs these same tests on the GPU.

GPTQ (4 and 8 bits, act-order, lm_head at 8 bits, a layer kept in float by `dynamic`) and
AWQ checkpoints, written by `kvserve quantize` in their standard layouts, load in float32
and in bfloat16 and give the logits of an HF model holding
the weights this file unpacks on its own (tests/e2e/test_quantize_cli.py's reader). A W8A8
(compressed-tensors) checkpoint stays int8 there: ops.int8_linear, which equals the packed
kernels' integer oracle to float rounding.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvserve import LLM
from kvserve.ops import get_ops
from kvserve.quant.block_pack import Q4_1, Q8_0, W8A8, pack, qlinear_reference
from kvserve.quant.rtn import int4_to_q4_1, int8_to_q8_0, quantize_int4, quantize_int8
from kvserve.sampling_params import SamplingParams
from tests.e2e.test_quantize_cli import (
    LINEARS,
    _dequantize,
    _quantize,
    _tensors,
    tiny_dir,  # noqa: F401  (a fixture)
)
from tests.helpers import tiny_hf_model

CALIB = Path(__file__).resolve().parents[2] / "README.md"  # any text will do; it travels
FLOAT_LAYER = "model.layers.0.self_attn.o_proj"  # kept in float by gptq-float-layer
PROMPT = list(b"Everyone is permitted to copy and distribute verbatim copies")


@pytest.fixture(scope="module")
def target() -> tuple[str, str]:
    """(device, ops backend): tests/cuda overrides it with ("cuda", "auto")."""
    return "cpu", "torch"


@pytest.fixture(scope="module")
def checkpoints(tiny_dir: tuple[Path, Any],  # noqa: F811
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src, _ = tiny_dir
    out = {}
    for name, args in {"gptq": ["--method", "gptq"],
                       "gptq-act-order-sym": ["--method", "gptq", "--act-order", "--sym"],
                       "gptq-8bit": ["--method", "gptq", "--bits", "8"],
                       "gptq-head8": ["--method", "gptq", "--lm-head-bits", "8"],
                       "awq": ["--method", "awq"],
                       "w8a8": ["--method", "smoothquant"]}.items():
        path = tmp_path_factory.mktemp(name)
        r = _quantize(str(src), *args, "--group-size", "32", "--calib", str(CALIB),
                      "--calib-tokens", "512", "--seq-len", "128", "-o", str(path / "q"))
        assert r.returncode == 0, r.stderr
        out[name] = path / "q"
    # A layer the checkpoint keeps in float (GPTQModel's `dynamic` "-:" rule): the GPTQ
    # export with layer 0's o_proj as its float16 values.
    out["gptq-float-layer"] = tmp_path_factory.mktemp("gptq-float-layer") / "q"
    shutil.copytree(out["gptq"], out["gptq-float-layer"])
    t = _tensors(out["gptq-float-layer"])
    t[f"{FLOAT_LAYER}.weight"] = _dequantize(t, FLOAT_LAYER, "gptq", 4).half().contiguous()
    for k in ("qweight", "qzeros", "scales", "g_idx"):
        del t[f"{FLOAT_LAYER}.{k}"]
    save_file(t, str(out["gptq-float-layer"] / "model.safetensors"))
    cfg_path = out["gptq-float-layer"] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["dynamic"] = {r"-:.*\.0\.self_attn\.o_proj": {}}
    cfg_path.write_text(json.dumps(cfg))
    return out


def _reference(path: Path, name: str) -> Any:
    """The HF model holding the checkpoint's weights as this file unpacks them (float32)."""
    t = _tensors(path)
    sd = {k: v.float() for k, v in t.items() if k.endswith(".weight") and v.is_floating_point()}
    for i in range(2):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            if name == "w8a8":
                sd[p + ".weight"] = t[p + ".weight"].float() * t[p + ".weight_scale"].float()
            elif p + ".qweight" in t:  # not a layer kept in float
                bits = 8 if name == "gptq-8bit" else 4
                sd[p + ".weight"] = _dequantize(t, p, name.split("-")[0], bits)
    if "lm_head.qweight" in t:
        sd["lm_head.weight"] = _dequantize(t, "lm_head", "gptq", 8)
    hf = tiny_hf_model("llama", seed=3)
    hf.load_state_dict(sd)
    return hf


def _prompt_logprobs(path: Path, target: tuple[str, str], dtype: str, **kw: Any
                     ) -> torch.Tensor:
    """PROMPT's logprobs from the engine on target (float64)."""
    device, ops = target
    # float32: a float32 KV cache too (these methods default to float16 there), so that
    # the weights alone are compared.
    kv = {"kv_cache_dtype": "auto"} if dtype == "float32" else {}
    llm = LLM(model=str(path), device=device, ops_backend=ops, dtype=dtype,
              kv_cache_memory="16MiB", **kv, **kw)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    return torch.tensor([d[PROMPT[i + 1]].logprob
                         for i, d in enumerate(out.prompt_logprobs[1:])]).double()


def _reference_logprobs(hf: Any) -> torch.Tensor:
    """PROMPT's logprobs from an HF model (float64)."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.double(), -1)[torch.arange(len(PROMPT) - 1),
                                                  torch.tensor(PROMPT[1:])]


@pytest.mark.parametrize("name", ["gptq", "gptq-act-order-sym", "gptq-8bit", "gptq-head8",
                                  "gptq-float-layer", "awq", "w8a8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_checkpoint_runs_without_the_cpu_kernels(
        checkpoints: dict[str, Path], target: tuple[str, str], name: str, dtype: str) -> None:
    ours = _prompt_logprobs(checkpoints[name], target, dtype)
    err = (ours - _reference_logprobs(_reference(checkpoints[name], name))).abs().max()
    # float32, measured: 4e-7 for the symmetric formats; ~3e-4 for the asymmetric ones, whose
    # Q4_1 repacking rounds each group's minimum -s * z to float16 (the CPU kernels' values
    # too); ~3e-3 for W8A8's int8 activations. bfloat16 (its cache too): ~2-4e-3.
    asym = name in ("gptq", "gptq-head8", "gptq-float-layer", "awq")
    limit = {"float32": 2e-2 if name == "w8a8" else 1e-3 if asym else 1e-5,
             "bfloat16": 2e-2}[dtype]
    assert err < limit, err


@pytest.mark.parametrize("name", ["gptq", "gptq-act-order-sym", "gptq-8bit", "awq"])
def test_4_bit_checkpoints_stay_4_bit(checkpoints: dict[str, Path], target: tuple[str, str],
                                      name: str) -> None:
    """In bfloat16, the 4-bit checkpoints' linears hold torch's int4 matmul weights (half a
    byte a weight, and a scale / zero pair per group of 32), not the model's dtype; 8-bit
    GPTQ is dequantized. What a layer computes is its checkpoint's weight (dense_weight: the
    int4 matmul of the identity)."""
    device, ops = target
    llm = LLM(model=str(checkpoints[name]), device=device, ops_backend=ops, dtype="bfloat16",
              kv_cache_memory="16MiB")
    model = llm.llm_engine.model
    ref = _reference(checkpoints[name], name)
    ref_weights = dict(ref.named_parameters())
    linears = [(n, m) for n, m in model.named_modules() if hasattr(m, "quant_method")
               and n != "lm_head"]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    for n, layer in linears:
        held = sum(p.numel() * p.element_size() for p in layer.parameters())
        weights = layer.in_features * layer.out_features
        if name == "gptq-8bit":
            assert layer.weight.dtype == torch.bfloat16, n
            continue
        assert layer.weight.dtype in (torch.uint8, torch.int32), n  # the device's tile layout
        assert held <= weights * (0.5 + 4 / 32) + 256, (n, held, weights)
        got = layer.quant_method.dense_weight(layer).cpu()
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                 "gate_up_proj": ["gate_proj", "up_proj"]}.get(n.rsplit(".", 1)[1])
        prefix = "model." + n.rsplit(".", 1)[0]
        want = torch.cat([ref_weights[f"{prefix}.{p}.weight"] for p in parts] if parts
                         else [ref_weights[f"model.{n}.weight"]])
        # The pairs as bfloat16: within 1/32 of a step of the checkpoint's values.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("bits", [8, 4])
def test_round_to_nearest_at_load_runs_without_the_cpu_kernels(
        tiny_dir: tuple[Path, Any], target: tuple[str, str], bits: int) -> None:  # noqa: F811
    """--quantization int8 / int4 on a float checkpoint: the HF model holding its weights
    rounded as kvserve rounds them (quantize_int8 / quantize_int4, held to gguf-py's decode in
    tests/unit/test_quant_rtn.py) and decoded by gguf-py; lm_head stays 8-bit under int4."""
    src, hf = tiny_dir
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for name, w in sd.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            if bits == 8 or name == "lm_head.weight":
                blocks, qtype = int8_to_q8_0(*quantize_int8(w)), Q8_0
            else:
                blocks, qtype = int4_to_q4_1(*quantize_int4(w, 32), 32), Q4_1
            out = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype))
            sd[name] = torch.from_numpy(np.ascontiguousarray(out, np.float32)).reshape(w.shape)
    ref_model = tiny_hf_model("llama", seed=3)
    ref_model.load_state_dict(sd)
    ours = _prompt_logprobs(src, target, "float32", quantization=f"int{bits}",
                            **({"quant_group_size": 32} if bits == 4 else {}))
    assert (ours - _reference_logprobs(ref_model)).abs().max() < 1e-5


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
def test_int8_linear_is_the_packed_kernels_oracle(target: tuple[str, str], m: int) -> None:
    """ops.int8_linear on an int8 weight [N, K] and its scales against qlinear_reference on
    the same weight packed as W8A8 blocks (the CPU kernels' bit-exact oracle): the same
    integers, the scales applied once rather than per 32-value block."""
    device, ops_name = target
    g = torch.Generator().manual_seed(m)
    w = torch.randn(48, 256, generator=g)
    x = torch.randn(m, 256, generator=g) * 3
    x[:, 7] *= 40  # an outlier channel, as LLM activations have
    bias = torch.randn(48, generator=g)
    q, s = quantize_int8(w)
    want = qlinear_reference(x, pack(int8_to_q8_0(q, s), Q8_0, 256), W8A8, 48, bias)
    ops = get_ops(ops_name, device)
    got = ops.int8_linear(x.to(device), q.to(device), s.to(device), bias.to(device))
    assert got.device.type == device
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4)
