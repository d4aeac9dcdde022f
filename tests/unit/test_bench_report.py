"""benchmarks/report.py: ceilings and the issue's targets from stored results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> Any:
    spec = importlib.util.spec_from_file_location("bench_report",
                                                  ROOT / "benchmarks" / "report.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _serve(tput8: float, ttft8: float, tput16: float) -> dict[str, Any]:
    def run(c: int, tput: float, ttft: float) -> dict[str, Any]:
        return {"max_concurrency": c, "completed": 2 * c, "output_throughput": tput,
                "total_token_throughput": 2 * tput, "median_ttft_ms": ttft,
                "p99_ttft_ms": 2 * ttft, "median_tpot_ms": 50.0, "median_itl_ms": 50.0}

    return {"weights": "f32", "runs": [run(8, tput8, ttft8), run(16, tput16, 2 * ttft8)]}


def _write(d: Path, name: str, obj: Any) -> None:
    (d / f"{name}.json").write_text(json.dumps(obj))


def test_ceilings_and_targets(tmp_path: Path, report: Any) -> None:
    w = {"params": 100_000_000, "tensor_types": ["F32", "Q4_1"], "prefill_len": 512,
         "bytes_per_token_f32": 400_000_000, "bytes_per_token_file": 80_000_000,
         "prefill_flop_per_token": 2e8}
    _write(tmp_path, "machine", {"machine": {}, "bandwidth": {"read_gb_s": 20.0},
                                 "gemm": {"gflop_s": 100.0}, "weights": [w, w]})
    # kvserve on the file's blocks (default) and on float32; llama.cpp on both formats.
    _write(tmp_path, "kvserve_latency", {"prefill_tok_s": 450.0, "decode_tok_s": 160.0,
                                         "input_len": 512})
    _write(tmp_path, "kvserve_latency_f32", {"prefill_tok_s": 600.0, "decode_tok_s": 30.0,
                                             "input_len": 512})
    _write(tmp_path, "llama_cpp_file", {"single": {"prefill_tok_s": 300.0,
                                                   "decode_tok_s": 80.0}})
    _write(tmp_path, "llama_cpp_f32", {"single": {"prefill_tok_s": 500.0,
                                                  "decode_tok_s": 40.0}})
    _write(tmp_path, "kvserve_throughput", {"output_tok_s": 150.0})
    _write(tmp_path, "kvserve_throughput_f32", {"output_tok_s": 100.0})
    _write(tmp_path, "hf", {"batch_output_tok_s": 25.0})
    _write(tmp_path, "serve_kvserve", _serve(130.0, 1000.0, 90.0))
    _write(tmp_path, "serve_llama_server", _serve(60.0, 4000.0, 60.0))
    def prefix_run(ttft: float) -> dict[str, Any]:
        return {"median_ttft_ms": ttft, "mean_ttft_ms": ttft, "output_throughput": 10.0,
                "prefix_len": 1024, "output_len": 16, "num_prompts": 8, "max_concurrency": 2}

    _write(tmp_path, "prefix", {"on": prefix_run(100.0), "off": prefix_run(150.0)})
    rep = report.Report(tmp_path)
    assert rep.decode_ceiling("f32") == pytest.approx(50.0)  # 20 GB/s / 400 MB
    assert rep.decode_ceiling("file") == pytest.approx(250.0)
    assert rep.prefill_ceiling() == pytest.approx(500.0)  # 100 GFLOP/s / 200 MFLOP
    assert rep.batch_decode_ceiling() == pytest.approx(500.0)  # 100 GFLOP/s / (2 x 1e8)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in rep.criteria()
            if line.startswith("| ") and "target" not in line}
    assert "2.17x | **met**" in rows["serving output tok/s at 8 streams >= 2.0x llama-server"]
    assert "1.50x | not met" in rows["serving output tok/s at 16 streams >= 2.0x llama-server"]
    assert "0.25x | **met**" in rows["median TTFT at 8 streams <= 1/3 of llama-server's"]
    assert "0.75x | not met" in rows["batch-1 decode >= 1.0x llama.cpp (F32)"]
    assert "60% | **met**" in rows["batch-1 decode >= 60% of the F32 bandwidth ceiling"]
    assert "1.20x | **met**" in rows["prefill 512 >= 1.0x llama.cpp (F32)"]
    assert "2.00x | **met**" in rows["batch-1 decode >= 1.0x llama.cpp (Q4_1)"]
    assert "64% | **met**" in rows["batch-1 decode >= 60% of the Q4_1 bandwidth ceiling"]
    assert "1.50x | **met**" in rows["prefill 512 >= 1.0x llama.cpp (Q4_1)"]
    assert "6.00x | **met**" in rows["batch 8 >= 5x HF transformers (kvserve Q4_1, HF float32)"]
    assert "4.00x | not met" in rows["batch 8 >= 5x HF transformers (both float32)"]
    assert "0.67x | not met" in rows["shared prefix: TTFT with caching <= 1/2 of without"]
    md = rep.markdown()
    assert "| kvserve serve | f32 | 130.0 |" in md


def test_missing_results_say_not_measured(tmp_path: Path, report: Any) -> None:
    md = report.Report(tmp_path).markdown()
    assert "not measured" in md and "n/a" in md


def test_paired_rounds_compare_round_by_round(tmp_path: Path, report: Any) -> None:
    # kvserve and llama.cpp timed in alternating rounds while the machine slows down and
    # speeds up: kvserve wins the fast round by a lot and loses both slow rounds. The ratio of
    # the medians (100 / 90) would call it a win; the median of the per-round ratios, which
    # compares runs seconds apart, is the honest 0.91x.
    ours, theirs = [100.0, 60.0, 100.0], [90.0, 70.0, 110.0]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    _write(tmp_path, "kvserve_latency_f32", {
        "prefill_tok_s": 600.0, "decode_tok_s": 100.0, "decode_tok_s_runs": ours,
        "input_len": 512,
        "paired": {"rounds": 3, "peer_prefill_tok_s": 500.0, "peer_decode_tok_s": 90.0,
                   "peer_decode_tok_s_runs": theirs, "prefill_ratio": 1.2,
                   "prefill_ratio_runs": [1.2, 1.1, 1.3], "decode_ratio": sorted(ratios)[1],
                   "decode_ratio_runs": ratios}})
    # A separate single-stream run of llama.cpp (older results) must not be used instead.
    _write(tmp_path, "llama_cpp_f32", {"single": {"prefill_tok_s": 1.0, "decode_tok_s": 1.0}})
    rep = report.Report(tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in rep.criteria()
            if line.startswith("| ")}
    assert "0.91x | not met" in rows["batch-1 decode >= 1.0x llama.cpp (F32)"]
    assert "1.20x | **met**" in rows["prefill 512 >= 1.0x llama.cpp (F32)"]
    table = {line.split(" | ")[0].lstrip("| "): line for line in rep.latency()
             if line.startswith("| ")}
    assert table["llama.cpp, F32 GGUF"].split(" | ")[1:] == [
        "500.0", "n/a", "1.20x", "90.0", "n/a of n/a", "0.91x |"]
    assert "decode 1.11, 0.86, 0.91" in "\n".join(rep.latency())


def test_quant_table_compares_each_row_with_its_peer_and_its_float32_row(
        tmp_path: Path, report: Any) -> None:
    def row(key: str, family: str, ppl: float, peer_ppl: float | None, decode: float,
            peer_decode: float | None, **extra: Any) -> dict[str, Any]:
        r: dict[str, Any] = {
            "key": key, "label": key, "family": family, "errors": {},
            "ppl": {"kvserve": {"ppl": ppl, "stderr": 0.1}},
            "latency": {"kvserve": {"prefill_tok_s": 1000.0, "decode_tok_s": decode},
                        "memory": {"weight_bytes": 200e6, "kv_bytes_per_token": 23040,
                                   "kv_dtype": "float16", "isa": "avx512"}},
            **extra}
        if peer_ppl is not None:
            r["ppl"]["llama.cpp"] = {"ppl": peer_ppl, "stderr": 0.1}
            r["latency"]["llama.cpp"] = {"prefill_tok_s": 500.0, "decode_tok_s": peer_decode}
            r["latency"]["decode_ratio"] = decode / peer_decode  # one round
            r["latency"]["prefill_ratio"] = 2.0
            r["peer_memory"] = {"weight_bytes": 96.6e6, "kv_bytes_per_token": 23040,
                                "kv_types": ["f16", "f16"]}
        return r

    _write(tmp_path, "quant", {
        "ctx": 512, "text": "GPL-3.txt", "prefill_len": 512, "decode_len": 64,
        "latency_rounds": 1, "batch": {"seqs": 16}, "float_source_is_gguf": True,
        "rows": [
            row("q4_1", "smollm2-135m", 20.0, 19.0, 400.0, 200.0),
            row("f32", "smollm2-135m", 18.0, 18.0, 100.0, 100.0),
            row("int4", "smollm2-135m", 21.0, None, 380.0, None),
            row("qwen", "qwen", 9.0, 9.0, 20.0, 25.0),
            row("qwen_bw", "qwen", 9.0, 9.0, 20.0, 25.0),
            # another family's float32 row, keyed by its prefix
            row("q05_f32", "q05", 5.0, None, 15.0, None),
            row("q05_gptq4", "q05", 6.0, None, 50.0, None),
            {"key": "w8a8", "label": "w8a8", "family": "smollm2-135m", "errors": {},
             "unavailable": "not available: no --method smoothquant"}]})
    q = json.loads((tmp_path / "quant.json").read_text())
    q["rows"][4]["latency"].update(decode_bandwidth_share=0.9,
                                   bandwidth_gb_s_runs=[20.0, 23.0, 22.0])
    # a row kept from an earlier run (compare --quant-rows re-measured the others)
    q["date"] = q["rows"][0]["date"] = "2026-12-02T03:00:00+00:00"
    q["rows"][2]["date"] = "2026-12-01T15:09:29+00:00"
    # ... and one kept from a run on another CPU, which the note names
    xeon = {"cpu_model": "Intel Xeon", "cpus": 2, "isa": ["avx2", "avx512f"]}
    q["machine"] = q["rows"][1]["machine"] = xeon
    epyc = {"cpu_model": "AMD EPYC", "cpus": 2, "isa": ["avx2", "fma"]}
    for i in (3, 4):
        q["rows"][i].update(date="2026-12-02T09:00:00+00:00", machine=epyc)
    (tmp_path / "quant.json").write_text(json.dumps(q))
    md = "\n".join(report.Report(tmp_path).quant_section())

    def cells(text: str) -> dict[str, list[str]]:
        """A table's body rows: first cell -> the other cells."""
        return {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:]
                for line in text.splitlines()
                if line.startswith("| ") and not line.startswith("| row ")}

    quality_md, speed_md = md.split("### Speed")
    quality, speed = cells(quality_md), cells(speed_md)
    # PPL: kvserve, llama.cpp, the difference to llama.cpp and to the model's float32 row.
    assert quality["q4_1"][:4] == ["20.000", "19.000", "+1.000 (+5.3%)", "+2.000 (+11.1%)"]
    assert quality["f32"][3] == "+0.000 (+0.0%)"
    assert quality["int4"][1:4] == ["n/a", "n/a", "+3.000 (+16.7%)"]  # no same-format peer
    assert quality["qwen"][3] == "n/a"  # no float32 row of its model
    assert quality["q05_gptq4"][3] == "+1.000 (+20.0%)"  # against q05_f32, not f32
    assert quality["q4_1"][4:] == ["200.0", "96.6", "23,040 (float16)", "23,040 (f16/f16)"]
    assert speed["q4_1"][:8] == ["avx512", "1,000.0", "500.0", "2.00x", "400.0", "200.0",
                                 "2.00x", "n/a"]
    assert speed["qwen"][6] == "0.80x"
    # decode's share of the bandwidth measured in its rounds (their median beside it)
    assert speed["qwen"][7] == "n/a" and speed["qwen_bw"][7] == "90% of 22.0 GB/s"
    assert ("Kept from earlier runs of this step (`--quant-rows` named the others): int4 "
            "(2026-12-01T15:09:29+00:00); qwen, qwen_bw (2026-12-02T09:00:00+00:00, on AMD "
            "EPYC (2 cores; avx2, fma)).") in md
    assert "w8a8" not in quality and "- w8a8: not available: no --method smoothquant" in md


