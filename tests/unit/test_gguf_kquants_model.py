"""Q4_K_M-, Q5_K_M-, Q3_K_M-, Q2_K-, IQ4_XS- and IQ4_NL-like GGUF files under quantization
"gguf": every K-quant (and IQ4_XS) matrix stays packed for the K-quant kernels, every IQ4_NL
one for the 32-weight block kernels (a fused projection mixing types in runs of one type
each), the model's logits stay near the float model's on the same blocks dequantized (what
int8 activations cost), and the fused C++ stack equals the Python layers bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.ops.cpu import CpuOps
from kvserve.ops.reference import ReferenceOps
from kvserve.quant import get_quant_method, quant_config
from kvserve.quant.gguf import GGUFLinearMethod
from kvserve.quant.gguf_weights import KQUANT_TYPES
from tests.helpers import PagedSequence
from tests.unit.test_loader import write_gguf

N_LAYERS = 2
Q4_K_M = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
          "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v / ffn_down a _M file
    keeps at Q6_K: of 2 layers, the last."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q5_k_m(i: int) -> dict[str, Q]:
    more = Q.Q6_K if _use_more_bits(i, N_LAYERS) else Q.Q5_K
    return {"attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_v": more, "attn_output": Q.Q5_K,
            "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K, "ffn_down": more}


def _q3_k_m(i: int) -> dict[str, Q]:
    down = Q.Q4_K if _use_more_bits(i, N_LAYERS) else Q.Q3_K
    return {"attn_q": Q.Q3_K, "attn_k": Q.Q3_K, "attn_v": Q.Q5_K, "attn_output": Q.Q4_K,
            "ffn_gate": Q.Q3_K, "ffn_up": Q.Q3_K, "ffn_down": down}


Q2_K_FILE = {"attn_q": Q.Q2_K, "attn_k": Q.Q2_K, "attn_v": Q.Q3_K, "attn_output": Q.Q3_K,
             "ffn_gate": Q.Q2_K, "ffn_up": Q.Q2_K, "ffn_down": Q.Q3_K}

# attn_v at Q5_K, as llama-quantize wrote the Qwen2.5-Coder 1.5B IQ4_XS file of the benchmarks
IQ4_XS_FILE = {"attn_q": Q.IQ4_XS, "attn_k": Q.IQ4_XS, "attn_v": Q.Q5_K, "attn_output": Q.IQ4_XS,
               "ffn_gate": Q.IQ4_XS, "ffn_up": Q.IQ4_XS, "ffn_down": Q.IQ4_XS}


def _iq4_nl(i: int) -> dict[str, Q]:
    """As llama-quantize wrote the default model's IQ4_NL file: IQ4_NL throughout, ffn_down
    at Q5_K in the layers _use_more_bits picks."""
    down = Q.Q5_K if _use_more_bits(i, N_LAYERS) else Q.IQ4_NL
    return {**{t: Q.IQ4_NL for t in Q4_K_M}, "ffn_down": down}


# file kind -> layer -> tensor -> type, after llama.cpp's choices for 2 layers of 2 KV heads
# (llama-quant.cpp); output.weight is Q6_K in all, as llama.cpp writes it
FILES = {"Q4_K_M": lambda i: Q4_K_M, "Q5_K_M": _q5_k_m, "Q3_K_M": _q3_k_m,
         "Q2_K": lambda i: Q2_K_FILE, "IQ4_XS": lambda i: IQ4_XS_FILE, "IQ4_NL": _iq4_nl}


def _write(tmp_path: Path, kind: str) -> tuple[Path, dict[str, Q]]:
    types = {f"blk.{i}.{t}.weight": q for i in range(N_LAYERS) for t, q in FILES[kind](i).items()}
    types["output.weight"] = Q.Q6_K
    path = tmp_path / f"{kind.lower()}.gguf"
    write_gguf(path, n_layers=N_LAYERS, types=types)
    return path, types


def _runs(types: list[Q], rows: list[int]) -> list[tuple[int, int, int]]:
    """Shards of these types and row counts -> (type, first row, rows) of each run of one
    type, in order: the parts a GGUFLinearMethod must keep."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for t, n in zip(types, rows, strict=True):
        if runs and runs[-1][0] == int(t):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((int(t), start, n))
        start += n
    return runs


