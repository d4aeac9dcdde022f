"""SmoothQuant W8A8 (Xiao et al., 2023): int8 weights per output channel, int8 activations per
token, through the int8 kernels.

Per-token int8 loses little on weights but much on LLM activations: a few input channels
carry values 10-100x the rest, and one scale per token spends its 8 bits on them. SmoothQuant
moves that difficulty into the weights, exactly: for a linear reading x [T, K],

    s[k] = max_t |x[t, k]| ** alpha / max_n |W[n, k]| ** (1 - alpha)
    x W^T = (x / s) (W s)^T

and 1/s is folded into the RMSNorm weight before the linears, so the smoothed model needs no
extra op. As in the paper's Llama recipe, the two norms are smoothed into what reads them:

    input_layernorm          -> q, k, v
    post_attention_layernorm -> gate, up

(o_proj and down_proj read the attention output and the SiLU product, whose outliers are
milder; they are quantized unsmoothed). alpha = 0.5 is the paper's default. The channel
maxima come from calibration text run through the float model, layer by layer.

Then every linear is quantized: weights per output channel (rtn.quantize_int8: symmetric,
scale float16-exact), activations dynamically per token (one scale per row, computed at run
time). Both run on the Q8_0 int8 kernels (wtype W8A8: the weight's blocks all carry the
row's scale, the activation's blocks the row's), VNNI where present and AVX2 otherwise.

Where it comes from:
- `--quantization w8a8` on a float checkpoint: quantized at load, unsmoothed (the baseline
  SmoothQuant improves on).
- `kvserve quantize MODEL --method smoothquant --calib FILE [--alpha A]`: smoothed, then
  written in the compressed-tensors "int-quantized" layout vLLM loads (per linear `weight`
  int8 [N, K], `weight_scale` [N, 1]; activations "dynamic" per "token"); kvserve finds such a
  checkpoint by its quantization_config and loads it as this method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.quant.base import (
    KernelWeight,
    LinearMethod,
    QuantizedTensor,
    QuantMethod,
    copy_shard,
    create_dense_weight,
    dense,
    dense_names,
    require_float32,
)
from kvserve.quant.block_pack import BLOCK, Q8_0, W8A8, pack
from kvserve.quant.calibration import (
    LayerWeights,
    attention,
    layer_forward,
    layer_weights,
    rms_norm,
)
from kvserve.quant.kernel_runs import dequantize_runs
from kvserve.quant.rtn import int8_to_q8_0, quantize_int8

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, QuantConfig

DEFAULT_ALPHA = 0.5
# What a compressed-tensors checkpoint must say, flattened as kvserve keeps
# quantization_config (kvserve/loader/hf_loader.py): key under config_groups.<group> -> value.
COMPRESSED_TENSORS_W8A8 = {
    "weights.num_bits": 8, "weights.type": "int", "weights.symmetric": True,
    "weights.strategy": "channel", "input_activations.num_bits": 8,
    "input_activations.type": "int", "input_activations.symmetric": True,
    "input_activations.strategy": "token", "input_activations.dynamic": True,
}


# --------------------------------------------------------------------------- smoothing


def smooth_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float
                  ) -> torch.Tensor:
    """s [K] for linears `weights` ([N_i, K]) reading inputs whose channel maxima are act_max
    [K]: act_max^alpha / max|W|^(1 - alpha), each factor floored at 1e-5 (a dead channel gets
    s = 1 rather than a division by zero)."""
    w_max = torch.cat(weights).abs().amax(dim=0).clamp(min=1e-5)
    s = act_max.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return torch.where(act_max > 0, s, torch.ones_like(s))


def smooth_layer(w: LayerWeights, x: torch.Tensor, cfg: ModelConfig,
                 rope: tuple[torch.Tensor, torch.Tensor], alpha: float) -> LayerWeights:
    """One decoder layer's weights with both norms smoothed into their linears; x [S, T, H]
    is the layer's (float) input residual stream. The layer's float function is unchanged up
    to rounding. Returns a new dict; w is not modified."""
    w = dict(w)
    eps = cfg.rms_norm_eps
    groups = (("input_layernorm.weight", ("self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj")),
              ("post_attention_layernorm.weight", ("mlp.gate_proj", "mlp.up_proj")))
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    x2 = x + attention(h, w, cfg, rope)  # the MLP's input (smoothing q/k/v leaves it as is)
    for (norm, linears), inp in zip(groups, (x, x2), strict=True):
        act_max = rms_norm(inp, w[norm], eps).reshape(-1, inp.shape[-1]).abs().amax(dim=0)
        s = smooth_scales(act_max, [w[f"{n}.weight"] for n in linears], alpha)
        w[norm] = w[norm] / s
        for n in linears:
            w[f"{n}.weight"] = w[f"{n}.weight"] * s
    return w


def smooth_model(weights: dict[str, torch.Tensor], x: torch.Tensor, cfg: ModelConfig,
                 rope: tuple[torch.Tensor, torch.Tensor], alpha: float,
                 progress: Any = None) -> dict[str, torch.Tensor]:
    """Every layer smoothed, each from its float inputs (x: the embedded calibration batch
    [S, T, H]); returns the HF-named weights with the smoothed layers in place."""
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        lw = layer_weights(weights, i)
        smoothed = smooth_layer(lw, x, cfg, rope, alpha)
        x = layer_forward(x, lw, cfg, rope)
        out.update({f"model.layers.{i}.{k}": v for k, v in smoothed.items()})
        if progress is not None:
            progress(i)
    return out


def fake_w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [.., K] @ w [N, K]^T as W8A8 computes it, in float: the weight rounded per output
    channel (quantize_int8), the activation per token; for quality checks, not the kernels'
    bits."""
    q, s = quantize_int8(w)
    xf = x.reshape(-1, x.shape[-1]).float()
    d = (xf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    xq = torch.round(xf / d).clamp(-127, 127) * d
    return (xq @ (q.float() * s[:, None]).T).reshape(*x.shape[:-1], w.shape[0])


# ------------------------------------------------------------------------ the method


class W8A8LinearMethod:
    """A Linear whose weight is int8 per output channel (quantized at load from floats, or
    read from a compressed-tensors checkpoint's weight / weight_scale), packed as Q8_0
    groups and run against per-token int8 activations (ops.qlinear, wtype W8A8)."""

    def __init__(self, prefix: str, from_checkpoint: bool, packed: bool = True) -> None:
        """packed False: no CPU kernels (CUDA); the int8 weight stays [N, K] beside its
        scales (layer.weight_scale) for ops.int8_linear (torch._int_mm on CUDA)."""
        self.prefix = prefix
        self.from_checkpoint = from_checkpoint
        self.packed = packed
        self.shards: dict[int, dict[str, torch.Tensor]] = {}

    def checkpoint_names(self, layer: Any) -> tuple[str, ...]:
        if not self.from_checkpoint:
            return dense_names(layer)
        return ("weight", "weight_scale") + (("bias",) if layer.bias is not None else ())

    def create_weights(self, layer: Any, dtype: torch.dtype) -> None:
        if layer.in_features % BLOCK:
            inputs = f"{layer.in_features} inputs"
            if layer.parallel == "row":  # a row-parallel rank quantizes its share of x
                inputs = (f"this rank's {layer.in_features} of its inputs (tensor parallel "
                          f"size {layer.tp.size})")
            raise ValueError(f"{self.prefix}: W8A8 runs on blocks of {BLOCK} inputs; "
                             f"{inputs} do not divide by {BLOCK}")
        create_dense_weight(layer, dtype)

    def load_shard(self, layer: Any, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        # Under tensor parallelism the layer has cut `weight` to this rank's rows (column-
        # parallel) or input columns (row-parallel); `weight_scale` [N, 1] arrives whole. A
        # column-parallel rank keeps its rows' scales; a row-parallel one keeps every row's,
        # and quantizes its own share of x per token (as the int8 GGUF kernels do under TP).
        if self.from_checkpoint and name in ("weight", "weight_scale"):
            t, n = dense(tensor), layer.shard_sizes[shard]
            if (name == "weight_scale" and layer.parallel == "column"
                    and t.numel() == n * layer.tp.size):  # else _checkpoint_weights names it
                t = t.reshape(-1).narrow(0, layer.tp.rank * n, n)
            self.shards.setdefault(shard, {})[name] = t
        else:
            copy_shard(layer, name, shard, dense(tensor))

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.from_checkpoint:
            q, s = self._checkpoint_weights(layer)
        else:
            q, s = quantize_int8(layer.weight.data)
        if not self.packed:
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(s, requires_grad=False)
            return
        layer.weight = nn.Parameter(pack(int8_to_q8_0(q, s), Q8_0, layer.in_features),
                                    requires_grad=False)

    def _checkpoint_weights(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The shards' int8 weights [N, K] and scales [N] (rounded to float16, the blocks'
        scale type: at most 2^-11 relative, below the int8 rounding itself)."""
        qs, ss = [], []
        k = layer.in_features
        for i, n in enumerate(layer.shard_sizes):
            t = self.shards.get(i, {})
            what = f"{self.prefix} shard {i}"
            q, s = t.get("weight"), t.get("weight_scale")
            if q is None or s is None:
                raise ValueError(f"{what}: a W8A8 layer needs weight and weight_scale, found "
                                 f"{sorted(t)}")
            if q.dtype != torch.int8 or tuple(q.shape) != (n, k):
                raise ValueError(f"{what}: weight must be int8 {(n, k)}, found {q.dtype} "
                                 f"{tuple(q.shape)}")
            if not s.is_floating_point() or s.numel() != n:
                raise ValueError(f"{what}: weight_scale must hold one float per output channel "
                                 f"({n}), found {s.dtype} {tuple(s.shape)}")
            qs.append(q)
            ss.append(s.float().reshape(n))
        self.shards = {}
        q = torch.cat(qs)
        if int(q.min()) < -127:
            raise ValueError(f"{self.prefix}: int8 weights must lie in [-127, 127] (symmetric), "
                             f"found {int(q.min())}")
        return q, torch.cat(ss).to(torch.float16).float()

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return layer.ops.int8_linear(x, layer.weight, layer.weight_scale, layer.bias)
        return layer.ops.qlinear(x, layer.weight, layer.out_features, layer.bias, wtype=W8A8)

    def kernel_weights(self, layer: Any) -> list[KernelWeight] | None:
        return [KernelWeight(layer.weight, W8A8, 0, layer.out_features)] if self.packed else None

    def weight_rows(self, layer: Any) -> None:
        return None  # int8 per channel: its rows are not the checkpoint's values

    def dense_weight(self, layer: Any) -> torch.Tensor:
        if not self.packed:
            return layer.weight.float() * layer.weight_scale[:, None]
        # The blocks are Q8_0's, each carrying its row's scale.
        kw = KernelWeight(layer.weight, Q8_0, 0, layer.out_features)
        return dequantize_runs([kw], layer.in_features)

    def int4_groups(self, layer: Any) -> None:
        return None  # int8


def checkpoint_settings(qc: dict[str, Any]) -> bool:
    """Checks a compressed-tensors quantization_config (flattened) is W8A8 as kvserve runs
    it, with a ValueError naming the first setting that is not and what was found; returns
    whether lm_head is quantized (not in `ignore`)."""
    groups = sorted({k.split(".")[1] for k in qc if k.startswith("config_groups.")})
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint has {len(groups)} config_groups "
                         f"{groups}; kvserve loads one W8A8 group")
    fmt = qc.get("format")
    if fmt != "int-quantized":
        raise ValueError(f"compressed-tensors checkpoint has format={fmt!r}; kvserve loads "
                         f"'int-quantized' (W8A8)")
    prefix = f"config_groups.{groups[0]}."
    for key, want in COMPRESSED_TENSORS_W8A8.items():
        found = qc.get(prefix + key)
        if found != want:
            raise ValueError(f"compressed-tensors checkpoint has {key}={found!r}; kvserve "
                             f"loads W8A8 with {key}={want!r}")
    return "lm_head" not in (qc.get("ignore") or ())


class W8A8QuantMethod(QuantMethod):
    """quantization "w8a8": SmoothQuant-style int8 weights per channel x int8 activations per
    token. A float checkpoint is quantized at load (no smoothing); a compressed-tensors W8A8
    checkpoint (`kvserve quantize --method smoothquant`, or llm-compressor's) is loaded."""

    name = "w8a8"
    needs_kernels = True
    default_kv_cache_dtype = "float16"
    without_kernels_note = "int8 weights x per-token int8 activations through ops.int8_linear"

    @classmethod
    def detect(cls, model_path: str, device: str, dtype: str, ops_backend: str,
               quantization_config: dict[str, Any] | None = None) -> bool:
        qc = quantization_config or {}
        # compressed-tensors' weight-only "pack-quantized" format is CompressedTensorsWNA16's
        return (qc.get("quant_method") == "compressed-tensors"
                and qc.get("format") != "pack-quantized")

    @classmethod
    def validate(cls, config: EngineConfig) -> None:
        require_float32(cls.name, config)
        qc = config.model_config.quantization_dict
        if qc:
            if qc.get("quant_method") != "compressed-tensors":
                raise ValueError(f"quantization 'w8a8' loads a float checkpoint or a "
                                 f"compressed-tensors one; this one's quantization_config has "
                                 f"quant_method {qc.get('quant_method')!r}")
            checkpoint_settings(qc)

    def __init__(self, config: QuantConfig | None = None, packed: bool = True) -> None:
        super().__init__(config)
        self.packed = packed

    def without_kernels(self, device: str) -> QuantMethod:
        """Still W8A8: an int8 GEMM exists without kvserve's kernels (torch._int_mm on
        CUDA), so the weights stay int8 and the activations are quantized per token."""
        return W8A8QuantMethod(self.config, packed=False)

    def linear_method(self, prefix: str) -> LinearMethod:
        qc = dict(self.config.checkpoint_config or ()) if self.config is not None else {}
        if not qc:
            return W8A8LinearMethod(prefix, from_checkpoint=False, packed=self.packed)
        if prefix == "lm_head" and not checkpoint_settings(qc):
            from kvserve.quant.base import UnquantizedLinearMethod

            return UnquantizedLinearMethod(half=True)
        return W8A8LinearMethod(prefix, from_checkpoint=True, packed=self.packed)
