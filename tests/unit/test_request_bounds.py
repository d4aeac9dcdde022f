"""The request-side bounds that keep a bad body cheap: pydantic fails fast on every list (one
error per list, not one per item and union member), the prompt's shape is checked in one pass
with one precise error, and the sampling fields refuse the combinations that would corrupt
the output."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvserve.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from kvserve.server.errors import from_validation_error, from_value_error
from kvserve.server.protocol import (
    MAX_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)


def _error(model: Any, body: dict[str, Any]) -> tuple[ValidationError, Any]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value, from_validation_error(info.value)


@pytest.mark.parametrize("model, body, param, words", [
    # 150k wrongly typed prompt items: 450,001 errors before, one now.
    (CompletionRequest, {"prompt": [1.5] * 150_000}, "prompt", "prompt[0]"),
    (CompletionRequest, {"prompt": [1, 2] * 1000 + ["x"]}, "prompt", "prompt[2000]"),
    (CompletionRequest, {"prompt": ["a"] * 100}, "prompt", "at most 64 prompts"),
    (CompletionRequest, {"prompt": [[1]] * 10 + [[2, "x"]]}, "prompt", "prompt[10][1]"),
    (CompletionRequest, {"prompt": [7] * (MAX_TOKEN_IDS + 1)}, "prompt",
     f"at most {MAX_TOKEN_IDS} token ids"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {str(i): "x" for i in range(100_000)}},
     "logit_bias", "at most 1024"),
    (CompletionRequest, {"prompt": "x", "stop": [1] * 100_000}, "stop", "stop"),
    # 1,000 messages x 1,000 bad content parts: 2,001,000 errors (8 s to format) before.
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{}] * 1000}] * 1000},
     "messages[0].content", "messages[0].content"),
    (DetokenizeRequest, {"tokens": [0.5] * 200_000}, "tokens", "tokens"),
    (DetokenizeRequest, {"tokens": [1] * (MAX_TOKEN_IDS + 1)}, "tokens", "tokens"),
])
def test_bad_lists_cost_one_error(model: Any, body: dict[str, Any], param: str,
                                  words: str) -> None:
    err, api = _error(model, body)
    assert err.error_count() <= 4, err.error_count()  # one per union member at most
    assert api.status == 400 and api.param is not None and api.param.startswith(param)
    assert words in api.message, api.message


def test_valid_lists_still_validate() -> None:
    assert CompletionRequest.model_validate({"prompt": list(range(MAX_TOKEN_IDS))}).prompt[-1] \
        == MAX_TOKEN_IDS - 1
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompt == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt == ["a", "b"]
    r = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}]})
    assert r.messages[0].role == "developer"


def test_sampling_combinations_that_would_corrupt_output_are_refused() -> None:
    schema = StructuredOutputsParams(json_object=True)
    for kw in ({"min_tokens": 3}, {"ignore_eos": True}):
        with pytest.raises(ValueError, match="structured output .* min_tokens > 0 or "
                                             "ignore_eos"):
            SamplingParams(structured_outputs=schema, **kw)  # type: ignore[arg-type]
    SamplingParams(structured_outputs=schema)  # alone it is fine
    for bad in (1e-300, 0.0, 0.005):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 2.0\]"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01


@pytest.mark.parametrize("kw, param", [
    ({"top_p": 0.0}, "top_p"),
    ({"logit_bias": {5: 500.0}}, "logit_bias"),  # logit_bias[5] must be in ...
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stop": ["x" * 1000]}, "stop"),  # each stop string must be ...
    ({"stop_token_ids": [-1]}, "stop_token_ids"),  # stop_token_ids[] must be ...
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"structured_outputs": StructuredOutputsParams(json_object=True), "ignore_eos": True},
     "response_format"),
])
def test_a_bad_sampling_value_names_its_field(kw: dict[str, Any], param: str) -> None:
    """The server's error names the field from the error itself (ParamError.param), never
    from its message's words: a message that starts with another field's name keeps the
    field it was raised for, and a plain ValueError names none."""
    with pytest.raises(ParamError) as info:
        SamplingParams(**kw)
    assert info.value.param == param
    fields = {"top_p", "logit_bias", "stop", "stop_token_ids", "min_tokens", "max_tokens",
              "response_format", "messages"}
    assert from_value_error(info.value, fields).param == param
    assert from_value_error(info.value, fields, {param: "x"}).param == "x"
    assert from_value_error(ParamError("max_tokens", "top_p must be ..."), fields).param \
        == "max_tokens"
    assert from_value_error(ValueError(str(info.value)), fields).param is None
    assert from_value_error(ParamError("seed", "seed must be ..."), fields).param is None
