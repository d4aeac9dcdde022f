"""`kvserve bench latency`: batch-1 prefill and decode speed of the engine, in process.

    prefill: one prompt of --input-len tokens, max_tokens=1; prefill tok/s = input_len /
             (time from add_request to the first token). The step budget is raised to the
             prompt length so the prompt runs as one chunk.
    decode:  one short prompt, --output-len tokens with ignore_eos; decode tok/s =
             (output_len - 1) / (time from the first token to the last).

Every run uses a fresh random prompt, so a prefix-cache hit never shortens a later run.
Reported: the median (and all runs) after --num-iters-warmup unmeasured runs, plus start-up
time (engine construction: model load + KV allocation) and the first request's time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

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


def run_latency(args: EngineArgs, input_len: int, output_len: int, decode_prompt_len: int,
                num_iters: int, num_iters_warmup: int, seed: int = 0) -> dict[str, Any]:
    from kvserve.llm_engine import LLMEngine

    for name, v in (("input_len", input_len), ("output_len", output_len),
                    ("decode_prompt_len", decode_prompt_len), ("num_iters", num_iters)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 to time decode, got {output_len}")
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    startup_s = time.perf_counter() - t0
    vocab = engine.config.model_config.vocab_size
    rng = random.Random(seed)
    # Ids from the middle of the vocabulary: ordinary tokens, no specials.
    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, vocab - 1000) for _ in range(n)]

    prefill_tps, decode_tps, first_request_s = [], [], None
    for i in range(num_iters_warmup + num_iters):
        s, first, _, _ = _timed_request(engine, f"p{i}", prompt(input_len), 1)
        if first_request_s is None:
            first_request_s = first - s
        if i >= num_iters_warmup:
            prefill_tps.append(input_len / (first - s))
    for i in range(num_iters_warmup + num_iters):
        _, first, last, n = _timed_request(engine, f"d{i}", prompt(decode_prompt_len),
                                           output_len)
        if n != output_len:
            raise RuntimeError(f"decode run generated {n} tokens, expected {output_len}")
        if i >= num_iters_warmup:
            decode_tps.append((n - 1) / (last - first))
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": engine.config.model, "dtype": engine.config.dtype,
        "ops_backend": engine.config.ops_backend,
        "input_len": input_len, "output_len": output_len,
        "decode_prompt_len": decode_prompt_len, "num_iters": num_iters,
        "startup_s": startup_s, "first_request_s": first_request_s,
        "prefill_tok_s": statistics.median(prefill_tps), "prefill_tok_s_runs": prefill_tps,
        "decode_tok_s": statistics.median(decode_tps), "decode_tok_s_runs": decode_tps,
        "command": " ".join(sys.argv),
    }


def run(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli(ns)
    args.model = ns.model
    if args.max_num_batched_tokens is None or args.max_num_batched_tokens < ns.input_len:
        args.max_num_batched_tokens = ns.input_len
    r = run_latency(args, ns.input_len, ns.output_len, ns.decode_prompt_len, ns.num_iters,
                    ns.num_iters_warmup, ns.seed)
    print(f"start-up (load + KV allocation): {r['startup_s']:.2f} s; first request "
          f"{r['first_request_s']:.2f} s")
    print(f"prefill {ns.input_len} tokens, batch 1: {r['prefill_tok_s']:.1f} tok/s (median of "
          f"{ns.num_iters}: {', '.join(f'{x:.1f}' for x in r['prefill_tok_s_runs'])})")
    print(f"decode {ns.output_len} tokens, batch 1: {r['decode_tok_s']:.1f} tok/s (median of "
          f"{ns.num_iters}: {', '.join(f'{x:.1f}' for x in r['decode_tok_s_runs'])})")
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
    EngineArgs.add_cli_args(p)
