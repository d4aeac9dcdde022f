"""`kvserve serve`'s model arguments: MODEL and repeated --model [NAME=]MODEL."""

from __future__ import annotations

import pytest

from kvserve.server.cli import model_args


def test_one_model_as_before() -> None:
    assert model_args(None, None) == [(None, None)]  # the default model
    assert model_args("m.gguf", None) == [(None, "m.gguf")]
    assert model_args(None, ["m.gguf"]) == [(None, "m.gguf")]
    assert model_args("m.gguf", ["m.gguf"]) == [(None, "m.gguf")]
    assert model_args(None, ["chat=m.gguf"]) == [("chat", "m.gguf")]  # named


def test_several_models_each_named() -> None:
    assert model_args(None, ["a=smollm2-135m", "b=/x/y", "c=/p=q"]) == [
        ("a", "smollm2-135m"), ("b", "/x/y"), ("c", "/p=q")]


def test_a_path_with_an_equals_sign_that_exists_is_a_path(tmp_path) -> None:
    d = tmp_path / "k=v"
    d.mkdir()
    assert model_args(None, [str(d)]) == [(None, str(d))]


@pytest.mark.parametrize("tag, flags, match", [
    ("m1", ["m2"], "the model is given twice: 'm1' and --model 'm2'"),
    ("m1", ["a=x", "b=y"], "give no MODEL argument"),
    (None, ["a=x", "y"], "each --model must be NAME=MODEL, got 'y'"),
    (None, ["a=x", "a=y"], "'a' is given twice"),
])
def test_bad_model_arguments(tag: str | None, flags: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        model_args(tag, flags)
