"""HF transformers on the same weights (runs in the project venv): LlamaForCausalLM built
from kvserve's loader (the weights kvserve runs: the GGUF dequantized to float32), as
tests/model/test_parity_smollm2.py builds it.

    decode: batch 1, greedy generate of --decode-len tokens after a 16-token prompt;
            tok/s = (decode_len - 1) / (generate time - the time of a 1-token generate)
    batch:  --batch-size prompts of --input-len tokens, left padding, greedy generate of
            --output-len tokens each (EOS ignored); output tok/s = all generated tokens /
            generate time

Prompts are random ids from the middle of the vocabulary. The median of --num-iters runs
after one warm-up. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import torch


def build_model(path: str | None) -> Any:
    from kvserve.loader import load_checkpoint, resolve_model
    from kvserve.loader.hf_reference import hf_model_from_checkpoint

    return hf_model_from_checkpoint(load_checkpoint(resolve_model(path)))


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int) -> float:
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=2)
    dt = time.perf_counter() - t
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError(f"generated {out.shape[1] - ids.shape[1]} tokens, expected {n}")
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    import transformers

    torch.set_num_threads(ns.threads)
    model = build_model(ns.model)
    vocab = model.config.vocab_size
    rng = random.Random(ns.seed)

    def prompts(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Left padding: lengths n-8..n so the batch really is padded.
        lens = [n - rng.randrange(0, 9) if b > 1 else n for _ in range(b)]
        ids = torch.full((b, n), 2, dtype=torch.long)
        mask = torch.zeros((b, n), dtype=torch.long)
        for i, m in enumerate(lens):
            ids[i, n - m:] = torch.tensor([rng.randrange(1000, vocab - 1000) for _ in range(m)])
            mask[i, n - m:] = 1
        return ids, mask

    decode = []
    for it in range(ns.num_iters + 1):
        ids, mask = prompts(1, 16)
        t1 = _generate(model, ids, mask, 1)
        tn = _generate(model, ids, mask, ns.decode_len)
        if it:
            decode.append((ns.decode_len - 1) / (tn - t1))
    ids, mask = prompts(ns.batch_size, ns.input_len)
    _generate(model, ids, mask, 8)  # warm-up
    batch = []
    for _ in range(ns.num_iters):
        ids, mask = prompts(ns.batch_size, ns.input_len)
        dt = _generate(model, ids, mask, ns.output_len)
        batch.append(ns.batch_size * ns.output_len / dt)
    print(json.dumps({
        "transformers": transformers.__version__, "torch": torch.__version__,
        "threads": ns.threads, "dtype": "float32",
        "decode_len": ns.decode_len, "decode_tok_s": statistics.median(decode),
        "decode_tok_s_runs": decode,
        "batch_size": ns.batch_size, "input_len": ns.input_len, "output_len": ns.output_len,
        "batch_output_tok_s": statistics.median(batch), "batch_output_tok_s_runs": batch,
        "command": " ".join(sys.argv),
    }, indent=2))


if __name__ == "__main__":
    main()
