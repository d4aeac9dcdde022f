"""GGUF block types the kernels do not read as stored (IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S,
IQ1_S, IQ1_M, TQ2_0, ...): under quantization "gguf" the i-quants are rewritten exactly in
IQ4_XS's layout (their own values; IQ2_XS, IQ2_S and IQ1_M with a scale per 16 weights;
iquant_rewrite.rewrite_iq4) and every other such matrix
requantized to Q8_0 at load (GGUFWeight.for_kernels), both packed on the int8 kernels;
"gguf_exact" and a backend without the kernels dequantize them, as the loader did before.
References: gguf-py's dequantize and its Q8_0 quantizer, and the float model on the same
blocks dequantized."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.quant import get_quant_method, quant_config
from kvserve.quant.ggml_kquants import (
    IQ1_M16,
    IQ1_S4,
    IQ2_X16,
    IQ2_XXS4,
    IQ3_S4,
    IQ3_XXS4,
    IQ4_REWRITES,
    dequantize_kquant,
)
from kvserve.quant.gguf_weights import GGUFWeight
from kvserve.quant.iquant_rewrite import rewrite_iq4
from tests.unit.test_gguf_kquants_model import _logits_error
from tests.unit.test_loader import _raw, write_gguf

# Layer 0: no type the kernels read; layer 1's qkv mixes one (q) with two kept K-quants.
TYPES = {
    0: {"attn_q": Q.IQ3_S, "attn_k": Q.IQ3_S, "attn_v": Q.TQ2_0, "attn_output": Q.IQ3_XXS,
        "ffn_gate": Q.IQ2_XXS, "ffn_up": Q.IQ2_XXS, "ffn_down": Q.IQ2_S},
    1: {"attn_q": Q.IQ3_S, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.IQ1_S,
        "ffn_gate": Q.IQ1_M, "ffn_up": Q.IQ1_M, "ffn_down": Q.IQ2_XS},
}
LINEARS = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "iquants.gguf"
    types = {f"blk.{i}.{t}.weight": q for i, ts in TYPES.items() for t, q in ts.items()}
    types["output.weight"] = Q.Q6_K
    write_gguf(path, n_layers=2, types=types)
    return path


@pytest.mark.parametrize("qtype", [Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ2_XS, Q.IQ2_S,
                                   Q.IQ1_M], ids=lambda q: q.name)
def test_i_quants_rewrite_exactly_in_iq4_xs_layout(qtype: Q) -> None:
    """Every byte random (grid indices, IQ3_S's 9th bits, signs, scales; fp16 d down to the
    1e-5 of real files, where d / 8 in fp16 would be subnormal): the rewritten blocks
    dequantize to gguf-py's weights bit for bit, and the model's loading path (for_kernels)
    gives the same blocks."""
    rng = np.random.default_rng(int(qtype))
    n, k = 40, 768
    nbytes, target = IQ4_REWRITES[qtype]
    raw = rng.integers(0, 256, (n, k // 256, nbytes), dtype=np.uint8)
    d = rng.uniform(-0.01, 0.01, (n, k // 256, 1)) * 10.0 ** -rng.integers(0, 3, (n, 1, 1))
    d16 = np.float16(d).view(np.uint16)
    if qtype == Q.IQ1_M:  # d's 4 nibbles, lowest first, atop the 4 scale words at [48, 56)
        words = raw[..., 48:56].copy().view(np.uint16) & 0x0FFF
        nibbles = (d16 >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 15
        raw[..., 48:56] = (words | nibbles << 12).view(np.uint8)
    else:
        raw[..., 0:2] = d16.view(np.uint8)
    raw = raw.reshape(n, -1)
    out = rewrite_iq4(torch.from_numpy(raw), qtype, k)
    assert out.shape == (n, k // 256 * (146 if target in (IQ2_X16, IQ1_M16) else 136))
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(dequantize_kquant(out, target, k), want)
    ours = GGUFWeight(torch.from_numpy(raw), int(qtype), k).for_kernels()
    assert ours.qtype == target and torch.equal(ours.data, out)


def test_any_block_type_dequantizes_as_gguf_py_and_requantizes_to_q8_0() -> None:
    rng = np.random.default_rng(0)
    for qtype in (Q.IQ3_S, Q.IQ2_XXS, Q.TQ2_0):
        raw = _raw(rng, (24, 512), qtype)
        w = GGUFWeight(torch.from_numpy(raw), int(qtype), 512)
        floats = gguf.quants.dequantize(raw, qtype)
        assert torch.equal(w.dequantize(), torch.from_numpy(floats))
        q8 = w.as_q8_0()
        assert q8.qtype == Q.Q8_0 and q8.k == 512
        assert np.array_equal(q8.data.numpy(), gguf.quants.quantize(floats, Q.Q8_0))


def test_other_block_types_run_on_the_kernels(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Every linear of both layers runs packed: the i-quants in (or after) IQ4_XS's layout
    (the file's values exactly), the other types as Q8_0 (gguf-py's Q8_0 of the file's
    values), kept types as stored."""
    ck = load_checkpoint(str(_write(tmp_path)))
    with caplog.at_level(logging.INFO, logger="kvserve.loader.gguf_loader"):
        packed = build_model(ck, get_ops("auto"), torch.float32, "gguf")
    assert ("2 IQ1_M, 1 IQ1_S, 1 IQ2_S, 1 IQ2_XS, 2 IQ2_XXS, 3 IQ3_S, 1 IQ3_XXS, 1 TQ2_0 "
            "matrices of no type kvserve's kernels read as stored: quantization 'gguf' "
            "rewrites them") in caplog.text
    want_types = {
        "layers.0.self_attn.qkv_proj": [IQ3_S4, Q.Q8_0], "layers.0.self_attn.o_proj": [IQ3_XXS4],
        "layers.0.mlp.gate_up_proj": [IQ2_XXS4], "layers.0.mlp.down_proj": [IQ2_X16],
        "layers.1.self_attn.qkv_proj": [IQ3_S4, Q.Q4_K, Q.Q6_K],
        "layers.1.self_attn.o_proj": [IQ1_S4], "layers.1.mlp.gate_up_proj": [IQ1_M16],
        "layers.1.mlp.down_proj": [IQ2_X16]}
    floats = build_model(ck, get_ops("auto"), torch.float32, "none")
    for name, types in want_types.items():
        lin = packed.get_submodule(name)
        parts = lin.quant_method.kernel_weights(lin)
        assert [p.wtype for p in parts] == types, name
        assert all(p.weight.dtype == torch.uint8 and p.weight.dim() == 3 for p in parts)
        ref = floats.get_submodule(name).weight
        want = []
        for p in parts:  # Q8_0 rows: gguf-py's Q8_0 of the float rows; the rest exactly them
            rows = ref[p.start:p.start + p.rows].numpy()
            if p.wtype == Q.Q8_0:
                rows = gguf.quants.dequantize(gguf.quants.quantize(rows, Q.Q8_0), Q.Q8_0)
            want.append(torch.from_numpy(rows))
        assert torch.equal(lin.quant_method.dense_weight(lin), torch.cat(want)), name
    # Q8_0's rounding and int8 activations on top of the file's values (every weight checked
    # above): measured 0.124; 0.047 with layer 1's o_proj Q4_K instead of IQ1_S, another
    # random network (the float logits' peak 43.9 against 35.0, the int8 activations'
    # absolute error 2.1 against 4.3). The K-quant files of test_gguf_kquants_model.py, int8
    # activations alone: 0.026-0.145, bounds 0.12-0.2.
    err = _logits_error(packed, floats)
    assert 0 < err < 0.2, err


def test_gguf_exact_and_a_backend_without_kernels_dequantize_them(tmp_path: Path) -> None:
    """No Q8_0 detour where the kernels' int8 arithmetic is not asked for: gguf_exact keeps
    the float32 model's bits, and off the kernels (CUDA; the torch backend here) the weights
    are the file's values dequantized."""
    ck = load_checkpoint(str(_write(tmp_path)))
    exact = build_model(ck, get_ops("auto"), torch.float32, "gguf_exact")
    floats = build_model(ck, get_ops("auto"), torch.float32, "none")
    assert exact.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert _logits_error(exact, floats) == 0
    quant = get_quant_method(quant_config("gguf")).without_kernels("cpu")
    off = build_model(ck, get_ops("torch"), torch.float32, quant)
    for name in ("layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj"):
        assert torch.equal(off.get_submodule(name).weight, floats.get_submodule(name).weight)
