"""Issue 14's tensor-parallel numbers: TP=1 / 2 / 3 latency and throughput, and what one
all-reduce costs, on this machine. Writes benchmarks/results/tp.json (report.py renders it).

    all-reduce   µs per call of [rows, hidden] float32 between `size` pinned processes, over
                 shared memory (kvserve/distributed/shm.py) and over gloo; the median of
                 --rounds rounds of a few hundred calls
    engine       `kvserve bench latency` (batch 1: a 512-token prefill, 128 decoded tokens)
                 and `kvserve bench throughput` (16 prompts x 128 in, 64 out) per model and
                 tensor_parallel_size; the default model at TP 1 / 3 (9 heads, 3 KV heads:
                 2 does not divide), Qwen2.5-Coder 0.5B at TP 1 / 2 (14 / 2 heads), both
                 all-reduces at TP 2
    per step     a decode step runs 2 all-reduces a layer: 2 x layers x the batch-1 cost

    .venv/bin/python benchmarks/tp_bench.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from machine import cpu_info  # noqa: E402

QWEN = BENCH / ".cache" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
MODELS = {"smollm2-135m": {"path": "smollm2-135m", "layers": 30, "hidden": 576,
                           "tp": [(1, "shm"), (3, "shm"), (3, "gloo")]},
          "qwen2.5-coder-0.5b": {"path": str(QWEN), "layers": 24, "hidden": 896,
                                 "tp": [(1, "shm"), (2, "shm"), (2, "gloo")]}}


def _allreduce_worker(rank: int, size: int, port: int, shm: int, hidden: int, rows: list[int],
                      calls: int, q: Any) -> None:
    import os

    import torch

    from kvserve.distributed.group import TPGroup

    os.sched_setaffinity(0, [rank % os.cpu_count()])  # type: ignore[operator]
    torch.set_num_threads(1)
    g = TPGroup.connect(rank, size, port, "cpu", 60, shm_elements=shm,
                        spin=size <= (os.cpu_count() or 1))
    out = {}
    for m in rows:
        x = torch.randn(m, hidden)
        for _ in range(20):
            g.all_reduce(x)
        n = calls if m < 64 else max(20, calls // 10)
        t = time.perf_counter()
        for _ in range(n):
            g.all_reduce(x)
        out[m] = (time.perf_counter() - t) / n * 1e6
    g.close()
    if rank == 0:
        q.put(out)


def allreduce_us(size: int, backend: str, hidden: int, rows: list[int], calls: int,
                 port: int) -> dict[int, float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shm = 512 * hidden if backend == "shm" else 0
    procs = [ctx.Process(target=_allreduce_worker, args=(r, size, port, shm, hidden, rows,
                                                         calls, q)) for r in range(size)]
    for p in procs:
        p.start()
    got = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return got


def run_cli(cmd: list[str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "kvserve.cli", *cmd, "--output-json", f.name],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round, fewer iterations")
    ns = ap.parse_args()
    rounds = 1 if ns.quick else ns.rounds
    out: dict[str, Any] = {"machine": cpu_info(), "date": time.strftime("%Y-%m-%d"),
                           "allreduce": [], "engine": []}
    rows = [1, 8, 512]
    port = 29811
    for name, m in MODELS.items():
        for size in sorted({tp for tp, _ in m["tp"] if tp > 1}):
            for backend in ("shm", "gloo"):
                runs = []
                for _ in range(rounds):
                    port += 1
                    runs.append(allreduce_us(size, backend, m["hidden"], rows,
                                             100 if ns.quick else 400, port))
                med = {r: statistics.median(x[r] for x in runs) for r in rows}
                out["allreduce"].append({"model": name, "size": size, "backend": backend,
                                         "hidden": m["hidden"], "us": med})
                print(f"all-reduce {name} TP={size} {backend}: "
                      + ", ".join(f"[{r}, {m['hidden']}] {v:.0f} us" for r, v in med.items()),
                      flush=True)
    iters = ["--num-iters", "1" if ns.quick else "3"]
    for name, m in MODELS.items():
        if not Path(m["path"]).exists() and m["path"] != "smollm2-135m":
            print(f"skipping {name}: {m['path']} missing (benchmarks/models.py fetches it)")
            continue
        for tp, backend in m["tp"]:
            flags = ["--model", m["path"], "--tensor-parallel-size", str(tp),
                     "--tp-all-reduce", backend, "--kv-cache-memory", "512MiB"]
            lat, thr = [], []
            for _ in range(rounds):
                lat.append(run_cli(["bench", "latency", *flags, *iters,
                                    "--num-iters-warmup", "1"]))
                thr.append(run_cli(["bench", "throughput", *flags, *iters,
                                    "--num-prompts", "16", "--input-len", "128",
                                    "--output-len", "64"]))
            row = {"model": name, "tp": tp, "all_reduce": backend,
                   "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in lat),
                   "decode_tok_s": statistics.median(r["decode_tok_s"] for r in lat),
                   "throughput_tok_s": statistics.median(r["output_tok_s"] for r in thr),
                   "layers": m["layers"]}
            out["engine"].append(row)
            print(f"{name} TP={tp} ({backend}): prefill {row['prefill_tok_s']:.0f} tok/s, "
                  f"decode {row['decode_tok_s']:.1f} tok/s, 16 x 64 out "
                  f"{row['throughput_tok_s']:.1f} tok/s", flush=True)
    path = BENCH / "results" / "tp.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
