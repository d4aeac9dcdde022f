"""Structured output: the sampler's bitmask against xgrammar's own kernel, and the grammar
manager on the default model's tokenizer (special tokens never allowed, EOS only once the
JSON is complete)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve.request import Request
from kvserve.sample.processors import apply_token_bitmask
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured_output import StructuredOutputManager

xgr = pytest.importorskip("xgrammar")


def _allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    out = apply_token_bitmask(logits, torch.tensor([0]), mask_row.unsqueeze(0))
    return set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())


def test_apply_token_bitmask_matches_xgrammar() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 1000, 5
    logits = torch.randn(batch, vocab, generator=gen)
    rows = [0, 2, 3]
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    full = torch.full((batch, words), -1, dtype=torch.int32)  # -1: every bit set
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab, indices=rows)
    got = apply_token_bitmask(logits, torch.tensor(rows), bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without a grammar untouched


def test_manager_masks_follow_the_schema(smollm2: Any) -> None:
    tok = smollm2[1].tokenizer
    vocab = smollm2[1].model_config.vocab_size
    mgr = StructuredOutputManager(tok, vocab)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    plain = Request("plain", [1, 2, 3], SamplingParams(), max_tokens=10)
    req = Request("r", [1, 2, 3], params, max_tokens=32)
    eos = tok.eos_token_ids[0]
    specials = set(tok.all_special_ids) - set(tok.eos_token_ids)
    for token in tok.encode('{"a": 12}', add_special_tokens=False):
        got = mgr.token_bitmask([plain, req])
        assert got is not None
        rows, masks = got
        assert rows.tolist() == [1]
        allowed = _allowed(masks[0], vocab)
        assert token in allowed and eos not in allowed and not allowed & specials
        mgr.accept("r", token)
    rows, masks = mgr.token_bitmask([req])  # type: ignore[misc]
    assert eos in _allowed(masks[0], vocab)  # complete: the stop token may come now
    mgr.accept("r", eos)
    assert mgr.token_bitmask([req]) is None  # terminated
    mgr.remove("r")
    assert len(mgr) == 0


def test_bad_schema_is_a_value_error(smollm2: Any) -> None:
    mgr = StructuredOutputManager(smollm2[1].tokenizer, smollm2[1].model_config.vocab_size)
    with pytest.raises(ValueError, match="json_schema"):
        mgr.compile(StructuredOutputsParams(json={"type": "no-such-type"}))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def _schemas(n: int) -> list[StructuredOutputsParams]:
    return [StructuredOutputsParams(json={
        "type": "object", "properties": {f"field_{i}_{j}": {"type": "string", "maxLength": 40}
                                         for j in range(6)},
        "required": [f"field_{i}_0"]}) for i in range(n)]


def test_the_grammar_cache_is_bounded(smollm2: Any) -> None:
    tok, vocab = smollm2[1].tokenizer, smollm2[1].model_config.vocab_size
    unbounded = StructuredOutputManager(tok, vocab, cache_limit_bytes=1 << 40)
    for spec in _schemas(12):
        unbounded.compile(spec)
    per_schema = unbounded.cache_size_bytes / 12
    assert per_schema > 0  # what an unbounded cache keeps: every schema it ever compiled
    limit = int(per_schema * 3)
    mgr = StructuredOutputManager(tok, vocab, cache_limit_bytes=limit)
    for spec in _schemas(12):
        mgr.compile(spec)
        assert mgr.cache_size_bytes <= limit * 1.25, (mgr.cache_size_bytes, limit)
    assert mgr.num_compiled == 12
    with pytest.raises(ValueError, match=">= 0 bytes"):
        StructuredOutputManager(tok, vocab, cache_limit_bytes=-1)
