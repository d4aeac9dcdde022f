"""Fixtures that load the default model (SmolLM2-135M GGUF) once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine
from kvserve.loader import load_checkpoint, resolve_model
from kvserve.models import build_model
from kvserve.ops import get_ops

REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


@pytest.fixture(scope="session")
def gpl_text() -> str:
    return (REFERENCE_DIR / "GPL-3.txt").read_text()


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """(path, checkpoint, kvserve model) as the engine builds it by default: the default ops
    backend, the GGUF's Q4_1 / Q8_0 weights repacked and run against int8-quantized
    activations (quantization "gguf", llama.cpp's arithmetic)."""
    path = resolve_model(None)
    ckpt = load_checkpoint(path)
    return path, ckpt, build_model(ckpt, get_ops("auto"), torch.float32, "gguf")


@pytest.fixture(scope="session")
def smollm2_exact(smollm2: Any) -> Any:
    """The same weights with quantization "gguf_exact": blocks as stored, float32 compute,
    so the output is the float32 model's bit for bit (what HF parity holds to 1e-4)."""
    path, ckpt, _ = smollm2
    return path, ckpt, build_model(ckpt, get_ops("auto"), torch.float32, "gguf_exact")


@pytest.fixture(scope="session")
def make_engine(smollm2: Any, request: pytest.FixtureRequest) -> Callable[..., LLMEngine]:
    """Builds an engine over the shared model with the given EngineArgs fields
    (quantization="gguf_exact" picks the smollm2_exact model)."""
    path, ckpt, _ = smollm2

    def make(**kwargs: Any) -> LLMEngine:
        kwargs.setdefault("kv_cache_memory", "256MiB")  # ~5,600 tokens; keeps tests light
        args = EngineArgs.from_kwargs(model=path, **kwargs)
        config = args.create_engine_config(path, ckpt.model_config)
        fixture = "smollm2_exact" if config.quantization == "gguf_exact" else "smollm2"
        assert config.quantization in ("gguf", "gguf_exact"), config.quantization
        model = request.getfixturevalue(fixture)[2]
        return LLMEngine(config, ckpt.tokenizer, model, LLMEngine.num_kv_blocks(config))

    return make


def run_all(engine: LLMEngine) -> dict[str, Any]:
    """Step until idle; returns request_id -> final RequestOutput."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done
