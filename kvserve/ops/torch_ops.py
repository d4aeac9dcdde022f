"""Torch ops backend for devices without kvserve kernels (CUDA, and CPUs without AVX2/FMA).

Everything is ReferenceOps' except two ops that here never wait for the device, so that a
decode step can be captured in a CUDA graph (kvserve/graphs.py):
- write_kv: the reference drops slot -1 rows by a boolean mask (a device sync, and a shape
  known only on the host); here every row writes, a -1 row its slot's own old value back into
  the null block, which leaves the cache's bytes as the reference leaves them.
- paged attention runs the whole varlen batch in one `scaled_dot_product_attention` call with
  no per-request Python loop:
each request's blocks are gathered into a padded [B, K, Hkv, D] context, its queries into a
padded [B, Q, H, D] block, and a boolean mask carries both causality and the padding. The
reference stays the oracle; tests/unit/test_ops_torch.py holds the parity test.

Cost: a mixed step pads every request to the longest query and the longest context, so a
prefill chunk batched with many decodes computes B x max_query_len rows. Pure decode steps
(max_query_len == 1) pad nothing on the query side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kv.layout import QuantizedKVCache
from kvserve.ops.reference import ReferenceOps, dequantize_kv, quantize_kv


class TorchOps(ReferenceOps):
    name = "torch"

    @staticmethod
    def write_kv(key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor | QuantizedKVCache, slot_mapping: torch.Tensor) -> None:
        """Same contract as ReferenceOps.write_kv: slot -1 changes nothing. Such a row is
        aimed at slot 0 (in null block 0, which no request holds) and writes back what is
        there, so no row is dropped on the host."""
        keep = (slot_mapping >= 0).unsqueeze(-1).unsqueeze(-1)  # [T, 1, 1]
        slots = slot_mapping.clamp(min=0).long()
        quant = isinstance(kv_cache, QuantizedKVCache)
        data = kv_cache.data if quant else kv_cache
        nb, bs, hkv, d = data.shape[1:]
        for i, x in enumerate((key, value)):
            rows = data[i].view(nb * bs, hkv, d)
            if quant:
                q, s = quantize_kv(x, kv_cache.kv_dtype)
                scales = kv_cache.scales[i].view(nb * bs, hkv)
                scales[slots] = torch.where(keep[..., 0], s, scales[slots])
                rows[slots] = torch.where(keep, q, rows[slots])
            else:
                rows[slots] = torch.where(keep, x.to(data.dtype), rows[slots])

    @staticmethod
    def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int) -> torch.Tensor:
        """Same contract as ReferenceOps.paged_attention (see there). A quantized cache: the
        gathered blocks only are dequantized, as the reference does."""
        t, h, d = q.shape
        quant = isinstance(kv_cache, QuantizedKVCache)
        bs, hkv = (kv_cache.data if quant else kv_cache).shape[2:4]
        b = seq_lens.shape[0]
        dev = q.device
        nblk = -(-max_seq_len // bs)
        blocks = block_tables[:, :nblk].long()  # [B, nblk]; padding points at null block 0
        if quant:
            kv = dequantize_kv(kv_cache.data[:, blocks], kv_cache.scales[:, blocks])
        else:
            kv = kv_cache[:, blocks]
        k = kv[0].reshape(b, nblk * bs, hkv, d).to(q.dtype)
        v = kv[1].reshape(b, nblk * bs, hkv, d).to(q.dtype)
        qsl = query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]  # [B]
        # Token t belongs to request row[t], as its col[t]-th query.
        row = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)
        col = torch.arange(t, device=dev) - qsl[row]
        qp = q.new_zeros(b, max_query_len, h, d)
        qp[row, col] = q
        # Query i of request b sits at position seq_len - q_len + i and sees keys up to it.
        # Padded query rows see at least key 0, so no row is all -inf (no NaN).
        q_pos = (seq_lens.long() - q_lens).unsqueeze(1) + torch.arange(max_query_len,
                                                                       device=dev)
        k_pos = torch.arange(nblk * bs, device=dev)
        mask = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # [B, Q, K]
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=h != hkv)  # [B, H, Q, D]
        return out.transpose(1, 2)[row, col]
