"""Tokenizer: a `tokenizers.Tokenizer` plus the facts the engine needs about it.

It is built either from GGUF metadata (gguf_tokenizer.py) or from an HF directory's
tokenizer.json (hf_loader.py). Encoding never runs the backend's post-processor: BOS is added
here, only when the model asks for it (add_bos_token), so the two sources behave the same and
a BOS is never added twice.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers

from kvserve.loader.chat_template import render_chat_template


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Iterable[int], add_bos_token: bool,
                 chat_template: str | None, all_special_ids: Iterable[int],
                 unk_token_id: int | None = None, pad_token_id: int | None = None) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        # Deduplicated, first one = the tokenizer's own EOS.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.all_special_ids: set[int] = set(all_special_ids)
        # id -> its text alone, filled as logprobs ask (bounded by the vocabulary). Plain dict
        # reads and writes are atomic, so any thread may fill it.
        self._token_text: dict[int, str] = {}
        for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"tokenizer {name} {value} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (e.g. to save a tokenizer.json)."""
        return self._backend

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary entry holds. A byte-level entry has a
        character per byte and a SentencePiece entry its characters (or <0xNN>), so no token
        encodes more characters of text than this (a fused-<unk> vocabulary aside)."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(t) for t in vocab), default=1)

    def decode_token(self, token_id: int) -> str:
        """One token's text (special tokens included), as logprobs show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special tokens written in the text are always parsed as specials: the backend
        # matches added tokens before the model runs (like llama.cpp's parse_special=true).
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        out = []
        for i in ids:
            token = self._backend.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            out.append(token)
        return out

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def _token_str(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens as template variables, as transformers passes them."""
        named = {"bos_token": self._token_str(self.bos_token_id),
                 "eos_token": self._token_str(self.eos_token_id),
                 "unk_token": self._token_str(self.unk_token_id),
                 "pad_token": self._token_str(self.pad_token_id)}
        return {k: v for k, v in named.items() if v is not None}

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead of "
                             "chat messages")
        special: Mapping[str, str] = self.special_tokens_map
        text = render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    special, **kwargs)
        if tokenize:
            # The template writes BOS itself when the model wants one.
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, add_bos_token={self.add_bos_token})")
