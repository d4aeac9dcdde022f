"""Where a server's decode time goes, against the same engine in-process: one stream, a few
chat prompts one after another, greedy, a fixed number of tokens each.

Each engine step is timed from inside (wall and the engine thread's CPU time), and so is
the engine thread's time between steps, split into the EngineThread calls that fill it
(_dispatch and its _post, the call_soon_threadsafe that hands a step's outputs to the event
loop; _drain_commands). In-process, LLMEngine.step is driven directly.

    python benchmarks/server_steps.py MODEL in [--engine-args '{"quantization": "gguf_exact"}']
    python benchmarks/server_steps.py MODEL serve [--uvicorn-loop uvloop --uvicorn-http httptools]

A diagnostic: it wraps kvserve's methods from outside (in the server's own process, through
--child), and alternating runs are what compare (the machine drifts between them).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = ["Write a Python function that parses a CSV file and returns a list of dicts.",
           "Explain how a hash map works, with an example in C.",
           "Write a bash script that backs up a directory to a tarball with a date stamp.",
           "Describe the difference between TCP and UDP."]
GAP_S = 0.05  # a pause between steps longer than this is waiting for a request, not overhead


def _chat(p: str) -> str:
    return f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"


def instrument(out: Path | None) -> dict[str, float]:
    """Wraps LLMEngine.step and EngineThread's per-step calls with timers; with out, dumps
    the totals there every 20 steps."""
    import kvserve.engine_thread as et
    import kvserve.llm_engine as le

    tot: dict[str, float] = {"steps": 0, "step_wall": 0.0, "step_cpu": 0.0, "between": 0.0}
    last: list[float] = []
    step = le.LLMEngine.step

    def timed_step(self: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        if last and t0 - last[0] < GAP_S:
            tot["between"] += t0 - last[0]
        result = step(self)
        t1 = time.perf_counter()
        tot["steps"] += 1
        tot["step_wall"] += t1 - t0
        tot["step_cpu"] += time.thread_time() - c0
        last[:] = [t1]
        if out is not None and tot["steps"] % 20 == 0:
            out.write_text(json.dumps(tot))
        return result

    le.LLMEngine.step = timed_step
    for name in ("_dispatch", "_post", "_drain_commands"):
        fn = getattr(et.EngineThread, name)

        def timed(self: Any, *a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(self, *a, **kw)
            finally:
                tot[_name] = tot.get(_name, 0.0) + time.perf_counter() - t0

        setattr(et.EngineThread, name, timed)
    return tot


def in_process(model: str, tokens: int, engine_args: dict[str, Any]
               ) -> tuple[float, dict[str, float]]:
    from kvserve.engine_args import EngineArgs
    from kvserve.llm_engine import LLMEngine
    from kvserve.sampling_params import SamplingParams

    tot = instrument(None)
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args))
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start, n = time.perf_counter(), 0
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), _chat(p), sp)
        while engine.has_unfinished_requests():
            n += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return n / (time.perf_counter() - start), tot


def served(model: str, tokens: int, loop: str, http: str) -> tuple[float, dict[str, float]]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    totals = Path(f"/tmp/server_steps_{port}.json")
    proc = subprocess.Popen([sys.executable, __file__, model, "serve", "--child", str(port),
                             "--totals", str(totals), "--uvicorn-loop", loop,
                             "--uvicorn-http", http], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = httpx.Client(timeout=600)
        client.post(url + "/v1/completions", json={"model": model, "prompt": "hi",
                                                   "max_tokens": 4}).raise_for_status()
        start, n = time.perf_counter(), 0
        for p in PROMPTS:
            body = {"model": model, "prompt": _chat(p), "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                n += sum(1 for line in r.iter_lines()
                         if line.startswith("data: ") and line != "data: [DONE]")
        rate = n / (time.perf_counter() - start)
        time.sleep(0.5)  # the last totals dump
        return rate, json.loads(totals.read_text())
    finally:
        proc.terminate()
        proc.wait()
        totals.unlink(missing_ok=True)


def child(model: str, port: int, totals: str, loop: str, http: str) -> None:
    """The server, instrumented, with uvicorn's event loop and HTTP parser as asked."""
    import uvicorn

    instrument(Path(totals))
    init = uvicorn.Config.__init__

    def config(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **dict(kw, loop=loop, http=http))

    uvicorn.Config.__init__ = config
    from kvserve.cli import main

    main(["serve", "--model", model, "--port", str(port)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("mode", choices=["in", "serve"])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--engine-args", type=json.loads, default={},
                   help='in-process only: EngineArgs as JSON')
    p.add_argument("--uvicorn-loop", default="asyncio")
    p.add_argument("--uvicorn-http", default="h11")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--totals", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        return child(ns.model, ns.child, ns.totals, ns.uvicorn_loop, ns.uvicorn_http)
    rate, t = (in_process(ns.model, ns.tokens, ns.engine_args) if ns.mode == "in"
               else served(ns.model, ns.tokens, ns.uvicorn_loop, ns.uvicorn_http))
    per = {k: round(1000 * v / t["steps"], 3) for k, v in t.items() if k != "steps"}
    print(f"{ns.mode}: {rate:.2f} tok/s, {int(t['steps'])} steps; ms per step: {per}")


if __name__ == "__main__":
    main()
