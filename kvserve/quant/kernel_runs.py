"""A weight held as KernelWeight runs (kvserve/quant/base.py: one format each, side by side
in its rows, as a Q4_K_M file's fused qkv holds Q4_K and Q6_K): its float32 matrix, its 4-bit
groups where every run is one (torch's int4 kernels on a GPU), and x times it on the CPU
kernels. What every linear method whose weights the kernels run shares (gguf, rtn, GPTQ / AWQ,
SmoothQuant).
"""

from __future__ import annotations

from typing import Any

import torch

from kvserve.quant import ggml_kquants
from kvserve.quant.base import KernelWeight
from kvserve.quant.block_pack import BLOCK, Q4_0, Q4_1, Q4_1_128, unpack
from kvserve.quant.gguf_weights import KQUANT_TYPES, Q4_K, GGUFWeight, PackedRows
from kvserve.quant.int4_groups import Int4Groups
from kvserve.quant.kquant_pack import unpack as unpack_kquant_rows


def int4_runs(parts: list[KernelWeight], k: int, perm: torch.Tensor | None = None
              ) -> Int4Groups | None:
    """A weight held as packed Q4_0 / Q4_1 (or Q4_1_128) / Q4_K runs as 4-bit groups of 32 in
    torch's int4 convention, w = (q - 8) * scale + zero: Q4_1's d q + m is scale d, zero
    m + 8 d; Q4_0's d (q - 8) is scale d, zero 0; a Q4_K sub-block's dl q - dm (dl = d *
    scale, dm = dmin * min) is scale dl, zero 8 dl - dm. None if any run is another format.
    perm: act-order's input order, which the runs' columns follow."""
    qs, scales, zeros = [], [], []
    for p in parts:
        if p.weight.dim() != 3 or p.wtype not in (Q4_0, Q4_1, Q4_1_128, Q4_K):
            return None
        if p.wtype == Q4_K:
            kp = ggml_kquants.unpack_kquant(unpack_kquant_rows(p.weight, Q4_K, p.rows), Q4_K, k)
            q = kp.q.reshape(p.rows, k)
            d = (kp.d[..., None] * kp.scale.float()).reshape(p.rows, -1)
            assert kp.dmin is not None and kp.min is not None
            zero = 8 * d - (kp.dmin[..., None] * kp.min.float()).reshape(p.rows, -1)
        else:
            q, d, m = unpack(p.weight, p.wtype)
            q, d = q[:p.rows].reshape(p.rows, k), d[:p.rows]
            if m is None:  # Q4_0: unpack gave q - 8
                q, zero = q + 8, torch.zeros_like(d)
            else:
                zero = m[:p.rows] + 8 * d
        qs.append(q.to(torch.uint8))
        scales.append(d)
        zeros.append(zero)
    return Int4Groups(torch.cat(qs), torch.cat(scales), torch.cat(zeros), BLOCK, perm)


def dequantize_runs(parts: list[KernelWeight], k: int) -> torch.Tensor:
    """A weight held as KernelWeight runs, as float32 [N, K]: each run's floats, 16-row
    groups (a packed legacy or K-quant format) or GGUF rows as stored, dequantized."""
    out = []
    for p in parts:
        if p.weight.dtype != torch.uint8:
            out.append(p.weight.float())
        elif p.weight.dim() == 3:
            out.append(PackedRows(p.weight, p.wtype, k, p.rows).dequantize())
        else:
            out.append(GGUFWeight(p.weight, p.wtype, k).dequantize())
    return torch.cat(out)


def apply_kernel_weights(ops: Any, x: torch.Tensor, parts: list[KernelWeight],
                         bias: torch.Tensor | None) -> torch.Tensor:
    """x times a weight held as KernelWeight runs, each on the kernel for its format, the
    runs' outputs side by side: what the fused layer stack computes for such a linear."""
    outs = []
    for p in parts:
        b = bias if bias is None or len(parts) == 1 else bias[p.start:p.start + p.rows]
        if p.wtype in KQUANT_TYPES:
            outs.append(ops.qlinear_kquant(x, p.weight, p.rows, b, wtype=p.wtype))
        elif p.weight.dim() == 3:
            outs.append(ops.qlinear(x, p.weight, p.rows, b, wtype=p.wtype))
        else:
            outs.append(ops.linear(x, p.weight, b, wtype=p.wtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
