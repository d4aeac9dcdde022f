"""Parity of the CPU (AVX2/FMA) ops backend against ReferenceOps, the oracle.

Tolerances, all fp32 with a different summation order than torch's (attention and the K/V
cache: test_attention_cpu.py):
- linear: weights scaled by 1/sqrt(K) (as a real init), so outputs are unit scale; a length-K
  dot product reordered moves the result by ~eps * sqrt(K) ~ 1e-6 here -> rtol = atol = 1e-5.
- rms_norm: a reordered sum of squares changes the scale factor by ~1e-7 -> 1e-6 / 1e-5.
- silu_and_mul: our exp() is within ~2 ulp of libm's -> 1e-6 / 1e-5.
- rotary and the residual of add_rms_norm do the reference's exact roundings, so they must
  match bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.ops import get_ops
from kvserve.ops.cpu import ISAS, CpuOps, cpu_has_avx2_fma, runnable_isas
from kvserve.ops.reference import ReferenceOps
from tests.helpers import assert_close_exact_dtype as close
from tests.helpers import paged_model_input

REF = ReferenceOps()


# ---------------------------------------------------------------------------------- linear


@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 33, 512])
@pytest.mark.parametrize("n,k", [(960, 576), (64, 100), (37, 8), (13, 7), (3, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(ops: CpuOps, m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g) if with_bias else None
    close(ops.linear(x, w, b), REF.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_linear_strided_and_batched_inputs(ops: CpuOps) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 40, generator=g) / math.sqrt(40)
    wide = torch.randn(6, 64, generator=g)
    x = wide[:, 8:48]  # rows 64 floats apart: the kernel reads them in place
    close(ops.linear(x, w), REF.linear(x, w), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, 40, generator=g)
    close(ops.linear(x3, w), REF.linear(x3, w), atol=1e-5, rtol=1e-5)
    x_t = torch.randn(40, 4, generator=g).t()  # last dim strided: handed to torch
    close(ops.linear(x_t, w), REF.linear(x_t, w), atol=1e-5, rtol=1e-5)
    big = torch.randn(ops.small_m + 1, 40, generator=g)  # past the crossover: torch's GEMM
    close(ops.linear(big, w), REF.linear(big, w), atol=1e-5, rtol=1e-5)


def _isa_ops() -> list[str]:
    """The linear kernels this CPU can run, each to be tested on its own."""
    return runnable_isas(amx=False)


@pytest.fixture(scope="module", params=_isa_ops())
def isa_ops(request: pytest.FixtureRequest) -> CpuOps:
    o = CpuOps(isa=request.param)
    assert o.isa == request.param
    return o


@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 13, 40, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 100), (37, 8), (13, 7), (3, 1),
                                 (21, 17)])
def test_linear_each_isa_matches_reference(isa_ops: CpuOps, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    close(isa_ops.linear(x, w, b), REF.linear(x, w, b), atol=1e-5, rtol=1e-5)
    close(isa_ops.linear(x, w), REF.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [576, 1536, 100, 7, 16, 33])
@pytest.mark.parametrize("n", [4, 13, 37, 100])
def test_linear_is_batch_invariant(isa_ops: CpuOps, n: int, k: int) -> None:
    """Row i of linear(x) equals linear(x[i:i+1]) bit for bit, for every batch size: a
    request's greedy output must not depend on what else is in the batch. N % 16, % 8 and
    % 4 are not all 0, so rows take different tile shapes at M = 1 and at M >= 2."""
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    for bias in (None, b):
        alone = torch.cat([isa_ops.linear(x[i:i + 1], w, bias) for i in range(40)])
        for m in range(1, 41):
            for start in {0, 40 - m, (40 - m) // 2}:  # the rows at the front, back, middle
                batch = isa_ops.linear(x[start:start + m], w, bias)
                assert torch.equal(batch, alone[start:start + m]), (m, start)
    # Up to the kernel's crossover, past the ~100-row passes it splits large M into.
    big = torch.randn(min(isa_ops.small_m, 300), k, generator=g)
    out = isa_ops.linear(big, w, b)
    for i in (0, 1, 107, 108, 250, big.shape[0] - 1):
        assert torch.equal(out[i:i + 1], isa_ops.linear(big[i:i + 1], w, b)), i


@pytest.mark.parametrize("dtype, wtype", [(torch.float16, 1), (torch.bfloat16, 30)])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 1536), (13, 16)])
def test_half_weights_give_float32_on_their_values(isa_ops: CpuOps, dtype: torch.dtype,
                                                   wtype: int, n: int, k: int) -> None:
    """float16 / bfloat16 rows (wtype 1 / 30) are widened exactly in registers, so every row
    is the float32 kernel's on the widened weights bit for bit, at any M (each tile shape,
    and torch's GEMM past small_m), and close to the reference's own float32 product."""
    g = torch.Generator().manual_seed(n + k + wtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 3, 5, 8, 13, 40, isa_ops.small_m + 1):
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            got = isa_ops.linear(x, w, bias, wtype=wtype)
            assert torch.equal(got, isa_ops.linear(x, w.float(), bias)), (m, bias is None)
            close(got, REF.linear(x, w, bias, wtype=wtype), atol=1e-5, rtol=1e-5)


def test_half_weights_of_odd_width_use_the_reference(ops: CpuOps) -> None:
    """The kernels take K % 16 == 0; other widths widen through the reference."""
    x, w = torch.randn(3, 24), torch.randn(5, 24).half()
    assert torch.equal(ops.linear(x, w, wtype=1), REF.linear(x, w.float()))
    with pytest.raises(RuntimeError, match="K % 16 == 0"):
        ops._ext.linear(x, w, 1, None, False)
    with pytest.raises(RuntimeError,
                       match=r"a wtype 1 \(F16\) weight must be float16, got BFloat16"):
        ops._ext.linear(torch.randn(3, 32), torch.randn(5, 32).bfloat16(), 1, None, False)


def test_linear_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="isa"):
        CpuOps(isa="sse2")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx2")
    assert CpuOps().isa == "avx2"
    monkeypatch.setenv("KVSERVE_CPU_ISA", "neon")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA"):
        CpuOps()


@pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2+FMA CPU")
def test_isa_order_and_amx_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is the best ISA this CPU runs; KVSERVE_CPU_ISA names a lower one; "amx" on
    a CPU without AMX-INT8 is an error that says so."""
    monkeypatch.delenv("KVSERVE_CPU_ISA", raising=False)
    best = CpuOps()
    ext = best._ext
    has_amx = ext.cpu_has_avx512() and ext.cpu_has_amx_int8()
    assert best.isa == ("amx" if has_amx else "avx512" if ext.cpu_has_avx512() else "avx2")
    assert runnable_isas() == list(ISAS[ISAS.index(best.isa):])
    assert "amx" not in runnable_isas(amx=False)
    if has_amx:
        monkeypatch.setenv("KVSERVE_CPU_ISA", "avx512")
        vnni = CpuOps()
        assert vnni.isa == "avx512" and vnni._vnni and not vnni._amx
        assert best._amx and best._vnni
    else:
        with pytest.raises(ValueError, match="AMX"):
            CpuOps(isa="amx")
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx2")
    assert runnable_isas() == ["avx2"]


