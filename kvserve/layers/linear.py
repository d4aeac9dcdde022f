"""Linear layers that delegate their math to a QuantMethod.

The model file never mentions quantization: a quantized checkpoint swaps the QuantMethod (see
kvserve/quant/), the layer keeps its name and its place in the model.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from kvserve.quant.gguf import GGUFWeight


class LinearMethod(Protocol):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """Dense weights in nn.Linear's [out, in] layout, which both the AVX2 small-M kernel and
    MKL's large-M GEMM read row-contiguously."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=dtype), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.ops.linear(x, layer.weight, layer.bias)


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

    def load_shard(self, name: str, shard: int, tensor: Any) -> None:
        """Copy one checkpoint tensor (weight or bias) into output-row shard `shard`. A GGUF
        block tensor (kvserve.quant.gguf.GGUFWeight) goes to a quant method that keeps it, or
        is dequantized here."""
        if isinstance(tensor, GGUFWeight):
            if name == "weight" and hasattr(self.quant_method, "load_quantized"):
                self.quant_method.load_quantized(self, shard, tensor)
                return
            tensor = tensor.dequantize()
        start = sum(self.shard_sizes[:shard])
        size = self.shard_sizes[shard]
        param = getattr(self, name)
        if param is None or tuple(tensor.shape) != (size,) + tuple(param.shape[1:]):
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} does not fit {name} shard "
                             f"{shard} of shape {(size,) + tuple(param.shape[1:])}")
        param.data[start:start + size].copy_(tensor)

    def process_weights_after_loading(self) -> None:
        """Called once every checkpoint tensor is in (vLLM's name): a quant method may repack."""
        hook = getattr(self.quant_method, "process_weights_after_loading", None)
        if hook is not None:
            hook(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)
