"""The quantization seam: what a quantization method is, and what it hands each linear layer.

    QuantConfig (config.py)          which method, and its knobs
      -> QuantMethod (a registry entry, kvserve/quant/__init__.py)
           finds itself in a checkpoint (detect), checks a config (validate),
           says whether the loader keeps checkpoint tensors as stored (keeps_quantized)
           -> linear_method(prefix): one LinearMethod per linear layer
                create_weights            the layer's parameters, before loading
                load_shard                one checkpoint tensor into one output shard
                process_weights_after_loading   repack once every shard is in
                apply                     y = x W^T + b in the method's arithmetic
                kernel_weights            the weight as the CPU kernels read it (KernelWeight
                                          runs), for the fused layer stack; None if they cannot
                weight_rows               the weight read row by row (a tied embedding shares it)
                dense_weight              the loaded values as float32 [out, in]
                int4_groups               4-bit integers and a scale / zero per group, where
                                          the method's weights are that (GPTQ-4, AWQ, int4)
           -> without_kernels(device): the method on a backend without the CPU kernels (CUDA);
              by default its linears on torch's int4 matmul where int4_groups gives them and
              the device runs it (bfloat16: layer.ops.int4_linear), else dequantized once
              loaded (DequantizedLinearMethod)

The model file builds its Linear layers with `quant.linear_method(prefix)` and never names a
format; a checkpoint tensor it cannot place as stored (an embedding, a norm) it turns into
floats with `dense`, whatever the format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from kvserve.quant.half_weights import float_wtype, half_rows, keep_exact_halves
from kvserve.quant.int4_groups import Int4Groups

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, QuantConfig

# `layer` below is a kvserve.layers.linear.Linear (in_features, out_features, shard_sizes, bias,
# ops, weight); typed Any so that this seam does not import the layer built on it.
Linear = Any


class QuantizedTensor(Protocol):
    """A checkpoint tensor the loader kept as stored (quant/gguf_weights.py GGUFWeight, ...)."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of dequantize()'s result."""
        ...

    def dequantize(self) -> torch.Tensor: ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float rows ids of the matrix, each equal to its row of dequantize() (an embedding
        lookup that never dequantizes the whole table, as llama.cpp's get_rows)."""
        ...

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor | None:
        """A slice as stored (a tensor-parallel shard: rows, or columns along whole blocks);
        None when the format cannot be cut there (the caller dequantizes)."""
        ...


def is_quantized(tensor: torch.Tensor | QuantizedTensor) -> bool:
    """Whether a checkpoint tensor came as stored (not a torch.Tensor: torch.Tensor has a
    dequantize method of its own, so the protocol alone cannot tell them apart)."""
    return not isinstance(tensor, torch.Tensor)


def dense(tensor: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """A checkpoint tensor as floats, whatever its format."""
    return tensor.dequantize() if is_quantized(tensor) else tensor  # type: ignore[return-value]


class KernelWeight(NamedTuple):
    """Output rows [start, start + rows) of a linear's weight in one format, as the kernels
    read it: float rows [rows, K] (wtype 0), GGUF rows [rows, row bytes] (ops.linear), or
    16-row groups [groups, K / block, record bytes] (3-D: ops.qlinear, or ops.qlinear_kquant
    for a K-quant). wtype is a ggml type id: the kernels are told the format rather than
    guess it from a row length. perm: the order of the inputs the weight's columns hold
    (GPTQ act-order: column j is input perm[j]), int64 [K], the same for every run of a
    linear; the kernels gather x in it first. None: the inputs in order."""

    weight: torch.Tensor
    wtype: int
    start: int
    rows: int
    perm: torch.Tensor | None = None


class LinearMethod(Protocol):
    """How one Linear layer stores and applies its weight (vLLM's LinearMethodBase)."""

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        """The tensors each output shard needs from a checkpoint ("weight", "bias"; a GPTQ
        layer's "qweight", ...): what the model checks were all loaded."""
        ...

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None: ...

    def load_shard(self, layer: Linear, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None: ...

    def process_weights_after_loading(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def kernel_weights(self, layer: Linear) -> list[KernelWeight] | None:
        """The loaded weight as runs of output rows in one format each, in order (one run
        unless a fused projection mixes formats, as a Q4_K_M file's qkv does), with the input
        order its columns hold (KernelWeight.perm), which the CPU backend's fused layer stack
        reads directly; None when apply does more than that and the layer must run in
        Python."""
        ...

    def weight_rows(self, layer: Linear) -> QuantizedTensor | None:
        """The loaded weight read row by row as floats, where the method keeps the
        checkpoint's own values in a form that allows it (16-bit floats, GGUF blocks packed or
        as stored): a tied embedding's lookup then shares the lm_head's weight instead of a
        second copy. None where the method changed the values (quantized them at load) or
        keeps no such form."""
        ...

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The loaded weight as float32 [out, in], in the checkpoint's input order: the
        values apply multiplies by, for a backend without kvserve's CPU kernels
        (DequantizedLinearMethod)."""
        ...

    def int4_groups(self, layer: Linear) -> Int4Groups | None:
        """The loaded weight as 4-bit integers with a scale and a zero per group of inputs
        (and act-order's input permutation), where the method holds it so (4-bit groups of
        GPTQ, AWQ, int4, GGUF Q4_0 / Q4_1 / Q4_K): what torch's int4 matmul runs on a backend
        without kvserve's CPU kernels (DequantizedLinearMethod). None for any other weight."""
        ...


def dense_names(layer: Linear) -> tuple[str, ...]:
    """checkpoint_names of a layer stored as a weight (and a bias)."""
    return ("weight", "bias") if layer.bias is not None else ("weight",)


def create_dense_weight(layer: Linear, dtype: torch.dtype) -> None:
    """layer.weight as an uninitialised float [out, in] parameter: what float shards are
    copied into, and the placeholder a quantized method replaces once loaded (torch.empty
    takes no physical memory until written)."""
    layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                requires_grad=False)


def copy_shard(layer: Linear, name: str, shard: int, tensor: torch.Tensor) -> None:
    """Copies a float tensor into output-row shard `shard` of parameter `name` (weight or
    bias); ValueError naming both shapes when it does not fit."""
    if name not in ("weight", "bias"):
        raise ValueError(f"a checkpoint tensor {name!r} has no place in a linear layer stored "
                         f"as a weight and a bias; a quantized checkpoint (GPTQ, AWQ) needs its "
                         f"quantization method")
    start = sum(layer.shard_sizes[:shard])
    size = layer.shard_sizes[shard]
    param = getattr(layer, name)
    if param is None or tuple(tensor.shape) != (size,) + tuple(param.shape[1:]):
        want = None if param is None else (size,) + tuple(param.shape[1:])
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} does not fit {name} shard "
                         f"{shard} of shape {want}")
    param.data[start:start + size].copy_(tensor)


class UnquantizedLinearMethod:
    """Dense weights in nn.Linear's [out, in] layout, which both the small-M kernels and
    MKL's large-M GEMM read row-contiguously. A quantized checkpoint tensor is dequantized."""

    def __init__(self, half: bool = False) -> None:
        """half: once loaded, a float32 weight whose every value is a float16 value (else a
        bfloat16 one) is kept at that width. For a quantized checkpoint's float output layer
        (GPTQ, AWQ and W8A8 exports keep lm_head in float16), which a decode step would
        otherwise stream as float32: twice the bytes of every other layer together on a
        small model. ops.linear widens it exactly, so the logits are float32's bit for bit."""
        self.half = half

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        return dense_names(layer)

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        create_dense_weight(layer, dtype)

    def load_shard(self, layer: Linear, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        copy_shard(layer, name, shard, dense(tensor))

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.half:
            keep_exact_halves(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.ops.linear(x, layer.weight, layer.bias, wtype=float_wtype(layer.weight))

    def kernel_weights(self, layer: Linear) -> list[KernelWeight] | None:
        return [KernelWeight(layer.weight, float_wtype(layer.weight), 0, layer.out_features)]

    def weight_rows(self, layer: Linear) -> QuantizedTensor | None:
        return half_rows(layer.weight)

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        return layer.weight.float()

    def int4_groups(self, layer: Linear) -> None:
        return None


class DequantizedLinearMethod:
    """A quantized method's linear on a backend without kvserve's CPU kernels (CUDA, the torch
    backend), loaded as the method loads it (a GPTQ checkpoint's qweight, int4 rounding at
    load). Then 4-bit groups (int4_groups) stay 4-bit on torch's int4 matmul where the device
    runs it (ops.int4_linear: bfloat16, on CUDA or the CPU); any other weight is dequantized once
    into the model's dtype and multiplied as a float weight (the method's values, the float
    model's memory and speed)."""

    def __init__(self, inner: LinearMethod, device: str = "cpu") -> None:
        self.inner = inner
        self.device = torch.device(device)
        self.dtype = torch.float32
        # On ops.int4_linear: (group size, act-order's perm on the device).
        self.int4: tuple[int, torch.Tensor | None] | None = None

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        return self.inner.checkpoint_names(layer)

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.inner.create_weights(layer, dtype)

    def load_shard(self, layer: Linear, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        self.inner.load_shard(layer, name, shard, tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)
        groups = self.inner.int4_groups(layer)
        if groups is not None:
            groups = groups.coarsest()
            if layer.ops.int4_unsupported(groups, self.device, self.dtype) is None:
                # Packed on the device itself: the tile layout is the device's own.
                packed, pairs = layer.ops.int4_pack(groups, self.device, self.dtype)
                layer.weight = nn.Parameter(packed, requires_grad=False)
                layer.int4_pairs = nn.Parameter(pairs, requires_grad=False)
                self.int4 = (groups.group_size,
                             None if groups.perm is None else groups.perm.to(self.device))
                return
        layer.weight = nn.Parameter(self.inner.dense_weight(layer).to(self.dtype),
                                    requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is None:
            return layer.ops.linear(x, layer.weight, layer.bias, wtype=float_wtype(layer.weight))
        return layer.ops.int4_linear(x, layer.weight, layer.int4_pairs, self.int4[0],
                                     layer.out_features, self.int4[1], layer.bias)

    def kernel_weights(self, layer: Linear) -> list[KernelWeight] | None:
        if self.int4 is not None:
            return None  # not a format the CPU kernels read (which never run here)
        return [KernelWeight(layer.weight, float_wtype(layer.weight), 0, layer.out_features)]

    def weight_rows(self, layer: Linear) -> QuantizedTensor | None:
        return None  # the method's values, not the checkpoint's: the embedding keeps its own

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        if self.int4 is None:
            return layer.weight.float()
        # The int4 matmul of the identity: the weight as the kernel itself reads it.
        eye = torch.eye(layer.in_features, device=layer.int4_pairs.device, dtype=self.dtype)
        return layer.ops.int4_linear(eye, layer.weight, layer.int4_pairs, self.int4[0],
                                     layer.out_features, self.int4[1]).float().T.contiguous()

    def int4_groups(self, layer: Linear) -> None:
        return None  # already placed: nothing wraps this method again


# The model file's fused linears -> the checkpoint modules each holds, in shard order. The
# model loads q / k / v into qkv_proj's shards 0-2 and gate / up into gate_up_proj's 0-1 by
# this map; a method that configures modules by their checkpoint names (GPTQModel's
# `dynamic`, AutoAWQ's `modules_to_not_convert`, compressed-tensors' `ignore`) reads a fused
# layer's parts through checkpoint_modules.
FUSED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_modules(prefix: str) -> tuple[str, ...]:
    """The checkpoint modules of the linear layer `prefix` (linear_method's argument):
    "model.layers.0.self_attn.qkv_proj" -> its q_proj, k_proj and v_proj; any other layer
    is its own module."""
    head, _, last = prefix.rpartition(".")
    parts = FUSED_LINEARS.get(last)
    if parts is None:
        return (prefix,)
    return tuple(f"{head}.{p}" if head else p for p in parts)


class QuantMethod:
    """One quantization method: a registry entry (kvserve.quant), built from a QuantConfig.

    Subclasses set name, override linear_method, and, where they apply, detect / validate."""

    name: ClassVar[str] = "none"
    # The loader hands checkpoint tensors over as stored (QuantizedTensor) instead of floats.
    keeps_quantized: ClassVar[bool] = False
    # Only kvserve's CPU kernels run it; on another backend every forward would dequantize.
    needs_kernels: ClassVar[bool] = False
    # kv_cache_dtype when the user names none. "auto" is the model's dtype (float32 on CPU);
    # the methods run on the CPU kernels keep llama.cpp's default, a float16 cache: half the
    # bytes a token, twice the tokens in the same memory, what their benchmark rows measure.
    default_kv_cache_dtype: ClassVar[str] = "auto"
    # The group sizes it takes (QuantConfig.group_size), and the one it gets when unset;
    # () for a method without groups.
    group_sizes: ClassVar[tuple[int, ...]] = ()
    default_group_size: ClassVar[int | None] = None
    # What without_kernels() runs, for the start-up log.
    without_kernels_note: ClassVar[str] = ("4-bit groups on torch's int4 matmul in bfloat16 "
                                           "(--dtype bfloat16); other weights, and any weight "
                                           "in another dtype, dequantized once loaded into the "
                                           "model's dtype")

    def __init__(self, config: QuantConfig | None = None) -> None:
        self.config = config

    @classmethod
    def detect(cls, model_path: str, device: str, dtype: str, ops_backend: str,
               quantization_config: dict[str, Any] | None = None) -> bool:
        """Whether this method is the default for such a checkpoint (its path, its
        config.json quantization_config) and target."""
        return False

    @classmethod
    def check_quant_config(cls, config: QuantConfig) -> None:
        """ValueError naming the field for knobs this method does not take."""
        if not cls.group_sizes and config.group_size is not None:
            raise ValueError(f"quantization {cls.name!r} takes no group_size, got "
                             f"{config.group_size}")
        if cls.group_sizes and config.group_size not in cls.group_sizes:
            raise ValueError(f"quantization {cls.name!r} needs group_size in "
                             f"{', '.join(map(str, cls.group_sizes))}, got {config.group_size}")

    @classmethod
    def validate(cls, config: EngineConfig) -> None:
        """ValueError naming the field when the engine config cannot run this method."""

    def linear_method(self, prefix: str) -> LinearMethod:
        """The LinearMethod of the linear layer `prefix` (its checkpoint name, e.g.
        "model.layers.0.self_attn.qkv_proj")."""
        return UnquantizedLinearMethod()

    def without_kernels(self, device: str) -> QuantMethod:
        """This method on a backend without kvserve's CPU kernels (needs_kernels), on device:
        by default every linear through DequantizedLinearMethod (4-bit groups on torch's int4
        matmul, anything else dequantized once loaded), since there every forward would
        otherwise unpack the blocks again in Python."""
        return DequantizedQuantMethod(self, device)


class DequantizedQuantMethod(QuantMethod):
    """QuantMethod.without_kernels' default: the method's loading, its linears dequantized."""

    def __init__(self, inner: QuantMethod, device: str = "cpu") -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.device = device
        self.name = inner.name  # type: ignore[misc]
        self.keeps_quantized = inner.keeps_quantized  # type: ignore[misc]

    def linear_method(self, prefix: str) -> LinearMethod:
        return DequantizedLinearMethod(self.inner.linear_method(prefix), self.device)


def kernels_run(device: str, ops_backend: str) -> bool:
    """Whether an engine on this device and ops backend runs kvserve's CPU kernels (the auto
    / cpu backend on a CPU)."""
    return device == "cpu" and ops_backend in ("auto", "cpu")


def require_float32(name: str, config: EngineConfig) -> None:
    """The int8-activation kernels take float32 activations: ValueError naming dtype. Without
    them (CUDA) the method's weights are dequantized into the model's dtype, any dtype."""
    if config.dtype != "float32" and kernels_run(config.device, config.ops_backend):
        raise ValueError(f"quantization {name!r} computes in float32; dtype must be float32, "
                         f"got {config.dtype!r}")


class NoQuantization(QuantMethod):
    """Every weight in the model's dtype (quantized checkpoint tensors dequantized at load)."""

    name = "none"