def _logits_error(model: torch.nn.Module, floats: torch.nn.Module) -> float:
    """The largest difference of a prompt's logits from the float model's, relative to the
    float model's largest logit."""
    prompt = [5, 9, 2, 7, 1, 3, 200, 11]
    logits = []
    for m in (model, floats):
        runner = PagedSequence(m, block_size=4)
        logits.append(runner.forward({runner.new_seq(): prompt})[0])
    return float((logits[0] - logits[1]).abs().max() / logits[1].abs().max())


def _wtypes(lin: torch.nn.Module) -> list[int]:
    return [p.wtype for p in lin.quant_method.kernel_weights(lin)]


@pytest.mark.parametrize("kind", list(FILES))
def test_k_m_file_runs_packed_and_near_the_float_model(tmp_path: Path, kind: str) -> None:
    path, types = _write(tmp_path, kind)
    ck = load_checkpoint(str(path))
    packed = build_model(ck, get_ops("auto"), torch.float32, "gguf")
    floats = build_model(ck, get_ops("auto"), torch.float32, "none")
    for i, layer in enumerate(packed.layers):
        t = {name: types[f"blk.{i}.{name}.weight"] for name in Q4_K_M}
        qkv = layer.self_attn.qkv_proj.quant_method
        assert isinstance(qkv, GGUFLinearMethod)
        # q and k pack together, v with them where it is of their type, rows in order
        q_rows, kv = layer.self_attn.q_size, layer.self_attn.kv_size
        assert [(p.wtype, p.start, p.rows) for p in qkv.parts] == _runs(
            [t["attn_q"], t["attn_k"], t["attn_v"]], [q_rows, kv, kv])
        assert _wtypes(layer.mlp.gate_up_proj) == [t["ffn_gate"]]
        assert layer.mlp.gate_up_proj.weight.dim() == 3  # packed 16-row groups
        assert _wtypes(layer.mlp.down_proj) == [t["ffn_down"]]
        assert _wtypes(layer.self_attn.o_proj) == [t["attn_output"]]
    assert _wtypes(packed.lm_head) == [Q.Q6_K]
    if kind == "Q5_K_M":  # both shapes of qkv: one Q5_K run, then Q5_K and Q6_K runs
        assert [len(la.self_attn.qkv_proj.quant_method.parts) for la in packed.layers] == [1, 2]
    # Each packed linear: the K-quant oracle's bits, within ~1% of the float linear on the
    # same blocks dequantized (what Q8_K activations cost; measured 0.5-1%).
    g = torch.Generator().manual_seed(0)
    for name in ("layers.0.self_attn.qkv_proj", "layers.1.self_attn.qkv_proj",
                 "layers.1.mlp.gate_up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj",
                 "layers.0.self_attn.o_proj", "lm_head"):
        ours, ref = packed.get_submodule(name), floats.get_submodule(name)
        x = torch.randn(4, ours.in_features, generator=g)
        y, want = ours(x), ref(x)
        assert (y - want).abs().max() < 0.02 * want.abs().max(), name
        parts = ours.quant_method.kernel_weights(ours)
        oracle = torch.cat([(ReferenceOps.qlinear_kquant if p.wtype in KQUANT_TYPES
                             else ReferenceOps.qlinear)(x, p.weight, p.rows, wtype=p.wtype)
                            for p in parts], dim=-1)
        assert torch.equal(y, oracle), name
    # The whole (random-weight) model: errors add up over the layers (measured 0.068 Q4_K_M,
    # 0.094 Q5_K_M, 0.067 Q3_K_M, 0.026 Q2_K, 0.145 IQ4_XS, 0.039 IQ4_NL; each linear alone is
    # within 2% of the float one above).
    err = _logits_error(packed, floats)
    assert 0 < err < (0.2 if kind == "IQ4_XS" else 0.12), err


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "qkv_bias"])
def test_fused_stack_runs_mixed_k_quant_layers_as_the_python_layers_do(
        qlinear_ops: CpuOps, tmp_path: Path, bias: bool, kind: str) -> None:
    """The fused C++ stack takes a Q4_K_M layer (its qkv two runs, Q4_K then Q6_K), a Q5_K_M
    one (one Q5_K run, or Q5_K then Q6_K), a Q3_K_M or Q2_K one (Q3_K then Q5_K, Q2_K then
    Q3_K), and gives the Python layers' logits bit for bit on the same kernels: a prefill of
    two sequences (M > 1: each run's rows go into place through the scratch), then decode
    steps of one (M = 1: straight into place); with a qkv bias (Qwen2's) split between the
    runs too."""
    path, _types = _write(tmp_path, kind)
    ck = load_checkpoint(str(path))
    fused_ops = CpuOps(isa=qlinear_ops.isa, fuse_layers=True)
    plain_ops = CpuOps(isa=qlinear_ops.isa, fuse_layers=False)
    models = [build_model(ck, o, torch.float32, "gguf") for o in (fused_ops, plain_ops)]
    if bias:
        g = torch.Generator().manual_seed(4)
        for layers in zip(*(m.layers for m in models)):
            b = torch.randn(layers[0].self_attn.qkv_proj.out_features, generator=g)
            for la in layers:
                la.self_attn.qkv_proj.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
    runners = [PagedSequence(m, block_size=4) for m in models]
    seqs = [[r.new_seq(), r.new_seq()] for r in runners]
    steps = [{0: [5, 9, 2, 7, 1, 3, 200, 11], 1: [8, 8, 3]}, {0: [4]}, {0: [6], 1: [7]}]
    for chunks in steps:
        outs = [r.forward({s[i]: toks for i, toks in chunks.items()})
                for r, s in zip(runners, seqs)]
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    assert fused_ops._stacks and None not in fused_ops._stacks.values()  # it did fuse


