"""CPU ops backend: AVX2/FMA C++ kernels for the hot paths of a decoder step.

The kernels are the extension in kvserve/ops/csrc/, built just in time on first use
(ops/cpu_extension.py: its sources, flags and cache).

Routing, decided per call here and never inside the kernels:
- a CPU without AVX2+FMA, or CpuOps(use_kernels=False): every op is ReferenceOps' (exact);
- non-float32 inputs (a float16 KV cache and a quantized one excepted: KV_CACHE_DTYPES), or
  shapes a kernel does not cover: that op is ReferenceOps';
- linear with more than SMALL_M rows (SMALL_M_AVX512 for the AVX-512 kernel): torch's
  F.linear (MKL's GEMM wins at large M);
- the ISA (ISAS): the best this CPU runs, "amx" > "avx512" > "avx2"; the environment
  variable KVSERVE_CPU_ISA (or CpuOps(isa=...)) names a lower one. "amx" is "avx512" plus
  AMX tiles for qlinear_kquant at 32+ rows.
- linear's kernel: the AVX-512 one when the ISA is "avx512" or "amx", else the AVX2 one.
- qlinear (packed GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL weights, or W8A8 and
  Q4_1_128, x int8 activations): the kernel at every M, the VNNI one where the AVX-512 ISA
  is chosen and the CPU has VNNI, else the AVX2 one (the same bits either way).
- qlinear_kquant (packed GGUF K-quants and the IQ4_XS-layout types x Q8_K activations,
  KQUANT_KERNEL_WTYPES):
  the kernel at every M, VNNI or AVX2 as qlinear; under "amx", Q4_K / Q5_K / Q6_K at 32+ rows
  on AMX tiles (the same bits, ggml_kquants.dot_kquant's, on every path).
- otherwise the kernel, with the semantics of the reference docstrings.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.kv.layout import QuantizedKVCache
from kvserve.ops.cpu_extension import cpu_has_avx2_fma, load_extension
from kvserve.ops.reference import ReferenceOps
from kvserve.quant.base import KernelWeight
from kvserve.quant.block_pack import (
    F32,
    IQ4_NL,
    Q4_0,
    Q4_1,
    Q4_1_128,
    Q5_0,
    Q5_1,
    Q8_0,
    W8A8,
)
from kvserve.quant.ggml_kquants import IQ4_FAMILY, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from kvserve.quant.half_weights import BF16, F16, HALF_DTYPES

# Largest M that the AVX2 kernel serves before handing off to torch's F.linear. On the 2-core
# EPYC (Zen 5) we measured the kernel ahead of MKL at every M up to 2048 (2-3x at M <= 16,
# 1.2-1.8x at 48..256, 0-10% at 512..1024), so the hand-off sits where the gain gets thin and
# an AVX-512 MKL on another CPU would take the lead.
SMALL_M = 256
# The same for the AVX-512 kernel. On the same EPYC it runs at 290-400 GFLOP/s from M = 64 up
# (it re-streams the weights once per ~100 activation rows), against MKL's 165-215 through
# torch 2.13 at M = 256..1024, i.e. 1.5-2x; M <= 2048 stays on it, which also keeps prefill
# chunks that size batch invariant.
SMALL_M_AVX512 = 2048
# KV cache dtypes the attention / write_kv kernels read and write (queries and outputs stay
# float32). float16 halves the DRAM a decode streams; it is widened exactly, so the kernels
# compute what they would on a float32 cache holding the same values. int8 and uint8 (fp8
# e4m3fn bits) are a QuantizedKVCache's data, read with its scales as stored: the same again
# on the dequantized values. Others (bfloat16): the reference.
KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.int8, torch.uint8)
# Weight formats (ggml type ids) the kernels read; the caller names the format (wtype).
# linear's row kernels (csrc/linear*.cpp, also gguf_exact) read these as stored rows:
ROW_WTYPES = (F32, F16, BF16, Q4_1, Q8_0)
# qlinear's int8-activation kernels (csrc/qlinear*.cpp) read these packed (block_pack.pack; W8A8:
# Q8_0 records against per-token activations):
PACKED_WTYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, W8A8, Q4_1_128)
# K-quant formats (ggml type ids) the packed qlinear_kquant kernels read.
KQUANT_KERNEL_WTYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, *IQ4_FAMILY)


def _kernels_read(p: KernelWeight) -> bool:
    """Whether the fused stack's kernels read this run as it is: float32 / float16 /
    bfloat16 rows, GGUF rows, or packed groups of a format with a packed kernel."""
    if not p.weight.is_contiguous():
        return False
    if p.weight.dim() == 3:
        return p.weight.dtype == torch.uint8 and p.wtype in PACKED_WTYPES + KQUANT_KERNEL_WTYPES
    if p.wtype in HALF_DTYPES:
        return p.weight.dtype == HALF_DTYPES[p.wtype] and p.weight.shape[1] % 16 == 0
    return (p.weight.dtype, p.wtype) == (torch.float32, F32) or (
        p.weight.dtype == torch.uint8 and p.wtype in (Q4_1, Q8_0))


ISAS = ("amx", "avx512", "avx2")  # best first


def runnable_isas(amx: bool = True) -> list[str]:
    """The ISAs this CPU runs, best first, from what CpuOps() takes down (KVSERVE_CPU_ISA caps
    it): each kernel path a test holds to its reference. amx=False leaves out "amx", which
    differs from "avx512" only in qlinear_kquant at 32+ rows."""
    if not cpu_has_avx2_fma():
        return []
    isas = list(ISAS[ISAS.index(CpuOps().isa):])
    return isas if amx else [i for i in isas if i != "amx"]


def _kv_parts(kv_cache: torch.Tensor | QuantizedKVCache
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the cache tensor, its scales or None): what the kernels take."""
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.data, kv_cache.scales
    return kv_cache, None