def test_spec_section_dates_a_model_kept_from_an_earlier_run(tmp_path: Path,
                                                             report: Any) -> None:
    """compare's spec step narrowed by --spec-models keeps the other model's results with
    the date they were measured; the page says so for that model alone."""
    def model(key: str, date: str) -> dict[str, Any]:
        return {"key": key, "label": f"model {key}", "date": date, "configs": [],
                "cells": []}

    _write(tmp_path, "spec", {
        "date": "2026-12-02T03:00:00+00:00", "threads": 2, "tasks": {"grounded": "g"},
        "concurrency": [1, 8], "models": [model("default", "2026-12-01T17:37:42+00:00"),
                                          model("qwen1.5b", "2026-12-02T03:00:00+00:00")]})
    md = "\n".join(report.Report(tmp_path).spec_section())
    default, qwen = md.split("### model default")[1].split("### model qwen1.5b")
    assert "Measured 2026-12-01T17:37:42+00:00, in an earlier run" in default
    assert "Measured" not in qwen and "round(s), medians." not in default
    # A kept model measured over other rounds than this run's says so.
    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["rounds"], spec["models"][0]["rounds"] = 1, 3
    _write(tmp_path, "spec", spec)
    md = "\n".join(report.Report(tmp_path).spec_section())
    assert "named only the others). 3 round(s), medians." in md


