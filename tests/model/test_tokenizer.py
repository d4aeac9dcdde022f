"""The GGUF-built tokenizer against independent references: llama.cpp's ids for the default
model, and transformers' chat-template rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvserve.loader import Tokenizer, load_checkpoint, resolve_model
from kvserve.loader.gguf_tokenizer import build_gguf_backend, tokenizer_from_gguf

REFERENCE = (Path(__file__).parents[2].parent / "shared" / "reference"
             / "smollm2_tokenization_llamacpp.json")


def _cases() -> list[dict[str, Any]]:
    if not REFERENCE.is_file():
        return []
    return json.loads(REFERENCE.read_text(encoding="utf-8"))["cases"]


CASES = _cases()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_checkpoint(resolve_model(None)).tokenizer


def test_reference_file_present() -> None:
    # The ids were produced by llama.cpp on the same GGUF (see the file's "note"), with
    # add_special=false, parse_special=true; the model's add_bos_token is false.
    assert REFERENCE.is_file(), f"missing {REFERENCE}"
    assert len(CASES) == 31


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_encode_matches_llamacpp(tok: Tokenizer, case: dict[str, Any]) -> None:
    ids = tok.encode(case["text"], add_special_tokens=True)
    assert ids == case["ids"], tok.convert_ids_to_tokens(ids)[:40]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_decode_round_trips(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]


def test_default_model_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert not tok.add_bos_token
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert tok.all_special_ids == set(range(17))  # <|endoftext|> ... <empty_output>
    assert tok.convert_ids_to_tokens([1, 2, 19556]) == ["<|im_start|>", "<|im_end|>", "Hello"]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([49152])


# --- chat template vs transformers -------------------------------------------------------

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi <b>there</b> & café"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?\n  "}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "<|im_end|> literal"}],
]


@pytest.fixture(scope="module")
def hf_tok(tok: Tokenizer) -> Any:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>")
    hf.chat_template = tok.chat_template
    return hf


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok: Any, conv: int,
                                            add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[conv]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=False)
    assert ours == theirs
    ours_ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       tokenize=True)
    theirs_ids = hf_tok.apply_chat_template(messages,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=True, return_dict=False)
    assert ours_ids == list(theirs_ids)


def test_default_template_text(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(joined)


# A template exercising transformers' helpers: tojson without HTML escaping, loop controls,
# bos_token, strip of blocks, raise_exception, and extra kwargs.
_HELPERS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}"
    "{{ raise_exception('roles must not be bad') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}\n"
    "  {{ m | tojson }}|{{ m.content | tojson(indent=2) }}\n"
    "{% endfor %}{% if add_generation_prompt %}GEN{{ extra }}{% endif %}")


def test_helper_template_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    messages = [{"role": "user", "content": "<a> & 'b' é"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "y"}, {"role": "user", "content": "z"}]
    custom = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2], add_bos_token=False,
                       chat_template=_HELPERS_TEMPLATE, all_special_ids=tok.all_special_ids,
                       unk_token_id=0, pad_token_id=2)
    ours = custom.apply_chat_template(messages, extra="!")
    theirs = hf_tok.apply_chat_template(messages, chat_template=_HELPERS_TEMPLATE,
                                        add_generation_prompt=True, tokenize=False, extra="!")
    assert ours == theirs
    assert "\\u00e9" not in ours and "<a> & 'b'" in ours
    with pytest.raises(ValueError, match="roles must not be bad"):
        custom.apply_chat_template([{"role": "bad", "content": "x"}])


@pytest.mark.parametrize(("messages", "match"), [
    ([{"role": 3, "content": "x"}], r"messages\[0\]\.role must be a string"),
    ([{"content": "x"}], r"messages\[0\]\.role must be a string"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     r"content\[0\] must be a text part.*'image_url'"),
    ([{"role": "user"}], r"has no content"),
    (["hello"], r"messages\[0\] must be an object"),
    ([], r"non-empty list"),
])
def test_malformed_messages(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_no_template_is_a_clear_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=[2], add_bos_token=False,
                     chat_template=None, all_special_ids=())
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


# --- SentencePiece ("llama") vocabularies and other pre-tokenizers ------------------------

def _spm_meta(add_space_prefix: bool = True) -> dict[str, Any]:
    # A vocabulary where SentencePiece's highest-score-first merging and a naive left-to-right
    # merge disagree: "▁ab" + "c" must win over "▁a" + "bc" because "▁ab" scores higher.
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    pieces += [("▁", -1.0, 1), ("a", -2.0, 1), ("b", -3.0, 1), ("c", -4.0, 1),
               ("▁a", -5.0, 1), ("bc", -7.0, 1), ("▁ab", -6.0, 1), ("<tool>", 0.0, 4)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p for p, _, _ in pieces],
        "tokenizer.ggml.scores": [s for _, s, _ in pieces],
        "tokenizer.ggml.token_type": [t for _, _, t in pieces],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def test_sentencepiece_vocab() -> None:
    tok = tokenizer_from_gguf(_spm_meta())
    ids = {t: i for i, t in enumerate(_spm_meta()["tokenizer.ggml.tokens"])}
    assert tok.add_bos_token  # the SentencePiece default when the GGUF does not say
    assert tok.encode("abc") == [1, ids["▁ab"], ids["c"]]
    assert tok.encode("abc ab", add_special_tokens=False) == [
        ids["▁ab"], ids["c"], ids["▁ab"]]
    # "é" is not in the vocabulary: UTF-8 bytes C3 A9 through <0xNN> tokens.
    assert tok.encode("é", add_special_tokens=False) == [ids["▁"], ids["<0xC3>"], ids["<0xA9>"]]
    assert tok.encode("a<tool>b</s>", add_special_tokens=False) == [
        ids["▁a"], ids["<tool>"], ids["▁"], ids["b"], 2]
    for text in ("abc ab", "é a", "c  b"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.all_special_ids == {0, 1, 2}


def test_sentencepiece_without_space_prefix() -> None:
    tok = tokenizer_from_gguf(_spm_meta(add_space_prefix=False))
    ids = {t: i for i, t in enumerate(_spm_meta()["tokenizer.ggml.tokens"])}
    assert tok.encode("ab", add_special_tokens=False) == [ids["a"], ids["b"]]
    assert tok.decode(tok.encode("ab c")) == "ab c"


@pytest.mark.parametrize(("pre", "text", "words"), [
    ("llama-bpe", "12345 abc's\n\n x", ["123", "45", "Ġabc", "'s", "ĊĊ", "Ġx"]),
    ("qwen2", "12345 abc", ["1", "2", "3", "4", "5", "Ġabc"]),
    ("smollm", "a12 b", ["a", "1", "2", "Ġb"]),
    ("gpt2", "a12 b", ["a", "12", "Ġb"]),
    ("no-such-pre", "a12 b", ["a", "12", "Ġb"]),  # unknown: GPT-2's regex
])
def test_gpt2_pre_tokenizers(pre: str, text: str, words: list[str]) -> None:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b", "a c", "malformed"]}
    backend, _ = build_gguf_backend(meta)
    assert [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(text)] == words
