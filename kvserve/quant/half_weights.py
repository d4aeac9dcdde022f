"""Float weights kept at 16 bits, exactly: a float32 matrix whose every value is a float16
(else a bfloat16) value is stored at that width, and the row kernels widen it back in
registers, so results are float32's bit for bit while a decode step streams half the bytes.
What UnquantizedLinearMethod(half=True) and the GGUF method's F16 / BF16 matrices keep, and
what a tied embedding looks up from (FloatRows)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

# ggml type ids of the float rows of half float32's bytes that ops.linear reads (and widens
# exactly); float32 is 0.
F16, BF16 = 1, 30
HALF_DTYPES = {F16: torch.float16, BF16: torch.bfloat16}
_HALF_WTYPES = {dtype: wtype for wtype, dtype in HALF_DTYPES.items()}


def exact_half(w: torch.Tensor) -> torch.Tensor | None:
    """A float32 tensor as float16 when every value is a float16 value, else as bfloat16
    when every one is a bfloat16 value (widening gives w back exactly); else None."""
    if w.dtype != torch.float32:
        return None
    for dtype in HALF_DTYPES.values():
        narrow = w.to(dtype)
        if torch.equal(narrow.float(), w):
            return narrow
    return None


def keep_exact_halves(layer: Any) -> None:
    """A Linear layer's (kvserve.layers.linear) float32 weight whose every value is a float16
    value (else a bfloat16 one) is kept at that width: ops.linear widens it exactly, so
    results are float32's bit for bit, and a decode step streams half the bytes. A new
    parameter: a tied lm_head leaves the float32 embedding (looked up row by row) as it is."""
    w = layer.weight
    if w.dim() != 2 or w.shape[1] % 16:
        return
    narrow = exact_half(w)
    if narrow is not None:
        layer.weight = nn.Parameter(narrow, requires_grad=False)


def float_wtype(weight: torch.Tensor) -> int:
    """The ggml type id ops.linear is told for a float weight: F16 / BF16, else 0."""
    return _HALF_WTYPES.get(weight.dtype, 0)


class FloatRows(NamedTuple):
    """A float matrix kept at its stored width (16-bit) and read row by row as float32, as
    QuantizedTensor is: a tied lm_head kept at 16 bits, which the embedding lookup shares
    instead of a float32 copy of the same values (the widening is exact)."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids.to(self.weight.device)].float()

    def narrow(self, dim: int, start: int, length: int) -> FloatRows:
        return FloatRows(self.weight.narrow(dim, start, length))


def half_rows(weight: torch.Tensor) -> FloatRows | None:
    """A weight kept at 16 bits (keep_exact_halves) as rows to look up; None for float32 (a
    tied float32 lm_head is the embedding's own tensor already)."""
    return FloatRows(weight) if weight.dtype in _HALF_WTYPES and weight.dim() == 2 else None
