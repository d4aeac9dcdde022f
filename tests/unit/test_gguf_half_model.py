"""F16 and BF16 matrices of a GGUF file under quantization "gguf": kept at 16 bits (the file's
own values; the row kernels widen them exactly in registers), so the model's logits are those
of the same file run in float32, bit for bit, in the fused stack and in the Python layers, at
decode and at a prefill past the small-M kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops.cpu import CpuOps, cpu_has_avx2_fma
from tests.helpers import PagedSequence
from tests.unit.test_loader import write_gguf

pytestmark = pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs the AVX2 kernels")

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "python_layers"])
def test_half_matrices_stay_16_bit_and_give_the_float32_logits(tmp_path: Path,
                                                               fuse: bool) -> None:
    types = {f"blk.{i}.{t}.weight": q for i, q in ((0, Q.F16), (1, Q.BF16)) for t in LINEARS}
    types["output.weight"] = Q.F16
    path = tmp_path / "half.gguf"
    # positions for a prompt past small_m, which is 2048 rows on AVX-512
    stored = write_gguf(path, n_layers=2, types=types, context_length=4096)
    ck = load_checkpoint(str(path))
    ops = CpuOps(fuse_layers=fuse)
    half = build_model(ck, ops, torch.float32, "gguf")
    floats = build_model(ck, ops, torch.float32, "none")
    for i, dtype in ((0, torch.float16), (1, torch.bfloat16)):
        layer = half.layers[i]
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            assert lin.weight.dtype == dtype
    assert half.lm_head.weight.dtype == torch.float16
    data, _ = stored["output.weight"]  # [vocab, hidden] float16 as written
    assert torch.equal(half.lm_head.weight, torch.from_numpy(np.asarray(data)))
    for m in (floats.lm_head, *floats.layers[0].modules()):
        assert getattr(m, "weight", torch.empty(0)).dtype == torch.float32
    # A prefill past small_m (torch's GEMM on the widened rows), then decode steps (M = 1).
    g = torch.Generator().manual_seed(0)
    vocab = ck.model_config.vocab_size
    prompt = torch.randint(0, vocab, (ops.small_m + 9,), generator=g).tolist()
    runs = []
    for model in (half, floats):
        runner = PagedSequence(model, num_blocks=(len(prompt) + 3) // 16 + 2, block_size=16)
        seq = runner.new_seq()
        out = [runner.forward({seq: prompt})[0]]
        for t in (3, 17, 5):
            out.append(runner.forward({seq: [t]})[0])
        runs.append(out)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_a_tied_16_bit_embedding_is_held_once(tmp_path: Path) -> None:
    """Tied, with an F16 token_embd: the lm_head keeps it at 16 bits and the lookup reads the
    same rows (widened exactly), so no float32 copy is held; logits as the float32 model's."""
    types = {f"blk.{i}.{t}.weight": Q.F16 for i in range(1) for t in LINEARS}
    types["token_embd.weight"] = Q.F16
    path = tmp_path / "tied.gguf"
    write_gguf(path, n_layers=1, tied=True, types=types)
    ck = load_checkpoint(str(path))
    assert ck.model_config.tie_word_embeddings
    ops = CpuOps()
    half = build_model(ck, ops, torch.float32, "gguf")
    floats = build_model(ck, ops, torch.float32, "none")
    assert half.lm_head.weight.dtype == torch.float16
    assert half.embed_tokens.numel() == 0 and half.embed_stored is not None
    assert half.embed_stored.weight is half.lm_head.weight
    held = sum(p.numel() * p.element_size() for p in half.parameters())
    assert held < sum(p.numel() * p.element_size() for p in floats.parameters()) / 1.9
    prompt = [5, 9, 2, 7, 1, 3, 20, 11]
    runs = []
    for model in (half, floats):
        runner = PagedSequence(model, block_size=16)
        seq = runner.new_seq()
        runs.append([runner.forward({seq: prompt})[0], runner.forward({seq: [4]})[0]])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
