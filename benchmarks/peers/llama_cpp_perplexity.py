"""llama.cpp's perplexity of a GGUF over given token ids, scored as llama-perplexity does at
ctx 512: non-overlapping 512-token chunks, each scoring tokens 257..511 given their prefix.
Runs in the peers venv (llama-cpp-python); the ids come from kvserve's tokenizer, which
tests/model/test_tokenizer.py holds equal to llama.cpp's. This is where the reference numbers
of tests/model/test_perplexity.py come from:

    .venv/bin/python -c "import json; from kvserve.loader import load_checkpoint, resolve_model; \\
        print(json.dumps(load_checkpoint(resolve_model(None)).tokenizer.encode( \\
        open('../shared/reference/GPL-3.txt').read())))" > /tmp/gpl_ids.json
    benchmarks/.peers-venv/bin/python benchmarks/peers/llama_cpp_perplexity.py MODEL.gguf \\
        /tmp/gpl_ids.json
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from llama_cpp import Llama


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("ids", help="a JSON list of token ids")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    with open(a.ids) as f:
        ids = json.load(f)
    llm = Llama(model_path=a.model, n_ctx=a.ctx, n_batch=a.ctx, logits_all=True,
                n_threads=a.threads, verbose=False)
    nll, count = 0.0, 0
    for c in range(len(ids) // a.ctx):
        chunk = ids[c * a.ctx:(c + 1) * a.ctx]
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:a.ctx], dtype=np.float64)
        for i in range(a.ctx // 2 + 1, a.ctx):
            row = logits[i - 1]
            top = row.max()
            nll -= row[chunk[i]] - (top + math.log(np.exp(row - top).sum()))
            count += 1
    print(json.dumps({"model": a.model, "chunks": len(ids) // a.ctx, "scored": count,
                      "ppl": math.exp(nll / count)}))


if __name__ == "__main__":
    main()