def _kv_ok(kv_cache: torch.Tensor | QuantizedKVCache) -> bool:
    """The kernels read this cache: a contiguous float32 / float16 tensor, or a contiguous
    QuantizedKVCache (an int8 or uint8 tensor alone is no cache: it has no scales)."""
    data, scales = _kv_parts(kv_cache)
    quantized = data.dtype in (torch.int8, torch.uint8)
    return (data.dtype in KV_CACHE_DTYPES and quantized == (scales is not None)
            and kv_cache.is_contiguous())


class CpuOps(ReferenceOps):
    name = "cpu"

    def __init__(self, use_kernels: bool | None = None, isa: str | None = None,
                 fuse_layers: bool = True, ext: ModuleType | None = None) -> None:
        """use_kernels=None: use them when the CPU supports them (building on first use);
        False: behave exactly like ReferenceOps. ext: the kernels' module when using them
        (default: this install's build; benchmarks/kernel_ab.py passes another revision's).
        isa: the kernels' instruction set, one of ISAS; None reads KVSERVE_CPU_ISA and, when
        that is unset, takes the best this CPU runs. "avx512" on a CPU without AVX-512F, or
        "amx" on one without AMX-INT8, is a ValueError."""
        if use_kernels is None:
            use_kernels = cpu_has_avx2_fma()
        self._ext = (ext or load_extension()) if use_kernels else None
        isa = isa or os.environ.get("KVSERVE_CPU_ISA") or None
        if isa is not None and isa not in ISAS:
            raise ValueError(f"isa (or KVSERVE_CPU_ISA) must be one of {', '.join(ISAS)}, "
                             f"got {isa!r}")
        has_avx512 = self._ext is not None and self._ext.cpu_has_avx512()
        # Only where amx may be chosen: asking is what makes Linux grant the tile state.
        has_amx = has_avx512 and isa in (None, "amx") and self._ext.cpu_has_amx_int8()
        if isa in ("avx512", "amx") and self._ext is not None and not has_avx512:
            needs = "AVX-512F and AMX-INT8" if isa == "amx" else "AVX-512F"
            raise ValueError(f"isa={isa!r} needs a CPU with {needs}; this one has AVX2 only")
        if isa == "amx" and self._ext is not None and not has_amx:
            raise ValueError("isa='amx' needs a CPU with AMX-INT8 (and Linux's grant of its "
                             "tile state); this one has AVX-512 without it")
        self.isa = isa or ("amx" if has_amx else "avx512" if has_avx512 else "avx2")
        self._avx512 = self.isa in ("avx512", "amx") and has_avx512
        # qlinear's AVX-512 kernel needs VNNI as well; without it the AVX2 twin runs (same bits).
        self._vnni = self._avx512 and self._ext.cpu_has_avx512_vnni()
        self._amx = self.isa == "amx" and has_amx
        self.small_m = SMALL_M_AVX512 if self._avx512 else SMALL_M
        self.fuse_layers = fuse_layers and self._ext is not None
        # layer -> its LayerWeights for the fused kernel, or None when it cannot be fused.
        self._layer_args: dict[Any, Any] = {}
        # layer list (fused_llama_stack) or layer (fused_llama_layer) -> its C++ LlamaStack,
        # or None when some layer cannot be fused.
        self._stacks: dict[Any, Any] = {}

    @property
    def uses_kernels(self) -> bool:
        return self._ext is not None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               *, wtype: int = F32) -> torch.Tensor:
        """weight: float32 [N, K] (wtype F32), float16 / bfloat16 [N, K] (F16 / BF16, K % 16
        == 0: half the bytes, widened exactly in registers), or uint8 GGUF Q4_1 / Q8_0 blocks
        of the format wtype names (kvserve/quant/gguf.py), which the kernels read as stored
        and dequantize for torch's GEMM at large M. Other block formats (no row kernel): the
        reference."""
        half = HALF_DTYPES.get(wtype)
        if (self._ext is None or x.dtype != torch.float32 or wtype not in ROW_WTYPES
                or weight.dtype != (half or (torch.float32 if wtype == F32 else torch.uint8))
                or (half is not None and x.shape[-1] % 16)
                or (bias is not None and (bias.dtype != torch.float32
                                          or not bias.is_contiguous()))
                or not weight.is_contiguous() or x.dim() == 0):
            return super().linear(x, weight, bias, wtype=wtype)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.shape[0] > self.small_m or x2.stride(-1) != 1:
            if half is not None:
                weight = weight.float()
            elif wtype != F32:
                weight = self._ext.dequantize(weight, wtype, k)
            return F.linear(x, weight, bias)
        out = self._ext.linear(x2, weight, wtype, bias, self._avx512)
        return out.view(*x.shape[:-1], weight.shape[0])

    def qlinear(self, x: torch.Tensor, weight: torch.Tensor, n: int,
                bias: torch.Tensor | None = None, *, wtype: int) -> torch.Tensor:
        """weight: packed GGUF groups (kvserve/quant/gguf.py pack) of the format wtype names
        (PACKED_WTYPES: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, W8A8, Q4_1_128); x is quantized
        to int8 per 32 values and the kernels (csrc/qlinear*.cpp) give qlinear_reference's
        bits at any M."""
        if not self._packed_kernel_takes(x, bias, wtype, PACKED_WTYPES):
            return super().qlinear(x, weight, n, bias, wtype=wtype)
        x2 = self._rows(x)
        return self._ext.qlinear(x2, weight, wtype, n, bias, self._vnni).view(*x.shape[:-1], n)

    def qlinear_kquant(self, x: torch.Tensor, weight: torch.Tensor, n: int,
                       bias: torch.Tensor | None = None, *, wtype: int) -> torch.Tensor:
        """weight: packed K-quant groups (kvserve/quant/kquant_pack.py pack_kquant) of the
        format wtype names (KQUANT_KERNEL_WTYPES); x is quantized to Q8_K per 256 values and
        the kernels (csrc/qlinear_kquant*.cpp) give ReferenceOps.qlinear_kquant's bits at any
        M."""
        if not self._packed_kernel_takes(x, bias, wtype, KQUANT_KERNEL_WTYPES):
            return super().qlinear_kquant(x, weight, n, bias, wtype=wtype)
        x2 = self._rows(x)
        return self._ext.qlinear_kquant(x2, weight, wtype, n, bias, self._vnni,
                                        self._amx).view(*x.shape[:-1], n)

    def fused_llama_layer(self, layer: Any, x: torch.Tensor, residual: torch.Tensor | None,
                          inp: Any, kv_cache: torch.Tensor, cos_sin: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole decoder layer in one C++ call (a one-layer csrc/llama_stack.cpp
        LlamaStack): the same kernels in the same order as the Python layer, minus ~12 round
        trips. kv_cache: this layer's, [2, ...]. None when the layer cannot be fused."""
        stack = self._stack(layer, [layer], x, kv_cache, cos_sin)
        if stack is None:
            return None
        data, scales = _kv_parts(kv_cache.unsqueeze(0))
        return stack.forward(x.contiguous(), None if residual is None else residual.contiguous(),
                             inp.positions, cos_sin, data, inp.slot_mapping,
                             inp.block_tables, inp.seq_lens, inp.query_start_loc, scales)

    def fused_llama_stack(self, layers: Any, x: torch.Tensor, inp: Any, kv_cache: torch.Tensor,
                          cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every decoder layer in one C++ call (csrc/llama_stack.cpp LlamaStack): what
        fused_llama_layer does per layer (the same kernels in the same order, so the same
        bits), minus each layer's Python call, input checks and scratch (0.3-0.55 ms of a
        30-layer batch-1 step). kv_cache: all layers, [L, 2, ...]. None when some layer cannot
        be fused."""
        stack = self._stack(layers, layers, x, kv_cache, cos_sin)
        if stack is None:
            return None
        data, scales = _kv_parts(kv_cache)
        return stack.forward(x.contiguous(), None, inp.positions, cos_sin, data,
                             inp.slot_mapping, inp.block_tables, inp.seq_lens,
                             inp.query_start_loc, scales)

    def _stack(self, key: Any, layers: Any, x: torch.Tensor, kv_cache: torch.Tensor,
               cos_sin: torch.Tensor) -> Any:
        """The LlamaStack of these layers (built, its weights checked, once per key), or None
        when this call or some layer cannot take the fused path."""
        if not self.fuse_layers or x.dtype != torch.float32 or x.dim() != 2 or not _kv_ok(
                kv_cache):
            return None
        if key not in self._stacks:
            plan = [self._args(layer, cos_sin) for layer in layers]
            # Tensor parallelism: the stack calls the group's all-reduce after each o_proj and
            # down_proj (its communication hook), where the row-parallel Linear would.
            tp = layers[0].self_attn.o_proj.tp
            hook = tp.all_reduce if tp.size > 1 else None
            self._stacks[key] = (None if None in plan else
                                 self._ext.LlamaStack(plan, self._avx512, self.small_m, hook,
                                                      self._amx))
        return self._stacks[key]

    def _args(self, layer: Any, cos_sin: torch.Tensor) -> Any:
        """The layer's fused-kernel arguments (_fusable), worked out once per layer."""
        if layer not in self._layer_args:
            self._layer_args[layer] = self._fusable(layer, cos_sin)
        return self._layer_args[layer]

    def _fusable(self, layer: Any, cos_sin: torch.Tensor) -> Any:
        """The fused kernel's LayerWeights (named fields; each linear as its LinearMethod's
        kernel_weights, the runs of output rows with their formats), or None when a piece of
        the layer is not something the kernels read (a format without a kernel, runs of one
        linear in different input orders) or has an odd head_dim."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj,
                   "down": mlp.down_proj}
        modes = {name: lin.parallel for name, lin in linears.items()}
        if set(modes.values()) != {"none"} and (
                modes != {"qkv": "column", "o": "row", "gate_up": "column", "down": "row"}
                or len({id(lin.tp) for lin in linears.values()}) != 1):
            return None  # a split the stack's communication hook does not know
        runs = {name: lin.quant_method.kernel_weights(lin) for name, lin in linears.items()}
        tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, cos_sin]
        if attn.qkv_proj.bias is not None:
            tensors.append(attn.qkv_proj.bias)
        if (any(r is None or not all(map(_kernels_read, r))
                or any(p.perm is not r[0].perm for p in r) for r in runs.values())
                or any(linears[n].bias is not None for n in ("o", "gate_up", "down"))
                or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors)
                or attn.head_dim % 8 != 0
                or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
            return None
        w = self._ext.LayerWeights()
        w.in_norm, w.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        w.eps = layer.input_layernorm.eps
        for name, r in runs.items():
            setattr(w, name, self._ext.LinearWeights([p.weight for p in r], [p.wtype for p in r],
                                                     [p.rows for p in r], r[0].perm))
        w.qkv_bias = attn.qkv_proj.bias
        w.heads, w.kv_heads, w.head_dim, w.scale = (attn.num_heads, attn.num_kv_heads,
                                                    attn.head_dim, attn.scale)
        return w

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int) -> torch.Tensor:
        """A QuantizedKVCache is read as stored (int8 / fp8 bytes and their scales)."""
        if (self._ext is None or q.dtype != torch.float32 or not _kv_ok(kv_cache)
                or q.shape[-1] % 8 != 0 or q.stride(-1) != 1):
            return super().paged_attention(q, kv_cache, block_tables, seq_lens, query_start_loc,
                                           scale, max_query_len, max_seq_len)
        data, scales = _kv_parts(kv_cache)
        return self._ext.paged_attention(q, data, block_tables, seq_lens, query_start_loc,
                                         scale, scales)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor | QuantizedKVCache, slot_mapping: torch.Tensor) -> None:
        """A QuantizedKVCache gets each row quantized with its scale (reference.quantize_kv's
        bytes)."""
        if (self._ext is None or key.dtype != torch.float32 or value.dtype != torch.float32
                or not _kv_ok(kv_cache) or key.stride(-1) != 1 or value.stride(-1) != 1):
            return super().write_kv(key, value, kv_cache, slot_mapping)
        data, scales = _kv_parts(kv_cache)
        self._ext.write_kv(key, value, data, slot_mapping, scales)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._f32(x, weight):
            return super().rms_norm(x, weight, eps)
        out = self._ext.rms_norm(self._rows(x), weight.contiguous(), eps)
        return out if x.dim() == 2 else out.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x -> (rms_norm(sum), sum), both new tensors; inputs are not mutated."""
        if not self._f32(x, residual, weight) or x.shape != residual.shape:
            return super().add_rms_norm(x, residual, weight, eps)
        out, res = self._ext.add_rms_norm(self._rows(x), self._rows(residual),
                                          weight.contiguous(), eps)
        return (out, res) if x.dim() == 2 else (out.view(x.shape), res.view(x.shape))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not self._f32(x) or x.shape[-1] % 2:
            return super().silu_and_mul(x)
        out = self._ext.silu_and_mul(self._rows(x))
        return out if x.dim() == 2 else out.view(*x.shape[:-1], x.shape[-1] // 2)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (not self._f32(q, k, cos_sin) or q.stride(-1) != 1 or k.stride(-1) != 1
                or not cos_sin.is_contiguous()):
            return super().rotary(q, k, positions, cos_sin)
        return self._ext.rotary(q, k, positions, cos_sin)

    def _f32(self, *ts: torch.Tensor) -> bool:
        return self._ext is not None and all(t.dtype == torch.float32 and t.dim() > 0
                                             for t in ts)

    def _packed_kernel_takes(self, x: torch.Tensor, bias: torch.Tensor | None, wtype: int,
                             formats: tuple[int, ...]) -> bool:
        """Whether qlinear's / qlinear_kquant's kernel takes this call (else the reference):
        float32 activations, a format it reads, a float32 contiguous bias or none."""
        return (self._ext is not None and x.dtype == torch.float32 and x.dim() > 0
                and wtype in formats
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [rows, n] dense in n; a view when the leading dims allow it. The model's
        2-D activations pass straight through (a reshape costs a microsecond per call)."""
        if x.dim() == 2 and x.stride(1) == 1:
            return x
        x2 = x.reshape(-1, x.shape[-1])
        return x2 if x2.stride(-1) == 1 else x2.contiguous()
