"""continue_final_message: the prompt is the rendered conversation cut right after the final
message's content, found with a sentinel, so neither a template that rewrites the content
(trims it) nor a short content that also occurs inside the template's own markup
("im" in "<|im_end|>") moves the cut."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvserve.server.serving_chat import _continue_final_text

TRIM = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DROP_ASSISTANT = ("{% for m in messages %}{% if m['role'] != 'assistant' %}"
                  "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}")


def _tok(smollm2: Any, template: str | None = None) -> Any:
    tok = copy.copy(smollm2[1].tokenizer)
    if template is not None:
        tok.chat_template = template
    return tok


def test_cut_after_a_short_content_found_inside_the_markup(smollm2: Any) -> None:
    tok = _tok(smollm2)  # SmolLM2's ChatML template
    conv = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "im"}]
    full = tok.apply_chat_template(conv, add_generation_prompt=False)
    assert isinstance(full, str) and full.endswith("im<|im_end|>\n")
    # rfind("im") matched inside the closing <|im_end|>: the old cut kept "<|im".
    assert full[:full.rfind("im") + 2].endswith("<|im")
    got = _continue_final_text(tok, conv)
    assert got == full[:-len("<|im_end|>\n")] and got.endswith("assistant\nim")


def test_cut_when_the_template_trims_the_content(smollm2: Any) -> None:
    tok = _tok(smollm2, TRIM)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, "}]
    rendered = tok.apply_chat_template(conv, add_generation_prompt=False)
    assert rendered == "<|user|>Hi</s><|assistant|>Hello,</s>"
    assert rendered.rfind("Hello, ") == -1  # the old cut: -1 + 7, a prompt of "<|user|"
    assert _continue_final_text(tok, conv) == "<|user|>Hi</s><|assistant|>Hello, "


def test_a_template_that_drops_the_final_message_is_an_error(smollm2: Any) -> None:
    tok = _tok(smollm2, DROP_ASSISTANT)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ValueError, match="continue_final_message"):
        _continue_final_text(tok, conv)
