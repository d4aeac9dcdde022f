"""IncrementalDetokenizer tests with a small byte-level BPE trained in the test."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.unit.small_bpe import BPEAdapter, train_bpe

# Rare enough that BPE leaves their UTF-8 bytes as separate tokens.
TEXT = "hello world caf\u00e9 \u65e5\u672c\u8a9e \U0001f642 the lazy dog STOP over \u00e9t\u00e9!"


@pytest.fixture(scope="module")
def raw_tok() -> Tokenizer:
    return train_bpe()


@pytest.fixture
def tok(raw_tok: Tokenizer) -> BPEAdapter:
    return BPEAdapter(raw_tok)


def _detok(tok: BPEAdapter, prompt: str = "hello", **params: object) -> IncrementalDetokenizer:
    req = Request("r", tok.encode(prompt), SamplingParams(**params), max_tokens=100)
    return IncrementalDetokenizer(tok, req)


def _stream(detok: IncrementalDetokenizer, ids: list[int],
            step: int = 1) -> tuple[list[str], str | None]:
    deltas: list[str] = []
    for i in range(0, len(ids), step):
        delta, stop = detok.update(ids[i:i + step])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas, None


@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_join_to_full_decode(tok: BPEAdapter, step: int) -> None:
    ids = tok.encode(TEXT)
    detok = _detok(tok)
    deltas, stop = _stream(detok, ids, step)
    assert stop is None
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert detok.output_text == TEXT


def test_split_utf8_is_held_not_replaced(tok: BPEAdapter) -> None:
    ids = tok.encode(TEXT)
    # Precondition: some multi-byte characters really are split across tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    detok = _detok(tok)
    deltas, _ = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "\U0001f642" in "".join(deltas)


def test_flush_releases_incomplete_utf8_like_decode(tok: BPEAdapter) -> None:
    ids = tok.encode("ok \U0001f642")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = _detok(tok)
    deltas, _ = _stream(detok, ids[:cut])
    assert "\ufffd" not in "".join(deltas)
    tail = detok.flush()
    assert "".join(deltas) + tail == tok.decode(ids[:cut])
    assert tail.endswith("\ufffd")


def test_decodes_only_a_small_window(tok: BPEAdapter) -> None:
    ids = tok.encode(TEXT * 8)
    detok = _detok(tok)
    tok.decoded_lengths.clear()
    deltas, _ = _stream(detok, ids)
    assert len(ids) > 200
    # Prompt context (<= 5) plus a few tokens of one character; never the whole output.
    assert max(tok.decoded_lengths) <= 10
    assert "".join(deltas) + detok.flush() == TEXT * 8


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok: BPEAdapter, include: bool) -> None:
    ids = tok.encode(TEXT)
    stop = "lazy dog ST"
    # Precondition: no single token holds the whole stop string.
    assert not any(stop in tok.decode([t]) for t in ids)
    detok = _detok(tok, stop=["never", stop], include_stop_str_in_output=include)
    deltas, matched = _stream(detok, ids)
    assert matched == stop
    end = TEXT.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == detok.output_text == TEXT[:end]
    assert detok.finished and detok.update(ids[:1]) == ("", None)
    assert detok.flush() == ""


def test_stop_string_inside_a_token(tok: BPEAdapter) -> None:
    ids = tok.encode("say hello world")
    inner = [t for t in ids if tok.decode([t]).strip() == "hello"]
    assert inner, "precondition: 'hello' is one token"
    detok = _detok(tok, stop="ell")
    deltas, matched = _stream(detok, ids)
    assert matched == "ell"
    assert "".join(deltas) == detok.output_text == "say h"


def test_first_completed_stop_string_wins(tok: BPEAdapter) -> None:
    ids = tok.encode("the quick brown fox")
    # "quick brown" starts first but "ick" completes first; feed everything at once too.
    for step in (1, len(ids)):
        detok = _detok(tok, stop=["quick brown", "ick"])
        deltas, matched = _stream(detok, ids, step)
        assert matched == "ick"
        assert "".join(deltas) == "the qu"


def test_partial_stop_string_is_held_back_then_flushed(tok: BPEAdapter) -> None:
    ids = tok.encode("the lazy dog STO")
    detok = _detok(tok, stop="STOP!")
    deltas, matched = _stream(detok, ids)
    assert matched is None
    streamed = "".join(deltas)
    # The last len("STOP!") - 1 = 4 chars are held: " STO" might still become the stop.
    assert streamed == "the lazy dog"
    assert detok.output_text == "the lazy dog STO"
    assert detok.flush() == " STO"
    assert detok.flush() == ""


def test_include_stop_str_holds_nothing_back(tok: BPEAdapter) -> None:
    ids = tok.encode("the lazy dog STO")
    detok = _detok(tok, stop="STOP!", include_stop_str_in_output=True)
    deltas, _ = _stream(detok, ids)
    assert "".join(deltas) == "the lazy dog STO"


def test_skip_special_tokens(tok: BPEAdapter, raw_tok: Tokenizer) -> None:
    eos = raw_tok.token_to_id("<eos>")
    ids = tok.encode("hello world") + [eos] + tok.encode(" dog")
    for skip, expected in ((True, "hello world dog"), (False, "hello world<eos> dog")):
        detok = _detok(tok, skip_special_tokens=skip)
        deltas, _ = _stream(detok, ids)
        assert "".join(deltas) + detok.flush() == expected


def test_prompt_is_context_not_output(tok: BPEAdapter) -> None:
    # Output decodes in the context of the prompt's last tokens. (A prompt that ends inside a
    # UTF-8 character is skipped: the character belongs to both, and we make no promise.)
    full = tok.encode("hello \u65e5\u672c")
    for cut in range(1, len(full)):
        req = Request("r", full[:cut], SamplingParams(), max_tokens=10)
        detok = IncrementalDetokenizer(tok, req)
        deltas, _ = _stream(detok, full[cut:])
        text = "".join(deltas) + detok.flush()
        prompt_text = tok.decode(full[:cut])
        if not prompt_text.endswith("\ufffd"):
            assert prompt_text + text == "hello \u65e5\u672c"


def test_window_stays_bounded_over_many_skipped_special_tokens(tok: BPEAdapter,
                                                               raw_tok: Tokenizer) -> None:
    eos = raw_tok.token_to_id("<eos>")
    ids = tok.encode("hello") + [eos] * 100 + tok.encode(" world")
    detok = _detok(tok)
    tok.decoded_lengths.clear()
    deltas, _ = _stream(detok, ids)
    assert "".join(deltas) + detok.flush() == "hello world"
    assert max(tok.decoded_lengths) <= 40
