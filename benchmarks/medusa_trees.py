"""Medusa: linear verification against trees, as issue 12 asks ("tree or linear verification,
whichever measures better here"), measured rather than built.

    python benchmarks/medusa_trees.py HEADS_DIR [--model GGUF] [--prompts 8]

The target generates its greedy answers to the spec step's prompts (benchmarks/spec_rows.py,
both tasks); at every position of them the heads' top-4 tokens are compared with the target's
own next tokens. A candidate set (a tree of rank paths: a chain is (0,), (0, 0), ...; "top2@1"
is (0,), (1,), two rows at the first head) accepts the deepest path whose every node hit, so
its mean accepted length is exact for these positions. Its price is a forward of 1 + nodes
rows, timed here by rows (the same positions through the model, logits included), so
tokens a millisecond = (1 + accepted) / cost(1 + nodes). Prints both per task, best first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import spec_rows as sr
import torch

from kvserve import LLM, SamplingParams
from kvserve.loader import resolve_model
from kvserve.model_runner import ModelRunner
from kvserve.outputs import ScheduledRequest, SchedulerOutput
from kvserve.request import Request
from kvserve.spec.medusa import MedusaHeads, lm_head_weight
from kvserve.spec.medusa_train import final_hidden, head_logits

GPL = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "GPL-3.txt"
TOPK = 4


def forward_ms(model, config, rows: int, reps: int = 15) -> float:
    """Median ms of one forward (and its logits) of `rows` tokens after a 100-token context."""
    bs = config.cache.block_size
    runner = ModelRunner(config.replace(speculative=None), model, 2 + math.ceil(128 / bs))
    ctx = list(range(100, 200))
    seq = ctx + list(range(300, 300 + rows))
    req = Request("t", seq, SamplingParams(max_tokens=1), max_tokens=1)
    blocks = list(range(1, 1 + math.ceil(len(seq) / bs)))

    def step(start: int, toks: list[int]) -> float:
        inp, _, _ = runner.prepare_inputs(SchedulerOutput(
            [ScheduledRequest(req, toks, start, blocks, False)], len(toks)))
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.compute_logits(model(inp, runner.kv_cache))
        return time.perf_counter() - t0

    times = []
    for _ in range(reps):
        step(0, ctx)  # the context, untimed (rewritten in the same slots each time)
        times.append(step(len(ctx), seq[len(ctx):]))
    return statistics.median(times) * 1e3


def prefixes(paths: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    return {p[:d] for p in paths for d in range(1, len(p) + 1)}


def candidate_sets(num_heads: int) -> dict[str, set[tuple[int, ...]]]:
    sets: dict[str, set[tuple[int, ...]]] = {"none": set()}
    for depth in range(1, num_heads + 1):
        sets[f"chain{depth}"] = prefixes([(0,) * depth])
    for w in (2, 3, 4):
        sets[f"top{w}@1"] = prefixes([(r,) for r in range(w)])
        sets[f"top{w}@1+chain"] = prefixes([(r,) for r in range(w)] + [(0,) * num_heads])
    sets["2x2"] = prefixes([(a, b) for a in range(2) for b in range(2)])
    sets["3x2x1"] = prefixes([(a, b, 0) for a in range(3) for b in range(2)])
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("heads", help="a Medusa directory (kvserve train-medusa -o DIR)")
    ap.add_argument("--model", default=None, help="the target (default: the default model)")
    ap.add_argument("--prompts", type=int, default=8)
    a = ap.parse_args()
    llm = LLM(resolve_model(a.model), enable_prefix_caching=False)
    eng = llm.llm_engine
    model, config, tok = eng.runner.model, eng.config, eng.tokenizer
    lm = lm_head_weight(model)
    heads = MedusaHeads.load(a.heads, lm)
    k = heads.num_heads
    sets = candidate_sets(k)
    most = 1 + max(len(s) for s in sets.values())
    cost = {r: forward_ms(model, config, r) for r in range(1, most + 1)}
    print("forward + logits, ms by rows:", {r: round(c, 2) for r, c in cost.items()})
    params = SamplingParams(temperature=0, max_tokens=sr.MAX_TOKENS)
    for task in sr.TASKS:
        lines = sr.prompt_lines(tok, task, a.prompts, sr.MAX_TOKENS, GPL)
        outs = llm.generate([line["prompt"] for line in lines], params, use_tqdm=False)
        seqs, starts = [], []
        for line, out in zip(lines, outs, strict=True):
            prompt = tok.encode(line["prompt"], add_special_tokens=False)
            seqs.append(prompt + list(out.outputs[0].token_ids))
            starts.append(len(prompt) - 1)
        hits = []  # [positions, K, TOPK]: head k's rank-r token is the target's token k ahead
        for (hidden, greedy), start in zip(final_hidden(model, config, seqs), starts,
                                           strict=True):
            rows = torch.arange(start, greedy.shape[0] - 1 - k)
            with torch.no_grad():
                top = head_logits(heads, lm, hidden[rows]).topk(TOPK, -1).indices  # [K, N, R]
            want = torch.stack([greedy[rows + j] for j in range(1, k + 1)])  # [K, N]
            hits.append((top == want[..., None]).permute(1, 0, 2))
        hit = torch.cat(hits)
        cum = [[round(float(hit[:, j, :r + 1].any(-1).float().mean()), 3) for r in range(TOPK)]
               for j in range(k)]
        print(f"{task}: {hit.shape[0]} positions; head k's top-1..{TOPK} accuracy: {cum}")
        rows_out = []
        for name, tree in sets.items():
            best = torch.zeros(hit.shape[0])
            for path in tree:
                ok = torch.ones(hit.shape[0], dtype=torch.bool)
                for j, r in enumerate(path):
                    ok &= hit[:, j, r]
                best = torch.maximum(best, ok.float() * len(path))
            acc = float(best.mean())
            rows_out.append((name, len(tree), acc, (1 + acc) / cost[1 + len(tree)] * 1e3))
        base = rows_out[0][3]
        for name, nodes, acc, tps in sorted(rows_out, key=lambda x: -x[3]):
            print(f"  {name:14s} nodes {nodes:2d}  accepted {acc:.3f}  "
                  f"{tps:6.1f} tok/s  {tps / base:.3f}x")


if __name__ == "__main__":
    main()
