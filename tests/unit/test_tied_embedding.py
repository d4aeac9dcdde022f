"""A tied embedding is held once: the lookup reads the lm_head's own weight where its method
keeps the checkpoint's values in a form read row by row (LinearMethod.weight_rows), here the
GGUF blocks packed into 16-row groups for the kernels (PackedRows), instead of a second copy of
the same blocks as stored. The reference for every row is the stored blocks' dequantize
(held to gguf-py in test_quant_gguf / test_ggml_blocks / test_kquant_kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve.loader import load_checkpoint
from kvserve.models import build_model
from kvserve.ops.cpu import CpuOps, cpu_has_avx2_fma
from kvserve.quant.block_pack import IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, pack
from kvserve.quant.ggml_kquants import IQ4_FAMILY, KQUANT_NAMES
from kvserve.quant.gguf_weights import GGUFWeight, PackedRows
from kvserve.quant.kquant_pack import pack_kquant
from tests.helpers import PagedSequence
from tests.unit import test_ggml_blocks, test_kquant_kernels, test_quant_gguf
from tests.unit.test_loader import write_gguf

LEGACY = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL]
KQUANTS = [int(q) for q in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)] + list(IQ4_FAMILY)


def stored_blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Valid random blocks (finite fp16 scales of both signs) of n rows of k weights."""
    if qtype in KQUANTS:
        return test_kquant_kernels.random_blocks(qtype, n, k, seed)
    if qtype in (Q4_1, Q8_0):
        return test_quant_gguf.random_blocks(qtype, n, k, seed)
    return torch.from_numpy(test_ggml_blocks.random_blocks(qtype, n, k, seed))


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS,
                         ids=lambda q: KQUANT_NAMES.get(q) or Q(q).name)
def test_packed_rows_are_the_stored_rows(qtype: int) -> None:
    n, k = 37, 512  # the last 16-row group only partly filled
    data = stored_blocks(qtype, n, k, seed=qtype)
    packed = pack_kquant(data, qtype, k) if qtype in KQUANTS else pack(data, qtype, k)
    rows = PackedRows(packed, qtype, k, n)
    stored = GGUFWeight(data, qtype, k)
    assert rows.shape == stored.shape == (n, k)
    # Repeated ids, out of order, across groups, the last row; a 2-D batch of ids.
    ids = torch.tensor([36, 0, 17, 17, 5, 31, 32, 0])
    assert torch.equal(rows.rows(ids), stored.rows(ids))
    assert torch.equal(rows.rows(ids.reshape(2, 4)), stored.rows(ids).reshape(2, 4, k))
    assert rows.rows(ids[:0]).shape == (0, k)
    assert torch.equal(rows.dequantize(), stored.dequantize())


@pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs the AVX2 kernels")
@pytest.mark.parametrize("embd", [Q.Q8_0, Q.Q4_1, Q.Q6_K, Q.Q4_K], ids=lambda q: q.name)
def test_a_tied_block_embedding_is_held_once(tmp_path: Path, embd: Q) -> None:
    """Tied, token_embd in blocks: the lm_head packs them, the lookup reads those groups, and
    no other copy of the embedding is held; the model's logits are those it gives when it
    looks tokens up in the stored blocks instead (the previous way), bit for bit."""
    path = tmp_path / "tied.gguf"
    write_gguf(path, n_layers=1, tied=True, types={"token_embd.weight": embd})
    ck = load_checkpoint(str(path))
    assert ck.model_config.tie_word_embeddings
    model = build_model(ck, CpuOps(), torch.float32, "gguf")
    assert isinstance(model.embed_stored, PackedRows)
    assert model.embed_stored.packed.data_ptr() == model.lm_head.weight.data_ptr()
    assert model.embed_tokens.numel() == 0  # nor a float table
    stored = dict(ck.weights(keep_quantized=True))["model.embed_tokens.weight"]
    assert isinstance(stored, GGUFWeight) and stored.qtype == int(embd)
    vocab = ck.model_config.vocab_size
    prompt = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = []
    for lookup in (model.embed_stored, stored):
        model.embed_stored = lookup
        runner = PagedSequence(model, block_size=16)
        seq = runner.new_seq()
        runs.append([runner.forward({seq: prompt})[0], runner.forward({seq: [vocab - 1]})[0]])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_untied_16_bit_embedding_is_kept_at_16_bits(tmp_path: Path, dtype: torch.dtype
                                                       ) -> None:
    """An HF checkpoint stored in bfloat16 / float16 (untied): the loader hands its floats over
    as float32, and the model keeps the table at the stored width; each lookup widens its
    rows exactly, so the logits are those of the float32 table, bit for bit. A table whose
    values are not all 16-bit ones stays float32."""
    from tests.helpers import kvserve_model_from_hf, tiny_hf_model

    hf = tiny_hf_model("llama")  # untied
    assert not hf.config.tie_word_embeddings
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype).float())  # the values a 16-bit checkpoint holds
    model = kvserve_model_from_hf(hf, "LlamaForCausalLM", CpuOps())
    assert model.embed_tokens.dtype == dtype and model.embed_stored is None
    assert torch.equal(model.embed_tokens.float(), hf.model.embed_tokens.weight)
    prompt = list(range(3, 40))

    def logits() -> torch.Tensor:
        runner = PagedSequence(model)
        return runner.forward({runner.new_seq(): prompt})[0]

    narrow = logits()
    model.embed_tokens = torch.nn.Parameter(model.embed_tokens.float(), requires_grad=False)
    assert torch.equal(narrow, logits())
    with torch.no_grad():
        hf.model.embed_tokens.weight[5, 0] += 1e-6  # one value no 16-bit float holds
    full = kvserve_model_from_hf(hf, "LlamaForCausalLM", CpuOps())
    assert full.embed_tokens.dtype == torch.float32
