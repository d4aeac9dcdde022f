"""Benchmark datasets: reproducible from the seed, and prompts of the asked length."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

import pytest

from kvserve.bench.datasets import (
    file_requests,
    random_requests,
    shared_prefix_requests,
    word_token_ids,
)

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class WordTokenizer:
    """A word-level stand-in for BPE: id 0 is BOS, then ' word' and 'word' for 200 words,
    then single characters. Encoding splits before spaces, like a BPE pre-tokenizer."""

    def __init__(self, add_bos: bool = True) -> None:
        words = [a + b + c for a in _LETTERS[:2] for b in _LETTERS[:10] for c in _LETTERS[:10]]
        chars = list(string.printable)
        self.vocab = ["<s>"] + [" " + w for w in words] + words + chars
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)
        self.add_bos = add_bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for piece in re.findall(r" ?[a-z]+|.", text, flags=re.DOTALL):
            ids += [self.ids[piece]] if piece in self.ids else [self.ids[c] for c in piece]
        return [0, *ids] if add_special_tokens and self.add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


def test_word_tokens_are_single_words_with_a_space() -> None:
    tok = WordTokenizer()
    ids = word_token_ids(tok)
    assert ids == list(range(1, 201))


def test_random_is_reproducible_and_exact_length() -> None:
    tok = WordTokenizer()
    a = random_requests(tok, 5, input_len=50, output_len=16, seed=3)
    assert a == random_requests(tok, 5, input_len=50, output_len=16, seed=3)
    assert a != random_requests(tok, 5, input_len=50, output_len=16, seed=4)
    assert len({r.prompt for r in a}) == 5
    for r in a:
        assert r.prompt_len == 50 == len(tok.encode(r.prompt))  # BOS + 49 words
        assert r.output_len == 16
        assert list(r.prompt_token_ids) == tok.encode(r.prompt)
        assert not r.prompt.startswith(" ")


def test_random_range_ratio_bounds() -> None:
    tok = WordTokenizer(add_bos=False)
    reqs = random_requests(tok, 50, input_len=100, output_len=10, seed=0, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(tok, 1, 10, 10, range_ratio=1.0)
    with pytest.raises(ValueError, match="input_len must be >= 1"):
        random_requests(tok, 1, 0, 10)


def test_shared_prefix_shares_exactly_the_prefix() -> None:
    tok = WordTokenizer()
    reqs = shared_prefix_requests(tok, 6, prefix_len=64, suffix_len=8, output_len=4, seed=1)
    assert reqs == shared_prefix_requests(tok, 6, prefix_len=64, suffix_len=8, output_len=4,
                                          seed=1)
    prefixes = {r.prompt.split("\n\n")[0] for r in reqs}
    assert len(prefixes) == 1
    assert len(tok.encode(prefixes.pop())) == 64
    assert len({r.prompt for r in reqs}) == 6
    ids = [r.prompt_token_ids for r in reqs]
    assert all(x[:64] == ids[0][:64] for x in ids)
    two = shared_prefix_requests(tok, 6, 64, 8, 4, num_prefixes=2, seed=1)
    assert len({r.prompt.split("\n\n")[0] for r in two}) == 2


def test_file_dataset(tmp_path: Path) -> None:
    tok = WordTokenizer()
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt": "aaa abb", "output_len": 3}) + "\n\nbaa bbb bcc\n")
    reqs = file_requests(tok, str(p), output_len=7)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("aaa abb", 3, 3), ("baa bbb bcc", 4, 7)]
    assert [r.prompt for r in file_requests(tok, str(p), 7, num_prompts=3)] == [
        "aaa abb", "baa bbb bcc", "aaa abb"]
    p.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        file_requests(tok, str(p), 7)


def test_random_prompts_with_the_real_tokenizer(smollm2: Any) -> None:
    tok = smollm2[1].tokenizer
    for r in random_requests(tok, 8, input_len=200, output_len=128, seed=0):
        assert abs(r.prompt_len - 200) <= 1  # the first word loses its space
        assert len(tok.encode(r.prompt)) == r.prompt_len
