"""`kvserve bench latency`: batch-1 prefill and decode speed of the engine, in process.

    prefill: one prompt of --input-len tokens, max_tokens=1; prefill tok/s = input_len /
             (time from add_request to the first token). The step budget is raised to the
             prompt length so the prompt runs as one chunk.
    decode:  one short prompt, --output-len tokens with ignore_eos; decode tok/s =
             (output_len - 1) / (time from the first token to the last).

Every run uses a fresh random prompt, so a prefix-cache hit never shortens a later run.
Reported: the median (and all runs) after --num-iters-warmup unmeasured runs, plus start-up
time (engine construction: model load + KV allocation), the first request's time and the
engine's footprint (weight bytes as loaded, KV bytes per token, the kernels' ISA).
--paired instead times one run per command read from stdin (see serve_paired).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import IO, Any

from kvserve.bench.metrics import format_spec_summary, spec_summary
from kvserve.engine_args import EngineArgs


def _timed_request(engine: Any, rid: str, ids: list[int], max_tokens: int
                   ) -> tuple[float, float, float, int]:
    """(start, first token, last token, output tokens) of one request run alone."""
    from kvserve.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens,
                        ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, sp)
    first = last = t0
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = len(out.outputs[0].token_ids)
            if got > n:
                last = time.perf_counter()
                if n == 0:
                    first = last
                n = got
    return t0, first, last, n


def footprint(engine: Any) -> dict[str, Any]:
    """What the loaded engine holds: weight_bytes, every tensor of the model's parameters and
    of its linears' methods (a K-quant layer mixing two formats keeps its weights there), each
    tensor once (a tied embedding is the lm_head); kv_bytes_per_token over all layers, K and
    V, a quantized cache's scales included; kv_dtype; and the ops backend's ISA (cpu: the
    linear kernels', "amx", "avx512" or "avx2"; None elsewhere). An embedding kept as stored
    counts its blocks. decode_read_bytes: what one batch-1 decode step reads of them, every
    linear's tensors (the lm_head's too), not an untied embedding's table (it reads one row
    of it)."""
    import torch

    from kvserve.kv.layout import (
        QUANTIZED_KV_DTYPES,
        SCALE_BYTES,
        bytes_per_block,
        kv_elem_size,
        resolve_kv_dtype,
    )
    from kvserve.layers.linear import Linear

    seen: set[tuple[int, int]] = set()  # (address, bytes): a tensor's own bytes, not its
    # storage's (a weight kept as a view of the file's memmap would count the whole file)
    streamed: set[tuple[int, int]] = set()  # the linears' tensors (lm_head's included)

    def add(t: Any, into: set[tuple[int, int]]) -> None:
        if isinstance(t, torch.Tensor):
            into.add((t.data_ptr(), t.nbytes))
        elif isinstance(t, (list, tuple)):
            for x in t:
                add(x, into)

    model = engine.model
    for param in model.parameters():
        add(param, seen)
    add(getattr(model, "embed_stored", None), seen)  # an embedding kept as stored (its blocks)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        for value in vars(method).values() if method is not None else ():
            add(value, seen)
            if isinstance(module, Linear):
                add(value, streamed)
        if isinstance(module, Linear):
            for param in module.parameters():
                add(param, streamed)
    cfg, mc = engine.config, engine.config.model_config
    kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, cfg.dtype)
    kv_per_token = bytes_per_block(
        mc.num_hidden_layers, 1, mc.num_key_value_heads, mc.head_dim, kv_elem_size(kv_dtype),
        SCALE_BYTES if kv_dtype in QUANTIZED_KV_DTYPES else 0)
    return {"weight_bytes": sum(n for _, n in seen),
            "decode_read_bytes": sum(n for _, n in streamed), "kv_dtype": kv_dtype,
            "kv_bytes_per_token": kv_per_token, "quantization": cfg.quantization,
            "isa": getattr(getattr(model, "ops", None), "isa", None)}


class LatencyBench:
    """One engine and the two timed runs; each run uses a fresh random prompt."""

    def __init__(self, args: EngineArgs, input_len: int, output_len: int,
                 decode_prompt_len: int, seed: int = 0) -> None:
        from kvserve.llm_engine import LLMEngine
        from kvserve.platform import setup_process

        for name, v in (("input_len", input_len), ("output_len", output_len),
                        ("decode_prompt_len", decode_prompt_len)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if output_len < 2:
            raise ValueError(f"output_len must be >= 2 to time decode, got {output_len}")
        self.input_len, self.output_len = input_len, output_len
        self.decode_prompt_len = decode_prompt_len
        t0 = time.perf_counter()
        with setup_process(args.device):
            self.engine = LLMEngine.from_engine_args(args)
        self.startup_s = time.perf_counter() - t0
        self.first_request_s: float | None = None
        self._vocab = self.engine.config.model_config.vocab_size
        self._rng = random.Random(seed)
        self._runs = 0

    def _prompt(self, n: int) -> list[int]:
        # Ids from the middle of the vocabulary: ordinary tokens, no specials.
        return [self._rng.randrange(1000, self._vocab - 1000) for _ in range(n)]

    def prefill(self) -> float:
        """tok/s of one prompt of input_len tokens: input_len / time to the first token."""
        s, first, _, _ = _timed_request(self.engine, f"p{self._runs}",
                                        self._prompt(self.input_len), 1)
        self._runs += 1
        if self.first_request_s is None:
            self.first_request_s = first - s
        return self.input_len / (first - s)

    def decode(self) -> float:
        """tok/s of the output_len - 1 tokens after the first, after a short prompt."""
        _, first, last, n = _timed_request(self.engine, f"d{self._runs}",
                                           self._prompt(self.decode_prompt_len),
                                           self.output_len)
        self._runs += 1
        if n != self.output_len:
            raise RuntimeError(f"decode run generated {n} tokens, expected {self.output_len}")
        return (n - 1) / (last - first)


def run_latency(args: EngineArgs, input_len: int, output_len: int, decode_prompt_len: int,
                num_iters: int, num_iters_warmup: int, seed: int = 0) -> dict[str, Any]:
    if num_iters < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}")
    b = LatencyBench(args, input_len, output_len, decode_prompt_len, seed)
    prefill_tps = [b.prefill() for _ in range(num_iters_warmup + num_iters)][num_iters_warmup:]
    decode_tps = [b.decode() for _ in range(num_iters_warmup + num_iters)][num_iters_warmup:]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": b.engine.config.model, "dtype": b.engine.config.dtype,
        "ops_backend": b.engine.config.ops_backend,
        "input_len": input_len, "output_len": output_len,
        "decode_prompt_len": decode_prompt_len, "num_iters": num_iters,
        "startup_s": b.startup_s, "first_request_s": b.first_request_s,
        **footprint(b.engine),
        "prefill_tok_s": statistics.median(prefill_tps), "prefill_tok_s_runs": prefill_tps,
        "decode_tok_s": statistics.median(decode_tps), "decode_tok_s_runs": decode_tps,
        "spec": spec_summary(b.engine),
        "command": " ".join(sys.argv),
    }


def serve_paired(b: LatencyBench, num_iters_warmup: int, stdin: IO[str], stdout: IO[str]
                 ) -> int:
    """--paired: one timed run per command line, so that a driver can alternate this engine's
    runs with a peer's (benchmarks/compare). After the warm-up it prints one JSON line,
    {"ready": true, "startup_s", "first_request_s", ..., and footprint()'s fields}; then
    each line "prefill" or "decode" on stdin gets one JSON line back, {"prefill_tok_s": x}
    or {"decode_tok_s": x}.
    End of input ends it; anything else gets {"error": ...} and exit status 2."""
    def say(obj: dict[str, Any]) -> None:
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()

    for _ in range(max(1, num_iters_warmup)):
        b.prefill()
        b.decode()
    say({"ready": True, "startup_s": b.startup_s, "first_request_s": b.first_request_s,
         "model": b.engine.config.model, "dtype": b.engine.config.dtype,
         "ops_backend": b.engine.config.ops_backend, "input_len": b.input_len,
         "output_len": b.output_len, "decode_prompt_len": b.decode_prompt_len,
         **footprint(b.engine)})
    for line in stdin:
        cmd = line.strip()
        if cmd not in ("prefill", "decode"):
            say({"error": f"unknown command {cmd!r}: expected 'prefill' or 'decode'"})
            return 2
        say({f"{cmd}_tok_s": b.prefill() if cmd == "prefill" else b.decode()})
    return 0


def run(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli(ns)
    args.model = ns.model
    if args.max_num_batched_tokens is None or args.max_num_batched_tokens < ns.input_len:
        args.max_num_batched_tokens = ns.input_len
    if ns.paired:
        b = LatencyBench(args, ns.input_len, ns.output_len, ns.decode_prompt_len, ns.seed)
        return serve_paired(b, ns.num_iters_warmup, sys.stdin, sys.stdout)
    r = run_latency(args, ns.input_len, ns.output_len, ns.decode_prompt_len, ns.num_iters,
                    ns.num_iters_warmup, ns.seed)
    print(f"start-up (load + KV allocation): {r['startup_s']:.2f} s; first request "
          f"{r['first_request_s']:.2f} s")
    print(f"prefill {ns.input_len} tokens, batch 1: {r['prefill_tok_s']:.1f} tok/s (median of "
          f"{ns.num_iters}: {', '.join(f'{x:.1f}' for x in r['prefill_tok_s_runs'])})")
    print(f"decode {ns.output_len} tokens, batch 1: {r['decode_tok_s']:.1f} tok/s (median of "
          f"{ns.num_iters}: {', '.join(f'{x:.1f}' for x in r['decode_tok_s_runs'])})")
    if r["spec"] is not None:
        print(format_spec_summary(r["spec"]))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--input-len", type=int, default=512, help="prefill prompt length")
    p.add_argument("--output-len", type=int, default=128, help="decode length")
    p.add_argument("--decode-prompt-len", type=int, default=16)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--output-json", default=None)
    p.add_argument("--paired", action="store_true",
                   help="one timed run per stdin line ('prefill' or 'decode'), one JSON line "
                        "back each: lets benchmarks/compare alternate kvserve's runs with a "
                        "peer's, so the machine's drift hits both alike")
    EngineArgs.add_cli_args(p)
