"""compressed-tensors "pack-quantized" checkpoints: llm-compressor's weight-only exports
(W4A16 / W8A16, from its GPTQ, AWQ or round-to-nearest recipes), which vLLM serves under
`--quantization compressed-tensors`: the layout of the W4A16 checkpoints published for it.

What this module knows is the checkpoint's quantization_config (flattened by the loader):
which settings kvserve runs, and which modules its `targets` and `ignore` lists quantize. The
tensors' layout is int4_layouts.py's, beside GPTQ's and AWQ's, and their repacking into
Q4_1 / Q8_0 blocks int4_checkpoints.py's. (compressed-tensors' other format kvserve loads,
"int-quantized" W8A8, is smoothquant.py's.)
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.quant.base import LinearMethod
from kvserve.quant.block_pack import BLOCK
from kvserve.quant.int4_checkpoints import Int4CheckpointLinearMethod, Int4CheckpointMethod
from kvserve.quant.int4_layouts import COMPRESSED_TENSORS


def _matches(entry: str, name: str) -> bool:
    """compressed-tensors' target / ignore matching: "re:<pattern>" is a regex matched at the
    name's start, "Linear" any linear layer (a class name), else the module name itself."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry in ("Linear", name)


def _groups(qc: dict[str, Any]) -> list[str]:
    """The names of the (flattened) quantization_config's config groups, in the order their
    writers number them (group_2 before group_10): the flattened config keeps no file order,
    and llm-compressor writes group_0, group_1, ... in order."""
    return sorted({k.split(".")[1] for k in qc if k.startswith("config_groups.")},
                  key=lambda g: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                 for p in re.split(r"(\d+)", g)])


def _group_view(qc: dict[str, Any], group: str) -> dict[str, Any]:
    """qc with config group `group` alone: the settings of the modules it quantizes."""
    others = tuple(f"config_groups.{g}." for g in _groups(qc) if g != group)
    return {k: v for k, v in qc.items() if not k.startswith(others)}


def _group_of(qc: dict[str, Any], name: str) -> str | None:
    """The config group that quantizes module `name`, as compressed-tensors picks it where
    several targets match (its match_targets): the group of an exact name first, then of a
    regular expression (in the targets' sorted order), then of the class "Linear"; None
    where no target matches or the ignore list names the module."""
    if any(_matches(e, name) for e in qc.get("ignore") or ()):
        return None
    # (rank, target, -i): where two groups name the same target, the later one's scheme is
    # the target's (compressed-tensors maps each target to a scheme, the last one written;
    # the groups are in _groups' order here, group_2 before group_10).
    found = [((0 if t == name else 1 if t.startswith("re:") else 2), t, -i, g)
             for i, g in enumerate(_groups(qc))
             for t in qc.get(f"config_groups.{g}.targets") or () if _matches(t, name)]
    return min(found)[3] if found else None


def wna16_settings(qc: dict[str, Any]) -> tuple[int, int, bool]:
    """(bits, group_size (-1: a channel, one group of all inputs), symmetric) of a
    compressed-tensors pack-quantized quantization_config (flattened) with one config group
    (a module's _group_view), with a ValueError naming the first setting kvserve does not
    run and what was found."""
    groups = _groups(qc)
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint has {len(groups)} config_groups "
                         f"{groups}; kvserve reads each weight-only group alone")
    g = f"config_groups.{groups[0]}."
    fmt = qc.get(g + "format", qc.get("format"))
    if fmt != "pack-quantized":
        raise ValueError(f"compressed-tensors checkpoint has format={fmt!r}; this method loads "
                         f"'pack-quantized' (int-quantized W8A8: --quantization w8a8)")
    if any(k.startswith(g + "input_activations.") for k in qc):
        raise ValueError(f"compressed-tensors checkpoint quantizes input_activations "
                         f"(num_bits={qc.get(g + 'input_activations.num_bits')!r}); kvserve "
                         f"loads pack-quantized weights with float activations (WNA16)")
    w = g + "weights."
    # key -> (what kvserve runs, as the error says it); dynamic may be left out (None)
    wanted = {"type": (("int",), "'int'"), "num_bits": ((4, 8), "4 or 8"),
              "strategy": (("group", "channel"), "'group' or 'channel'"),
              "dynamic": ((False, None), "false (static weight scales)")}
    for key, (allowed, shown) in wanted.items():
        if qc.get(w + key) not in allowed:
            raise ValueError(f"compressed-tensors checkpoint has weights.{key}="
                             f"{qc.get(w + key)!r}; kvserve loads {shown}")
    group = -1
    if qc[w + "strategy"] == "group":
        group = qc.get(w + "group_size")
        if not isinstance(group, int) or group <= 0 or group % BLOCK:
            raise ValueError(f"compressed-tensors checkpoint has weights.group_size={group!r}; "
                             f"kvserve needs a positive multiple of {BLOCK}")
    return qc[w + "num_bits"], group, bool(qc.get(w + "symmetric", True))


class CompressedTensorsWNA16Method(Int4CheckpointMethod):
    """compressed-tensors "pack-quantized" checkpoints, weight-only 4 or 8 bits (llm-compressor's
    W4A16 / W8A16: GPTQ, AWQ or round to nearest; groups or channels, symmetric or not,
    actorder), as vLLM serves them under `--quantization compressed-tensors`."""

    name = COMPRESSED_TENSORS
    fmt = COMPRESSED_TENSORS

    @classmethod
    def detect(cls, model_path: str, device: str, dtype: str, ops_backend: str,
               quantization_config: dict[str, Any] | None = None) -> bool:
        qc = quantization_config or {}
        return qc.get("quant_method") == cls.fmt and qc.get("format") == "pack-quantized"

    @classmethod
    def settings(cls, qc: dict[str, Any]) -> tuple[int, int, int]:
        """Every config group's settings checked; the first's (a module's view holds its
        own group alone)."""
        views = [_group_view(qc, g) for g in _groups(qc)] or [qc]  # none: named below
        bits, group, _ = [wna16_settings(v) for v in views][0]
        return bits, group, 0

    @classmethod
    def scheme(cls, qc: dict[str, Any]) -> tuple[Any, ...]:
        """settings(qc) and whether the group is symmetric (its layers store no zero
        points): modules of one layer from a symmetric and an asymmetric group differ. qc is
        a module's view, one group."""
        bits, group, sym = wna16_settings(qc)
        return bits, group, 0, sym

    @classmethod
    def quantizes_lm_head(cls, qc: dict[str, Any]) -> bool:
        """lm_head is quantized where a target names it (the class target "Linear" does) and
        the ignore list does not, as for any module; llm-compressor's W4A16 / W8A16 recipes
        ignore it."""
        return cls.module_config(qc, "lm_head") is not None

    @classmethod
    def module_config(cls, qc: dict[str, Any], name: str) -> dict[str, Any] | None:
        """A module is quantized by the config group whose target names it (_group_of) where
        the ignore list does not name it, as llm-compressor decides; the others stay float."""
        group = _group_of(qc, name)
        return None if group is None else _group_view(qc, group)

    def layer_method(self, prefix: str, qc: dict[str, Any]) -> LinearMethod:
        bits, group, sym = wna16_settings(qc)
        return Int4CheckpointLinearMethod(self.fmt, group, 0, prefix, bits, sym)
