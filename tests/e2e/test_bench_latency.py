"""`kvserve bench latency --paired`: the line protocol benchmarks/compare uses to alternate
kvserve's timed runs with llama.cpp's (one run per command, one JSON line back), and the
engine footprint its ready line reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf

from kvserve.loader import resolve_model
from kvserve.ops.cpu import ISAS

ROOT = Path(__file__).resolve().parents[2]


def test_paired_protocol_times_one_run_per_command() -> None:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "latency", "--paired",
           "--input-len", "24", "--output-len", "5", "--decode-prompt-len", "8"]
    p = subprocess.run(cmd, input="decode\nprefill\ndecode\nwarp\nprefill\n", text=True,
                       capture_output=True, cwd=ROOT, timeout=600, check=False)
    lines = [json.loads(line) for line in p.stdout.splitlines()]  # stdout: JSON lines only
    ready, *answers = lines
    assert ready["ready"] is True and ready["startup_s"] > 0 and ready["input_len"] == 24
    assert ready["output_len"] == 5 and ready["first_request_s"] > 0
    # The footprint, from gguf-py's reading of the file: the GGUF's blocks are kept as they are
    # stored (repacked, same bytes); the float16 KV cache holds layers x (K, V) x kv heads x
    # head_dim x 2 bytes per token.
    r = gguf.GGUFReader(resolve_model(None))
    meta = {f.name: f.contents() for f in r.fields.values() if f.name.startswith("llama.")}
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    # The file's tensors, each once: the tied embedding is repacked into 16-row groups for
    # the lm_head's kernels, and the lookup reads those (no float table, no second copy).
    embd = next(int(t.n_bytes) for t in r.tensors if t.name == "token_embd.weight")
    assert ready["weight_bytes"] == sum(int(t.n_bytes) for t in r.tensors)
    assert ready["kv_dtype"] == "float16" and ready["kv_bytes_per_token"] == (
        meta["llama.block_count"] * 2 * meta["llama.attention.head_count_kv"]
        * (hidden // heads) * 2)
    # What a decode step reads: every linear's weights (the layers' and the lm_head's
    # repacked copy of the embedding), not the norms nor the stored table looked up by row.
    linears = sum(int(t.n_bytes) for t in r.tensors
                  if t.name.startswith("blk.") and len(t.shape) == 2)
    assert ready["decode_read_bytes"] == linears + embd
    assert ready["quantization"] == "gguf" and ready["isa"] in ISAS
    # One answer per command, in order, until the unknown one; nothing after it runs.
    assert [next(iter(a)) for a in answers] == ["decode_tok_s", "prefill_tok_s",
                                                "decode_tok_s", "error"]
    assert all(a[k] > 0 for a in answers[:3] for k in a)
    assert "'warp'" in answers[3]["error"] and "'prefill' or 'decode'" in answers[3]["error"]
    assert p.returncode == 2


def test_paired_protocol_ends_cleanly_at_end_of_input() -> None:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "latency", "--paired",
           "--input-len", "8", "--output-len", "2", "--decode-prompt-len", "4"]
    p = subprocess.run(cmd, input="", text=True, capture_output=True, cwd=ROOT, timeout=600,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert [json.loads(line)["ready"] for line in p.stdout.splitlines()] == [True]