def test_linear_other_dtypes_fall_back(ops: CpuOps) -> None:
    x = torch.randn(3, 16).bfloat16()
    w = torch.randn(8, 16).bfloat16()
    assert torch.equal(ops.linear(x, w), REF.linear(x, w))


# ------------------------------------------------------------------------ norms and friends


@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (3, 4, 37), (512, 576)])
def test_rms_norm_matches_reference(ops: CpuOps, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    close(ops.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 576), (5, 37), (600, 576)])
def test_add_rms_norm_matches_reference_and_leaves_inputs(ops: CpuOps,
                                                          shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(shape[0])
    wide = torch.randn(shape[0], shape[1] + 8, generator=g)
    x = wide[:, 3:3 + shape[1]]  # strided rows
    residual = torch.randn(*shape, generator=g)
    w = torch.randn(shape[1], generator=g)
    x0, r0 = x.clone(), residual.clone()
    out, res = ops.add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_res = REF.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(res, ref_res)
    close(out, ref_out, atol=1e-6, rtol=1e-5)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("shape", [(1, 3072), (3, 26), (600, 3072), (2, 3, 16)])
def test_silu_and_mul_matches_reference(ops: CpuOps, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g) * 4
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, -88.5, 89.0])  # exp saturation
    close(ops.silu_and_mul(x), REF.silu_and_mul(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t,heads,kv_heads,d", [(1, 9, 3, 64), (37, 4, 2, 128), (5, 2, 1, 20)])
def test_rotary_matches_reference_exactly(ops: CpuOps, t: int, heads: int, kv_heads: int,
                                          d: int) -> None:
    from kvserve.layers.rotary import rope_cos_sin

    g = torch.Generator().manual_seed(t * d)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    cos_sin = rope_cos_sin(d, 4096, 10000.0, None)
    pos = torch.randint(0, 4096, (t,), generator=g)
    for mine, ref in zip(ops.rotary(q, k, pos, cos_sin), REF.rotary(q, k, pos, cos_sin)):
        assert mine.shape == ref.shape and torch.equal(mine, ref)


def test_unsupported_dtypes_use_reference(ops: CpuOps) -> None:
    x = torch.randn(4, 32).half()
    w = torch.ones(32).half()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), REF.silu_and_mul(x))


