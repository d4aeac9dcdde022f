"""Benchmark prompts: random, shared-prefix and file datasets, reproducible from a seed.

Random text is built from "word tokens" of the model's own vocabulary: tokens that decode to
a space plus lowercase letters (" the", " river"). A run of them re-encodes to the same ids
(BPE does not merge across the leading spaces), so a prompt of n sampled words is n tokens
(plus BOS, where the model adds one) on every server that uses this tokenizer, and the text
is what every server receives.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_WORD = re.compile(r"^ [a-z]{2,12}$")


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as this tokenizer counts them (incl. BOS where added)
    output_len: int
    prompt_token_ids: tuple[int, ...] = ()  # for in-process benchmarks; may be empty


def word_token_ids(tokenizer: TokenizerLike) -> list[int]:
    """Ids of the tokens that are one lowercase word with a leading space, in id order."""
    ids = []
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [i]:
            ids.append(i)
    if len(ids) < 100:
        raise ValueError(f"the tokenizer has only {len(ids)} single-word tokens; the random "
                         "dataset needs at least 100")
    return ids


class WordSampler:
    """Draws runs of word tokens; a run of n ids encodes back to n tokens."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self.words = word_token_ids(tokenizer)
        self.num_special = len(tokenizer.encode("", add_special_tokens=True))  # BOS or nothing

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.words) for _ in range(n)]

    def text(self, ids: Sequence[int]) -> str:
        # Drop the first word's leading space: a prompt that starts with a space is odd, and
        # " the" and "the" are both one token.
        return self.tokenizer.decode(list(ids), skip_special_tokens=False).lstrip(" ")

    def request(self, text: str, output_len: int) -> SampleRequest:
        ids = self.tokenizer.encode(text)
        return SampleRequest(text, len(ids), output_len, tuple(ids))


def _check_len(name: str, value: int, low: int = 1) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def random_requests(tokenizer: TokenizerLike, num_prompts: int, input_len: int,
                    output_len: int, seed: int = 0, range_ratio: float = 0.0
                    ) -> list[SampleRequest]:
    """num_prompts prompts of about input_len tokens (BOS included) and output_len new
    tokens each. range_ratio r draws each length uniformly from [len*(1-r), len*(1+r)]."""
    _check_len("num_prompts", num_prompts)
    _check_len("input_len", input_len)
    _check_len("output_len", output_len)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    sampler = WordSampler(tokenizer)
    out = []
    for _ in range(num_prompts):
        n_in = _jitter(rng, input_len, range_ratio)
        n_out = _jitter(rng, output_len, range_ratio)
        words = sampler.ids(rng, max(1, n_in - sampler.num_special))
        out.append(sampler.request(sampler.text(words), n_out))
    return out


def _jitter(rng: random.Random, n: int, ratio: float) -> int:
    if ratio == 0:
        return n
    return rng.randint(max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio))))


def shared_prefix_requests(tokenizer: TokenizerLike, num_prompts: int, prefix_len: int,
                           suffix_len: int, output_len: int, num_prefixes: int = 1,
                           seed: int = 0) -> list[SampleRequest]:
    """A long common "system prompt" of prefix_len tokens, then a distinct question of about
    suffix_len tokens per request. Requests cycle through num_prefixes prefixes, so request
    i uses prefix i % num_prefixes; the order is shuffled with the seed."""
    _check_len("num_prompts", num_prompts)
    _check_len("prefix_len", prefix_len)
    _check_len("suffix_len", suffix_len)
    _check_len("output_len", output_len)
    _check_len("num_prefixes", num_prefixes)
    rng = random.Random(seed)
    sampler = WordSampler(tokenizer)
    prefixes = [sampler.text(sampler.ids(rng, max(1, prefix_len - sampler.num_special)))
                for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        question = sampler.text(sampler.ids(rng, suffix_len))
        text = f"{prefixes[i % num_prefixes]}\n\nQuestion {i}: {question}?"
        out.append(sampler.request(text, output_len))
    rng.shuffle(out)
    return out


def file_requests(tokenizer: TokenizerLike, path: str, output_len: int,
                  num_prompts: int | None = None) -> list[SampleRequest]:
    """Prompts from a file: JSON lines ({"prompt": ..., optional "output_len"}) or plain
    text lines. Blank lines are skipped. num_prompts takes the first n, cycling if needed."""
    _check_len("output_len", output_len)
    items: list[tuple[str, int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            prompt, n_out = _parse_line(line, output_len, f"{path}:{lineno}")
            items.append((prompt, n_out))
    if not items:
        raise ValueError(f"{path} has no prompts")
    if num_prompts is not None:
        _check_len("num_prompts", num_prompts)
        items = [items[i % len(items)] for i in range(num_prompts)]
    out = []
    for prompt, n_out in items:
        ids = tokenizer.encode(prompt)
        out.append(SampleRequest(prompt, len(ids), n_out, tuple(ids)))
    return out


def _parse_line(line: str, output_len: int, where: str) -> tuple[str, int]:
    if not line.lstrip().startswith("{"):
        return line, output_len
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: a JSON line needs a non-empty string 'prompt'")
    n_out = obj.get("output_len", output_len)
    if not isinstance(n_out, int) or n_out < 1:
        raise ValueError(f"{where}: 'output_len' must be an integer >= 1, got {n_out!r}")
    return prompt, n_out
