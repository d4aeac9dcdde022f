"""GPTQ (4- and 8-bit), AWQ (4-bit) and compressed-tensors WNA16 (4- and 8-bit) checkpoints
(HF safetensors), repacked at load.

All store, per linear of N outputs and K inputs, groups of G inputs sharing a scale and a
zero point: w = s (q - z), q and z in [0, 15] (4-bit; [0, 255] at 8 bits). The layouts, and
their unpacking (unpack_layer), are int4_layouts.py's.

They run as GGUF blocks (kvserve/quant/gguf.py), on the int8-activation kernels. 4-bit: Q4_1,
w = d * q + m with d = s and m = -s * z per 32-input block (each block repeats its group's
pair; m is rounded to float16, the blocks' type), packed as Q4_1_128 (the pair once per 4
blocks) where the groups are 128 inputs or a multiple (rtn.q4_1_format). 8-bit: Q8_0,
w = d * (q - z) with d = s, which needs q - z in [-128, 127] (a symmetric export's zero of
128 always is). With act-order the inputs are permuted so that each group's inputs are
contiguous, and each call gathers x in that order (the C++ layer stack too:
KernelWeight.perm). lm_head stays float16 unless the checkpoint quantizes it
(`Int4CheckpointMethod.quantizes_lm_head`), and so does any layer the checkpoint keeps in
float by its per-module settings (`module_config`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvserve.quant.base import (
    KernelWeight,
    LinearMethod,
    QuantizedTensor,
    QuantMethod,
    UnquantizedLinearMethod,
    checkpoint_modules,
    copy_shard,
    create_dense_weight,
    dense,
    require_float32,
)
from kvserve.quant.block_pack import BLOCK, F32, Q8_0, pack
from kvserve.quant.int4_groups import Int4Groups
from kvserve.quant.int4_layouts import COMPRESSED_TENSORS, TENSORS, unpack_layer
from kvserve.quant.kernel_runs import dequantize_runs, int4_runs
from kvserve.quant.rtn import int4_to_q4_1, int8_to_q8_0, q4_1_format

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

class Int4CheckpointLinearMethod:
    """A Linear loaded from GPTQ / AWQ / compressed-tensors tensors (per output shard),
    repacked as Q4_1 / Q4_1_128 (Q8_0 at 8 bits) groups."""

    def __init__(self, fmt: str, group_size: int, zero_offset: int, prefix: str,
                 bits: int = 4, sym: bool = False) -> None:
        self.fmt = fmt  # "gptq" | "awq" | COMPRESSED_TENSORS
        self.bits = bits  # 4, or 8 (GPTQ, compressed-tensors)
        self.group_size = group_size  # -1: one group of all K inputs
        self.zero_offset = zero_offset  # added to stored zeros (GPTQ v1: 1)
        self.sym = sym  # compressed-tensors: no zero points stored
        self.prefix = prefix
        self.parts: dict[int, dict[str, torch.Tensor]] = {}
        self.perm: torch.Tensor | None = None  # act-order: x's inputs in group order
        self.wtype = F32

    def checkpoint_names(self, layer: Any) -> tuple[str, ...]:
        names = TENSORS[self.fmt][0]
        if self.fmt == COMPRESSED_TENSORS and not self.sym:
            names += ("weight_zero_point",)
        return names + (("bias",) if layer.bias is not None else ())

    def create_weights(self, layer: Any, dtype: torch.dtype) -> None:
        # A placeholder (no memory is touched): process_weights_after_loading replaces it.
        create_dense_weight(layer, dtype)

    def load_shard(self, layer: Any, name: str, shard: int,
                   tensor: torch.Tensor | QuantizedTensor) -> None:
        required, optional = TENSORS[self.fmt]
        if name in required + optional:
            self.parts.setdefault(shard, {})[name] = dense(tensor)
        elif name == "bias":
            copy_shard(layer, name, shard, dense(tensor))
        else:
            raise ValueError(f"{self.prefix}: a {self.fmt} layer takes "
                             f"{', '.join(required + optional)} tensors, found {name!r}")

    def process_weights_after_loading(self, layer: Any) -> None:
        # Under tensor parallelism the tensors arrive whole (Linear cuts only weight and bias):
        # unpacked at the whole layer's size, then cut to this rank's output rows (column-
        # parallel) or input columns (row-parallel: whole groups, in order).
        tp, rank = layer.tp.size, layer.tp.rank
        column, row = layer.parallel == "column", layer.parallel == "row"
        k = layer.in_features * (tp if row else 1)
        g = self.group_size if self.group_size > 0 else k
        if k % g or g % BLOCK:
            raise ValueError(f"{self.prefix}: group_size {g} must divide the {k} inputs and be "
                             f"a multiple of {BLOCK}")
        qs, zs, ss, gidx = [], [], [], []
        for i, n in enumerate(layer.shard_sizes):
            q, z, s, gi = unpack_layer(self.fmt, self.parts.get(i, {}), n * (tp if column else 1),
                                       k, g, f"{self.prefix} shard {i}", bits=self.bits,
                                       zero_offset=self.zero_offset, sym=self.sym)
            if column:
                q, z, s = (t[rank * n:(rank + 1) * n] for t in (q, z, s))
            qs.append(q)
            zs.append(z)
            ss.append(s)
            gidx.append(gi)
        self.parts = {}
        q, z, s = torch.cat(qs), torch.cat(zs), torch.cat(ss)  # [N, K], [N, K/G], [N, K/G]
        trivial = torch.arange(k) // g
        if any(not torch.equal(gi, gidx[0]) for gi in gidx):
            raise ValueError(f"{self.prefix}: the fused shards' g_idx differ; kvserve needs "
                             f"one input order per layer")
        if row:
            if not torch.equal(gidx[0], trivial):
                raise ValueError(f"{self.prefix}: an act-order layer's groups (g_idx) mix "
                                 f"inputs that tensor parallelism gives to different ranks: "
                                 f"run it with tensor_parallel_size 1")
            kr = layer.in_features
            if self.group_size > 0:
                if kr % g:
                    raise ValueError(f"{self.prefix}: tensor parallelism gives each rank {kr} "
                                     f"of the {k} inputs, not whole groups of {g}")
                z, s = (t[:, rank * kr // g:(rank + 1) * kr // g] for t in (z, s))
            elif kr % BLOCK:
                raise ValueError(f"{self.prefix}: tensor parallelism gives each rank {kr} of "
                                 f"the {k} inputs, not whole blocks of {BLOCK}")
            else:
                g = kr  # one group a row: each rank keeps the row's pair
            q, k = q[:, rank * kr:(rank + 1) * kr], kr
            gidx[0] = trivial = torch.arange(k) // g
        if not torch.equal(gidx[0], trivial):  # act-order: inputs grouped by permutation
            perm = torch.sort(gidx[0], stable=True).indices
            if not torch.equal(gidx[0][perm], trivial):
                raise ValueError(f"{self.prefix}: g_idx must give each of the {k // g} groups "
                                 f"exactly {g} inputs")
            q = q[:, perm]
            self.perm = perm
        if self.bits == 4:
            blocks = int4_to_q4_1(q.to(torch.uint8), s, -s * z, g)
            self.wtype = q4_1_format(g)
        else:
            v = q - z.repeat_interleave(g, dim=1).long()
            if int(v.min()) < -128 or int(v.max()) > 127:
                raise ValueError(f"{self.prefix}: 8-bit weights q - zero span "
                                 f"[{int(v.min())}, {int(v.max())}]; kvserve runs 8-bit weights "
                                 f"as int8 blocks, which hold [-128, 127]")
            blocks, self.wtype = int8_to_q8_0(v.to(torch.int8), s), Q8_0
        layer.weight = nn.Parameter(pack(blocks, self.wtype, k), requires_grad=False)

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return layer.ops.qlinear(x, layer.weight, layer.out_features, layer.bias,
                                 wtype=self.wtype)

    def kernel_weights(self, layer: Any) -> list[KernelWeight] | None:
        # An act-order layer's columns hold its inputs in perm's order: the stack gathers x so.
        return [self._run(layer, self.perm)]

    def _run(self, layer: Any, perm: torch.Tensor | None = None) -> KernelWeight:
        """The layer's weight as one run of its format (perm: as kernel_weights hands it)."""
        return KernelWeight(layer.weight, self.wtype, 0, layer.out_features, perm)

    def weight_rows(self, layer: Any) -> None:
        # A quantized lm_head has no embedding's values: a tied model looks tokens up in the
        # checkpoint's float table.
        return None

    def dense_weight(self, layer: Any) -> torch.Tensor:
        w = dequantize_runs([self._run(layer)], layer.in_features)
        if self.perm is None:
            return w
        out = torch.empty_like(w)  # act-order: column j of w is input perm[j]
        out[:, self.perm] = w
        return out

    def int4_groups(self, layer: Any) -> Int4Groups | None:
        return int4_runs([self._run(layer)], layer.in_features, self.perm)  # None at 8 bits


