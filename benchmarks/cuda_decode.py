"""Decode on CUDA with CUDA graphs (kvserve/graphs.py) against the same engine op by op
(`enforce_eager`), in one process, on:
- a random-weight Llama of TinyLlama-1.1B's shape (benchmarks/cuda_int4_linear.py's), in
  bfloat16 and with `--quantization int4` (tinygemm);
- the default model (SmolLM2-135M, its GGUF dequantized into bfloat16).
Greedy decode tok/s at 1 and 16 sequences (128 tokens each, medians of 3 after a warm-up),
and whether graphs and eager gave the same tokens. Then n-gram speculation (K = 4) on the
1.1B model, whose random weights fall into loops that n-gram lookup predicts: its verify
steps in graphs too, against eager and against plain decoding with graphs. Needs a CUDA GPU:

    PYTHONPATH=. python benchmarks/cuda_decode.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from cuda_int4_linear import _random_llama  # benchmarks/, beside this file

from kvserve import LLM, SamplingParams
from kvserve.loader import resolve_model

DEVICE, LAYERS = "cuda", 22


def _rates(llm: LLM, vocab: int) -> tuple[dict[int, float], list[list[int]]]:
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    rates, tokens = {}, []
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (32,), generator=gen)
                    .tolist()} for _ in range(batch)]
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up (and the graphs' captures)
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            runs.append(sum(len(o.outputs[0].token_ids) for o in outs)
                        / (time.perf_counter() - t0))
        rates[batch] = statistics.median(runs)
        tokens += [o.outputs[0].token_ids for o in outs]
    return rates, tokens


def compare(name: str, model: str, vocab: int, **kw: object) -> None:
    results = {}
    for eager in (True, False):
        results[eager] = _run(name, model, vocab, eager, **kw)
    (e, et), (g, gt) = results[True], results[False]
    same = sum(a == b for a, b in zip(et, gt, strict=True))
    print(f"{name}: graphs / eager " + ", ".join(f"batch {b}: {g[b] / e[b]:.2f}x" for b in e)
          + f"; same greedy tokens in {same} of {len(et)} sequences", flush=True)


def _run(name: str, model: str, vocab: int, eager: bool, **kw: object
         ) -> tuple[dict[int, float], list[list[int]]]:
    llm = LLM(model=model, device=DEVICE, dtype="bfloat16", kv_cache_memory="2GiB",
              enforce_eager=eager, **kw)
    result = _rates(llm, vocab)
    runner = llm.llm_engine.runner
    replays = {} if runner.graphs is None else dict(runner.graphs.replays)
    spec = runner.spec_stats
    accepted = (f", {spec.num_accepted_tokens} of {spec.num_draft_tokens} draft tokens "
                f"accepted" if spec.num_draft_tokens else "")
    del llm, runner
    torch.cuda.empty_cache()
    print(f"{name}, {'eager' if eager else 'graphs'}: "
          + ", ".join(f"batch {b}: {r:.0f} tok/s" for b, r in result[0].items())
          + f" (replays by queries: {replays}{accepted})", flush=True)
    return result


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        _random_llama(Path(d), DEVICE, LAYERS)
        compare("1.1B Llama bfloat16", d, 256, quantization="none")
        compare("1.1B Llama int4 (tinygemm)", d, 256, quantization="int4",
                quant_group_size=128)
        ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
        plain = _run("1.1B Llama bfloat16, no speculation", d, 256, False)[0]
        for eager in (True, False):
            rates = _run("1.1B Llama bfloat16, n-gram K=4", d, 256, eager,
                         speculative_config=ngram)[0]
            print("  over plain decoding with graphs: " + ", ".join(
                f"batch {b}: {rates[b] / plain[b]:.2f}x" for b in rates), flush=True)
    try:
        default = resolve_model(None)
    except ValueError as e:  # the GPU machine may not have it
        print(f"SmolLM2-135M: skipped ({e})")
        return
    compare("SmolLM2-135M bfloat16", default, 49152, quantization="none")


if __name__ == "__main__":
    main()
