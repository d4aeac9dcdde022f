"""Logit parity with HF transformers on tiny random-weight Llama / Mistral / Qwen2 models.

Tolerance: float32 on both sides, but different summation orders (fused qkv, paged
attention with online softmax, our kernels) give ~1e-6 relative differences per op that grow
through the layers; 1e-4 of the logits' scale leaves a wide margin while still catching any
real bug (a wrong RoPE, mask or bias shows up as O(1) differences).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvserve.distributed.group import TPGroup
from kvserve.models import get_model_class
from kvserve.ops import get_ops
from tests.helpers import (
    PagedSequence,
    assert_logits_close,
    kvserve_model_from_hf,
    model_config_from_hf,
    tiny_hf_model,
)

ARCHS = [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
         ("qwen2", "Qwen2ForCausalLM")]


@pytest.mark.parametrize("ops_name", ["reference", "auto", "torch"])
@pytest.mark.parametrize("arch,architecture", ARCHS)
def test_prefill_and_decode_match_hf(arch: str, architecture: str, ops_name: str) -> None:
    hf = tiny_hf_model(arch)
    model = kvserve_model_from_hf(hf, architecture, get_ops(ops_name))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (37,), generator=gen).tolist()
    runner = PagedSequence(model, block_size=4)
    seq = runner.new_seq()
    (logits,) = runner.forward({seq: prompt})
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert_logits_close(logits, ref)
    # Decode 12 steps feeding the greedy token; compare to HF on the whole sequence.
    tokens = list(prompt)
    for _ in range(12):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = runner.forward({seq: tokens[-1:]})
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1:]
        assert_logits_close(logits, ref)


@pytest.mark.parametrize("ops_name", ["reference", "auto", "torch"])
def test_mixed_varlen_batch_matches_hf(ops_name: str) -> None:
    """Prefill chunks and decodes of several sequences in one forward."""
    hf = tiny_hf_model("llama", seed=3)
    model = kvserve_model_from_hf(hf, "LlamaForCausalLM", get_ops(ops_name))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 1, 17)]
    runner = PagedSequence(model, block_size=4)
    seqs = [runner.new_seq() for _ in prompts]
    fed = [0] * len(prompts)
    # Step 1: prefill chunks of different sizes; step 2+: rest of the prompts mixed with
    # single-token steps of sequences that are already done.
    steps = [{0: 5, 1: 10, 2: 1, 3: 3}, {1: 13, 3: 14}, {0: 1, 2: 1}]
    extra = {s: list(p) for s, p in zip(seqs, prompts)}
    for step in steps:
        chunks = {}
        for s, n in step.items():
            if fed[s] + n > len(extra[s]):  # decoding: append a deterministic new token
                extra[s].append((7 * fed[s] + s) % 256)
            chunks[s] = extra[s][fed[s]: fed[s] + n]
        outs = runner.forward(chunks)
        for (s, chunk), logits in zip(chunks.items(), outs):
            fed[s] += len(chunk)
            with torch.no_grad():
                ref = hf(torch.tensor([extra[s][: fed[s]]])).logits[0, -len(chunk):]
            assert_logits_close(logits, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_track_float32(dtype: torch.dtype) -> None:
    """bf16/fp16 weights and KV cache: within half precision of HF's float32 logits
    (bf16 keeps 8 mantissa bits, so ~1e-2 relative per op; 5e-2 of the scale over 2 layers)."""
    hf = tiny_hf_model("llama", seed=4)
    cfg = model_config_from_hf(hf.config, "LlamaForCausalLM")
    model = get_model_class("LlamaForCausalLM")(cfg, get_ops("auto"), dtype)
    model.load_weights((k, v.detach().clone()) for k, v in hf.state_dict().items())
    runner = PagedSequence(model, block_size=4)
    runner.kv = runner.kv.to(dtype)
    seq = runner.new_seq()
    prompt = list(range(3, 40))
    (logits,) = runner.forward({seq: prompt})
    (step,) = runner.forward({seq: [int(logits[-1].argmax())]})
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [int(logits[-1].argmax())]])).logits[0]
    scale = ref.abs().max().item()
    assert logits.dtype == torch.float32  # logits are always returned in float32
    torch.testing.assert_close(torch.cat([logits, step]), ref, rtol=0, atol=5e-2 * scale)


@pytest.mark.parametrize("small_m", [None, 4])  # 4: the prefill rows go to torch's GEMM
@pytest.mark.parametrize("arch,architecture", [ARCHS[0], ARCHS[2]])  # Llama; Qwen2 (q/k/v bias)
def test_fused_cpu_layer_equals_python_layer_bit_for_bit(arch: str, architecture: str,
                                                          small_m: int | None) -> None:
    """The one-call C++ decoder layer runs the Python layer's kernels in the same order (the
    model's forward takes it for all layers at once: CpuOps.fused_llama_stack)."""
    from kvserve.ops.cpu import CpuOps

    hf = tiny_hf_model(arch, seed=7)
    fused_ops, plain_ops = CpuOps(fuse_layers=True), CpuOps(fuse_layers=False)
    if not fused_ops.fuse_layers:
        pytest.skip("no AVX2/FMA kernels on this CPU: nothing to fuse")
    if small_m is not None:
        fused_ops.small_m = plain_ops.small_m = small_m
    outs = []
    for ops in (fused_ops, plain_ops):
        runner = PagedSequence(kvserve_model_from_hf(hf, architecture, ops), block_size=4)
        a, b = runner.new_seq(), runner.new_seq()
        step1 = runner.forward({a: list(range(5, 30)), b: list(range(40, 47))})
        step2 = runner.forward({a: [3], b: list(range(50, 61))})
        outs.append((step1 + step2, runner.kv))
    assert fused_ops._layer_args and all(v is not None for v in fused_ops._layer_args.values())
    assert [plan is not None for plan in fused_ops._stacks.values()] == [True]
    for x, y in zip(outs[0][0], outs[1][0]):
        assert torch.equal(x, y)
    assert torch.equal(outs[0][1], outs[1][1])


