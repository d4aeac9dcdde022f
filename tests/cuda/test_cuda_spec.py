"""Speculative decoding on a CUDA GPU, on tiny random models written in the test: greedy
output with each proposer is token for token the output without it on the same device, in a
batch whose small cache forces preemption; drafts are made, accepted and rejected; a draft
model's own KV cache lives on the GPU; seeded sampling through a draft model reproduces
itself. (The CPU suite, tests/e2e/test_spec_decode.py, covers the rest: distributions,
processors, stops, the server.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvserve import LLM
from kvserve.sampling_params import SamplingParams
from tests.e2e.test_tensor_parallel import save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The target, and a draft: the target's weights with noise, so that it agrees with
    the target mostly but not always."""
    out = {}
    for name in ("target", "draft"):
        path = tmp_path_factory.mktemp(name)
        hf = save_tiny(path, "llama", seed=3)
        if name == "draft":
            g = torch.Generator().manual_seed(4)
            with torch.no_grad():
                for w in hf.parameters():
                    w.add_(torch.randn(w.shape, generator=g) * 0.5 * w.std())
            hf.save_pretrained(str(path), safe_serialization=True)
        out[name] = str(path)
    return out


def _prompts() -> list[list[int]]:
    """Repeating prompts (n-gram lookup finds drafts in them) and random ones."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(10):
        motif = torch.randint(1, 255, (3 + i % 4,), generator=g).tolist()
        out.append(motif * (4 + i % 3) if i % 2 == 0
                   else torch.randint(1, 255, (20 + 3 * i,), generator=g).tolist())
    return out


def _generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(models: dict[str, str], spec: dict[str, Any] | None, **kw: Any) -> LLM:
    return LLM(model=models["target"], device=DEV, dtype="float32", kv_cache_memory="64MiB",
               speculative_config=spec, **kw)


def _specs(models: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
            "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
            "draft_model": {"method": "draft_model", "model": models["draft"],
                            "num_speculative_tokens": 3, "adaptive": False},
            "self_draft": {"method": "self_draft", "num_layers": 1,
                           "num_speculative_tokens": 3, "adaptive": False}}


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "self_draft"])
def test_greedy_speculation_on_cuda_is_plain_decoding(models: dict[str, str],
                                                      method: str) -> None:
    params = [SamplingParams(temperature=0, max_tokens=24 + 3 * i, ignore_eos=True)
              for i in range(10)]
    # 24 blocks of 16 cannot hold all ten requests at once: preemption.
    kw = dict(num_gpu_blocks_override=24, max_num_batched_tokens=64)
    plain = _generate(_llm(models, None, **kw), params)
    llm = _llm(models, _specs(models)[method], **kw)
    assert _generate(llm, params) == plain
    engine = llm.llm_engine
    assert engine.runner.kv_cache.device.type == "cuda"
    proposer_runner = getattr(engine.runner.proposer, "runner", None)
    if method in ("draft_model", "self_draft"):  # the draft's own cache (self_draft: a view)
        assert proposer_runner.kv_cache.device.type == "cuda"
    assert engine.scheduler.num_preemptions > 0
    st = engine.runner.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0, "no draft was accepted"
    if method in ("draft_model", "self_draft"):
        assert st.num_accepted_tokens < st.num_draft_tokens, "no draft was rejected"
    engine.scheduler.block_pool.check_integrity()


def test_seeded_sampling_through_a_draft_model_on_cuda_reproduces(
        models: dict[str, str]) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=24,
                             ignore_eos=True) for i in range(10)]
    spec = _specs(models)["draft_model"]
    first = _generate(_llm(models, spec), params)
    llm = _llm(models, spec)
    assert _generate(llm, params) == first
    assert llm.llm_engine.runner.spec_stats.num_accepted_tokens > 0
