"""Build a Tokenizer from GGUF `tokenizer.ggml.*` metadata on the `tokenizers` library.

Two vocabulary kinds (tokenizer.ggml.model):

  "gpt2"   byte-level BPE: tokens are byte-level strings (space = "Ġ"), merges are "a b" lines.
           The pre-tokenizer splits text into words before BPE; which regex depends on
           tokenizer.ggml.pre (see _PRE_TOKENIZERS).
  "llama"  SentencePiece BPE: tokens carry scores, spaces are "▁", bytes missing from the
           vocabulary fall back to <0xNN> tokens. SentencePiece merges the adjacent pair whose
           merged piece scores highest; tokenizers' BPE merges the pair of lowest rank, so the
           merges are generated from the vocabulary and ranked by the merged piece's score.

Control (type 3), user-defined (4) and unknown (2) tokens become added tokens, so they are
matched in text before BPE (llama.cpp's parse_special=true; transformers does the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from kvserve.loader.errors import CheckpointError
from kvserve.loader.tokenizer import Tokenizer

# llama.cpp's llama_token_type values.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6)

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_pre() -> pre_tokenizers.PreTokenizer:
    # The original SmolLM2 tokenizer.json: every digit is its own word, then GPT-2's regex.
    # (transformers' GGUF conversion differs on whitespace before digits; llama.cpp and the
    # original agree, e.g. "\n\n  0" -> ["\n\n  ", "0"].)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _regex_pre(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return build


# tokenizer.ggml.pre -> pre-tokenizer; anything else falls back to GPT-2's regex.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "smollm": _smollm_pre,
    "llama-bpe": _regex_pre(_LLAMA3_REGEX),
    "llama3": _regex_pre(_LLAMA3_REGEX),
    "qwen2": _regex_pre(_QWEN2_REGEX),
}
# Llama 3 looks a whole word up in the vocabulary before merging (HF: ignore_merges=True).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})


def _get(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    return meta.get(f"tokenizer.ggml.{key}", default)


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        # Some GGUFs repeat a string (padding tokens); the first id wins, as in llama.cpp.
        vocab.setdefault(tok, i)
    return vocab


def _bpe_merges(lines: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """"a b" lines -> pairs. A merge whose parts or result are not in the vocabulary could
    never apply (and makes tokenizers panic), so it is dropped."""
    merges = []
    for line in lines:
        left, sep, right = line.partition(" ")
        if sep and left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    return merges


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two vocabulary pieces, best merged score first."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> tuple[list[AddedToken], set[int]]:
    added, special_ids = [], set()
    for i, tok in enumerate(tokens):
        if types[i] in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            added.append(AddedToken(tok, special=True, normalized=False))
            special_ids.add(i)
        elif types[i] == TOKEN_USER_DEFINED:
            added.append(AddedToken(tok, special=False, normalized=False))
    return added, special_ids


def build_gguf_backend(meta: dict[str, Any]) -> tuple[tokenizers.Tokenizer, set[int]]:
    """GGUF metadata -> (tokenizers.Tokenizer, ids of special tokens)."""
    kind = _get(meta, "model")
    tokens: list[str] | None = _get(meta, "tokens")
    if not tokens:
        raise CheckpointError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types: list[int] = list(_get(meta, "token_type") or [TOKEN_NORMAL] * len(tokens))
    vocab = _vocab_dict(tokens)

    if kind == "gpt2":
        merge_lines: list[str] = _get(meta, "merges") or []
        if not merge_lines:
            raise CheckpointError("GGUF tokenizer.ggml.model is 'gpt2' but it has no "
                                  "tokenizer.ggml.merges")
        merges = _bpe_merges(merge_lines, vocab)
        pre = str(_get(meta, "pre", "default"))
        backend = tokenizers.Tokenizer(models.BPE(
            vocab, merges, fuse_unk=False, byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES))
        if pre == "qwen2":
            backend.normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json
        backend.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _gpt2_pre)()
        backend.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores: list[float] = list(_get(meta, "scores") or [0.0] * len(tokens))
        unk_id = _get(meta, "unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
        backend = tokenizers.Tokenizer(models.BPE(
            vocab, _spm_merges(tokens, scores, types, vocab), unk_token=unk, fuse_unk=True,
            byte_fallback=True))
        add_space_prefix = bool(_get(meta, "add_space_prefix", True))
        replace = normalizers.Replace(" ", "\u2581")
        backend.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
                              if add_space_prefix else replace)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))  # drop the prefix space added on encode
        backend.decoder = decoders.Sequence(steps)
    else:
        raise CheckpointError(f"unsupported GGUF tokenizer.ggml.model {kind!r}; supported: "
                              "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")

    added, special_ids = _added_tokens(tokens, types)
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend, special_ids


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    backend, special_ids = build_gguf_backend(meta)
    eos = [_get(meta, key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    default_add_bos = _get(meta, "model") == "llama"  # SentencePiece models add BOS by default
    return Tokenizer(
        backend,
        bos_token_id=_get(meta, "bos_token_id"),
        eos_token_ids=[int(e) for e in eos if e is not None],
        add_bos_token=bool(_get(meta, "add_bos_token", default_add_bos)),
        chat_template=meta.get("tokenizer.chat_template"),
        all_special_ids=special_ids,
        unk_token_id=_get(meta, "unknown_token_id"),
        pad_token_id=_get(meta, "padding_token_id"),
    )