def test_reference_mode_is_the_reference() -> None:
    o = CpuOps(use_kernels=False)
    assert not o.uses_kernels
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert torch.equal(o.linear(x, w), REF.linear(x, w))
    assert torch.equal(o.silu_and_mul(x), REF.silu_and_mul(x))


# ------------------------------------------------------------------------------ registry


@pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2+FMA CPU")
def test_auto_picks_cpu_backend() -> None:
    o = get_ops("auto")
    assert isinstance(o, CpuOps) and o.name == "cpu" and o.uses_kernels


def test_auto_falls_back_when_the_build_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.ops.cpu as cpu_mod

    def broken() -> None:
        raise RuntimeError("building the kvserve CPU kernels failed")

    monkeypatch.setattr(cpu_mod, "cpu_has_avx2_fma", lambda: True)
    monkeypatch.setattr(cpu_mod, "load_extension", broken)
    with pytest.raises(RuntimeError, match="building"):
        get_ops("cpu")
    assert get_ops("auto").name == "torch"  # the batched pure-torch backend


def test_decoder_layer_sequence_matches_reference() -> None:
    """Two engine steps of a tiny GQA decoder layer (prefill chunks of two requests, then a
    mixed step with a decode and the rest of a prefill) through both backends."""
    from kvserve.layers.rotary import rope_cos_sin

    cpu = get_ops("cpu")
    hidden, heads, kv_heads, d, inter, bs = 64, 4, 2, 16, 96, 4
    g = torch.Generator().manual_seed(0)

    def p(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    w_qkv, w_o = p((heads + 2 * kv_heads) * d, hidden), p(hidden, heads * d)
    w_gu, w_down = p(2 * inter, hidden), p(hidden, inter)
    n1, n2 = 1 + p(hidden), 1 + p(hidden)
    cos_sin = rope_cos_sin(d, 64, 10000.0, None)
    caches = {id(cpu): torch.zeros(2, 12, bs, kv_heads, d), id(REF): torch.zeros(2, 12, bs,
                                                                                 kv_heads, d)}
    tables = torch.tensor([[3, 7, 1, 0], [10, 2, 5, 0]], dtype=torch.int32)

    def step(o, x, residual, positions, seq_lens, q_lens) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        slots = torch.tensor([int(tables[b, pos // bs]) * bs + pos % bs
                              for b, ql in enumerate(q_lens)
                              for pos in range(seq_lens[b] - ql, seq_lens[b])])
        h, residual = o.add_rms_norm(x, residual, n1, 1e-6)
        q, k, v = o.linear(h, w_qkv).split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
        q, k = o.rotary(q.reshape(t, heads, d), k.reshape(t, kv_heads, d), positions, cos_sin)
        o.write_kv(k, v.reshape(t, kv_heads, d), caches[id(o)], slots)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        a = o.paged_attention(q, caches[id(o)], tables, torch.tensor(seq_lens, dtype=torch.int32),
                              qsl, d**-0.5, max(q_lens), max(seq_lens))
        h, residual = o.add_rms_norm(o.linear(a.reshape(t, heads * d), w_o), residual, n2, 1e-6)
        return o.linear(o.silu_and_mul(o.linear(h, w_gu)), w_down), residual

    x1, r1 = torch.randn(9, hidden, generator=g), torch.randn(9, hidden, generator=g)
    pos1 = torch.tensor(list(range(5)) + list(range(4)))
    x2, r2 = torch.randn(4, hidden, generator=g), torch.randn(4, hidden, generator=g)
    pos2 = torch.tensor([5, 4, 5, 6])
    for o in (cpu, REF):
        out1 = step(o, x1, r1, pos1, [5, 4], [5, 4])
        out2 = step(o, x2, r2, pos2, [6, 7], [1, 3])
        if o is cpu:
            mine = out1 + out2
    for a, b in zip(mine, out1 + out2):
        close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.allclose(caches[id(cpu)], caches[id(REF)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_layer_equals_python_layer(dtype: torch.dtype) -> None:
    """CpuOps.fused_llama_layer (one C++ call) against LlamaDecoderLayer's Python forward on
    the unfused kernels, bit for bit, outputs and KV cache: a prefill step of two requests,
    then a decode beside a prefill chunk."""
    from kvserve.config import ModelConfig
    from kvserve.layers.rotary import rope_cos_sin
    from kvserve.models.llama import LlamaDecoderLayer

    fused, plain = CpuOps(fuse_layers=True), CpuOps(fuse_layers=False)
    if not fused.fuse_layers:
        pytest.skip("no AVX2/FMA kernels on this CPU: nothing to fuse")
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    g = torch.Generator().manual_seed(2)
    layers = [LlamaDecoderLayer(cfg, 0, o, torch.float32) for o in (fused, plain)]
    for p_f, p_p in zip(layers[0].parameters(), layers[1].parameters()):
        w = torch.randn(p_f.shape, generator=g) / math.sqrt(p_f.shape[-1])
        p_f.data.copy_(w + 1 if p_f.dim() == 1 else w)  # norm weights near 1
        p_p.data.copy_(p_f.data)
    cos_sin = rope_cos_sin(16, 64, 10000.0, None)
    bs = 4
    tables = torch.tensor([[3, 7, 1, 0], [10, 2, 5, 0]], dtype=torch.int32)
    caches = [torch.zeros(1, 2, 12, bs, 2, 16, dtype=dtype) for _ in layers]

    # The first layer of a model gets no residual; a later one gets the stream so far.
    for seq_lens, q_lens, with_residual in (([5, 9], [5, 9], False), ([6, 12], [1, 3], True)):
        inp = paged_model_input(tables, bs, seq_lens, q_lens)
        x = torch.randn(sum(q_lens), 64, generator=g)
        residual = torch.randn(x.shape, generator=g) if with_residual else None
        out_f = fused.fused_llama_layer(layers[0], x, residual, inp, caches[0][0], cos_sin)
        assert out_f is not None  # the fused kernel took this cache dtype
        out_p = layers[1](x, residual, inp, caches[1], cos_sin)
        for a, b in zip(out_f, out_p):
            assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[1]) and caches[0].abs().sum() > 0


def test_llama_stack_checks_its_inputs_once_with_clear_errors() -> None:
    """LlamaStack checks the step's inputs once, not per layer: each bad one still gets a
    message naming it, before anything is written to the cache."""
    from kvserve.config import ModelConfig
    from kvserve.layers.rotary import rope_cos_sin
    from kvserve.models.llama import LlamaDecoderLayer

    ops = CpuOps(fuse_layers=True)
    if not ops.fuse_layers:
        pytest.skip("no AVX2/FMA kernels on this CPU: nothing to fuse")
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    layers = [LlamaDecoderLayer(cfg, i, ops, torch.float32) for i in range(2)]
    g = torch.Generator().manual_seed(3)
    for p in (p for la in layers for p in la.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) + (p.dim() == 1))
    cos_sin = rope_cos_sin(16, 64, 10000.0, None)
    stack = ops._ext.LlamaStack([ops._fusable(la, cos_sin) for la in layers], ops._avx512,
                                ops.small_m)
    kv = torch.zeros(2, 2, 4, 4, 2, 16)
    x = torch.randn(3, 64)
    pos, slots = torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6])
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    out, res = stack.forward(x, None, pos, cos_sin, kv, slots, tables, lens, qsl)
    assert out.shape == res.shape == (3, 64) and out.isfinite().all()
    assert kv[:, :, 1, :3].abs().sum() > 0 and kv[:, :, 1, 3:].abs().sum() == 0
    bad = {
        "positions has 2 entries": dict(positions=pos[:2]),
        "position 64 outside": dict(positions=torch.tensor([0, 1, 64])),
        "slot 16 is past": dict(slots=torch.tensor([4, 5, 16])),
        "query_start_loc must run from 0 to T=3": dict(qsl=torch.tensor([0, 2], dtype=torch.int32)),
        "needs more blocks": dict(lens=torch.tensor([5], dtype=torch.int32),
                                  qsl=torch.tensor([0, 3], dtype=torch.int32)),
        "kv_cache must be \\[2,": dict(kv=torch.zeros(1, 2, 4, 4, 2, 16)),
        "do not match the cache": dict(kv=torch.zeros(2, 2, 4, 4, 1, 16)),
        "residual must be contiguous": dict(residual=torch.randn(2, 64)),
    }
    before = kv.clone()
    for msg, change in bad.items():
        args = dict(residual=None, positions=pos, kv=kv, slots=slots, tables=tables, lens=lens,
                    qsl=qsl)
        args.update(change)
        with pytest.raises(RuntimeError, match=msg):
            stack.forward(x, args["residual"], args["positions"], cos_sin, args["kv"],
                          args["slots"], args["tables"], args["lens"], args["qsl"])
    assert torch.equal(kv, before)  # every check runs before the first layer writes
