"""The rows of benchmarks/compare's quant step (issue 11) and the parsers of what its tools
print. Pure: no process is started here (compare runs the commands).

A row is one weight / KV format of one model: kvserve runs it with its flags, llama.cpp runs
the same GGUF file with its flags where it has the same format (peer_gguf), else the row is
kvserve's alone. Rows of one model (family) are compared with that model's float32 row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models import (
    DEFAULT_QTYPES,
    QWEN_0_5B,
    QWEN_0_5B_QTYPES,
    QWEN_1_5B,
    QWEN_1_5B_QTYPES,
    requantized_file,
)

DEFAULT_FAMILY = "smollm2-135m"
QWEN05_FAMILY = "qwen2.5-coder-0.5b"
F32_KEY = "f32"  # the float32 row: the reference of every "PPL vs float32" of its family
# (the default model's; another family's float32 row is keyed "<prefix>_f32")
def quantizer_digest(root: Path) -> str:
    """sha1 of `kvserve quantize`'s sources (kvserve/quantize.py, kvserve/quant/*.py): a
    quantized checkpoint's name holds it, so code that writes other weights is not served
    a checkpoint an older version made."""
    h = hashlib.sha1()
    for p in [root / "kvserve" / "quantize.py", *sorted((root / "kvserve" / "quant").glob("*.py"))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def is_float32_row(key: str) -> bool:
    """A family's float32 row (an --isa twin's key too: f32@avx2)."""
    base = key.split("@")[0]
    return base == F32_KEY or base.endswith(f"_{F32_KEY}")


# llama.cpp's KV types: bytes per element (q8_0: 32 int8 + one float16 scale per 32).
LLAMA_KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
# kvserve's int8 KV beside llama.cpp's q8_0 KV (its V cache needs flash attention on).
LLAMA_KV_Q8 = ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")


@dataclass(frozen=True)
class QuantRow:
    key: str                    # results key; "@avx2" suffixed on an --isa avx2 row
    label: str
    family: str                 # the model: PPL deltas compare rows of one family only
    model: str                  # what kvserve loads: a GGUF file or a quantized HF directory
    kvserve_flags: tuple[str, ...] = ()
    peer_gguf: str | None = None  # llama.cpp on this file, or no same-format peer
    peer_flags: tuple[str, ...] = ()
    quantize: tuple[str, ...] = ()  # `kvserve quantize` args (less -o) that make `model`
    isa: str | None = None      # KVSERVE_CPU_ISA for kvserve's processes
    unavailable: str | None = None  # why the row cannot run here (recorded, not measured)

    def with_isa(self, isa: str) -> QuantRow:
        return dataclasses.replace(self, key=f"{self.key}@{isa}",
                                   label=f"{self.label} [KVSERVE_CPU_ISA={isa}]", isa=isa)


def quant_rows(default_gguf: str, f32_gguf: str, models: Path, quantized: Path,
               float_source: str, calib: str, quick: bool, quantize_methods: list[str],
               quantizer: str) -> list[QuantRow]:
    """Every row, in table order. float_source: the float weights `kvserve quantize` reads
    (an HF checkpoint when one is given, else the F32 GGUF); quantized: where its outputs go;
    quantizer: a digest of `kvserve quantize`'s code (quantizer_digest).
    Every kvserve row but the KV-cache ones keeps a float16 KV cache, llama.cpp's default,
    so that a row differs from its peer and from float32 in its weights alone."""
    f16kv = ("--kv-cache-dtype", "float16")
    calib_args = ("--calib", calib) + (("--calib-tokens", "256", "--seq-len", "128") if quick
                                       else ())
    tag = "-quick" if quick else ""

    def gguf_row(key: str, label: str, file: str, family: str = DEFAULT_FAMILY) -> QuantRow:
        return QuantRow(key, label, family, file, peer_gguf=file)

    qwen05 = str(models / QWEN_0_5B)

    def quantized_row(key: str, label: str, method: str, args: tuple[str, ...],
                      source: str = float_source, family: str = DEFAULT_FAMILY) -> QuantRow:
        cmd = (source, "--method", method, *args)
        # Named by its command and the quantizer's code too: a checkpoint is made once and
        # reused while the command (source, method, calibration text, flags) and the code
        # that made it stay the same (AWQ's default search changed under the same command).
        digest = hashlib.sha1("\0".join((*cmd, quantizer)).encode()).hexdigest()[:8]
        out = quantized / f"{family}-{key}{tag}-{digest}"
        row = QuantRow(key, label, family, str(out), f16kv, quantize=cmd)
        if method not in quantize_methods:
            row = dataclasses.replace(row, unavailable=(
                f"not available: `kvserve quantize` has no --method {method} (it has "
                f"{', '.join(quantize_methods) or 'none'})"))
        return row

    return [
        gguf_row("q4_1", "SmolLM2-135M Q4_1 (the shipped file)", default_gguf),
        *(gguf_row(t.lower(), f"SmolLM2-135M {t} (llama-quantize of the F32 GGUF)",
                   str(models / requantized_file(t))) for t in DEFAULT_QTYPES),
        gguf_row("qwen1.5b_q4_k_m", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
                 str(models / QWEN_1_5B), "qwen2.5-coder-1.5b"),
        *(gguf_row(f"qwen1.5b_{t.lower()}", f"Qwen2.5-Coder-1.5B-Instruct {t} (llama-quantize "
                   "--allow-requantize of the Q4_K_M file)",
                   str(models / requantized_file(t, QWEN_1_5B)), "qwen2.5-coder-1.5b")
          for t in QWEN_1_5B_QTYPES),
        gguf_row("qwen0.5b_q4_k_m", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
                 qwen05, QWEN05_FAMILY),
        # The 0.5B's weights dequantized: mostly Q5_0 (5 bits, no minimum), so unlike the
        # default model's Q4_1 weights they lie on no 4-bit grid, and the 4-bit methods
        # below differ by how they round, not by which grid can hold the weights again.
        QuantRow("qwen0.5b_f32", "Qwen2.5-Coder-0.5B float32 (its Q4_K_M file dequantized, "
                 "`--quantization none`)", QWEN05_FAMILY, qwen05,
                 ("--quantization", "none", *f16kv)),
        quantized_row("qwen0.5b_int4", "Qwen2.5-Coder-0.5B int4 RTN g128 (`kvserve quantize "
                      "--method int4`)", "int4", ("--group-size", "128"), qwen05,
                      QWEN05_FAMILY),
        quantized_row("qwen0.5b_gptq4", "Qwen2.5-Coder-0.5B GPTQ 4-bit g128 (`kvserve "
                      "quantize`)", "gptq", ("--group-size", "128", *calib_args), qwen05,
                      QWEN05_FAMILY),
        quantized_row("qwen0.5b_gptq4_head", "Qwen2.5-Coder-0.5B GPTQ 4-bit g128, lm_head too "
                      "(`kvserve quantize --lm-head`)", "gptq",
                      ("--group-size", "128", "--lm-head", *calib_args), qwen05, QWEN05_FAMILY),
        quantized_row("qwen0.5b_gptq4_head8", "Qwen2.5-Coder-0.5B GPTQ 4-bit g128, lm_head "
                      "at 8 bits (`kvserve quantize --lm-head-bits 8`)", "gptq",
                      ("--group-size", "128", "--lm-head-bits", "8", *calib_args), qwen05,
                      QWEN05_FAMILY),
        quantized_row("qwen0.5b_awq4", "Qwen2.5-Coder-0.5B AWQ 4-bit g128 (`kvserve "
                      "quantize`)", "awq", ("--group-size", "128", *calib_args), qwen05,
                      QWEN05_FAMILY),
        *(gguf_row(f"qwen0.5b_{t.lower()}", f"Qwen2.5-Coder-0.5B-Instruct {t} (llama-quantize "
                   "--allow-requantize --imatrix of the Q4_K_M file, the matrix over the "
                   "GPTQ / AWQ rows' calibration text)",
                   str(models / requantized_file(t, QWEN_0_5B)), QWEN05_FAMILY)
          for t in QWEN_0_5B_QTYPES),
        QuantRow(F32_KEY, "SmolLM2-135M float32 (`--quantization none`)", DEFAULT_FAMILY,
                 default_gguf, ("--quantization", "none", *f16kv), peer_gguf=f32_gguf),
        QuantRow("int8", "SmolLM2-135M int8 RTN at load (`--quantization int8`)",
                 DEFAULT_FAMILY, default_gguf, ("--quantization", "int8", *f16kv)),
        QuantRow("int4", "SmolLM2-135M int4 RTN g32 at load (`--quantization int4`)",
                 DEFAULT_FAMILY, default_gguf, ("--quantization", "int4", *f16kv)),
        QuantRow("kv_int8", "SmolLM2-135M Q4_1, int8 KV (llama.cpp: q8_0 KV)", DEFAULT_FAMILY,
                 default_gguf, ("--kv-cache-dtype", "int8"), peer_gguf=default_gguf,
                 peer_flags=LLAMA_KV_Q8),
        QuantRow("kv_fp8", "SmolLM2-135M Q4_1, fp8_e4m3 KV", DEFAULT_FAMILY, default_gguf,
                 ("--kv-cache-dtype", "fp8_e4m3")),
        quantized_row("gptq4", "SmolLM2-135M GPTQ 4-bit g32 (`kvserve quantize`)", "gptq",
                      ("--bits", "4", "--group-size", "32", *calib_args)),
        quantized_row("gptq4_head", "SmolLM2-135M GPTQ 4-bit g32, lm_head too (`kvserve "
                      "quantize --lm-head`)", "gptq",
                      ("--bits", "4", "--group-size", "32", "--lm-head", *calib_args)),
        quantized_row("awq4", "SmolLM2-135M AWQ 4-bit g32 (`kvserve quantize`)", "awq",
                      ("--bits", "4", "--group-size", "32", *calib_args)),
        quantized_row("w8a8", "SmolLM2-135M W8A8 SmoothQuant (`kvserve quantize`)",
                      "smoothquant", calib_args),
    ]


def quantize_methods(help_text: str) -> list[str]:
    """The --method choices `kvserve quantize --help` lists."""
    m = re.search(r"--method \{([^}]*)\}", help_text)
    return m.group(1).split(",") if m else []


def parse_ppl(text: str) -> dict[str, float]:
    """{"ppl", "stderr"} from kvserve's `PPL = x +/- y` or llama-perplexity's `Final estimate:
    PPL = x +/- y` (the last such line)."""
    found = re.findall(r"PPL = ([0-9.]+|nan|inf) \+/- ([0-9.]+|nan|inf)", text)
    if not found:
        raise ValueError("no `PPL = x +/- y` line in the output")
    ppl, err = found[-1]
    return {"ppl": float(ppl), "stderr": float(err)}


def parse_llama_bench(stdout: str, n_prompt: int, n_gen: int) -> dict[str, Any]:
    """llama-bench -o json: {"prefill_tok_s", "decode_tok_s"} (its avg_ts of the pp / tg
    tests, each with its stddev_ts) plus the model's size and build."""
    tests = json.loads(stdout)
    out: dict[str, Any] = {}
    for t in tests:
        kind = ("prefill" if t["n_prompt"] == n_prompt and t["n_gen"] == 0 else
                "decode" if t["n_gen"] == n_gen and t["n_prompt"] == 0 else None)
        if kind:
            out[f"{kind}_tok_s"] = t["avg_ts"]
            out[f"{kind}_stddev_tok_s"] = t["stddev_ts"]
        out.update(weight_bytes=t.get("model_size"), params=t.get("model_n_params"),
                   build_commit=t.get("build_commit"), cpu_info=t.get("cpu_info"),
                   type_k=t.get("type_k"), type_v=t.get("type_v"))
    if "prefill_tok_s" not in out or "decode_tok_s" not in out:
        raise ValueError(f"llama-bench printed no pp{n_prompt} / tg{n_gen} result")
    return out


