"""tests/e2e/test_decode_graphs.py on a CUDA GPU, with real captures and replays: a padded
replay against the eager step, and an engine with graphs against one with enforce_eager."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_decode_graphs import (  # noqa: F401  (the tests)
    test_a_padded_replay_is_the_eager_step,
    test_an_engine_with_graphs_gives_the_eager_engines_tokens,
    test_shapes_round_up_and_stay_bounded,
    tiny_dir,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def target() -> tuple[str, str, bool]:
    return "cuda", "auto", True