def test_spec_quotes_a_learning_proposer_by_its_first_run_only(tmp_path: Path,
                                                               report: Any) -> None:
    """suffix drafts from the server's earlier answers, and the runs repeat prompts: only its
    first run of a task's first cell is quoted; the rest are replays, out of the targets."""
    def cell(config: str, method: str, conc: int, tok_s: list[float],
             speedups: list[float] | None) -> dict[str, Any]:
        c: dict[str, Any] = {
            "config": config, "task": "open", "concurrency": conc, "engine": "kvserve",
            "method": method, "kind": "none" if method == "none" else "lookup",
            "label": config, "output_tok_s": sorted(tok_s)[1], "errors": [],
            "runs": [{"output_throughput": x} for x in tok_s]}
        if speedups:
            c.update(speedup=sorted(speedups)[1], speedup_runs=speedups,
                     acceptance={"acceptance_rate": 0.85, "mean_acceptance_length": 5.2})
        return c

    cells = [cell("kvserve:none", "none", 1, [17.0, 17.0, 17.0], None),
             cell("kvserve:suffix", "suffix", 1, [18.7, 69.5, 74.3], [1.10, 3.99, 4.58]),
             cell("kvserve:ngram", "ngram", 1, [18.0, 19.0, 20.0], [1.06, 1.12, 1.18]),
             cell("kvserve:suffix", "suffix", 8, [60.0, 61.0, 62.0], [1.4, 1.45, 1.5])]
    _write(tmp_path, "spec", {
        "date": "d", "threads": 2, "tasks": {"open": "o"}, "concurrency": [1, 8],
        "models": [{"key": "qwen1.5b", "label": "qwen", "configs": [
            {"key": c, "label": c, "kind": "lookup" if c != "kvserve:none" else "none"}
            for c in ("kvserve:none", "kvserve:suffix", "kvserve:ngram")], "cells": cells}]})
    rep = report.Report(tmp_path)
    m = rep.spec["models"][0]
    first = rep.spec_cell(m, "kvserve:suffix", "open", 1)
    assert first["output_tok_s"] == 18.7 and first["speedup"] == 1.10
    assert rep.spec_cell(m, "kvserve:suffix", "open", 8)["replays"] is True
    assert rep.spec_cell(m, "kvserve:ngram", "open", 1)["speedup"] == 1.12  # as measured
    md = "\n".join(rep.spec_section())
    row = next(ln for ln in md.splitlines() if ln.startswith("| kvserve:suffix"))
    assert "| 18.7 | 1.10x | first run only |" in row and "replays (not quoted)" in row
    assert "3.99x" not in md
    # Measured with an API key (a tenant) per run, no run saw another's answers: every
    # cell as measured, the median of its rounds.
    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["models"][0]["tenant_per_run"] = True
    _write(tmp_path, "spec", spec)
    rep = report.Report(tmp_path)
    m = rep.spec["models"][0]
    assert rep.spec_cell(m, "kvserve:suffix", "open", 1)["speedup"] == 3.99
    assert rep.spec_cell(m, "kvserve:suffix", "open", 8)["speedup"] == 1.45
    md = "\n".join(rep.spec_section())
    row = next(ln for ln in md.splitlines() if ln.startswith("| kvserve:suffix"))
    assert "| 69.5 | 3.99x | 85% / 5.20 |" in row and "replays" not in md
    assert "its own API key" in md


