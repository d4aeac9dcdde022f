"""The K-quant kernels' batch-1 decode against a plain read of the same bytes, same run.

    python benchmarks/kquant_stream.py [--model FILE.gguf] [--rounds 7] [--threads 2]

Every K-quant linear of a GGUF file (the Qwen 1.5B Q4_K_M file by default: make bench-quant
fetches it; the token embedding is looked up, not streamed, so it is left out) is packed as
kvserve keeps it and multiplied by one activation row, in the model's order, so each call reads
its weight from DRAM. Each round then sums the same packed bytes with torch (int64 view), the
rate this machine streams them at that moment, so the ratio holds still while the machine's
bandwidth drifts (16-32 GB/s between runs on the 2-core EPYC). Prints GB/s per format and the
median per-round ratio kernel / read; issue 11's "85% of the bandwidth ceiling" asks for 0.85.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from gguf import GGUFReader
from models import MODELS  # benchmarks/models.py

from kvserve.ops.cpu import KQUANT_KERNEL_WTYPES, PACKED_WTYPES, CpuOps
from kvserve.quant.block_pack import F32, pack
from kvserve.quant.ggml_kquants import IQ4_REWRITES
from kvserve.quant.ggml_kquants import KQUANT_NAMES as NAMES
from kvserve.quant.half_weights import HALF_DTYPES
from kvserve.quant.iquant_rewrite import rewrite_iq4
from kvserve.quant.kquant_pack import pack_kquant

DEFAULT = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
FLOAT_DTYPES = {F32: torch.float32, **HALF_DTYPES}  # ops.linear's rows


def load(path: Path, every_packed: bool = False) -> list[tuple[int, torch.Tensor, int, int]]:
    """(qtype, packed weight, rows N, columns K) of each K-quant linear, in file order; an
    i-quant rewritten first as the loader rewrites it (iquant_rewrite.rewrite_iq4). The token
    embedding is looked up, not streamed, so it is left out. every_packed (kernel_ab.py): the
    Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL linears too (block_pack.pack, ops.qlinear's
    layout), the F32 / F16 / BF16 ones as [N, K] tensors of their dtype (ops.linear's rows),
    and a tied model's embedding (no output.weight), which is its lm_head."""
    tensors = GGUFReader(path).tensors
    tied = every_packed and not any(t.name == "output.weight" for t in tensors)
    out = []
    for t in tensors:
        qt = int(t.tensor_type)
        kquant = qt in KQUANT_KERNEL_WTYPES or qt in IQ4_REWRITES
        packed = every_packed and qt in PACKED_WTYPES
        rows = every_packed and qt in FLOAT_DTYPES
        if not (kquant or packed or rows) or len(t.shape) != 2 \
                or (t.name == "token_embd.weight" and not tied):
            continue
        k, n = (int(d) for d in t.shape)
        raw = torch.from_numpy(t.data.reshape(n, -1).copy())
        if rows:  # GGUFReader hands BF16 out as its bytes
            out.append((qt, raw.view(torch.uint8).view(FLOAT_DTYPES[qt]).reshape(n, k), n, k))
            continue
        if qt in IQ4_REWRITES:
            raw, qt = rewrite_iq4(raw, qt, k), IQ4_REWRITES[qt][1]
        out.append((qt, pack_kquant(raw, qt, k) if kquant else pack(raw, qt, k), n, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=("avx512", "avx2"), help="kernel ISA (default: best)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ops = CpuOps(isa=a.isa)
    assert ops.uses_kernels, "this CPU lacks AVX2/FMA: CpuOps is the reference here"
    mats = load(a.model)
    xs = {k: torch.randn(1, k) for k in {k for _, _, _, k in mats}}
    flat = torch.cat([w.view(torch.int64).flatten() for _, w, _, _ in mats])
    fmt_bytes: dict[int, int] = {}
    for qt, w, _, _ in mats:
        fmt_bytes[qt] = fmt_bytes.get(qt, 0) + w.numel()
    total = flat.numel() * 8

    def kernels() -> dict[int, float]:
        secs = dict.fromkeys(fmt_bytes, 0.0)
        for qt, w, n, k in mats:
            t = time.perf_counter()
            ops.qlinear_kquant(xs[k], w, n, wtype=qt)
            secs[qt] += time.perf_counter() - t
        return secs

    def read() -> float:
        t = time.perf_counter()
        flat.sum()
        return time.perf_counter() - t

    print(f"{a.model.name}: {len(mats)} K-quant linears, {total / 1e6:.0f} MB "
          f"({', '.join(f'{NAMES[q]} {b / 1e6:.0f} MB' for q, b in fmt_bytes.items())}); "
          f"kernels {ops.isa}, {a.threads} threads")
    kernels(), read()  # warm-up: the extension, page faults
    rows: dict[str, list[float]] = {k: [] for k in ["read", "kernels", "ratio",
                                                    *(NAMES[q] for q in fmt_bytes)]}
    for r in range(a.rounds):
        secs = kernels()
        rd = total / read() / 1e9
        kern = total / sum(secs.values()) / 1e9
        rows["read"].append(rd)
        rows["kernels"].append(kern)
        rows["ratio"].append(kern / rd)
        for q, s in secs.items():
            rows[NAMES[q]].append(fmt_bytes[q] / s / 1e9)
        print(f"round {r}: read {rd:.1f} GB/s, kernels {kern:.1f} GB/s ({kern / rd:.2f}), "
              + ", ".join(f"{NAMES[q]} {rows[NAMES[q]][-1]:.1f}" for q in secs), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"median of {a.rounds}: read {med['read']:.1f} GB/s, kernels {med['kernels']:.1f} GB/s, "
          + ", ".join(f"{NAMES[q]} {med[NAMES[q]]:.1f}" for q in fmt_bytes)
          + f"; kernels / read {med['ratio']:.2f}")


if __name__ == "__main__":
    main()
