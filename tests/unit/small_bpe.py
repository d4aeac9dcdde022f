"""A small byte-level BPE trained in-process, for the tests of text output (no model files)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "hello world, hello there, hello again",
    "the quick brown fox jumps over the lazy dog",
    "stop signs say stop; hello stop",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
] * 20


def train_bpe() -> Tokenizer:
    """A 320-token byte-level BPE over CORPUS, "<eos>" its one special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


class BPEAdapter:
    """The decode() interface the detokenizer expects, plus a log of window sizes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids
