"""Decode steps from CUDA graphs (kvserve/graphs.py): the padded static-buffer path against the
eager step. Here, on the CPU's torch backend, the path runs without a capture
(`DecodeGraphs(capture=False)`: the same buffers, padding and shapes); tests/cuda/
test_cuda_graphs.py runs these tests with real captures and replays.

References: the eager forward of the same model on the same inputs (float32: the rows differ
only where a GEMM of the padded batch sums in another order, ~1e-6), and an engine without
graphs (greedy tokens and their logprobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.graphs import MAX_GATHER_TOKENS, DecodeGraphs
from kvserve.models import get_model_class
from kvserve.ops import get_ops
from tests.e2e.test_quantize_cli import tiny_dir  # noqa: F401  (a fixture)
from tests.helpers import PagedSequence, model_config_from_hf, tiny_hf_model


@pytest.fixture(scope="module")
def target() -> tuple[str, str, bool]:
    """(device, ops backend, capture): tests/cuda overrides it with ("cuda", "auto", True)."""
    return "cpu", "torch", False


def test_shapes_round_up_and_stay_bounded() -> None:
    g = DecodeGraphs(lambda inp, kv: (inp, kv), None, torch.device("cpu"), block_size=16,
                     max_batch=60, max_blocks=300, max_query_len=4, capture=False)
    assert g.batch_sizes == (1, 2, 4, 8, 16, 24, 32, 48, 60)  # max_num_seqs closes the list
    assert g.block_counts == (16, 32, 64, 128, 256, 300)
    assert g.shape_for(1, 1, 1) == (1, 1, 16)
    assert g.shape_for(3, 1, 16 * 16) == (4, 1, 16)
    assert g.shape_for(3, 1, 16 * 16 + 1) == (4, 1, 32)
    # Q queries: a request padded to them may reach Q - 1 positions further.
    assert g.shape_for(3, 3, 16 * 16 - 2) == (4, 3, 16)
    assert g.shape_for(3, 3, 16 * 16 - 1) == (4, 3, 32)
    assert g.shape_for(3, 5, 10) is None  # more than 1 + K queries
    assert g.shape_for(33, 1, 100) == (48, 1, 16)
    assert g.shape_for(61, 1, 100) is None  # more requests than max_num_seqs: eager
    assert g.shape_for(1, 1, 300 * 16) == (1, 1, 300)
    assert g.shape_for(1, 1, 300 * 16 + 1) is None
    # The attention's gathered context stays bounded: a graph's B x C x block_size.
    assert 48 * 300 * 16 <= MAX_GATHER_TOKENS < 60 * 300 * 16
    assert g.shape_for(48, 1, 300 * 16) == (48, 1, 300)
    assert g.shape_for(49, 1, 300 * 16) is None
    # A graph reads its inputs where they were at its capture: every tensor of a graph's
    # ModelInput must live in a buffer the DecodeGraphs keeps, none in a temporary.
    kept = {t.untyped_storage().data_ptr() for v in vars(g).values()
            for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)}
    for shape in ((1, 1, 16), (4, 3, 32), (60, 4, 300)):
        inp = g._static_input(*shape)
        for name, t in vars(inp).items():
            if isinstance(t, torch.Tensor):
                assert t.untyped_storage().data_ptr() in kept, (shape, name)


@torch.inference_mode()
@pytest.mark.parametrize("fed", [[1, 1, 1], [1, 3, 2]])
def test_a_padded_replay_is_the_eager_step(target: tuple[str, str, bool], fed: list[int]
                                           ) -> None:
    """Three sequences of 5, 21 and 40 tokens decode: one token each, or a speculative step's
    1, 3 and 2 (padded to 3 queries each), through the graphs' buffers (batch padded to 4,
    context to 16 blocks of 4) against the eager step on a copy of the cache. Logits and the
    KV rows written agree; every other slot, the null block included, is untouched by the
    padding."""
    device, backend, capture = target
    hf = tiny_hf_model("llama")
    cfg = model_config_from_hf(hf.config, "LlamaForCausalLM")
    ops = get_ops(backend, device=device)
    model = get_model_class("LlamaForCausalLM")(cfg, ops, torch.float32)
    model.load_weights((k, v.detach().clone()) for k, v in hf.state_dict().items())
    model = model.to(device).eval()
    seqs = PagedSequence(model, num_blocks=64, block_size=4, device=device)
    g = torch.Generator().manual_seed(0)
    for n in (5, 21, 40):
        seqs.forward({seqs.new_seq(): torch.randint(0, 256, (n,), generator=g).tolist()})
    before = seqs.kv.clone()
    step = {s: torch.randint(0, 256, (q,), generator=g).tolist() for s, q in enumerate(fed)}
    inp = _decode_input(seqs, step)
    graphs = DecodeGraphs(lambda i, kv: _forward_all(model, i, kv), seqs.kv,
                          torch.device(device), block_size=4, max_batch=8, max_blocks=32,
                          max_query_len=3, max_position=cfg.max_position_embeddings - 1,
                          capture=capture)
    assert graphs.shape_for(3, max(fed), inp.max_seq_len) == (4, max(fed), 16)
    ran = graphs.run(inp)
    assert ran is not None and graphs.replays == {max(fed): 1}
    hidden, logits = ran
    if max(fed) == 1:  # every graph's outputs land in the same buffers, none of their own
        assert graphs._out is not None
        assert logits.untyped_storage().data_ptr() == graphs._out[1].untyped_storage().data_ptr()
    after_graph = seqs.kv.clone()
    seqs.kv.copy_(before)
    eager_hidden, eager_logits = _forward_all(model, inp, seqs.kv)
    assert hidden.shape == eager_hidden.shape and logits.shape == (sum(fed), cfg.vocab_size)
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after_graph, seqs.kv, atol=1e-5, rtol=1e-5)
    written = torch.zeros(64 * 4, dtype=torch.bool, device=device)
    written[inp.slot_mapping] = True
    untouched = ~written.view(64, 4)
    assert torch.equal(after_graph[:, :, untouched], before[:, :, untouched])
    # A prefill chunk is not a graph's.
    assert graphs.run(_decode_input(seqs, {0: [1, 2, 3, 4]})) is None


def _forward_all(model: Any, inp: Any, kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model(inp, kv)
    return hidden, model.compute_logits(hidden)


def _decode_input(seqs: PagedSequence, chunks: dict[int, list[int]]) -> Any:
    """PagedSequence.forward's ModelInput for chunks, without running it."""
    captured = {}
    model = seqs.model
    seqs.model = _Capture(captured, model)
    lens = list(seqs.lens)
    seqs.forward(chunks)
    seqs.model, seqs.lens = model, lens
    return captured["inp"]


