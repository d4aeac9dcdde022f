"""`kvserve bench throughput`: offline throughput through LLM.generate.

--num-prompts random prompts of --input-len tokens, each generating exactly --output-len
tokens (ignore_eos, greedy), all submitted at once; the engine batches them as it likes.
output tok/s = generated tokens / wall time; total tok/s counts prompt tokens too. The median
of --num-iters runs (fresh prompts each run, so prefix caching never helps) after one warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

from kvserve.bench.metrics import format_spec_summary, spec_summary
from kvserve.engine_args import EngineArgs


def run_throughput(args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                   num_iters: int, seed: int = 0) -> dict[str, Any]:
    from kvserve.bench.datasets import random_requests
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    if num_iters < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}")
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len,
                        ignore_eos=True)
    llm.generate(["warm-up"], SamplingParams(max_tokens=4), use_tqdm=False)
    out_tps, total_tps, elapsed = [], [], []
    for it in range(num_iters):
        reqs = random_requests(tok, num_prompts, input_len, output_len, seed=seed + it)
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        if n_out != num_prompts * output_len:
            raise RuntimeError(f"generated {n_out} tokens, expected {num_prompts * output_len}")
        out_tps.append(n_out / dt)
        total_tps.append((n_in + n_out) / dt)
        elapsed.append(dt)
    cfg = llm.llm_engine.config
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": cfg.model, "dtype": cfg.dtype, "ops_backend": cfg.ops_backend,
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "num_iters": num_iters, "startup_s": startup_s,
        "output_tok_s": statistics.median(out_tps), "output_tok_s_runs": out_tps,
        "total_tok_s": statistics.median(total_tps), "total_tok_s_runs": total_tps,
        "requests_per_s": num_prompts / statistics.median(elapsed),
        "spec": spec_summary(llm.llm_engine),
        "command": " ".join(sys.argv),
    }


def run(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli(ns)
    args.model = ns.model
    r = run_throughput(args, ns.num_prompts, ns.input_len, ns.output_len, ns.num_iters,
                       ns.seed)
    print(f"{ns.num_prompts} prompts x ({ns.input_len} in, {ns.output_len} out): "
          f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, "
          f"{r['requests_per_s']:.2f} req/s (median of {ns.num_iters}; start-up "
          f"{r['startup_s']:.1f} s)")
    if r["spec"] is not None:
        print(format_spec_summary(r["spec"]))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)
