"""What the K-quant kernels cost by activation rows: a speculative verify step's 1 + K, small
batches, a prefill chunk.

    python benchmarks/kquant_rows.py [--model FILE.gguf] [--rows 1,2,3,4,5,8] [--rounds 5]

Every K-quant linear of a GGUF file (the Qwen 1.5B Q4_K_M file by default; the token
embedding left out, as in kquant_stream.py) is multiplied by M activation rows, in the
model's order, for each M of --rows in turn within a round (so the machine's drift hits every
M alike). Prints per format the milliseconds of all its linears at each M, the median over
rounds: the price of one more verify row, and where a tile shape or the wide records change.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from kquant_stream import DEFAULT, load  # benchmarks/kquant_stream.py

from kvserve.ops.cpu import CpuOps
from kvserve.quant.ggml_kquants import KQUANT_NAMES as NAMES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--rows", default="1,2,3,4,5,8", help="comma-separated M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ops = CpuOps()
    assert ops.uses_kernels, "this CPU lacks AVX2/FMA: CpuOps is the reference here"
    mats = load(a.model)
    ms = [int(m) for m in a.rows.split(",")]
    fmts = sorted({q for q, *_ in mats})
    xs = {(m, k): torch.randn(m, k) for m in ms for _, _, _, k in mats}
    times: dict[tuple[int, int], list[float]] = {(m, q): [] for m in ms for q in fmts}
    for r in range(a.rounds + 1):  # round 0 warms up: the extension, page faults
        for m in ms:
            secs = dict.fromkeys(fmts, 0.0)
            for qt, w, n, k in mats:
                t = time.perf_counter()
                ops.qlinear_kquant(xs[(m, k)], w, n, wtype=qt)
                secs[qt] += time.perf_counter() - t
            if r:
                for q in fmts:
                    times[(m, q)].append(secs[q] * 1e3)
    print(f"{a.model.name}: {len(mats)} K-quant linears; kernels {ops.isa}, {a.threads} threads, "
          f"ms, median of {a.rounds} rounds")
    print("rows " + "".join(f"{NAMES[q]:>9}" for q in fmts) + "    total")
    for m in ms:
        med = [statistics.median(times[(m, q)]) for q in fmts]
        print(f"{m:4d} " + "".join(f"{v:9.2f}" for v in med) + f" {sum(med):8.2f}")


if __name__ == "__main__":
    main()