@dataclass(frozen=True)
class _RankZeroOfTwo(TPGroup):
    """Rank 0 of a two-rank group without the other rank: its all-reduce doubles (as if the
    other rank's share were the same), enough to tell where the sums happen; `rows` records
    each call's row count."""

    rows: list[int] = field(default_factory=list, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return x.mul_(2.0)

    def gather_logits(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("arch,architecture", [ARCHS[0], ARCHS[2]])
def test_fused_stack_all_reduces_where_the_python_layers_do(arch: str, architecture: str
                                                             ) -> None:
    """Under tensor parallelism the C++ stack calls the group's all-reduce (its communication
    hook) after each o_proj and down_proj, as the row-parallel Linear does in Python: the
    same bits, and the all-reduce called 2 x layers times a forward either way."""
    from kvserve.ops.cpu import CpuOps

    hf = tiny_hf_model(arch, seed=11)
    cfg = model_config_from_hf(hf.config, architecture)
    outs, calls = [], []
    for fuse in (True, False):
        ops = CpuOps(fuse_layers=fuse)
        if not ops.fuse_layers and fuse:
            pytest.skip("no AVX2/FMA kernels on this CPU: nothing to fuse")
        tp = _RankZeroOfTwo(0, 2)
        model = get_model_class(architecture)(cfg, ops, torch.float32, tp=tp)
        model.load_weights((k, v.detach().clone()) for k, v in hf.state_dict().items())
        runner = PagedSequence(model.eval(), block_size=4)
        a, b = runner.new_seq(), runner.new_seq()
        step1 = runner.forward({a: list(range(5, 30)), b: list(range(40, 47))})
        step2 = runner.forward({a: [3], b: list(range(50, 61))})
        outs.append((step1 + step2, runner.kv))
        calls.append(tp.rows)
        if fuse:
            assert [plan is not None for plan in ops._stacks.values()] == [True]
    assert calls[0] == calls[1] == [32] * (2 * cfg.num_hidden_layers) + [12] * (
        2 * cfg.num_hidden_layers)
    for x, y in zip(outs[0][0], outs[1][0]):
        assert torch.equal(x, y)
    assert torch.equal(outs[0][1], outs[1][1])

