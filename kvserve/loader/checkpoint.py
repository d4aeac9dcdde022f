"""Checkpoint: what a loaded model file gives the engine (config, tokenizer, weights)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import ModelConfig
from kvserve.loader.errors import CheckpointError
from kvserve.loader.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    model_config: ModelConfig
    tokenizer: Tokenizer
    path: str
    _weights: Callable[..., Iterator[tuple[str, Any]]] = field(repr=False)

    def weights(self, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        """(HF name, float32 CPU tensor) pairs, dequantized one at a time so that at most one
        float32 copy of a tensor is alive beyond what the caller keeps. keep_quantized: a
        GGUF file's block-quantized matrices come as kvserve.quant.gguf_weights.GGUFWeight blocks
        (other checkpoints have none)."""
        return self._weights(keep_quantized)


def load_checkpoint(path: str) -> Checkpoint:
    """A .gguf file or an HF directory (config.json + safetensors + tokenizer.json)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"{path} is a directory without config.json; expected an HF "
                                  "checkpoint directory or a .gguf file")
        from kvserve.loader.hf_loader import HFCheckpoint

        hf = HFCheckpoint(path)
        return Checkpoint(hf.model_config, hf.tokenizer, path, hf.weights)
    if os.path.isfile(path):
        from kvserve.loader.gguf_loader import GGUFCheckpoint

        gg = GGUFCheckpoint(path)
        return Checkpoint(gg.model_config, gg.tokenizer, path, gg.weights)
    raise CheckpointError(f"no checkpoint at {path!r}: expected a .gguf file or an HF "
                          "checkpoint directory")