def _shown(scheme: tuple[Any, ...] | None, offsets: bool) -> str:
    """A module's scheme (Int4CheckpointMethod.scheme) as a refusal names it; offsets: with
    its zeros' storage offset (where that is what differs)."""
    if scheme is None:
        return "float"
    bits, group, offset, *sym = scheme
    text = f"{bits}-bit {'per channel' if group == -1 else f'group {group}'}"
    if sym:
        text += " symmetric" if sym[0] else " with zero points"
    return text + (f" (zeros stored {offset} below)" if offsets else "")


class Int4CheckpointMethod(QuantMethod):
    """A checkpoint whose config.json names this method in quantization_config."""

    fmt: ClassVar[str]
    needs_kernels = True
    default_kv_cache_dtype = "float16"

    @classmethod
    def detect(cls, model_path: str, device: str, dtype: str, ops_backend: str,
               quantization_config: dict[str, Any] | None = None) -> bool:
        return (quantization_config or {}).get("quant_method") == cls.fmt

    @classmethod
    def validate(cls, config: EngineConfig) -> None:
        qc = config.model_config.quantization_dict or {}
        if qc.get("quant_method") != cls.fmt:
            raise ValueError(f"quantization {cls.name!r} needs a checkpoint whose config.json "
                             f"quantization_config has quant_method {cls.fmt!r}, found "
                             f"{qc.get('quant_method')!r}")
        require_float32(cls.name, config)
        cls.settings(qc)

    @classmethod
    def settings(cls, qc: dict[str, Any]) -> tuple[int, int, int]:
        """(bits, group_size, zero offset) from quantization_config; ValueError naming what
        was found for what kvserve does not run."""
        bits = qc.get("bits", qc.get("w_bit"))
        allowed = (4, 8) if cls.fmt == "gptq" else (4,)
        if bits not in allowed:
            raise ValueError(f"{cls.fmt.upper()} checkpoint has bits={bits}; kvserve loads "
                             f"{' and '.join(map(str, allowed))}-bit {cls.fmt.upper()}")
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group, int) or (group != -1 and (group <= 0 or group % BLOCK)):
            raise ValueError(f"{cls.fmt.upper()} checkpoint has group_size={group!r}; kvserve "
                             f"needs -1 or a positive multiple of {BLOCK}")
        if cls.fmt == "awq":
            if qc.get("zero_point", True) is not True:
                raise ValueError("AWQ checkpoint has zero_point=false; kvserve loads AWQ with "
                                 "zero points")
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ checkpoint has version={version!r}; kvserve loads the "
                                 f"GEMM layout")
            return bits, group, 0
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint has checkpoint_format={fmt!r}; kvserve loads "
                             f"gptq and gptq_v2")
        return bits, group, 1 if fmt == "gptq" else 0

    @classmethod
    def quantizes_lm_head(cls, qc: dict[str, Any]) -> bool:
        """Whether the checkpoint's lm_head is quantized too: GPTQModel's `lm_head: true`,
        the key vLLM reads for GPTQ and AWQ alike. Most exports keep it in float."""
        return qc.get("lm_head") is True

    @classmethod
    def module_config(cls, qc: dict[str, Any], name: str) -> dict[str, Any] | None:
        """quantization_config as it applies to the checkpoint module `name`
        ("model.layers.0.self_attn.q_proj", "lm_head"), or None where the checkpoint keeps
        that module in float; each format's per-module settings override this."""
        return qc

    @classmethod
    def stored_config(cls, qc: dict[str, Any], name: str) -> dict[str, Any] | None:
        """module_config of a module the checkpoint stores in the format's layout; None for
        one stored as a float `weight` (lm_head too unless quantizes_lm_head)."""
        if name == "lm_head" and not cls.quantizes_lm_head(qc):
            return None
        return cls.module_config(qc, name)

    @classmethod
    def quantizes(cls, qc: dict[str, Any], name: str) -> bool:
        """Whether the checkpoint stores the linear module `name` in the format's layout
        (else as a float `weight`)."""
        return cls.stored_config(qc, name) is not None

    def linear_method(self, prefix: str) -> LinearMethod:
        """The layer's method from its checkpoint modules' settings, which must agree: kvserve
        runs q / k / v, and gate / up, as one layer each (base.checkpoint_modules). A layer
        the checkpoint keeps in float is held at its float16 / bfloat16 width."""
        assert self.config is not None and self.config.checkpoint_config is not None
        qc = dict(self.config.checkpoint_config)
        names = checkpoint_modules(prefix)
        configs = [self.stored_config(qc, n) for n in names]
        schemes = [None if c is None else self._module_scheme(n, c)
                   for n, c in zip(names, configs, strict=True)]
        if len(set(schemes)) > 1:
            offsets = len({s[2] for s in schemes if s is not None}) > 1
            shown = ", ".join(f"{n.rsplit('.', 1)[-1]} {_shown(s, offsets)}"
                              for n, s in zip(names, schemes, strict=True))
            raise ValueError(f"{prefix}: kvserve runs {len(names)} checkpoint modules as this "
                             f"one layer, and the checkpoint stores them differently ({shown})")
        if configs[0] is None:
            return UnquantizedLinearMethod(half=True)
        return self.layer_method(prefix, configs[0])

    @classmethod
    def scheme(cls, qc: dict[str, Any]) -> tuple[Any, ...]:
        """What the modules of one layer must share to run as one: settings(qc), (bits,
        group, zero offset)."""
        return cls.settings(qc)

    def _module_scheme(self, name: str, qc: dict[str, Any]) -> tuple[Any, ...]:
        """scheme(qc) of module `name`, whose name a refusal leads with (a per-module
        override, not the checkpoint's own settings, may be what kvserve does not run)."""
        try:
            return self.scheme(qc)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def layer_method(self, prefix: str, qc: dict[str, Any]) -> LinearMethod:
        """The LinearMethod of a quantized layer whose modules' settings are qc."""
        bits, group, offset = self.settings(qc)
        return Int4CheckpointLinearMethod(self.fmt, group, offset, prefix, bits)


