"""Micro-benchmarks of the CPU ops backend against torch / ReferenceOps at SmolLM2-135M shapes.

    python benchmarks/ops_micro.py [--threads 2] [--reps 15] [--only linear] [--ms 1,8,16]
                                   [--weights float16]

Each row is the median of --reps timed calls, both sides at the same thread count. Weights and
KV caches rotate through enough copies (>= 256 MB) that every call reads them from DRAM, as in
a real decoder step where 30 layers' weights go by before one comes back; small activations
stay cached, as they do in the model.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.ops.cpu import CpuOps
from kvserve.ops.reference import ReferenceOps

COLD_BYTES = 256 << 20  # > 32 MB L3 several times over

# SmolLM2-135M: hidden 576, 9 heads / 3 kv heads of 64, intermediate 1536, vocab 49152.
LINEAR_SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
                 "down": (576, 1536), "lm_head": (49152, 576)}


def median_time(fn: Callable[[int], object], reps: int) -> float:
    """fn(i) runs call i (i picks the rotating copy); returns the median seconds per call."""
    for i in range(3):  # warm-up: first-touch of outputs, thread pool wake-up
        fn(i)
    times = []
    for i in range(1, reps + 1):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    return max(2, min(200, math.ceil(COLD_BYTES / nbytes)))


def row(name: str, ours: float, base: float, base_name: str, extra: str = "") -> None:
    print(f"{name:<34} {ours * 1e6:>10.1f} {base * 1e6:>10.1f}  {base / ours:>6.2f}x  "
          f"{base_name:<10} {extra}")


# --weights: the width ops.linear reads (float16 / bfloat16 rows are widened exactly in
# registers: wtype 1 / 30), against F.linear on the same values in float32.
WEIGHT_WTYPES = {"float32": (torch.float32, 0), "float16": (torch.float16, 1),
                 "bfloat16": (torch.bfloat16, 30)}


def bench_linear(ops: CpuOps, reps: int, ms: list[int], weights: str = "float32") -> None:
    """ops' kernel (whatever its ISA; M > SMALL_M is F.linear inside it too) against F.linear,
    plus the AVX2 kernel's time when ops runs the AVX-512 one."""
    avx2 = CpuOps(isa="avx2") if ops.isa != "avx2" else None
    dtype, wtype = WEIGHT_WTYPES[weights]
    print(f"\nlinear ({weights} weights from DRAM, {ops.isa}) ours us   torch us  speedup  "
          "baseline   ours GB/s GFLOP/s | torch GB/s" + (" | avx2 us" if avx2 else ""))
    g = torch.Generator().manual_seed(0)
    for label, (n, k) in LINEAR_SHAPES.items():
        nbytes = n * k * dtype.itemsize
        ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies_for(nbytes))]
        # torch's side: the same values in float32 (its own rotating copies).
        wf = ws if dtype == torch.float32 else [w.float() for w in ws[:copies_for(nbytes * 2)]]
        # Every call takes the least recently used copy, whichever side made the last calls,
        # so no side gets weights that the other just left in L3.
        nxt = itertools.count()

        def timed(fn: Callable, x: torch.Tensor, ws: list = ws, nxt: itertools.count = nxt
                  ) -> float:
            return median_time(lambda i: fn(x, ws[next(nxt) % len(ws)]), reps)

        def ours_fn(x: torch.Tensor, w: torch.Tensor, o: CpuOps = ops) -> torch.Tensor:
            return o.linear(x, w, wtype=wtype)

        for m in ms:
            x = torch.randn(m, k, generator=g)
            ours, base = timed(ours_fn, x), timed(F.linear, x, wf)
            extra = (f"{nbytes / ours / 1e9:6.1f} {2 * m * n * k / ours / 1e9:6.1f} | "
                     f"{nbytes / base / 1e9:6.1f}")
            if avx2 is not None:
                extra += f" | {timed(lambda x, w: ours_fn(x, w, avx2), x) * 1e6:8.1f}"
            row(f"{label} {n}x{k} M={m}", ours, base, "F.linear", extra)


