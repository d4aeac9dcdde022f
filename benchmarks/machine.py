"""The machine and its ceilings (runs in the project venv). Prints one JSON object.

    read bandwidth  a sum over a --bw-gib GiB float32 array on --threads threads: the better
                    of numpy (split over Python threads; it releases the GIL) and torch.sum;
                    median of --iters runs each
    GEMM FLOP/s     torch.mm of two 2048 x 2048 float32 matrices on --threads threads:
                    2 * 2048^3 FLOP per call; median of --iters runs
    weights         bytes a decode step reads per token, for each GGUF given:
                    F32 (as kvserve runs it): 4 bytes x all parameters (a tied embedding is
                    read once, as the lm_head; the embedding lookup reads one row); the file
                    as shipped (e.g. Q4_1): the bytes of its tensors
                    prefill FLOP per token: 2 x non-embedding parameters (the lm_head runs
                    for the last position only) + attention, 4 x layers x hidden x mean
                    context (QK^T and PV over (L + 1) / 2 positions on average)

    decode ceiling  = bandwidth / weight bytes per token
    prefill ceiling = GEMM FLOP/s / prefill FLOP per token

    python benchmarks/machine.py [--gguf PATH ...] [--prefill-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def cpu_info() -> dict[str, Any]:
    out: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(re.findall(r"^([^:\n]+):\s*(.*)$", text, flags=re.MULTILINE))
        out["cpu_model"] = fields.get("Model name", "?")
        out["cpus"] = int(fields.get("CPU(s)", "0") or 0)
        out["threads_per_core"] = fields.get("Thread(s) per core")
        flags = set(fields.get("Flags", "").split())
        # avx512_vnni: what kvserve's AVX-512 int8 kernel needs (else its AVX2 twin runs);
        # amx_int8: where setup_peers.sh builds llama.cpp without its AMX kernels.
        out["isa"] = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                  "avx_vnni", "amx_tile", "amx_int8") if f in flags]
        out["l3"] = fields.get("L3 cache")
    except (OSError, subprocess.CalledProcessError):
        out["cpu_model"] = platform.processor() or "?"
        out["cpus"] = os.cpu_count()
    with open("/proc/meminfo") as f:
        mem = dict(line.split(":", 1) for line in f)
    out["mem_gib"] = round(int(mem["MemTotal"].split()[0]) / 2**20, 1)
    return out


def describe(m: dict[str, Any]) -> str:
    """cpu_info's result in words, for the reports: model (cores; ISA features)."""
    return (f"{m.get('cpu_model', '?')} ({m.get('cpus', '?')} cores; "
            f"{', '.join(m.get('isa') or [])})")


def read_bandwidth(gib: float, threads: int, iters: int) -> dict[str, Any]:
    """The best of two streaming reads of the same array, each the median of its runs:
    numpy sum split over `threads` Python threads, and torch.sum on `threads` threads.
    (numpy's pairwise float32 sum can be compute-bound on a fast core; torch's is not.)"""
    import torch

    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)

    def timed(fn: Any) -> list[float]:
        rates = []
        for it in range(iters + 1):
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if it:
                rates.append(a.nbytes / dt / 1e9)
        return rates

    with ThreadPoolExecutor(threads) as pool:
        np_runs = timed(lambda: list(pool.map(np.sum, parts)))
    torch.set_num_threads(threads)
    t = torch.from_numpy(a)
    torch_runs = timed(lambda: t.sum())
    methods = {"numpy_sum": statistics.median(np_runs), "torch_sum": statistics.median(torch_runs)}
    return {"read_gb_s": max(methods.values()), "method": max(methods, key=methods.get),
            "methods_gb_s": methods, "runs": {"numpy_sum": np_runs, "torch_sum": torch_runs},
            "bytes": a.nbytes, "threads": threads}


def gemm_flops(n: int, threads: int, iters: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    rates = []
    for it in range(iters + 1):
        t = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t
        if it:
            rates.append(2 * n**3 / dt / 1e9)
    return {"gflop_s": statistics.median(rates), "runs": rates, "n": n, "threads": threads}


def weights_info(path: str, prefill_len: int) -> dict[str, Any]:
    import gguf

    r = gguf.GGUFReader(path)
    params = sum(int(t.n_elements) for t in r.tensors)
    file_bytes = sum(int(t.n_bytes) for t in r.tensors)
    emb = sum(int(t.n_elements) for t in r.tensors if t.name == "token_embd.weight")
    tied = not any(t.name == "output.weight" for t in r.tensors)
    arch = r.fields["general.architecture"].contents()
    n_layers = int(r.fields[f"{arch}.block_count"].contents())
    hidden = int(r.fields[f"{arch}.embedding_length"].contents())
    # Non-embedding weights, plus the lm_head where it is a separate tensor (it runs for the
    # last position only, so it is left out of the per-token prefill FLOP either way).
    layer_params = params - emb - (0 if tied else emb)
    attn = 4 * n_layers * hidden * (prefill_len + 1) / 2
    types = sorted({t.tensor_type.name for t in r.tensors})
    return {"path": path, "params": params, "tied_embeddings": tied, "tensor_types": types,
            "bytes_per_token_f32": 4 * params, "bytes_per_token_file": file_bytes,
            "prefill_flop_per_token": 2 * layer_params + attn, "prefill_len": prefill_len}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", action="append", default=[])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bw-gib", type=float, default=1.0)
    p.add_argument("--gemm-n", type=int, default=2048)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--only-bandwidth", action="store_true",
                   help="print only the read bandwidth (a benchmark measures it beside each "
                        "timed round: this shared machine's bandwidth drifts)")
    ns = p.parse_args()
    if ns.only_bandwidth:
        print(json.dumps({"bandwidth": read_bandwidth(ns.bw_gib, ns.threads, ns.iters)}))
        return
    out = {"machine": cpu_info(),
           "bandwidth": read_bandwidth(ns.bw_gib, ns.threads, ns.iters),
           "gemm": gemm_flops(ns.gemm_n, ns.threads, ns.iters),
           "weights": [weights_info(g, ns.prefill_len) for g in ns.gguf]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
