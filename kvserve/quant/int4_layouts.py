"""The checkpoint layouts of 4- and 8-bit weights that kvserve reads and writes: GPTQ,
AWQ and compressed-tensors' pack-quantized, per linear of N outputs and K inputs in groups of
G inputs sharing a scale and a zero point. The readers (unpack_layer: the loader's
int4_checkpoints.py) and the writers (pack_*: `kvserve quantize`, quantize.py) of each layout
are here, beside the one drawing of it.

    w[n, k] = s(n, g) * (q(n, k) - z(n, g)),  g the group of input k, q and z in
                                              [0, 2^b - 1], b = bits (4 or 8)

P = 32 / b fields per int32 word; field i of a word sits at bits [b*i, b*i + b) (little end
first); int32 is two's complement, so a top field >= 2^(b-1) makes the stored int negative.

GPTQ (AutoGPTQ / GPTQModel, quant_method "gptq"), b = 4 or 8:

    qweight  int32 [K / P, N]      field i of word [r, n] is q[n, P*r + i]
    qzeros   int32 [K / G, N / P]  field i of word [g, c] is z[n = P*c + i, g], stored minus 1
                                   in the v1 format (checkpoint_format "gptq", AutoGPTQ's
                                   off-by-one: its packer stores z - 1, every v1 reader adds
                                   1 back) and as is in "gptq_v2"
    scales   float16 [K / G, N]
    g_idx    int32 [K]             the group of input k: k // G, or, with desc_act
                                   (act-order), any permutation's groups

AWQ GEMM (AutoAWQ WQLinear_GEMM, quant_method "awq", version "gemm", zero_point true), b = 4:

    qweight  int32 [K, N / 8]      nibble i of word [k, c] is q[n = 8c + ORDER[i], k]
    qzeros   int32 [K / G, N / 8]  the same interleave of z (no off-by-one)
    scales   float16 [K / G, N]
        ORDER = 0 2 4 6 1 3 5 7 (the GEMM kernel's dequantize order); groups are
        consecutive inputs (no g_idx)

compressed-tensors "pack-quantized" (llm-compressor's W4A16 / W8A16, quant_method
"compressed-tensors"; rows are outputs, offset O = 2^(b-1)):

    weight_packed      int32 [N, K / P]      field i of word [n, c] is q[n, P*c + i] + O
    weight_scale       float [N, K / G]      (strategy "group"; "channel": [N, 1], G = K)
    weight_zero_point  int32 [N / P, K / G]  field i of word [r, g] is z[P*r + i, g] + O;
                                             only when asymmetric (older exports: int8
                                             [N, K / G], unpacked, no O)
    weight_g_idx       int32 [K]             with actorder "group", as GPTQ's g_idx
    weight_shape       int [2]               (N, K)
        where w = s (q - z) for the library's signed q and z in [-O, O - 1] (z = 0 when
        symmetric); the stored fields q + O and z + O (O when symmetric), in [0, 2O - 1],
        are kvserve's unsigned q and z. The writer keeps groups consecutive (act-order only
        with static groups: its config's actorder "weight").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the writers' argument type only
    from kvserve.quant.gptq import QuantizedLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
COMPRESSED_TENSORS = "compressed-tensors"
# Each format's tensors of a quantized linear: (always there, optional).
TENSORS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    COMPRESSED_TENSORS: (("weight_packed", "weight_scale", "weight_shape"),
                         ("weight_zero_point", "weight_g_idx")),
}


# ---- writing ----


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers in [0, 2^bits) packed 32 / bits at a time along `dim` (first value in the low
    bits) into int32; values.shape[dim] must divide by 32 / bits."""
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    if v.shape[-1] % per:
        raise ValueError(f"cannot pack {v.shape[-1]} values {per} to an int32")
    if v.min() < 0 or v.max() >= 2**bits:
        raise ValueError(f"values outside [0, {2**bits}) cannot be packed in {bits} bits")
    v = v.reshape(*v.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    word = (v << shifts).sum(-1)  # disjoint bit ranges: the sum is the OR
    word = torch.where(word >= 2**31, word - 2**32, word)  # as two's complement int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def pack_gptq(ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """One linear in the GPTQ v1 layout (see the module docstring)."""
    if ql.zeros.min() < 1:
        raise ValueError("GPTQ v1 stores z - 1: a zero point of 0 has no encoding")
    return {
        "qweight": pack_int32(ql.q.T, ql.bits, dim=0),
        "qzeros": pack_int32(ql.zeros.T - 1, ql.bits, dim=1),
        "scales": ql.scales.T.to(torch.float16).contiguous(),
        "g_idx": ql.g_idx.to(torch.int32).clone(),  # its own storage (stacked q/k/v share one)
    }


def pack_awq(ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """One linear in the AWQ GEMM layout (see the module docstring)."""
    if ql.bits != 4:
        raise ValueError(f"the AWQ GEMM layout holds 4-bit weights, got {ql.bits}")
    k = ql.q.shape[1]
    if not torch.equal(ql.g_idx, torch.arange(k, dtype=torch.int32) // ql.group_size):
        raise ValueError("the AWQ layout has no g_idx: groups must be consecutive inputs")
    n = ql.q.shape[0]
    # Output channel 8c + ORDER[i] goes to nibble i of word c.
    order = (torch.arange(n // 8)[:, None] * 8 + torch.tensor(AWQ_ORDER)).reshape(-1)
    return {
        "qweight": pack_int32(ql.q.T[:, order], 4, dim=1),
        "qzeros": pack_int32(ql.zeros.T[:, order], 4, dim=1),
        "scales": ql.scales.T.to(torch.float16).contiguous(),
    }


def pack_compressed_tensors(ql: QuantizedLinear, sym: bool) -> dict[str, torch.Tensor]:
    """One linear in compressed-tensors' pack-quantized layout (see the module docstring)."""
    n, k = ql.q.shape
    if not torch.equal(ql.g_idx, torch.arange(k, dtype=torch.int32) // ql.group_size):
        raise ValueError("compressed-tensors' pack-quantized layout has no g_idx: groups must "
                         "be consecutive inputs (with --act-order, add --static-groups)")
    out = {"weight_packed": pack_int32(ql.q, ql.bits, dim=1),
           "weight_scale": ql.scales.to(torch.float16).contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = pack_int32(ql.zeros, ql.bits, dim=0)
    elif not bool((ql.zeros == 2 ** (ql.bits - 1)).all()):
        raise ValueError(f"a symmetric compressed-tensors grid has its zero at "
                         f"{2 ** (ql.bits - 1)}")
    return out


# ---- reading ----


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., C] -> [..., C, 32 / bits]: field i of each word (bits i*bits upwards)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] -> int32 [PR, C], P = 32 / bits: field i of word [r, c] is row Pr + i."""
    f = _fields(packed, bits)  # [R, C, P]
    return f.permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None, bits: int = 4
                ) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, PC]: field i of word [r, c] is column Pc + order[i]."""
    f = _fields(packed, bits)  # [R, C, P]: field i at [..., i]
    if order is not None:
        inv = torch.empty(len(order), dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(len(order))
        f = f[..., inv]  # column j of the P comes from field inv[j]
    return f.reshape(packed.shape[0], -1)


_INTS = (torch.int32,)
_FLOATS = (torch.float16, torch.float32, torch.bfloat16)


def _group_index(gi: torch.Tensor | None, name: str, k: int, ng: int, what: str
                 ) -> torch.Tensor:
    """The group of each of the k inputs: a checkpoint's g_idx, checked, or k // G."""
    if gi is None:
        return torch.arange(k) // (k // ng)
    gi = _check(name, gi, (k,), (torch.int32, torch.int64), what).long()
    if int(gi.min()) < 0 or int(gi.max()) >= ng:
        raise ValueError(f"{what}: {name} must hold groups in [0, {ng - 1}], found "
                         f"[{int(gi.min())}, {int(gi.max())}]")
    return gi


def _check(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtypes: tuple, what: str
           ) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{what}: the checkpoint has no {name}")
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(f"{what}: {name} must be {[str(d) for d in dtypes][0]} {list(shape)}, "
                         f"found {t.dtype} {list(t.shape)}")
    return t


def unpack_layer(fmt: str, t: dict[str, torch.Tensor], n: int, k: int, g: int, what: str,
                 *, bits: int = 4, zero_offset: int = 0, sym: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint's tensors of one linear (n outputs, k inputs, groups of g) in format fmt
    (TENSORS' keys) -> (q [n, K] int32, z float32 [n, K/G], s [n, K/G], g_idx [K]):
    unsigned q and z, w = s (q - z) (module docstring). zero_offset: added to GPTQ's
    stored zeros (v1: 1); sym: compressed-tensors without zero points. what: the layer, as
    a refusal names it (ValueError for a missing tensor, a wrong shape or dtype)."""
    ng = k // g
    per = 32 // bits  # fields per int32 word
    if n % per:
        raise ValueError(f"{what}: {n} outputs do not pack {per} zeros per int32")
    if fmt == COMPRESSED_TENSORS:
        return _unpack_compressed_tensors(t, n, k, ng, what, bits, sym)
    scales = _check("scales", t.get("scales"), (ng, n), _FLOATS, what).float()
    if fmt == "gptq":
        q = unpack_rows(_check("qweight", t.get("qweight"), (k // per, n), _INTS, what),
                        bits)
        z = unpack_cols(_check("qzeros", t.get("qzeros"), (ng, n // per), _INTS, what),
                        bits=bits)
        z = (z + zero_offset) & ((1 << bits) - 1)
        gi = _group_index(t.get("g_idx"), "g_idx", k, ng, what)
    else:
        q = unpack_cols(_check("qweight", t.get("qweight"), (k, n // 8), _INTS, what),
                        AWQ_ORDER)
        z = unpack_cols(_check("qzeros", t.get("qzeros"), (ng, n // 8), _INTS, what),
                        AWQ_ORDER)
        gi = torch.arange(k) // g
    # q is [K, n] in both layouts; kvserve's rows are outputs.
    return q.T.contiguous(), z.T.float().contiguous(), scales.T.contiguous(), gi


def _unpack_compressed_tensors(t: dict[str, torch.Tensor], n: int, k: int, ng: int,
                               what: str, bits: int, sym: bool
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:
    """unpack_layer of the pack-quantized layout, whose rows are already outputs."""
    per, offset = 32 // bits, 1 << (bits - 1)
    shape = _check("weight_shape", t.get("weight_shape"), (2,), (torch.int32, torch.int64),
                   what)
    if tuple(shape.tolist()) != (n, k):
        raise ValueError(f"{what}: weight_shape is {shape.tolist()}, the layer's weight is "
                         f"[{n}, {k}]")
    q = unpack_cols(_check("weight_packed", t.get("weight_packed"), (n, k // per), _INTS,
                           what), bits=bits)
    scales = _check("weight_scale", t.get("weight_scale"), (n, ng), _FLOATS, what).float()
    zp = t.get("weight_zero_point")
    if sym:
        z = torch.full((n, ng), float(offset))
    elif zp is not None and zp.dtype == torch.int8:  # unpacked, signed
        z = _check("weight_zero_point", zp, (n, ng), (torch.int8,), what).float() + offset
    else:
        z = unpack_rows(_check("weight_zero_point", zp, (n // per, ng), _INTS, what),
                        bits).float()
    return q, z, scales, _group_index(t.get("weight_g_idx"), "weight_g_idx", k, ng, what)
