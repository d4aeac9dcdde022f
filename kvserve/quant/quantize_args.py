"""`kvserve quantize`'s settings: which --method writes which --format layouts, and
`QuantizeArgs`, one run's knobs, checked on construction and against the model
(`for_model`) with a ValueError that names the flag. The driver is kvserve/quantize.py."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from kvserve.config import ModelConfig

# --method -> the --format layouts it can be written in, its default first
FORMATS = {"int8": ("gptq", "compressed-tensors"), "int4": ("gptq", "compressed-tensors"),
           "gptq": ("gptq", "compressed-tensors"), "awq": ("awq", "compressed-tensors"),
           "smoothquant": ("compressed-tensors",)}
METHODS = tuple(FORMATS)
CALIBRATED = ("gptq", "awq", "smoothquant")
LM_HEAD_METHODS = ("gptq", "int4", "int8")
BLOCK_INPUTS = 32  # W8A8 runs on Q8_0 blocks: every linear's inputs must divide by 32


# The methods with options of their own, as their refusals name them.
_OPTION_OF = {"gptq": "a GPTQ", "awq": "an AWQ"}


@dataclass(frozen=True)
class QuantizeArgs:
    """The knobs of one quantization run; ValueError naming the flag when out of range."""

    method: str
    bits: int = 4
    group_size: int | None = None  # None: the largest of 128, 64, 32 the model allows
    sym: bool = False
    act_order: bool = False
    static_groups: bool = False  # gptq: every group's grid fixed before any update
    mse: float = 0.0  # gptq / int4 / int8: > 0 searches each group's range (this norm)
    calib: str | None = None
    calib_tokens: int | None = None  # None: calibration.DEFAULT_TOKENS, or the text's all
    seq_len: int = 512
    alpha: float = 0.5  # smoothquant's migration strength
    awq_clip: bool = False  # awq: AutoAWQ's clip search after the scale search
    awq_duo_scaling: bool = True  # awq: AutoAWQ's scale candidates (else the paper's)
    format: str | None = None  # the checkpoint layout (FORMATS); None: the method's own
    lm_head: bool = False  # quantize lm_head too (gptq, int4, int8)
    lm_head_bits: int | None = None  # lm_head's bits where they are not --bits's

    @property
    def head_bits(self) -> int:
        """lm_head's bits (with lm_head)."""
        return self.lm_head_bits if self.lm_head_bits is not None else self.bits

    @property
    def head_sym(self) -> bool:
        """Whether lm_head's grid is symmetric: as the layers' (sym), and at 8 bits always
        (see __post_init__)."""
        return self.sym or self.head_bits == 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        if self.bits == 8:
            # 8 bits are symmetric: q - zero must fit the int8 blocks kvserve runs them as
            # (an asymmetric 8-bit grid's q - zero spans up to [-255, 255]).
            object.__setattr__(self, "sym", True)
        if self.format is None:
            object.__setattr__(self, "format", FORMATS[self.method][0])
        if self.format not in FORMATS[self.method]:
            raise ValueError(f"--method {self.method} writes --format "
                             f"{' or '.join(FORMATS[self.method])}, got {self.format!r}")
        if (self.format == "compressed-tensors" and self.act_order
                and not self.static_groups):
            raise ValueError("--format compressed-tensors keeps groups of consecutive inputs "
                             "(no g_idx): --act-order needs --static-groups there")
        if self.bits not in (4, 8):
            raise ValueError(f"--bits must be 4 or 8, got {self.bits}")
        if self.method == "int4" and self.bits != 4 or self.method == "int8" and self.bits != 8:
            raise ValueError(f"--method {self.method} writes {self.method[3:]}-bit weights; "
                             f"--bits {self.bits} contradicts it")
        if self.method == "smoothquant" and self.bits != 8:
            raise ValueError(f"--method smoothquant writes 8-bit weights (W8A8); --bits must "
                             f"be 8, got {self.bits}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"--alpha must be in [0, 1], got {self.alpha}")
        if self.method == "awq" and self.bits != 4:
            raise ValueError(f"--method awq writes the 4-bit AWQ GEMM layout; --bits must be 4, "
                             f"got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"--group-size must be >= 1, got {self.group_size}")
        for flag, given, only in (("--act-order (desc_act)", self.act_order, "gptq"),
                                  ("--static-groups", self.static_groups, "gptq"),
                                  ("--awq-clip", self.awq_clip, "awq"),
                                  ("--no-awq-duo-scaling", not self.awq_duo_scaling, "awq")):
            if given and self.method != only:
                raise ValueError(f"{flag} is {_OPTION_OF[only]} option; --method is "
                                 f"{self.method}")
        if self.lm_head and self.method not in LM_HEAD_METHODS:
            raise ValueError(f"--lm-head quantizes the output layer with "
                             f"{', '.join(LM_HEAD_METHODS)}; --method {self.method} keeps it in "
                             f"float (AutoAWQ's GEMM layout and W8A8 have no quantized lm_head)")
        if self.lm_head_bits is not None:
            if self.lm_head_bits not in (4, 8):
                raise ValueError(f"--lm-head-bits must be 4 or 8, got {self.lm_head_bits}")
            if not self.lm_head:
                raise ValueError("--lm-head-bits sets the bits of a quantized lm_head: give "
                                 "--lm-head too")
        if self.mse < 0:
            raise ValueError(f"--mse must be >= 0 (0: the plain min / max range), got "
                             f"{self.mse}")
        if self.mse > 0 and self.method not in ("gptq", "int4", "int8"):
            raise ValueError(f"--mse is a gptq / int4 / int8 option (their grids' range "
                             f"search); --method is {self.method}")
        if self.method in CALIBRATED:
            if self.calib is None:
                raise ValueError(f"--method {self.method} needs calibration text: --calib FILE")
            if not os.path.isfile(self.calib):
                raise ValueError(f"--calib file {self.calib!r} does not exist")
            if self.seq_len < 2:
                raise ValueError(f"--seq-len must be >= 2, got {self.seq_len}")
            if self.calib_tokens is not None and self.calib_tokens < self.seq_len:
                raise ValueError(f"--calib-tokens must be >= --seq-len ({self.seq_len}), got "
                                 f"{self.calib_tokens}")

    def for_model(self, mc: ModelConfig) -> QuantizeArgs:
        """These args with the group size settled for the model; ValueError unless every
        linear's inputs divide into groups and its outputs into packed int32s (W8A8: blocks
        of 32 inputs)."""
        ins = {"hidden_size": mc.hidden_size, "intermediate_size": mc.intermediate_size,
               "num_attention_heads * head_dim": mc.num_attention_heads * mc.head_dim}
        if mc.sliding_window is not None and self.seq_len > mc.sliding_window:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the model's sliding window "
                             f"({mc.sliding_window})")
        if self.method == "smoothquant":
            for name, k in ins.items():
                if k % BLOCK_INPUTS:
                    raise ValueError(f"W8A8 runs on blocks of {BLOCK_INPUTS} inputs; the "
                                     f"model's {name} ({k}) does not divide by {BLOCK_INPUTS}")
            return self
        if self.group_size is None:
            fits = [g for g in (128, 64, 32) if all(k % g == 0 for k in ins.values())]
            if not fits:
                raise ValueError(f"no group size of 128, 64 or 32 divides the model's linear "
                                 f"input widths {sorted(set(ins.values()))}; give --group-size")
            return dataclasses.replace(self, group_size=fits[0]).for_model(mc)
        for name, k in ins.items():
            if k % self.group_size:
                raise ValueError(f"--group-size {self.group_size} does not divide the model's "
                                 f"{name} ({k}), the input width of some linear layers")
        outs = {**ins, "num_key_value_heads * head_dim": mc.num_key_value_heads * mc.head_dim}
        widths = [(self.bits, name, n) for name, n in outs.items()]
        if self.lm_head:
            widths.append((self.head_bits, "vocab_size (--lm-head)", mc.vocab_size))
        for bits, name, n in widths:
            if n % (32 // bits):
                raise ValueError(f"{bits}-bit packing needs widths divisible by {32 // bits}; "
                                 f"the model's {name} is {n}")
        return self
