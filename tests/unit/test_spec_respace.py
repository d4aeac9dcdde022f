"""The prompt re-spaced (spec/respace.py): the rule on text, and the lookups that read it with
the default model's real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from kvserve.loader import resolve_model
from kvserve.loader.gguf_loader import open_gguf
from kvserve.loader.gguf_tokenizer import tokenizer_from_gguf
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.respace import respace, respaced_prompt
from kvserve.spec.suffix import SuffixProposer

WRAPPED = ("Fix the typo in this text:\n\n  The licenses for most software\nand other "
           "practical works are designed\nto take away your freedom.  By contrast, the GPL\n"
           "is intended to guarantee it.")
ONE_LINE = ("Fix the typo in this text:\n\n  The licenses for most software and other "
            "practical works are designed to take away your freedom. By contrast, the GPL "
            "is intended to guarantee it.")


@pytest.fixture(scope="module")
def tok() -> Any:
    return tokenizer_from_gguf(open_gguf(resolve_model(None)).metadata)


@pytest.mark.parametrize(("text", "want"), [
    (WRAPPED, ONE_LINE),
    ("a line  \nwrapped", "a line wrapped"),  # the blanks before the break go too
    ("one.\tTwo", "one.\tTwo"),  # a single blank stays as it is
    ("two  spaces\t\tand tabs", "two spaces and tabs"),
    ("para one\n\npara two", "para one\n\npara two"),  # a blank line ends a paragraph
    ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),  # indented: never joined
    ("  indented first line\nthen the rest", "  indented first line then the rest"),
    ("ends with a break\n", "ends with a break\n"),
])
def test_respace_joins_wrapped_lines_and_single_blanks_only(text: str, want: str) -> None:
    assert respace(text) == want


def test_respaced_prompt_is_the_one_line_text_encoded_or_none(tok: Any) -> None:
    ids = tok.encode(WRAPPED, add_special_tokens=False)
    assert respaced_prompt(tok, ids) == tok.encode(ONE_LINE, add_special_tokens=False)
    assert respaced_prompt(tok, tok.encode(ONE_LINE, add_special_tokens=False)) is None
    assert respaced_prompt(None, ids) is None


def _request(tok: Any, prompt: str, answer: str) -> Request:
    """A request whose prompt is `prompt` and whose output so far is `answer`."""
    req = Request("r", tok.encode(prompt, add_special_tokens=False),
                  SamplingParams(max_tokens=64), max_tokens=64)
    for t in tok.encode(answer, add_special_tokens=False):
        req.append_output_token(t)
    return req


# The answer so far ends after a line break of the prompt: "software\nand other" there,
# "software and other" here, so the request's own tokens hold no 2+ token suffix of it.
ANSWER = "The licenses for most software and other"
REST = " practical works are designed to take away your freedom."


@pytest.mark.parametrize("make", [lambda tok: NgramProposer(2, 4, tok),
                                  lambda tok: SuffixProposer(tokenizer=tok)],
                         ids=["ngram", "suffix"])
def test_a_lookup_drafts_across_a_line_break_from_the_respaced_prompt(tok: Any, make: Any
                                                                      ) -> None:
    with_it = make(tok)
    drafts = with_it.propose([_request(tok, WRAPPED, ANSWER)], [4], [[]])[0]
    assert len(drafts) == 4 and REST.startswith(tok.decode(drafts)), tok.decode(drafts)
    without = make(None)
    assert without.propose([_request(tok, WRAPPED, ANSWER)], [4], [[]]) == [[]]


def test_ngram_prefers_the_requests_own_tokens_at_the_same_length(tok: Any) -> None:
    # " one two" ends the answer: in the prompt it is followed by a line break (then
    # "five"), in the prompt re-spaced by " five". Both match as long; the own tokens win.
    prompt = "A one two\nthree. B one two\nfive"
    prop = NgramProposer(2, 4, tok)
    drafts = prop.propose([_request(tok, prompt, " B one two")], [2], [[]])[0]
    assert tok.decode(drafts) == "\nfive"
    # Where the own tokens have no match, the re-spaced prompt's continuation comes.
    drafts = prop.propose([_request(tok, prompt, "three. B one two five and")], [2], [[]])[0]
    assert drafts == []  # " five and" is in neither
    fresh = NgramProposer(2, 4, tok)
    drafts = fresh.propose([_request(tok, prompt, "A one two three")], [3], [[]])[0]
    assert tok.decode(drafts) == ". B one"


def test_suffix_encodes_the_respaced_prompt_only_once_a_request_drafts(tok: Any) -> None:
    # suffix sees every request every step (its tokens go to the tenant's cache), drafting or
    # not; the prompt's encoding waits for the first draft.
    prop = SuffixProposer(tokenizer=tok)
    req = _request(tok, WRAPPED, ANSWER)
    assert prop.propose([req], [0], [[]]) == [[]]
    assert not prop._requests["r"].respaced_read
    drafts = prop.propose([req], [4], [[]])[0]
    assert prop._requests["r"].respaced is not None and REST.startswith(tok.decode(drafts))
