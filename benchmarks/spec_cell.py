"""One cell of the spec step (a model, task and concurrency), for kvserve configurations side
by side: minutes where `compare --steps spec` takes an hour, to check a change to the
speculation policy before a full run.

Every configuration's server is up at once (as in the spec step), and each round runs each
of them back to back with `kvserve bench serve`, the order rotated every round. Printed per
round: output tok/s, the spec counters' deltas, and each configuration's ratio over the
first one's in the same round (the machine drifts between rounds; a ratio within a round
holds still); then the median ratio. Same prompts, server flags and API keys per run as the
spec step (benchmarks/spec_rows.py). --per-prompt (one stream): each prompt on every server
in turn, a round's tok/s over them all, as the spec step runs its one-stream cells (there a
draft model drafted 42, 0 and 127 times a round where the four prompts back to back gave
130 each: a server's requests then come after idle pauses).

    python benchmarks/spec_cell.py grounded 8 --rounds 3 none= \\
        'dm={"method": "draft_model", "model": "$DRAFT", "num_speculative_tokens": 4}'

A configuration is NAME=JSON (the --speculative-config; empty: none), or NAME@TREE=JSON to
run kvserve from another checkout (TREE put first on PYTHONPATH: `git worktree add TREE
REV` gives the code before a change, beside it in the same rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import spec_rows as sr
from models import MODELS

ROOT = Path(__file__).resolve().parent.parent
KVSERVE = str(ROOT / ".venv" / "bin" / "kvserve")
WORK = ROOT / "benchmarks" / ".cache" / "spec_cell"
TEXT = ROOT.parent / "shared" / "reference" / "GPL-3.txt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json",
                                             "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read()


def _wait(port: int, proc: subprocess.Popen) -> None:
    for _ in range(900):
        if proc.poll() is not None:
            raise SystemExit(f"a server exited with {proc.returncode} (log in {WORK})")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise SystemExit("a server did not start in 15 minutes")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=list(sr.TASKS))
    p.add_argument("concurrency", type=int, choices=list(sr.PROMPTS))
    p.add_argument("configs", nargs="+", metavar="NAME[@TREE]=JSON")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=str(MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--draft", default=str(MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--per-prompt", action="store_true",
                   help="one stream: each prompt on every server in turn, a round's tok/s "
                        "over all of them, as the spec step's one-stream cells run")
    ns = p.parse_args()
    if ns.per_prompt and ns.concurrency != 1:
        p.error("--per-prompt is for one stream")
    from kvserve.loader import load_checkpoint

    WORK.mkdir(parents=True, exist_ok=True)
    n = sr.PROMPTS[ns.concurrency]
    tok = load_checkpoint(ns.model).tokenizer
    lines = sr.prompt_lines(tok, ns.task, n, sr.MAX_TOKENS, TEXT)
    prompts = sr.write_jsonl(WORK / f"{ns.task}_{n}x{sr.MAX_TOKENS}.jsonl", lines)
    parts = sr.split_jsonl(prompts) if ns.per_prompt else [prompts]
    keys = WORK / "api_keys.txt"
    keys.write_text(sr.api_key_file(list(sr.TASKS), list(sr.PROMPTS), ns.rounds))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for cfg in ns.configs:
            name, tree, spec = sr.side_by_side(cfg)
            port = _free_port()
            cmd = [KVSERVE, "serve", ns.model, "--host", "127.0.0.1", "--port", str(port),
                   *sr.kvserve_serve_flags(keys)]
            if spec:
                cmd += ["--speculative-config", spec.replace("$DRAFT", ns.draft)]
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
            log = (WORK / f"server_{name}.log").open("w")
            servers[name] = (subprocess.Popen(cmd, env=env, stdout=log,
                                              stderr=subprocess.STDOUT), port)
        for proc, port in servers.values():
            _wait(port, proc)
            url = f"http://127.0.0.1:{port}"
            model_id = json.loads(_get(url + "/v1/models", sr.WARM_UP_KEY))["data"][0]["id"]
            _get(url + "/v1/completions", sr.WARM_UP_KEY,
                 {"model": model_id, "prompt": lines[0]["prompt"], "max_tokens": 16})
        ratios: dict[str, list[float]] = {name: [] for name in servers}
        first = next(iter(servers))
        for r in range(ns.rounds):
            names = sr.rotated(list(servers), r)
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for part in parts:
                for name in names:
                    port = servers[name][1]
                    url, key = f"http://127.0.0.1:{port}", sr.run_key(ns.task, ns.concurrency, r)
                    time.sleep(1.0)  # the previous server's spinning threads go quiet
                    before = sr.parse_spec_metrics(_get(url + "/metrics", key).decode())
                    out = WORK / f"result_{name}.json"
                    subprocess.run([KVSERVE, "bench", "serve", "--base-url", url, "--tokenizer",
                                    ns.model, "--dataset-name", "file", "--dataset-path",
                                    str(part), "--num-prompts", str(n // len(parts)),
                                    "--max-concurrency", str(ns.concurrency), "--num-warmups",
                                    "0", "--temperature", "0", "--api-key", key,
                                    "--result-file", str(out)], check=True, capture_output=True)
                    delta = sr.metrics_delta(before, sr.parse_spec_metrics(
                        _get(url + "/metrics", key).decode()))
                    runs[name].append({**json.loads(out.read_text()), "round": r,
                                       "spec": delta})
            tps: dict[str, float] = {}
            for name in names:
                got = sr.merge_runs(runs[name])
                tps[name] = got["output_throughput"]
                counts = {k: int(v) for k, v in got["spec"].items() if not isinstance(v, list)}
                print(f"round {r} {name}: {tps[name]:.2f} tok/s, "
                      f"{got['total_output_tokens']} tokens, {counts}", flush=True)
            for name in servers:
                ratios[name].append(tps[name] / tps[first])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}x" for k, v in ratios.items()),
                  flush=True)
        for name, v in ratios.items():
            print(f"{name}: median {statistics.median(v):.3f}x of {first} "
                  f"(rounds {', '.join(f'{x:.3f}' for x in v)})")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