def test_spec_runs_key_file_is_one_the_server_reads(tmp_path: Path, report: Any) -> None:
    """compare's spec step gives kvserve one API key per (task, streams, round) and one for
    the warm-up; kvserve serve's own --api-key-file reader takes the file as those keys."""
    import spec_rows  # benchmarks/, on the path once report.py is loaded

    from kvserve.server.cli import read_api_key_file

    path = tmp_path / "keys.txt"
    path.write_text(spec_rows.api_key_file(["grounded", "open"], [1, 8], 3))
    keys = read_api_key_file(str(path), {"default"})
    runs = {spec_rows.run_key(t, c, r) for t in ("grounded", "open") for c in (1, 8)
            for r in range(3)}
    assert len(runs) == 12 and spec_rows.WARM_UP_KEY not in runs
    assert keys == dict.fromkeys(runs | {spec_rows.WARM_UP_KEY}, "default")


def test_spec_one_stream_round_is_the_sum_of_its_prompts_runs(report: Any) -> None:
    """compare runs a one-stream cell's prompts one at a time on every server in turn; a
    round's run is theirs merged: tokens over seconds summed (not the mean of the parts'
    rates), the requests' median latency, the /metrics deltas added."""
    import spec_rows  # benchmarks/, on the path once report.py is loaded

    def part(seconds: float, tokens: int, ttft: float, drafts: float) -> dict[str, Any]:
        return {"round": 2, "duration_s": seconds, "completed": 1, "failed": 0,
                "total_input_tokens": 100, "total_output_tokens": tokens,
                "output_throughput": tokens / seconds, "median_ttft_ms": ttft,
                "median_tpot_ms": ttft / 10, "median_itl_ms": ttft / 10,
                "mean_e2el_ms": seconds * 1000, "output_lens": [tokens],
                "spec": {"drafts": drafts, "draft_tokens": 4 * drafts,
                         "accepted_tokens": drafts, "accepted_per_pos": [drafts]}}

    got = spec_rows.merge_runs([part(2.0, 100, 50.0, 3), part(6.0, 200, 90.0, 1),
                                part(4.0, 20, 70.0, 0)])
    assert got["round"] == 2 and got["completed"] == 3 and got["duration_s"] == 12.0
    assert got["total_output_tokens"] == 320 and got["output_throughput"] == 320 / 12.0
    assert got["median_ttft_ms"] == 70.0 and got["mean_e2el_ms"] == 4000.0
    assert got["output_lens"] == [100, 200, 20]
    assert got["spec"] == {"drafts": 4, "draft_tokens": 16, "accepted_tokens": 4,
                           "accepted_per_pos": [4]}
    assert "errors" not in got


