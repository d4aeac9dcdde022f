"""Speculation configurations side by side in one process: paired rounds where a 3% change
must show. A default-model run of the spec step is ~4 seconds, and servers a few seconds
apart on this shared machine spread 0.8-1.15x of each other (benchmarks/spec_cell.py's
rounds); engines in one process, run back to back, share the machine's state at the time.

Each configuration is one LLM engine (kvserve's own code), all loaded at once; each round
runs every engine over the same prompts of a task (spec_rows.py's, through the chat
template), greedy, one request at a time (--streams 1) or all of them at once (--streams 8:
8 prompts in one batch; with --arrive-per-step one joins per engine step, as a server takes
a burst), the order rotated every round. The suffix proposer's cache of past
answers starts empty every round, as a server's does for the spec step's fresh API key per
round (offline, every request is one tenant: round 2 would draft round 1's answers to the
very same prompts). Printed per round:
each engine's ratio of the first one's wall time over its own (> 1: faster), and its drafts
and accepted draft tokens; then the median and mean ratio over rounds. With --interleave the
engines run at once, one step of each in turn, each step timed alone: an A/A pair then
reads 1.003-1.011x where back-to-back runs read 0.87-1.16x (Qwen2.5-Coder 1.5B, open,
1 stream).

    python benchmarks/spec_pair.py grounded --rounds 12 none= \\
        'sd={"method": "self_draft", "num_speculative_tokens": 4}' \\
        'sd_old@/tmp/wt_old={"method": "self_draft", "num_speculative_tokens": 4}'

NAME@TREE=JSON swaps in the speculation policy (kvserve/spec/policy.py's SpecPolicy) of
another checkout, loaded from its file; the rest of the engine is this tree's. "$DRAFT" in a
JSON is --draft, "$MEDUSA" --medusa.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import spec_rows as sr
from models import MODELS, QWEN_0_5B

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT.parent / "shared" / "reference" / "GPL-3.txt"
MEDUSA = ROOT / "benchmarks" / ".cache" / "spec" / "medusa" / "default"


def _policy_class(tree: str) -> type:
    path = Path(tree) / "kvserve" / "spec" / "policy.py"
    spec = importlib.util.spec_from_file_location(f"policy_{abs(hash(tree))}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SpecPolicy


def _interleaved(engines: dict[str, Any], order: list[str], prompts: list[str], sp: Any,
                 streams: int, per_step: bool, tag: str) -> dict[str, float]:
    """Every engine's run at once, one step of each in turn (in `order`), each step timed
    alone; an engine's seconds are its own steps' sum. The machine's drift over a run's
    seconds then hits every engine alike, where back-to-back runs of ~35 s each read an A/A
    pair at 0.87-1.16x (Qwen2.5-Coder 1.5B, open, 1 stream, 5 rounds). One stream: an
    engine's next prompt is added when its last one finishes; more: all at once, or one
    per step with per_step."""
    added = dict.fromkeys(order, 0)
    done = dict.fromkeys(order, 0)
    seconds = dict.fromkeys(order, 0.0)
    live = list(order)
    while live:
        for n in list(live):
            engine = engines[n].llm_engine
            t0 = time.perf_counter()
            if streams == 1:
                todo = 1 if added[n] == done[n] else 0
            else:
                todo = 1 if per_step else len(prompts)
            for i in range(added[n], min(len(prompts), added[n] + todo)):
                engine.add_request(f"{tag}{i}", prompts[i], sp)
                added[n] += 1
            done[n] += sum(o.finished for o in engine.step())
            seconds[n] += time.perf_counter() - t0
            if done[n] == len(prompts):
                live.remove(n)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=list(sr.TASKS))
    p.add_argument("configs", nargs="+", metavar="NAME[@TREE]=JSON")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--streams", type=int, default=1, choices=list(sr.PROMPTS))
    p.add_argument("--model", default="smollm2-135m", help="the target (the default model)")
    p.add_argument("--arrive-per-step", action="store_true",
                   help="--streams 8: one request joins per engine step, as a server takes a "
                        "burst, instead of all at once")
    p.add_argument("--interleave", action="store_true",
                   help="run the engines at once, one step of each in turn, each timed "
                        "alone (_interleaved), instead of one engine's run after another's")
    p.add_argument("--draft", default=str(MODELS / QWEN_0_5B))
    p.add_argument("--medusa", default=str(MEDUSA))
    ns = p.parse_args()
    from kvserve import LLM, SamplingParams
    from kvserve.spec.base import SpecStats

    engines = {}
    for cfg in ns.configs:
        name, tree, spec = sr.side_by_side(cfg)
        kw = {}
        if spec:
            kw["speculative_config"] = json.loads(
                spec.replace("$DRAFT", ns.draft).replace("$MEDUSA", ns.medusa))
        # As the spec step's servers run (spec_rows.kvserve_serve_flags): no prefix caching,
        # so every round prefills its prompts again, as a user's first request does.
        llm = LLM(ns.model, enable_prefix_caching=False, kv_cache_memory=sr.KV_MEMORY, **kw)
        runner = llm.llm_engine.runner
        if tree:
            if runner.spec_policy is None:
                raise SystemExit(f"{name}: a policy from {tree} needs a speculative config")
            old = runner.spec_policy
            runner.spec_policy = _policy_class(tree)(old.k_max, old.adaptive,
                                                     old.draft_forwards)
        engines[name] = llm
    first = next(iter(engines))
    tok = engines[first].get_tokenizer()
    prompts = [line["prompt"] for line in
               sr.prompt_lines(tok, ns.task, sr.PROMPTS[ns.streams], sr.MAX_TOKENS, TEXT)]
    sp = SamplingParams(temperature=0, max_tokens=sr.MAX_TOKENS)
    for llm in engines.values():
        # As a server starts (LLMEngine.warm_up), then one generation: the first of each
        # engine is cold, and one stream before a burst is the policy's hardest start.
        llm.llm_engine.warm_up()
        llm.generate(prompts[:1], sp, use_tqdm=False)
    names = list(engines)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ns.rounds):
        seconds, counts = {}, {}
        for n in names:
            runner = engines[n].llm_engine.runner
            runner.spec_stats = SpecStats()
            cache = getattr(runner.proposer, "cache", None)
            if cache is not None:  # suffix: no answers of an earlier round (see above)
                runner.proposer.cache = type(cache)(cache.max_tokens)
        if ns.interleave:
            seconds = _interleaved(engines, sr.rotated(names, r), prompts, sp, ns.streams,
                                   ns.arrive_per_step, f"{r}-")
        else:
            for n in sr.rotated(names, r):
                t0 = time.perf_counter()
                if ns.arrive_per_step and ns.streams > 1:  # one joins per step, alone
                    _interleaved({n: engines[n]}, [n], prompts, sp, ns.streams, True, f"{r}-")
                else:
                    for batch in ([[p] for p in prompts] if ns.streams == 1 else [prompts]):
                        engines[n].generate(batch, sp, use_tqdm=False)
                seconds[n] = time.perf_counter() - t0
        for n in names:
            s = engines[n].llm_engine.runner.spec_stats
            counts[n] = f"{s.num_drafts} drafts, {s.num_accepted_tokens}/{s.num_draft_tokens}"
        for n in names:
            ratios[n].append(seconds[first] / seconds[n])
        print(f"round {r}: " + ", ".join(f"{n} {ratios[n][-1]:.3f}x ({counts[n]})"
                                         for n in names), flush=True)
    for n, v in ratios.items():
        print(f"{n}: median {statistics.median(v):.3f}x, mean {statistics.mean(v):.3f}x of "
              f"{first} over {len(v)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