def test_q4_k_layers_stay_4_bit_without_the_kernels(tmp_path: Path) -> None:
    """A Q4_K_M file under "gguf" in bfloat16 on a backend without kvserve's kernels (the
    torch one here, CUDA in practice): its all-Q4_K layers (gate_up, o_proj) run on torch's
    int4 matmul at half a byte a weight, the rest (Q6_K down_proj, qkv with its Q6_K v,
    lm_head) are dequantized, and the logits are the bfloat16 model's on the same blocks
    dequantized, to bfloat16's rounding. (In float32 every layer is dequantized: the CPU's
    int4 matmul is slow there.)"""
    path, _types = _write(tmp_path, "Q4_K_M")
    ck = load_checkpoint(str(path))
    ops = get_ops("torch")
    quant = get_quant_method(quant_config("gguf")).without_kernels("cpu")
    model = build_model(ck, ops, torch.bfloat16, quant)
    floats = build_model(ck, ops, torch.bfloat16, "none")
    for layer in model.layers:
        for lin in (layer.mlp.gate_up_proj, layer.self_attn.o_proj):
            assert lin.weight.dtype == torch.uint8  # the CPU int4 matmul's packing
            assert lin.weight.numel() == lin.in_features * lin.out_features // 2
        for lin in (layer.mlp.down_proj, layer.self_attn.qkv_proj):
            assert lin.weight.dtype == torch.bfloat16
    # Measured 0.015: bfloat16's own rounding (the dense bfloat16 model is 0.018 from the
    # float32 one); a wrong scale or zero in one layer is off by far more.
    err = _logits_error(model, floats)
    assert err < 4e-2, err
    f32 = build_model(ck, ops, torch.float32, quant)
    assert f32.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