def test_spec_best_proposer_counts_only_runs_that_drafted(tmp_path: Path,
                                                          report: Any) -> None:
    """The model-based target quotes the best proposer that made drafts: a configuration
    whose counters read no draft at all runs plain decoding, and its ratio is noise."""
    def cell(method: str, speedup: float | None, drafts: float) -> dict[str, Any]:
        c: dict[str, Any] = {
            "config": f"kvserve:{method}", "task": "open", "concurrency": 1,
            "engine": "kvserve", "method": method,
            "kind": "none" if method == "none" else "model", "label": method,
            "output_tok_s": 10.0, "errors": [], "runs": [{"output_throughput": 10.0}]}
        if speedup is not None:
            c.update(speedup=speedup, speedup_runs=[speedup], acceptance={
                "acceptance_rate": 0.7 if drafts else None,
                "mean_acceptance_length": 3.1 if drafts else None, "drafts": drafts})
        return c

    cells = [cell("none", None, 0), cell("draft_model", 1.05, 40.0),
             cell("self_draft", 1.14, 0.0)]
    _write(tmp_path, "spec", {
        "date": "d", "threads": 2, "tasks": {"open": "o"}, "concurrency": [1],
        "models": [{"key": "qwen1.5b", "label": "qwen", "draft": "d.gguf",
                    "tenant_per_run": True, "cells": cells, "configs": []}]})
    rows = {t: (k, ll, met) for t, k, ll, met in report.Report(tmp_path).spec_targets()}
    k, _, met = rows["qwen1.5b: best model-based proposer, open generation, 1 stream >= 1.3x"]
    assert k == "1.05x (draft_model)" and met is False
    floor = ("qwen1.5b: every proposer at 8 streams, on open generation and where under 50% "
             "of its drafts are accepted >= 0.95x (the lowest)")

    def floor_figure() -> str:
        _write(tmp_path, "spec", {**json.loads((tmp_path / "spec.json").read_text()),
                                  "models": [{"key": "qwen1.5b", "label": "qwen",
                                              "draft": "d.gguf", "tenant_per_run": True,
                                              "cells": cells, "configs": []}]})
        return {t: k for t, k, _, _ in report.Report(tmp_path).spec_targets()}[floor]

    # The floor (every proposer >= 0.95x) still counts it: enabling it cost what it cost.
    cells[2]["speedup"] = 0.80
    assert floor_figure() == "0.80x (self_draft open c=1)"
    # On the grounded task at one stream the floor holds only where the drafts mostly fail.
    for c in cells:
        c["task"] = "grounded"
    cells[1]["speedup"], cells[1]["acceptance"]["acceptance_rate"] = 0.85, 0.05
    assert floor_figure() == "0.85x (draft_model grounded c=1)"
    cells[1]["acceptance"]["acceptance_rate"] = 0.7  # predicted well: not on the floor
    assert floor_figure() == "n/a"
    # The A/A control (no speculation against none) is no proposer: never the floor's, but
    # its spread is printed beside the targets.
    control = {**cell("control", 0.88, 0), "kind": "control", "task": "open",
               "concurrency": 8, "speedup_runs": [0.88, 0.80, 1.07]}
    cells.append(control)
    assert floor_figure() == "n/a"
    md = "\n".join(report.Report(tmp_path).spec_section())
    assert ("qwen1.5b: the A/A control (a second kvserve server without speculation, ratioed "
            "like a proposer) read 0.88-0.88x over its 1 cell (medians; the lowest open c=8), "
            "0.80-1.07x in single rounds.") in md


