"""llama.cpp in process, through llama-cpp-python's low-level API (runs in the peers venv).

    single: batch-1 prefill of --prefill-len tokens (one llama_decode call, logits of the last
            token only) and batch-1 greedy decode of --decode-len tokens after a short prompt;
            decode tok/s = decode steps / their time (the first token comes from the prefill).
    batch:  --batch-seqs sequences with --batch-prompt-len token prompts, then --decode-len
            decode steps of one llama_batch holding one token of every sequence; pure decode
            tok/s = batch_seqs * steps / their time.
    paired: (--paired) one single-stream run per command on stdin, for benchmarks/compare to
            alternate with kvserve's (`kvserve bench latency --paired` speaks the same lines).

Prompts are random ids from the middle of the vocabulary (the same rule as `kvserve bench
latency`). Each run starts from a cleared KV cache; the median of --num-iters runs after one
warm-up. Prints one JSON object.

    python benchmarks/peers/llama_cpp_bench.py MODEL.gguf [--threads 2] ...
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time

import llama_cpp as lc
import numpy as np


class Context:
    def __init__(self, path: str, n_ctx: int, n_batch: int, n_seq_max: int, threads: int
                 ) -> None:
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq_max
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(n_batch, n_seq_max), 0, 1)

    def clear(self) -> None:
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def decode(self, tokens: list[int], pos: list[int], seqs: list[int], logits: list[bool]
               ) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, p, s, lg) in enumerate(zip(tokens, pos, seqs, logits)):
            b.token[i] = t
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s
            b.logits[i] = lg
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, i: int) -> int:
        ptr = lc.llama_get_logits_ith(self.ctx, i)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                    shape=(self.n_vocab,))
        return int(row.argmax())


def _prompt(rng: random.Random, n: int, n_vocab: int) -> list[int]:
    return [rng.randrange(1000, n_vocab - 1000) for _ in range(n)]


def prefill_once(c: Context, rng: random.Random, n: int) -> float:
    """tok/s of one n-token prompt: one llama_decode call, logits of the last token only."""
    c.clear()
    ids = _prompt(rng, n, c.n_vocab)
    t = time.perf_counter()
    c.decode(ids, list(range(n)), [0] * n, [False] * (n - 1) + [True])
    c.argmax(n - 1)
    return n / (time.perf_counter() - t)


def decode_once(c: Context, rng: random.Random, n: int) -> float:
    """tok/s of n - 1 greedy decode steps after a 16-token prompt (whose logits give the
    first token)."""
    c.clear()
    ids = _prompt(rng, 16, c.n_vocab)
    c.decode(ids, list(range(16)), [0] * 16, [False] * 15 + [True])
    tok = c.argmax(15)
    t = time.perf_counter()
    for step in range(n - 1):
        c.decode([tok], [16 + step], [0], [True])
        tok = c.argmax(0)
    return (n - 1) / (time.perf_counter() - t)


def single_stream(c: Context, prefill_len: int, decode_len: int, iters: int, seed: int
                  ) -> dict[str, object]:
    rng = random.Random(seed)
    prefill = [prefill_once(c, rng, prefill_len) for _ in range(iters + 1)][1:]
    decode = [decode_once(c, rng, decode_len) for _ in range(iters + 1)][1:]
    return {"prefill_len": prefill_len, "decode_len": decode_len,
            "prefill_tok_s": statistics.median(prefill), "prefill_tok_s_runs": prefill,
            "decode_tok_s": statistics.median(decode), "decode_tok_s_runs": decode}


def serve_paired(c: Context, prefill_len: int, decode_len: int, seed: int) -> int:
    """--paired: the protocol of `kvserve bench latency --paired`. After a warm-up, one JSON
    line {"ready": true, ...}; then one timed run per stdin line ("prefill" or "decode"), one
    JSON line back each. End of input ends it."""
    def say(obj: dict[str, object]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    rng = random.Random(seed)
    prefill_once(c, rng, prefill_len)
    decode_once(c, rng, decode_len)
    say({"ready": True, "prefill_len": prefill_len, "decode_len": decode_len})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "prefill":
            say({"prefill_tok_s": prefill_once(c, rng, prefill_len)})
        elif cmd == "decode":
            say({"decode_tok_s": decode_once(c, rng, decode_len)})
        else:
            say({"error": f"unknown command {cmd!r}: expected 'prefill' or 'decode'"})
            return 2
    return 0


def batched_decode(c: Context, seqs: int, prompt_len: int, decode_len: int, iters: int,
                   seed: int) -> dict[str, object]:
    rng = random.Random(seed + 1)
    rates = []
    for it in range(iters + 1):
        c.clear()
        toks = []
        for s in range(seqs):
            ids = _prompt(rng, prompt_len, c.n_vocab)
            c.decode(ids, list(range(prompt_len)), [s] * prompt_len,
                     [False] * (prompt_len - 1) + [True])
            toks.append(c.argmax(prompt_len - 1))
        t = time.perf_counter()
        for step in range(decode_len - 1):
            c.decode(toks, [prompt_len + step] * seqs, list(range(seqs)), [True] * seqs)
            toks = [c.argmax(i) for i in range(seqs)]
        dt = time.perf_counter() - t
        if it:
            rates.append(seqs * (decode_len - 1) / dt)
    return {"seqs": seqs, "prompt_len": prompt_len, "decode_len": decode_len,
            "decode_tok_s": statistics.median(rates), "decode_tok_s_runs": rates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--batch-seqs", type=int, default=0, help="0: skip the batched run")
    p.add_argument("--batch-prompt-len", type=int, default=200)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--paired", action="store_true",
                   help="one timed single-stream run per stdin line ('prefill' or 'decode')")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    n_seq = max(1, ns.batch_seqs)
    per_seq = max(ns.prefill_len, ns.batch_prompt_len + ns.decode_len, 16 + ns.decode_len)
    c = Context(ns.model, n_ctx=n_seq * (per_seq + 16), n_batch=max(ns.prefill_len,
                ns.batch_prompt_len), n_seq_max=n_seq, threads=ns.threads)
    if ns.paired:
        sys.exit(serve_paired(c, ns.prefill_len, ns.decode_len, ns.seed))
    out: dict[str, object] = {
        "llama_cpp_python": lc.__version__,
        "system_info": lc.llama_print_system_info().decode(errors="replace").strip(),
        "model": ns.model, "threads": ns.threads,
        "model_size_bytes": int(lc.llama_model_size(c.model)),
        "model_n_params": int(lc.llama_model_n_params(c.model)),
        "command": " ".join(sys.argv),
    }
    if not ns.skip_single:
        out["single"] = single_stream(c, ns.prefill_len, ns.decode_len, ns.num_iters, ns.seed)
    if ns.batch_seqs:
        out["batch"] = batched_decode(c, ns.batch_seqs, ns.batch_prompt_len, ns.decode_len,
                                      ns.num_iters, ns.seed)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
