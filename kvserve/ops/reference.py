"""Pure-torch ops: the oracle every other backend is tested against.

Shapes: T tokens in the step, H query heads, Hkv kv heads, D head_dim, B requests.
The KV layout is kvserve.kv.layout: one layer's cache is [2, num_blocks, block_size, Hkv, D],
a float tensor or a QuantizedKVCache (int8 / fp8_e4m3 data and a float32 scale per row).
Clarity over speed here; per-request loops are fine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvserve.kv.layout import QuantizedKVCache
from kvserve.ops import int4mm

if TYPE_CHECKING:
    from kvserve.quant.int4_groups import Int4Groups

# The largest magnitude each quantized KV type stores: int8 is symmetric (-127..127, never
# -128), e4m3fn's largest finite value is 448.
KV_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] of float32 -> (quantized [..., D], scales float32 [...]), one scale per
    row: scale = amax / qmax (fp32 division), q = x / scale (fp32 division) rounded
    (int8: half to even, clamped to [-127, 127]; fp8_e4m3: torch's cast to float8_e4m3fn, its
    bits as uint8). An all-zero row gets scale 0 and zeros. Every op is one IEEE rounding, so
    the kernels (csrc/elementwise.cpp write_kv) give these bytes bit for bit."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / KV_QMAX[kv_dtype]
    y = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    if kv_dtype == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """quantize_kv's inverse: float(q) * scale, one fp32 multiply per element (what the
    attention kernel computes for each element it reads). q int8, or uint8 e4m3fn bits."""
    vals = q.float() if q.dtype == torch.int8 else q.view(torch.float8_e4m3fn).float()
    return vals * scales.unsqueeze(-1)


class ReferenceOps:
    """The ops contract: every backend (CpuOps, TorchOps) subclasses it and overrides what
    it runs faster, so a model and its layers take `ops: ReferenceOps` and call only these
    methods; each method here is the specification the backends are held to."""

    name = "reference"

    def fused_llama_layer(self, layer: Any, x: torch.Tensor, residual: torch.Tensor | None,
                          inp: Any, kv_cache: torch.Tensor, cos_sin: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A backend may run a whole LlamaDecoderLayer in one call and return (out, residual);
        None means: run the layer's own Python forward, which is the specification."""
        return None

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               wtype: int = 0) -> torch.Tensor:
        """weight: float [N, K] (wtype 0), float16 / bfloat16 [N, K] (wtype 1 / 30, widened
        exactly), or uint8 GGUF blocks of the ggml type wtype (kvserve/quant/gguf.py),
        dequantized."""
        if wtype in (1, 30):
            weight = weight.to(x.dtype)
        elif wtype != 0:
            from kvserve.quant.gguf_weights import dequantize

            weight = dequantize(weight, wtype, x.shape[-1]).to(x.dtype)
        return F.linear(x, weight, bias)

    @staticmethod
    def qlinear(x: torch.Tensor, weight: torch.Tensor, n: int,
                bias: torch.Tensor | None = None, *, wtype: int) -> torch.Tensor:
        """weight: packed GGUF groups [ceil(n / 16), K / 32, record bytes] of the ggml type
        wtype; x quantized to int8 per 32 values, as llama.cpp does (kvserve/quant/gguf.py
        qlinear_reference)."""
        from kvserve.quant.block_pack import qlinear_reference

        return qlinear_reference(x, weight, wtype, n, bias).to(x.dtype)

    @staticmethod
    def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """W8A8 with the weight unpacked: int8 weight [N, K] with a scale per output row, x
        quantized to int8 per token (quantize_per_token: the W8A8 kernels' integers, without
        their per-block sums), exact int32 sums, then one scale per (token, output) and +
        bias[n]. torch._int_mm on CUDA (rows padded to its 17-row minimum); elsewhere float64
        products, exact for any such sum."""
        from kvserve.quant.block_pack import quantize_per_token

        lead, k = x.shape[:-1], x.shape[-1]
        qx, amax = quantize_per_token(x.reshape(-1, k))
        m, n = qx.shape[0], weight.shape[0]
        if qx.is_cuda and k % 8 == 0 and n % 8 == 0:
            acc = torch._int_mm(F.pad(qx, (0, 0, 0, max(0, 17 - m))), weight.t())[:m]
        else:
            acc = qx.double() @ weight.double().t()
        out = acc.float() * ((amax / 127) * scale[None, :].float())
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, n).to(x.dtype)

    @staticmethod
    def int4_unsupported(groups: Int4Groups, device: torch.device, dtype: torch.dtype
                         ) -> str | None:
        """Why torch's int4 matmul (kvserve/ops/int4mm.py) cannot hold these 4-bit groups on
        device for activations of dtype; None when it can."""
        return int4mm.unsupported(device, dtype, groups)

    @staticmethod
    def int4_pack(groups: Int4Groups, device: torch.device, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """4-bit groups as torch's int4 matmul holds them on device: (the weight in the
        device's tile layout, the (scale, zero) pairs in dtype). int4_unsupported must be
        None."""
        return int4mm.pack(groups, device, dtype)

    @staticmethod
    def int4_linear(x: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor,
                    group_size: int, n: int, perm: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """x times int4_pack's weight of n outputs (x's inputs gathered by perm first, as an
        act-order checkpoint's groups hold them), + bias[n], in x's dtype."""
        y = int4mm.matmul(x, packed, pairs, group_size, n, perm).to(x.dtype)
        return y if bias is None else y + bias

    @staticmethod
    def qlinear_kquant(x: torch.Tensor, weight: torch.Tensor, n: int,
                       bias: torch.Tensor | None = None, *, wtype: int) -> torch.Tensor:
        """weight: packed K-quant groups [ceil(n / 16), K / 256, record bytes] of the ggml type
        wtype (kvserve/quant/kquant_pack.py FIELDS); x quantized to Q8_K per 256 values
        as llama.cpp does, the integer dot products scaled in ggml_kquants.dot_kquant's float
        order, then + bias[n]."""
        from kvserve.quant.ggml_kquants import dot_kquant, quantize_activations_q8_k
        from kvserve.quant.kquant_pack import unpack

        lead, k = x.shape[:-1], x.shape[-1]
        xq = quantize_activations_q8_k(x.reshape(-1, k).float())
        out = dot_kquant(unpack(weight, wtype, n), wtype, xq)
        if bias is not None:
            out = out + bias
        return out.reshape(*lead, n).to(x.dtype)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * weight.float()).to(x.dtype)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x; returns (rms_norm(residual), residual)."""
        residual = x + residual
        return ReferenceOps.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x = [gate | up] along the last dim -> silu(gate) * up."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX/HF-style rotate-half RoPE. q [T, H, D], k [T, Hkv, D],
        cos_sin [max_pos, D] = [cos(D/2) | sin(D/2)] per position."""
        cs = cos_sin[positions]  # [T, D]
        half = cs.shape[-1] // 2
        cos = cs[:, :half].unsqueeze(1)
        sin = cs[:, half:].unsqueeze(1)

        def rot(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        return rot(q), rot(k)

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor | QuantizedKVCache, slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] -> kv_cache[0/1] at flat slots; slot -1 is skipped. A
        quantized cache gets each row quantized (quantize_kv) and its scale beside it."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if isinstance(kv_cache, QuantizedKVCache):
            nb, bs, hkv, d = kv_cache.data.shape[1:]
            for i, x in enumerate((key, value)):
                q, s = quantize_kv(x[keep], kv_cache.kv_dtype)
                kv_cache.data[i].view(nb * bs, hkv, d)[slots] = q
                kv_cache.scales[i].view(nb * bs, hkv)[slots] = s
            return
        nb, bs, hkv, d = kv_cache.shape[1:]
        kv_cache[0].view(nb * bs, hkv, d)[slots] = key[keep].to(kv_cache.dtype)
        kv_cache[1].view(nb * bs, hkv, d)[slots] = value[keep].to(kv_cache.dtype)

    @staticmethod
    def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int) -> torch.Tensor:
        """Causal attention of each request's queries over its paged context.

        Request b has q_len = query_start_loc[b+1] - query_start_loc[b] queries, which are the
        LAST q_len of its seq_lens[b] context tokens (already written to the cache):

            context  |0 ............................... seq_len-1|
            queries                         |seq_len-q_len .. seq_len-1|
        query i (0-based) sees keys [0, seq_len - q_len + i].
        A quantized cache: the blocks read are dequantized (dequantize_kv), then the same math.
        """
        quant = isinstance(kv_cache, QuantizedKVCache)
        _, nb, bs, hkv, d = (kv_cache.data if quant else kv_cache).shape
        h = q.shape[1]
        out = torch.empty_like(q)
        qsl = query_start_loc.tolist()
        for b, seq_len in enumerate(seq_lens.tolist()):
            s, e = qsl[b], qsl[b + 1]
            if e == s:
                continue
            nblk = -(-seq_len // bs)
            blocks = block_tables[b, :nblk].long()
            if quant:
                kv = dequantize_kv(kv_cache.data[:, blocks], kv_cache.scales[:, blocks])
            else:
                kv = kv_cache[:, blocks].float()
            k = kv[0].reshape(nblk * bs, hkv, d)[:seq_len]
            v = kv[1].reshape(nblk * bs, hkv, d)[:seq_len]
            k = k.repeat_interleave(h // hkv, dim=1)  # GQA: query head j uses kv head j // g
            v = v.repeat_interleave(h // hkv, dim=1)
            qb = q[s:e].float()
            scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
            q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        return out