def test_spec_configs_fill_in_each_models_draft_and_heads(report: Any) -> None:
    """spec_rows.spec_configs: a method needing a draft model or Medusa heads runs where the
    model has them, with their paths in its --speculative-config (which kvserve's own
    SpeculativeConfig accepts), and is no row where it has not."""
    import spec_rows  # benchmarks/, on the path once report.py is loaded

    from kvserve.config import SpeculativeConfig

    methods = ("ngram", "draft_model", "medusa")
    with_both = spec_rows.SpecModel("m", "M", "t.gguf", "d.gguf", methods, "heads/m")
    bare = spec_rows.SpecModel("m", "M", "t.gguf", None, methods)
    configs = spec_rows.KVSERVE_METHOD_CONFIGS
    got = {c.method: c for c in spec_rows.spec_configs(with_both, configs, True, True)
           if c.engine == "kvserve"}
    assert set(got) == {"none", "control", "ngram", "draft_model", "medusa"}
    assert got["control"].flags == () and got["control"].kind == "control"
    assert got["draft_model"].spec["model"] == "d.gguf"
    assert got["medusa"].spec["model"] == "heads/m"
    assert got["medusa"].flags == ("--speculative-config", json.dumps(got["medusa"].spec))
    for c in got.values():
        if c.spec:
            assert SpeculativeConfig(**c.spec).method == c.method
    got = {c.method for c in spec_rows.spec_configs(bare, configs, True, True)
           if c.engine == "kvserve"}
    assert got == {"none", "control", "ngram"}


def test_quantized_checkpoints_are_named_by_the_quantizers_code(tmp_path: Path,
                                                                  report: Any) -> None:
    """A quantized row's directory changes with `kvserve quantize`'s code, not only with its
    command: AWQ's default search changed once under the same command, and the step would
    have served the old checkpoint."""
    import quant_rows  # benchmarks/, on the path once report.py is loaded

    for rel in ("kvserve/quantize.py", "kvserve/quant/awq.py", "kvserve/quant/gptq.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    before = quant_rows.quantizer_digest(tmp_path)
    assert quant_rows.quantizer_digest(tmp_path) == before

    def dirs(code: str) -> dict[str, str]:
        rows = quant_rows.quant_rows("d.gguf", "f32.gguf", tmp_path, tmp_path / "q", "f32.gguf",
                                     "calib.txt", False, ["gptq", "awq"], code)
        return {r.key: r.model for r in rows if r.quantize}

    (tmp_path / "kvserve/quant/awq.py").write_text("# awq, another search\n")
    after = quant_rows.quantizer_digest(tmp_path)
    assert after != before
    old, new = dirs(before), dirs(after)
    assert {"gptq4", "awq4"} <= old.keys() and old.keys() == new.keys()
    assert all(old[k] != new[k] for k in old)
    assert dirs(before) == old  # the same code and command: the same checkpoint