class _Capture:
    def __init__(self, captured: dict[str, Any], model: Any) -> None:
        self.captured, self.model = captured, model

    def __call__(self, inp: Any, kv: Any) -> torch.Tensor:
        self.captured["inp"] = inp
        return torch.zeros(inp.input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@pytest.mark.parametrize("kv,spec", [("auto", None), ("int8", None), ("auto", "ngram")])
def test_an_engine_with_graphs_gives_the_eager_engines_tokens(
        target: tuple[str, str, bool], kv: str, spec: str | None,
        tiny_dir: tuple[Path, Any]) -> None:  # noqa: F811
    """A tiny random Llama (a byte vocabulary), its KV cache float32 or int8 (a scale per
    row), greedy, six requests of different lengths arriving together: decode batches of 6
    down to 1 as they finish (padded to 8, 4, 2, 1), contexts in the graphs' first two
    block counts, one request with prompt logprobs and one with logprobs; or the same with
    n-gram speculation (K = 3 every step: verify steps of 1 to 4 queries a request). The
    tokens and logprobs are an engine's without graphs."""
    device, backend, capture = target
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there",
               "def fibonacci(n):", "1, 2, 3, 4,", "The GNU General Public License " * 9,
               "Hello"]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True,
                             logprobs=2 if i == 1 else None,
                             prompt_logprobs=1 if i == 2 else None) for i in range(6)]
    kw: dict[str, Any] = dict(device=device, ops_backend=backend, dtype="float32",
                              kv_cache_memory="64MiB", max_num_seqs=8, kv_cache_dtype=kv)
    if spec is not None:
        kw["speculative_config"] = {"method": spec, "num_speculative_tokens": 3,
                                    "prompt_lookup_min": 1, "adaptive": False}
    path = str(tiny_dir[0])
    eager = LLM(model=path, enforce_eager=True, **kw)
    assert eager.llm_engine.runner.graphs is None
    want = eager.generate(prompts, params, use_tqdm=False)
    del eager
    llm = LLM(model=path, **kw)
    runner = llm.llm_engine.runner
    if not capture:  # the CPU builds none; the same path without a capture
        sched = llm.llm_engine.config.scheduler
        runner.graphs = DecodeGraphs(runner._model_logits, runner.kv_cache, runner.device,
                                     runner.block_size, sched.max_num_seqs,
                                     -(-sched.max_model_len // runner.block_size),
                                     max_query_len=4 if spec else 1,
                                     max_position=sched.max_model_len - 1, capture=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert runner.graphs is not None
    replays = runner.graphs.replays
    if spec is None:
        # Every decode step (all but the first of each request) came from the graphs.
        assert replays[1] >= max(p.max_tokens for p in params) - 1 and len(replays) == 1
    else:
        stats = runner.spec_stats
        assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert sum(replays[q] for q in (2, 3, 4)) > 0, replays
    assert max(len(p) for p in prompts) + 33 > 16 * 16  # the long one needs 32 blocks
    for w, o in zip(want, got, strict=True):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
        if w.outputs[0].logprobs:
            for a, b in zip(w.outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert abs(a[t].logprob - b[t].logprob) < 1e-4
        assert (w.prompt_logprobs is None) == (o.prompt_logprobs is None)
