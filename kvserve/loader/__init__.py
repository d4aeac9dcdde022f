"""Checkpoint loading: GGUF files and HF directories -> ModelConfig, Tokenizer, weights.

    resolve_model(name or path) -> path
    load_checkpoint(path) -> Checkpoint(model_config, tokenizer, weights())
"""

from __future__ import annotations

from kvserve.loader.checkpoint import Checkpoint, load_checkpoint
from kvserve.loader.errors import CheckpointError
from kvserve.loader.resolve import DEFAULT_MODEL, default_model_path, resolve_model
from kvserve.loader.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "DEFAULT_MODEL", "Tokenizer", "default_model_path",
           "load_checkpoint", "resolve_model"]