def parse_batched_bench(stdout: str) -> dict[str, Any]:
    """llama-batched-bench --output-format jsonl, one (pp, tg, pl) line: its decode-only
    rate (speed_tg) and, as kvserve's LLM.generate figure counts, generated tokens over the
    whole time, prefill included (output_tok_s)."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    runs = [r for r in rows if "speed_tg" in r]
    if not runs:
        raise ValueError("llama-batched-bench printed no result line")
    r = runs[-1]
    return {"output_tok_s": r["pl"] * r["tg"] / r["t"], "decode_only_tok_s": r["speed_tg"],
            "prefill_tok_s": r["speed_pp"], "pl": r["pl"], "pp": r["pp"], "tg": r["tg"]}


def llama_kv_bytes_per_token(metadata: dict[str, Any], type_k: str = "f16",
                             type_v: str = "f16") -> float:
    """llama.cpp's KV cache bytes per token over all layers, from a GGUF's metadata."""
    arch = metadata["general.architecture"]
    heads = metadata[f"{arch}.attention.head_count"]
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    dim = metadata[f"{arch}.embedding_length"] // heads
    dk = metadata.get(f"{arch}.attention.key_length", dim)
    dv = metadata.get(f"{arch}.attention.value_length", dim)
    return metadata[f"{arch}.block_count"] * kv_heads * (
        dk * LLAMA_KV_BYTES[type_k] + dv * LLAMA_KV_BYTES[type_v])


def peer_kv_types(peer_flags: tuple[str, ...]) -> tuple[str, str]:
    flags = list(peer_flags)

    def get(name: str) -> str:
        return flags[flags.index(name) + 1] if name in flags else "f16"

    return get("-ctk"), get("-ctv")