class GPTQQuantMethod(Int4CheckpointMethod):
    """4- and 8-bit GPTQ checkpoints (AutoGPTQ / GPTQModel layout, act-order, sym or asym).

    Per module, as GPTQModel writes them: `modules_in_block_to_quantize` (transformers'
    GPTQConfig: the decoder modules quantized, by name or name fragment; the others are
    float; lm_head, outside the blocks, is not held to it) and GPTQModel's `dynamic`,
    regular expressions matched at the start of a module's name, tried in order, the first
    that matches deciding: "-:<regex>" keeps the module in float, "+:<regex>" (or no prefix)
    overrides bits / group_size (ints) and desc_act / sym (bools), other keys ignored, as
    vLLM's override_config takes them. The names matched are the checkpoint's own
    (q_proj, up_proj), as GPTQModel applies them; vLLM matches its fused layers' names
    (`+:.*up_proj` takes all of gate_up_proj there), and kvserve refuses a fused layer whose
    modules come out differently."""

    # The keys a dynamic override may set, and their types (vLLM's override_config).
    OVERRIDES: ClassVar[dict[str, type]] = {"bits": int, "group_size": int, "desc_act": bool,
                                            "sym": bool}

    name = "gptq"
    fmt = "gptq"

    @classmethod
    def module_config(cls, qc: dict[str, Any], name: str) -> dict[str, Any] | None:
        blocks = qc.get("modules_in_block_to_quantize")
        if blocks and name != "lm_head" and not any(
                m in name for block in blocks
                for m in ((block,) if isinstance(block, str) else block)):
            return None
        for pattern, overrides in qc.get("dynamic") or ():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None
            elif re.match(pattern.removeprefix("+:"), name):
                return {**qc, **{k: v for k, v in overrides if k in cls.OVERRIDES
                                 and isinstance(v, cls.OVERRIDES[k])}}
        return qc


class AWQQuantMethod(Int4CheckpointMethod):
    """4-bit AWQ checkpoints (AutoAWQ GEMM layout). A module whose name contains an entry of
    `modules_to_not_convert` is kept in float, as AutoAWQ and vLLM skip it."""

    name = "awq"
    fmt = "awq"

    @classmethod
    def module_config(cls, qc: dict[str, Any], name: str) -> dict[str, Any] | None:
        if any(m in name for m in qc.get("modules_to_not_convert") or ()):
            return None
        return qc
