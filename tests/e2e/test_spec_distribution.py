"""Distribution identity at temperature > 0, through the whole engine: thousands of samples
of a tiny target's tokens 2 and 3 (the first one is sampled before anything is drafted) with
speculation match the target's own distribution, computed independently by HF transformers on
the same weights, by a chi-square test; and the test fails when the acceptance rule is broken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers
import torch

from kvserve.engine_args import EngineArgs
from kvserve.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tests.conftest import run_all
from tests.helpers import tiny_hf_model
from tests.unit.test_rejection import chisquare

V = 8
# Every token occurs in it, so an n-gram of one token always finds drafts.
PROMPT = [3, 1, 4, 1, 5, 0, 2, 6, 7, 5, 3]
N = 4000


def _save(path: Path, seed: int, sharpen: float) -> Any:
    hf = tiny_hf_model("llama", seed=seed, vocab_size=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(sharpen)  # peaked distributions: the test then has power
    hf.save_pretrained(str(path), safe_serialization=True)
    vocab = {chr(ord("a") + i): i for i in range(V)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "h"}))
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """(target dir, draft dir, the target's P(token 2, token 3) [V, V] after PROMPT)."""
    target_dir = tmp_path_factory.mktemp("target")
    draft_dir = tmp_path_factory.mktemp("draft")
    hf = _save(target_dir, seed=1, sharpen=12.0)
    _save(draft_dir, seed=2, sharpen=12.0)
    # P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1 t2), by HF on every prefix.
    with torch.no_grad():
        def probs(prefix: list[int]) -> torch.Tensor:
            logits = hf(torch.tensor([PROMPT + prefix])).logits[0, -1]
            return torch.softmax(logits.double(), dim=0)

        joint = torch.zeros(V, V, dtype=torch.float64)
        p1 = probs([])
        for t1 in range(V):
            p2 = probs([t1])
            for t2 in range(V):
                joint[t2] += p1[t1] * p2[t2] * probs([t1, t2])
    return target_dir, draft_dir, joint


def _samples(target: Path, spec: dict[str, Any], broken: bool = False) -> tuple[torch.Tensor,
                                                                                 Any]:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(target), quantization="none", kv_cache_memory="64MiB", max_num_seqs=1024,
        max_num_batched_tokens=8192, speculative_config=spec, seed=7))
    if broken:
        # Verification told the drafts came from a uniform q: min(1, p / q') is then not the
        # rule for the q they were drawn from.
        proposer = engine.runner.proposer
        real = proposer.draft_probs
        proposer.draft_probs = lambda reqs, drafts: [  # type: ignore[method-assign]
            None if q is None else torch.full_like(q, 1 / V) for q in real(reqs, drafts)]
    # Token 1 is sampled before any draft; tokens 2 and 3 are verified drafts or emitted by
    # the rejection step (a fourth token leaves room for two drafts after token 1).
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for i in range(N):
        engine.add_request(str(i), {"prompt_token_ids": PROMPT}, sp)
    outs = run_all(engine)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for out in outs.values():
        t = out.outputs[0].token_ids
        counts[t[1], t[2]] += 1
    return counts, engine.runner.spec_stats


SPECS = {
    "draft_model": lambda d: {"method": "draft_model", "model": str(d),
                              "num_speculative_tokens": 2, "quantization": "none",
                              "adaptive": False},
    "ngram": lambda d: {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                        "adaptive": False},
}


def _pvalue(counts: torch.Tensor, joint: torch.Tensor) -> float:
    # Cells expected below 5 are pooled into one, as a chi-square test needs.
    expected = joint.flatten() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts.flatten()[~small], counts.flatten()[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("method", list(SPECS))
def test_sampled_tokens_follow_the_target_distribution(pair: Any, method: str) -> None:
    target, draft, joint = pair
    counts, stats = _samples(target, SPECS[method](draft))
    assert stats.num_draft_tokens > N // 2, "too few drafts to test anything"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _pvalue(counts, joint) > 1e-3


def test_a_broken_acceptance_rule_fails_the_same_test(pair: Any) -> None:
    target, draft, joint = pair
    counts, _ = _samples(target, SPECS["draft_model"](draft), broken=True)
    assert _pvalue(counts, joint) < 1e-6
