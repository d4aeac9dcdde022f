"""The prompt re-spaced: a second text the lookup proposers (ngram, suffix) read.

Asked to edit a hard-wrapped text and return it whole, a model writes each paragraph as one
line, with one space after a full stop (Qwen2.5-Coder 1.5B and SmolLM2 on the GPL's
paragraphs, wrapped at 72 columns, two spaces between sentences). The prompt's tokens then stop
matching the answer at every line break (`...designed\\nto take` in the prompt, `...designed
to take` in the answer), and a lookup drafts nothing for the two or three tokens it takes to
match again: 44 of the 111 verify steps of the input-grounded task's four prompts (n-gram,
K = 16, replayed on the target's own greedy answers; benchmarks/results/spec_notes.md).

So the lookups also read the prompt re-spaced: a line break (with the blanks before it)
between a non-blank character and a line that starts at its first column becomes one space,
and so does a run of two or more blanks between non-blank characters; the text is encoded
again with the model's tokenizer. An indented line (code) is never joined to the one above.
The result is only a guess, verified as every draft is, so the output stays exact; the
request's own tokens win where both match as long (ngram.py, suffix.py). A prompt that
re-spacing leaves as it is has none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_RESPACE = re.compile(r"(?<=\S)[ \t]*\n(?=\S)|(?<=\S)[ \t]{2,}(?=\S)")


def respace(text: str) -> str:
    """text with its wrapped lines joined and its runs of blanks single (above)."""
    return _RESPACE.sub(" ", text)


def respaced_prompt(tokenizer: Any, prompt_ids: Sequence[int]) -> list[int] | None:
    """The prompt's tokens re-spaced (decoded with its special tokens, re-spaced, encoded
    again), or None where re-spacing changes nothing or there is no tokenizer."""
    if tokenizer is None or not prompt_ids:
        return None
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    new = respace(text)
    return tokenizer.encode(new, add_special_tokens=False) if new != text else None
