"""Linear layers that delegate their math to a LinearMethod.

The model file never mentions quantization: a quantized checkpoint brings another
LinearMethod (kvserve/quant/), the layer keeps its name and its place in the model.

Under tensor parallelism (kvserve/distributed/group.py) a layer is column-parallel (each
rank keeps its slice of every output shard: its heads of q, k and v) or row-parallel (its
slice of the input columns, then an all-reduce). The checkpoint's whole tensors arrive and
the layer cuts its slice of weight and bias before its LinearMethod sees them, so a method
quantizes, repacks or keeps only the rank's part (a GGUF matrix is cut along whole blocks, as
stored). Any other checkpoint tensor (a GPTQ layer's qweight, scales, ...) arrives whole: its
method knows its layout and cuts it (int4_checkpoints.py after unpacking), or refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from kvserve.distributed.group import TPGroup
from kvserve.quant.base import (
    LinearMethod,
    QuantizedTensor,
    UnquantizedLinearMethod,
    dense,
    is_quantized,
)

if TYPE_CHECKING:
    from kvserve.ops.reference import ReferenceOps

Parallel = Literal["none", "column", "row"]


class Linear(nn.Module):
    """y = x W^T + b. `shard_sizes` splits the output rows of a fused projection (qkv,
    gate_up) so the loader can place each checkpoint tensor at its offset. Sizes are the
    whole model's; with a tensor-parallel group the layer holds its rank's part of them."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, ops: ReferenceOps,
                 dtype: torch.dtype, shard_sizes: tuple[int, ...] | None = None,
                 quant_method: LinearMethod | None = None, parallel: Parallel = "none",
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.parallel = parallel if self.tp.size > 1 else "none"
        shard_sizes = shard_sizes or (out_features,)
        assert sum(shard_sizes) == out_features
        if self.parallel == "column":
            shard_sizes = tuple(self.tp.shard(n) for n in shard_sizes)
            out_features = sum(shard_sizes)
        elif self.parallel == "row":
            in_features = self.tp.shard(in_features)
        self.in_features = in_features
        self.out_features = out_features
        self.ops = ops
        self.shard_sizes = shard_sizes
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, dtype)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def load_shard(self, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        """One checkpoint tensor (weight or bias) into output-row shard `shard`: the
        LinearMethod keeps it as stored, or copies it in as floats."""
        if self.parallel != "none":
            tensor = self._rank_slice(name, shard, tensor)
        self.quant_method.load_shard(self, name, shard, tensor)

    def _rank_slice(self, name: str, shard: int, tensor: torch.Tensor | QuantizedTensor
                    ) -> torch.Tensor | QuantizedTensor:
        if name not in ("weight", "bias"):
            return tensor  # a layout of the method's own: it cuts (module docstring)
        r = self.tp.rank
        if self.parallel == "column":  # this rank's rows of the shard
            dim, n = 0, self.shard_sizes[shard]
        elif name == "bias":  # row-parallel: added once, after the sum
            return tensor if r == 0 else torch.zeros_like(dense(tensor))
        else:  # row-parallel: this rank's input columns
            dim, n = 1, self.in_features
        if is_quantized(tensor):
            cut = tensor.narrow(dim, r * n, n)  # type: ignore[union-attr]
            if cut is not None:
                return cut
            tensor = dense(tensor)  # the cut splits a quantization block
        return tensor.narrow(dim, r * n, n).contiguous()  # type: ignore[union-attr]

    def process_weights_after_loading(self) -> None:
        """Called once every checkpoint tensor is in (vLLM's name): a method may repack."""
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return self.tp.all_reduce(y) if self.parallel == "row" else y