def attention_batch(q_lens: list[int], seq_lens: list[int], layers: int, g: torch.Generator
                    ) -> tuple:
    heads, kv_heads, d, bs = 9, 3, 64, 16
    need = [-(-s // bs) for s in seq_lens]
    nb = 1 + sum(need)
    caches = [torch.randn(2, nb, bs, kv_heads, d, generator=g) for _ in range(layers)]
    perm = (torch.randperm(nb - 1, generator=g) + 1).int()
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at:at + n]
        at += n
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, caches, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def bench_attention(ops: CpuOps, ref: ReferenceOps, reps: int) -> None:
    print("\npaged_attention (9/3 heads, D 64, bs 16) ours us    ref us  speedup  baseline   "
          "KV GB/s")
    g = torch.Generator().manual_seed(1)
    cases = {"decode B=8 ctx=512": ([1] * 8, [512] * 8),
             "decode B=1 ctx=2048": ([1], [2048]),
             "decode B=32 ctx=128..2048": ([1] * 32, [128 + 61 * i for i in range(32)]),
             "prefill 1x512": ([512], [512]),
             "mixed 4 decodes + chunk 128": ([1, 1, 1, 1, 128], [300, 700, 90, 1500, 640])}
    for label, (q_lens, seq_lens) in cases.items():
        kv_bytes = sum(seq_lens) * 3 * 64 * 4 * 2
        q, caches, tables, sl, qsl = attention_batch(q_lens, seq_lens, copies_for(kv_bytes), g)
        args = (tables, sl, qsl, 0.125, max(q_lens), max(seq_lens))

        def run(o: ReferenceOps, i: int, q=q, caches=caches, args=args) -> torch.Tensor:
            return o.paged_attention(q, caches[i % len(caches)], *args)

        ours = median_time(lambda i, run=run: run(ops, i), reps)
        base = median_time(lambda i, run=run: run(ref, i), max(3, reps // 3))
        row(label, ours, base, "reference", f"{kv_bytes / ours / 1e9:6.1f}")
        if label.startswith("decode B=8"):
            # A ceiling, not a peer: SDPA over one contiguous, L3-warm K/V (no paging, no
            # rotation through layers), i.e. what torch does when memory is not the limit.
            k = torch.randn(8, 9, 512, 64, generator=g)
            v = torch.randn(8, 9, 512, 64, generator=g)
            qq = q.view(8, 9, 1, 64)
            sdpa = median_time(lambda i, qq=qq, k=k, v=v: F.scaled_dot_product_attention(
                qq, k, v), reps)
            row("  vs SDPA, contiguous warm K/V", ours, sdpa, "sdpa")


def bench_elementwise(ops: CpuOps, ref: ReferenceOps, reps: int) -> None:
    from kvserve.layers.rotary import rope_cos_sin

    print("\nelementwise                            ours us    ref us  speedup  baseline")
    g = torch.Generator().manual_seed(2)
    cos_sin = rope_cos_sin(64, 8192, 100000.0, None)
    w = torch.randn(576, generator=g)
    for t in (8, 512):
        x, res = torch.randn(t, 576, generator=g), torch.randn(t, 576, generator=g)
        gu = torch.randn(t, 3072, generator=g)
        qkv = torch.randn(t, 960, generator=g)
        q, k = qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64)
        v = qkv[:, 768:].view(t, 3, 64)
        pos = torch.randint(0, 8192, (t,), generator=g)
        cache = torch.zeros(2, 64 + t // 16 + 1, 16, 3, 64)
        slots = torch.randperm(cache.shape[1] * 16, generator=g)[:t]
        slots[::7] = -1
        cases: dict[str, Callable[[ReferenceOps], object]] = {
            "rms_norm": lambda o, x=x: o.rms_norm(x, w, 1e-5),
            "add_rms_norm": lambda o, x=x, res=res: o.add_rms_norm(x, res, w, 1e-5),
            "silu_and_mul": lambda o, gu=gu: o.silu_and_mul(gu),
            "rotary": lambda o, q=q, k=k, pos=pos: o.rotary(q, k, pos, cos_sin),
            "write_kv": lambda o, k=k, v=v, c=cache, s=slots: o.write_kv(k, v, c, s),
        }
        for name, fn in cases.items():
            ours = median_time(lambda i, fn=fn: fn(ops), reps)
            base = median_time(lambda i, fn=fn: fn(ref), reps)
            row(f"{name} T={t}", ours, base, "reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", choices=("linear", "attention", "elementwise"))
    ap.add_argument("--ms", default="1,4,8,16,64,256",
                    help="comma-separated batch sizes M for linear")
    ap.add_argument("--isa", choices=("avx512", "avx2"), help="linear kernel (default: best)")
    ap.add_argument("--weights", choices=tuple(WEIGHT_WTYPES), default="float32",
                    help="the weight width the linear kernel reads")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ops, ref = CpuOps(isa=a.isa), ReferenceOps()
    assert ops.uses_kernels, "this CPU lacks AVX2/FMA: CpuOps is the reference here"
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.reps}")
    if a.only in (None, "linear"):
        bench_linear(ops, a.reps, [int(m) for m in a.ms.split(",")], a.weights)
    if a.only in (None, "attention"):
        bench_attention(ops, ref, a.reps)
    if a.only in (None, "elementwise"):
        bench_elementwise(ops, ref, a.reps)


if __name__ == "__main__":
    main()
