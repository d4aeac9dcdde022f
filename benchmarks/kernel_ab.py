"""Two builds of the CPU kernels in one process, timed in alternating rounds: the working
tree's csrc/ against another git revision's, on every packed linear of a GGUF file.

    python benchmarks/kernel_ab.py [--base HEAD] [--rows 1,5,16,512] [--rounds 9]
                                   [--model FILE.gguf] [--isa avx512|avx2] [-D NAME=VALUE]
                                   [--formats Q6_K,...] [--in-cache CALLS]

A kernel change of a few percent drowns in this machine's drift between runs (its read rate
moves 30-60 GB/s from minute to minute), so both builds run in the same process, on the same
packed weights and activations, each round in turn (the first build first on even rounds).
Each build is compiled once into its own directory (kvserve.ops.cpu_extension's
build_extension, keyed on the sources' bytes), so a revision built before costs nothing.
-D NAME=VALUE is prepended to the working tree's qlinear*.cpp as a #define: a knob a kernel
file reads with #ifndef, tried at several values without editing it (the file's
default needs no -D).

Prints per M the milliseconds of all the linears (median over rounds) for each build and
the median per-round ratio tree / base: below 1 the tree is faster. The outputs of the two
builds are compared bit for bit first (the kernels' contract: same sums, same bits).

The linears are the file's K-quant ones (qlinear_kquant*.cpp), its Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 / IQ4_NL ones (qlinear*.cpp), each packed as kvserve keeps it, and its F32 / F16 /
BF16 ones (linear*.cpp's rows, as kvserve holds a float file's weights); a tied model's
token embedding is its lm_head and streams every step, so it counts as a linear there. The
default model (`--model` its Q4_1 file) has no K-quant: its 210 Q4_1 linears and Q8_0 lm_head.
--formats keeps the linears of the named types only (ggml's names), to time one format's
kernel without the others' time diluting its ratio.

--in-cache CALLS times each format's kernel alone instead: its largest linear of at most
16 MB (in L3 after the first call), CALLS pairs of calls per M, the builds alternating call by
call, and prints the median per-pair ratio. Where a machine shared with others runs one
minute at 1.5x the speed of the next, call-by-call pairs still agree to ~2% from run to run
(rounds over every linear from DRAM spread 0.7-1.3x): the way to see a change in the
compute of a multi-row tile, which DRAM hides less than it hides a 1-row one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from kquant_stream import DEFAULT, FLOAT_DTYPES, load  # benchmarks/kquant_stream.py

from kvserve.ops.build import read_sources
from kvserve.ops.cpu import KQUANT_KERNEL_WTYPES, CpuOps
from kvserve.ops.cpu_extension import KERNEL_FILES, build_extension

ROOT = Path(__file__).resolve().parent.parent
CSRC = "kvserve/ops/csrc"


def revision_files(rev: str) -> dict[str, bytes]:
    """KERNEL_FILES as they are at git revision rev."""
    return {name: subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT,
                                 check=True, capture_output=True).stdout
            for name in KERNEL_FILES}


def with_defines(files: dict[str, bytes], defines: list[str]) -> dict[str, bytes]:
    """files with each NAME=VALUE as a #define at the top of the quantized kernel files
    (qlinear*.cpp: the K-quants' and the packed formats')."""
    head = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines).encode()
    return {n: head + b if n.startswith("qlinear") else b for n, b in files.items()}


def multiply(ops: CpuOps, x: torch.Tensor, w: torch.Tensor, n: int, qt: int) -> torch.Tensor:
    if qt in FLOAT_DTYPES:
        return ops.linear(x, w, wtype=qt)
    if qt in KQUANT_KERNEL_WTYPES:
        return ops.qlinear_kquant(x, w, n, wtype=qt)
    return ops.qlinear(x, w, n, wtype=qt)


def ops_for(files: dict[str, bytes], isa: str | None) -> CpuOps:
    ext = build_extension(files)
    if isinstance(ext, RuntimeError):
        raise ext
    return CpuOps(isa=isa, ext=ext)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare against")
    ap.add_argument("--model", type=Path, default=DEFAULT)
    ap.add_argument("--rows", default="1,5,16,512", help="comma-separated M")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=("avx512", "avx2"), help="kernel ISA (default: best)")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                    help="a #define for the working tree's qlinear*.cpp files (repeatable)")
    ap.add_argument("--formats", help="comma-separated ggml type names (default: every one)")
    ap.add_argument("--in-cache", type=int, default=0, metavar="CALLS",
                    help="each format's largest linear of <= 16 MB alone, CALLS call-by-call pairs")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tree_files = with_defines(read_sources(ROOT / CSRC, KERNEL_FILES), a.defines)
    builds = {"base": ops_for(revision_files(a.base), a.isa), "tree": ops_for(tree_files, a.isa)}
    mats = load(a.model, every_packed=True)
    if a.formats:
        keep = {GGMLQuantizationType[f].value for f in a.formats.split(",")}
        mats = [mat for mat in mats if mat[0] in keep]
        assert mats, f"{a.model.name} has no linear of {a.formats}"
    ms = [int(m) for m in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    xs = {(m, k): torch.randn(m, k, generator=g) for m in ms for _, _, _, k in mats}

    for m in ms:  # same sums, same bits: a timing of a wrong kernel means nothing
        for qt, w, n, k in mats[:7]:
            base, tree = (multiply(b, xs[(m, k)], w, n, qt) for b in builds.values())
            assert torch.equal(base, tree), f"the builds differ at M={m}, wtype {qt}, {n}x{k}"

    if a.in_cache:
        in_cache(builds, mats, xs, ms, a.in_cache)
        return

    def timed(ops: CpuOps, m: int) -> float:
        t = time.perf_counter()
        for qt, w, n, k in mats:
            multiply(ops, xs[(m, k)], w, n, qt)
        return (time.perf_counter() - t) * 1e3

    times: dict[tuple[str, int], list[float]] = {(b, m): [] for b in builds for m in ms}
    ratios: dict[int, list[float]] = {m: [] for m in ms}
    for r in range(a.rounds + 1):  # round 0 warms up: page faults, the unpack buffers
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for m in ms:
            got = {b: timed(builds[b], m) for b in order}
            if r:
                for b, t in got.items():
                    times[(b, m)].append(t)
                ratios[m].append(got["tree"] / got["base"])
    isa = builds["tree"].isa
    print(f"{a.model.name}: {len(mats)} linears; kernels {isa}, {a.threads} threads; "
          f"base {a.base}, tree{' ' + ' '.join(a.defines) if a.defines else ''}; ms, median "
          f"of {a.rounds} rounds")
    print(f"{'rows':>5} {'base':>9} {'tree':>9} {'tree/base':>10} {'range':>12}")
    for m in ms:
        rs = ratios[m]
        print(f"{m:5d} {statistics.median(times[('base', m)]):9.2f} "
              f"{statistics.median(times[('tree', m)]):9.2f} {statistics.median(rs):10.3f} "
              f"{min(rs):5.2f}-{max(rs):.2f}")


Mat = tuple[int, torch.Tensor, int, int]  # kquant_stream.load's: qtype, weight, rows, columns


def in_cache(builds: dict[str, CpuOps], mats: list[Mat], xs: dict[tuple[int, int], torch.Tensor],
             ms: list[int], calls: int) -> None:
    """Per format, its largest linear of <= 16 MB: `calls` pairs of calls per M, base and tree
    alternating call by call (which goes first alternating too); the median per-pair ratio."""
    picked: dict[int, tuple[int, Mat]] = {}
    for mat in mats:
        qt, w = mat[0], mat[1]
        nbytes = w.numel() * w.element_size()
        if nbytes <= 16 << 20 and (qt not in picked or nbytes > picked[qt][0]):
            picked[qt] = (nbytes, mat)
    print(f"in cache, {calls} call-by-call pairs per M; us a call (median), tree/base (median "
          f"of the pairs' ratios)")
    for qt, (nbytes, (_, w, n, k)) in sorted(picked.items()):
        name = GGMLQuantizationType(qt).name
        print(f"{name} {n} x {k} ({nbytes / 1e6:.1f} MB)")
        print(f"{'rows':>5} {'base':>9} {'tree':>9} {'tree/base':>10}")
        for m in ms:
            x = xs[(m, k)]
            for ops in builds.values():  # warm: the weight into cache, the unpack buffers
                multiply(ops, x, w, n, qt)
            t: dict[str, list[float]] = {b: [] for b in builds}
            for i in range(calls):
                for b in (("base", "tree") if i % 2 == 0 else ("tree", "base")):
                    t0 = time.perf_counter()
                    multiply(builds[b], x, w, n, qt)
                    t[b].append((time.perf_counter() - t0) * 1e6)
            pairs = [tt / tb for tb, tt in zip(t["base"], t["tree"])]
            print(f"{m:5d} {statistics.median(t['base']):9.1f} "
                  f"{statistics.median(t['tree']):9.1f} {statistics.median(pairs):10.3f}")


if __name__ == "__main__":
    main()
