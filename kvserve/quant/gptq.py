"""GPTQ (Frantar et al., 2022): one linear layer quantized column by column, each column's
rounding error pushed onto the columns not yet quantized, weighted by the inverse Hessian of
the layer's reconstruction error over calibration inputs.

    minimize ||X W^T - X Wq^T||^2 over the quantized Wq, one row of W at a time; every row
    shares H = 2 X^T X (X: the layer's inputs [T, K]). Quantizing column j of a row leaves
    an error e_j; the other free columns F absorb it optimally by
        w_F -= (w_j - q_j) / [H_F^-1]_jj * [H_F^-1]_{j,F}
    With U the upper Cholesky factor of H^-1 (H^-1 = U^T U), the row j of U restricted to
    the columns after j is exactly that update for the remaining set, so one factorization
    serves all K steps; the updates are applied lazily in blocks of 128 columns (the
    paper's "lazy batch" trick: a rank-128 update per block instead of K rank-1 updates).

Rows never interact, so q_proj / k_proj / v_proj (one input, one H) are quantized as one
stacked matrix, with the same result as three separate calls.

The integer grid is AutoGPTQ's (Quantizer.find_params): per output row and group of G inputs,

    asymmetric  s = (max(w, 0) - min(w, 0)) / maxq,   z = round(-min(w, 0) / s)
    symmetric   s = 2 amax / maxq,                     z = (maxq + 1) / 2
    q = clamp(round(w / s) + z, 0, maxq),   w ~= s (q - z)

with s rounded to float16 (the checkpoint's scale type) before q is chosen against it, so the
stored integers are the nearest ones for the scales actually stored. The GPTQ v1 checkpoint
stores z - 1 (int4_layouts.py), which cannot hold z = 0; an asymmetric group whose min rounds to
z = 0 (min(w) > -s / 2) takes z = 1 and s = max / (maxq - 1) instead, a grid that still
covers [0, max].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedLinear:
    """A weight [N, K] as integers and per-group parameters, in no checkpoint's layout:

        w[n, k] ~= scales[n, g_idx[k]] * (q[n, k] - zeros[n, g_idx[k]])

    q int32 [N, K] in [0, 2^bits - 1]; scales float32 [N, K / G] (float16-exact);
    zeros int32 [N, K / G] in [0, 2^bits - 1]; g_idx int32 [K], the group of each input
    column (k // G unless act-order permuted the columns)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return self.scales[:, g] * (self.q - self.zeros[:, g]).float()


def _f16(x: torch.Tensor) -> torch.Tensor:
    # Smallest float16 subnormal as the floor: a scale never rounds to 0.
    return x.clamp(min=2.0**-24).to(torch.float16).float()


def group_params(w: torch.Tensor, bits: int, sym: bool, mse: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [N, G] (one group of columns) -> (s float32 [N], float16-exact; z float32 [N],
    integer-valued in [1, maxq]): AutoGPTQ's min/max grid, the range always holding 0.

    mse > 0 (GPTQ's own Quantizer with mse=True; GPTQModel's `mse`, the norm): the range is
    shrunk instead, to p (lo, hi) for the p in 1, 0.99, .., 0.21 whose grid rounds the
    group with the least sum |w - s (q - z)|^mse per row (ties: the widest). Clipping the few
    largest weights buys a finer step for all the others."""
    lo = w.min(dim=1).values.clamp(max=0)
    hi = w.max(dim=1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    flat = (lo == 0) & (hi == 0)  # an all-zero group: any grid, keep it finite
    lo = torch.where(flat, -torch.ones_like(lo), lo)
    hi = torch.where(flat, torch.ones_like(hi), hi)
    s, z = _range_grid(lo, hi, bits, sym)
    if mse <= 0:
        return s, z
    best = _grid_error(w, s, z, bits, mse)
    for i in range(1, _SHRINK_STEPS):
        p = 1 - i / _SHRINK_GRID
        s1, z1 = _range_grid(p * lo, p * hi, bits, sym)
        err = _grid_error(w, s1, z1, bits, mse)
        better = err < best
        best = torch.where(better, err, best)
        s, z = torch.where(better, s1, s), torch.where(better, z1, z)
    return s, z


# GPTQ's Quantizer: grid=100, maxshrink=0.8 (p down to 0.21).
_SHRINK_GRID = 100
_SHRINK_STEPS = 80


def _range_grid(lo: torch.Tensor, hi: torch.Tensor, bits: int, sym: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid (s, z) spanning [lo, hi] per row (lo <= 0 <= hi, not both 0)."""
    maxq = 2**bits - 1
    s = _f16((hi - lo) / maxq)
    if sym:
        return s, torch.full_like(s, (maxq + 1) // 2)
    z = torch.round(-lo / s).clamp(0, maxq)
    # z = 0 has no v1 encoding (z - 1 stored): stretch the grid to z = 1, s = hi / (maxq - 1).
    low_z = z == 0
    s = torch.where(low_z, _f16(hi / (maxq - 1)), s)
    return s, torch.where(low_z, torch.ones_like(z), z)


def _grid_error(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, norm: float
                ) -> torch.Tensor:
    """sum over each row of w [N, G] of |w - s (q - z)|^norm on the grid (s, z) [N]."""
    q = quantize_column(w, s[:, None], z[:, None], bits)
    return (s[:, None] * (q - z[:, None]) - w).abs().pow(norm).sum(1)


def quantize_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int
                    ) -> torch.Tensor:
    """q = clamp(round(w / s) + z, 0, maxq), elementwise (round half to even), float."""
    return torch.clamp(torch.round(w / s) + z, 0, 2**bits - 1)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """The layer-input Hessian H = 2 X^T X / T of ||X W^T - X Wq^T||^2 per token, float32
    [K, K], from inputs x [..., K] (any leading shape: tokens). The scale does not change
    GPTQ's result (damping is relative to mean(diag H)); dividing by T keeps it O(x^2)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (2.0 / x.shape[0] * (x.T @ x)).float()


def group_grids(w: torch.Tensor, bits: int, group_size: int, sym: bool, mse: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """group_params of every run of group_size columns of w [N, K]: (scales, zeros) float32
    [N, K / G]."""
    grids = [group_params(w[:, g0:g0 + group_size], bits, sym, mse)
             for g0 in range(0, w.shape[1], group_size)]
    return torch.stack([s for s, _ in grids], 1), torch.stack([z for _, z in grids], 1)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, mse: float = 0.0
                 ) -> QuantizedLinear:
    """Round to nearest on the same grid, no Hessian: the baseline GPTQ improves on, and
    `kvserve quantize --method int4 | int8` (mse: group_params' shrink search)."""
    k = w.shape[1]
    w = w.float()
    s_all, z_all = group_grids(w, bits, group_size, sym, mse)
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    q = quantize_column(w, s_all[:, g_idx.long()], z_all[:, g_idx.long()], bits)
    return QuantizedLinear(q.to(torch.int32), s_all, z_all.to(torch.int32), g_idx, bits,
                           group_size)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, sym: bool,
                  act_order: bool = False, block_size: int = 128, percdamp: float = 0.01,
                  static_groups: bool = False, mse: float = 0.0) -> QuantizedLinear:
    """GPTQ of w float [N, K] given h [K, K] = hessian(inputs).

    act_order: columns in descending diag(H) (the inputs with the most energy first, while
    the most columns remain to absorb their error); groups are then runs of G columns in
    that order and g_idx maps each original column to its group. static_groups (AutoGPTQ's):
    every group's grid is fixed up front from the weights before any update, groups being
    runs of G original columns, so g_idx stays k // G under act-order too. percdamp: lambda =
    percdamp * mean(diag H) added to the diagonal, so H stays positive definite with few
    tokens or dead inputs."""
    n, k = w.shape
    w = w.float().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0  # an input that is always 0: its column cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    if static_groups:
        scales, zeros = group_grids(w, bits, group_size, sym, mse)
    else:
        scales = torch.zeros(n, k // group_size)
        zeros = torch.zeros(n, k // group_size)
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w = w[:, perm]
    h = h[perm][:, perm]
    h += percdamp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    # U upper with H^-1 = U^T U: row j of U (from j on) is the update of step j.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()

    q = torch.zeros(n, k)
    s = z = torch.zeros(n)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()  # this block, updated step by step
        err = torch.zeros_like(w1)
        u = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static_groups:
                g = int(perm[col]) // group_size
                s, z = scales[:, g], zeros[:, g]
            elif col % group_size == 0:
                # The group's grid from its weights as the feedback has left them so far
                # (AutoGPTQ reads the copy from the block's start; the newer values are what
                # will actually be rounded).
                end = i + group_size  # in block coordinates; may run past the block
                cur = (w1[:, i:end] if end <= i2 - i1
                       else torch.cat([w1[:, i:], w[:, i2:i1 + end]], dim=1))
                s, z = group_params(cur, bits, sym, mse)
                scales[:, col // group_size] = s
                zeros[:, col // group_size] = z
            qc = quantize_column(w1[:, i], s, z, bits)
            q[:, col] = qc
            e = (w1[:, i] - s * (qc - z)) / u[i, i]
            w1[:, i:] -= e[:, None] * u[i, i:][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]  # the block's errors onto every later column

    inv = torch.argsort(perm)
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if not static_groups:
        g_idx = g_idx[inv]
    return QuantizedLinear(q[:, inv].to(torch.int32), scales, zeros.to(torch.int32), g_idx,
                           bits, group_size)
