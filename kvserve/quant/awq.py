"""AWQ (Lin et al., 2023): activation-aware weight quantization.

A weight column that meets large activations matters more. Scaling input channel k of W by
s_k > 1 (and dividing the activation by s_k, which is exact) shrinks its relative rounding
error: with group scale Delta mostly set by other columns,
    Q(w s) / s - w = Delta' * round_err / s_k,
so the salient channels lose error at little cost to the others. AutoAWQ searches
    s = s_x^alpha / (s_w^(1 - alpha) + 1e-4),   alpha in {0, 1/20, ..., 19/20}
    s_x[k] = mean_t |x[t, k]|,   s_w[k] = mean_n |w[n, k]| / max |w| of its group
(its default, duo_scaling: a column whose weights are small in their groups, which rounding
hurts most, is scaled up too), or the paper's s = s_x^alpha (`kvserve quantize
--no-awq-duo-scaling`); alpha = 0 of the paper's is plain round-to-nearest. s is normalised
by sqrt(max s * min s), and the alpha whose quantized block output is closest (MSE) to the
float one is kept. On Qwen2.5-Coder-0.5B (g128, 2048 calibration tokens of license text,
GPL-3 at ctx 512) duo scaling gave 6.46 against the paper's 6.70 (float 5.31, RTN 6.99).
1/s is then folded into the op before the linears, so the checkpoint needs no extra tensor:

    input_layernorm  -> q, k, v        (error of the attention block's output)
    v_proj rows      -> o_proj         (error of o_proj's output; with GQA one scale per v
                                        channel, repeated over the query heads it serves)
    post_attn norm   -> gate, up       (error of the MLP's output)
    up_proj rows     -> down_proj      (error of down_proj's output)

as AutoAWQ's apply_scale (scale_ln_fcs / scale_fc_fc) does. Then, where asked (`kvserve
quantize --awq-clip`; AutoAWQ does it by default), as AutoAWQ's auto_clip, each group of each
linear but q_proj and k_proj is clipped to [-c, c] with
    c = (1 - i / 20) max |w_group|,   i in {0, ..., 9}
(i = 0: no clipping), the c whose quantized group output sum_k x_k w_k (over a sample of the
scaled inputs) is closest to the float one. A smaller range rounds the bulk of a group more
finely at the cost of its few largest weights; q and k are skipped (AutoAWQ: their errors
pass through the softmax, which a per-group output error does not see). Off by default: on
Qwen2.5-Coder-0.5B (g128) it lowered every block's output error on held-out text by 3-21%
yet raised the model's perplexity (6.32 -> 6.76 on 4 GPL-3 windows, after the paper's scale
search; RTN 6.50): a smaller per-group error is not a smaller loss there. Like AutoAWQ,
every layer's calibration inputs come from the float model (a layer's search does not see the
earlier layers' quantization).

The integer grid is AutoAWQ's pseudo_quantize_tensor with zero point, per output row and
group of G inputs:
    s = max(max - min, 1e-5) / maxq (rounded to float16),  z = clamp(-round(min / s), 0, maxq)
    q = clamp(round(w / s) + z, 0, maxq),  w ~= s (q - z)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.quant.calibration import (
    LayerWeights,
    attention,
    attention_core,
    mlp,
    mlp_core,
    rms_norm,
)
from kvserve.quant.gptq import QuantizedLinear

N_GRID = 20
CLIP_STEPS = 10  # shrink factors 1, 0.95, ..., 0.55: AutoAWQ's max_shrink 0.5 of N_GRID
CLIP_TOKENS = 512  # the clip search reads every (T / 512)-th token, as AutoAWQ's
CLIPPED = ("self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj")


def awq_group_quantize(w: torch.Tensor, bits: int, group_size: int) -> QuantizedLinear:
    """w float [N, K] -> AutoAWQ's zero-point grid per group of G consecutive inputs."""
    n, k = w.shape
    maxq = 2**bits - 1
    g = w.float().reshape(n, k // group_size, group_size)
    hi, lo = g.amax(dim=-1), g.amin(dim=-1)
    s = ((hi - lo).clamp(min=1e-5) / maxq).to(torch.float16).float()
    z = torch.clamp(-torch.round(lo / s), 0, maxq)
    q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, maxq)
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    return QuantizedLinear(q.reshape(n, k).to(torch.int32), s, z.to(torch.int32), g_idx, bits,
                           group_size)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """w rounded onto its grid, as floats: the weight the quantized model computes with."""
    return awq_group_quantize(w, bits, group_size).dequantize()


