"""Linear layers that delegate their math to a LinearMethod.

The model file never mentions quantization: a quantized checkpoint brings another
LinearMethod (kvserve/quant/), the layer keeps its name and its place in the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.quant.base import LinearMethod, QuantizedTensor, UnquantizedLinearMethod


class Linear(nn.Module):
    """y = x W^T + b. `shard_sizes` splits the output rows of a fused projection (qkv,
    gate_up) so the loader can place each checkpoint tensor at its offset."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, ops: Any,
                 dtype: torch.dtype, shard_sizes: tuple[int, ...] | None = None,
                 quant_method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.ops = ops
        self.shard_sizes = shard_sizes or (out_features,)
        assert sum(self.shard_sizes) == out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, dtype)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def load_shard(self, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        """One checkpoint tensor (weight or bias) into output-row shard `shard`: the
        LinearMethod keeps it as stored, or copies it in as floats."""
        self.quant_method.load_shard(self, name, shard, tensor)

    def process_weights_after_loading(self) -> None:
        """Called once every checkpoint tensor is in (vLLM's name): a method may repack."""
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)