def weight_means(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """s_w [K]: per input channel, the mean over every row of `weights` (each [N_i, K]) of
    |w| over the max |w| of its group of group_size inputs (AutoAWQ's w_mean)."""
    w = torch.cat([x.float() for x in weights], dim=0)
    g = w.abs().reshape(w.shape[0], -1, group_size)
    return (g / (g.amax(dim=-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


def search_scale(x: torch.Tensor, weights: list[torch.Tensor],
                 block: Callable[[list[torch.Tensor]], torch.Tensor], bits: int,
                 group_size: int, expand: torch.Tensor | None = None,
                 n_grid: int = N_GRID, duo_scaling: bool = True) -> torch.Tensor:
    """The AWQ scale s [C] for linears `weights` (each [N_i, K]) that all read x [..., K].

    block(ws) is the inspected output computed with weights ws in place of `weights`; the
    search minimises mean (block(Q(W s) / s) - block(W))^2 over the candidates of the module
    docstring (duo_scaling: AutoAWQ's, else the paper's). expand: int64 [K] mapping each
    input channel to one of C < K scale channels (v_proj -> o_proj under GQA; a scale
    channel's s_x and s_w are the means over the channels it covers), else C = K."""
    k = x.shape[-1]
    x_mean = x.reshape(-1, k).abs().mean(0)
    w_mean = weight_means(weights, group_size) if duo_scaling else None
    if expand is not None:
        c = int(expand.max()) + 1
        counts = torch.bincount(expand, minlength=c).float()

        def per_scale_channel(v: torch.Tensor) -> torch.Tensor:
            return torch.zeros(c).index_add_(0, expand, v) / counts

        x_mean = per_scale_channel(x_mean)
        w_mean = None if w_mean is None else per_scale_channel(w_mean)
    ref = block(weights)
    best, best_err = torch.ones_like(x_mean), float("inf")
    for r in range(n_grid):
        a = r / n_grid
        s = x_mean.pow(a) if w_mean is None else x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s_in = s[expand] if expand is not None else s
        trial = [fake_quantize(w * s_in, bits, group_size) / s_in for w in weights]
        err = (block(trial) - ref).pow(2).mean().item()
        if err < best_err:
            best, best_err = s, err
    return best


def _v_to_o_channels(cfg: ModelConfig) -> torch.Tensor:
    """o_proj input channel (head h, dim d) -> the v_proj output channel it is a mix of:
    (h // (heads / kv_heads)) * D + d."""
    d = cfg.head_dim
    per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    c = torch.arange(cfg.num_attention_heads * d)
    return (c // d) // per_kv * d + c % d


def awq_scale_layer(w: LayerWeights, x: torch.Tensor, cfg: ModelConfig,
                    rope: tuple[torch.Tensor, torch.Tensor], bits: int, group_size: int,
                    duo_scaling: bool = True) -> LayerWeights:
    """One decoder layer's weights with the four AWQ scales searched and folded in (the
    float function of the layer is unchanged up to rounding); x [S, T, H] is the layer's
    input residual stream. Returns a new dict; w is not modified."""
    w = dict(w)
    eps = cfg.rms_norm_eps
    qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    gate_up = ("mlp.gate_proj.weight", "mlp.up_proj.weight")

    def with_(names: tuple[str, ...], ws: list[torch.Tensor]) -> LayerWeights:
        return {**w, **dict(zip(names, ws, strict=True))}

    # 1. input_layernorm -> q, k, v; judged on the attention output.
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    s = search_scale(h, [w[n] for n in qkv],
                     lambda ws: attention(h, with_(qkv, ws), cfg, rope), bits, group_size,
                     duo_scaling=duo_scaling)
    w["input_layernorm.weight"] = w["input_layernorm.weight"] / s
    for n in qkv:
        w[n] = w[n] * s
    # 2. v_proj rows -> o_proj columns; judged on o_proj's output. The o input is recomputed
    # with the scaled q/k/v: the float function is the same, and it is what o_proj will read.
    o_in = attention_core(rms_norm(x, w["input_layernorm.weight"], eps), w, cfg, rope)
    expand = _v_to_o_channels(cfg)
    o = "self_attn.o_proj.weight"
    s = search_scale(o_in, [w[o]], lambda ws: o_in @ ws[0].T, bits, group_size, expand,
                     duo_scaling=duo_scaling)
    # The attention block's output, taken before the scale moves (v / s, o * s: the same
    # function), instead of running the attention again.
    x2 = x + F.linear(o_in, w[o], w.get("self_attn.o_proj.bias"))
    w["self_attn.v_proj.weight"] = w["self_attn.v_proj.weight"] / s[:, None]
    if "self_attn.v_proj.bias" in w:
        w["self_attn.v_proj.bias"] = w["self_attn.v_proj.bias"] / s
    w[o] = w[o] * s[expand]
    # 3. post_attention_layernorm -> gate, up; judged on the MLP output.
    h2 = rms_norm(x2, w["post_attention_layernorm.weight"], eps)
    s = search_scale(h2, [w[n] for n in gate_up],
                     lambda ws: mlp(h2, with_(gate_up, ws)), bits, group_size,
                     duo_scaling=duo_scaling)
    w["post_attention_layernorm.weight"] = w["post_attention_layernorm.weight"] / s
    for n in gate_up:
        w[n] = w[n] * s
    # 4. up_proj rows -> down_proj columns; judged on down_proj's output.
    d_in = mlp_core(rms_norm(x2, w["post_attention_layernorm.weight"], eps), w)
    dn = "mlp.down_proj.weight"
    s = search_scale(d_in, [w[dn]], lambda ws: d_in @ ws[0].T, bits, group_size,
                     duo_scaling=duo_scaling)
    w["mlp.up_proj.weight"] = w["mlp.up_proj.weight"] / s[:, None]
    w[dn] = w[dn] * s
    return w


def clip_groups(w: torch.Tensor, c: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] with each (row, group of group_size inputs) clamped to [-c, c], c [N, K / G]."""
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    return torch.maximum(torch.minimum(g, c[..., None]), -c[..., None]).reshape(n, k)


def search_clip(x: torch.Tensor, w: torch.Tensor, bits: int, group_size: int,
                steps: int = CLIP_STEPS, n_grid: int = N_GRID,
                tokens: int = CLIP_TOKENS) -> torch.Tensor:
    """The clip bound c [N, K / G] of each (output row, input group) of w [N, K] read by
    inputs x [..., K]: the shrink of max |w| over the group that minimises the mean over
    tokens of (sum_k x_k Q(clip(w))_k - sum_k x_k w_k)^2, the group's own share of the output
    (AutoAWQ's _compute_best_clip). Ties keep the smaller shrink (i = 0 first: no clip)."""
    n, k = w.shape
    ng = k // group_size
    x2 = x.reshape(-1, k)
    x2 = x2[::max(1, x2.shape[0] // tokens)]
    xg = x2.reshape(-1, ng, group_size).transpose(0, 1)  # [G, T, group]
    w = w.float()
    wg = w.reshape(n, ng, group_size)
    ref = torch.bmm(xg, wg.permute(1, 2, 0))  # [G, T, N]: each group's share of each output
    amax = wg.abs().amax(dim=-1)  # [N, G]
    best, best_err = amax.clone(), torch.full_like(amax, float("inf"))
    for i in range(steps):
        c = amax * (1 - i / n_grid)
        qw = fake_quantize(clip_groups(w, c, group_size), bits, group_size)
        qw = qw.reshape(n, ng, group_size)
        err = (torch.bmm(xg, qw.permute(1, 2, 0)) - ref).pow(2).mean(dim=1).T  # [N, G]
        better = err < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, err, best_err)
    return best


def awq_clip_layer(w: LayerWeights, x: torch.Tensor, cfg: ModelConfig,
                   rope: tuple[torch.Tensor, torch.Tensor], bits: int, group_size: int
                   ) -> LayerWeights:
    """One decoder layer's weights (its AWQ scales already folded in) with every CLIPPED
    linear's groups clipped as search_clip finds, judged on the inputs each reads from the
    float residual stream x [S, T, H] through these weights. Returns a new dict."""
    w = dict(w)
    eps = cfg.rms_norm_eps
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    o_in = attention_core(h, w, cfg, rope)  # once: attention(h) is o_proj of it
    x2 = x + F.linear(o_in, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
    h2 = rms_norm(x2, w["post_attention_layernorm.weight"], eps)
    inputs = {"self_attn.v_proj": h, "self_attn.o_proj": o_in,
              "mlp.gate_proj": h2, "mlp.up_proj": h2, "mlp.down_proj": mlp_core(h2, w)}
    for name in CLIPPED:
        key = f"{name}.weight"
        w[key] = clip_groups(w[key], search_clip(inputs[name], w[key], bits, group_size),
                             group_size)
    return w
