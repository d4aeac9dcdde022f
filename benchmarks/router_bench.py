"""Issue 15's routing numbers: `kvserve router` against nginx least_conn in front of the same
two `kvserve serve` replicas, on a shared-prefix workload. Writes benchmarks/results/router.json
and prints a markdown table.

    replicas   2 x `kvserve serve` (default model), pinned to disjoint cores, each with a KV
               cache of --num-blocks blocks: by default room for one more than half the system
               prompts plus its share of the running requests, so one replica cannot hold
               every prefix and where a prompt goes decides whether its prefix is cached
    workload   --num-prefixes system prompts of --prefix-len tokens, each request one of them
               plus a distinct question of --suffix-len tokens (kvserve.bench.datasets'
               shared-prefix set), --output-len tokens out (min_tokens), --concurrency
               clients, streamed /v1/completions (kvserve.bench.serve's client)
    proxies    `kvserve router --backend A --backend B`; nginx with `upstream { least_conn; }`
               (its own minimal conf in a temp prefix, run in the foreground)
    rounds     --rounds rounds, each measuring both proxies, the order alternating (router
               first in even rounds); every measurement draws new prompts (its own seed), so
               no measurement finds the previous one's prefixes cached
    measured   prefix-cache hit rate = the deltas of vllm:prefix_cache_hits over
               vllm:prefix_cache_queries summed over both replicas; median TTFT (client side);
               output throughput; the router's decisions (its /metrics deltas); the medians
               over rounds go in the table

    .venv/bin/python benchmarks/router_bench.py [--rounds 3] [--quick]

--quick is a smoke run (tiny prompts, one round) written to a temp file, not results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from machine import cpu_info, describe  # noqa: E402

from kvserve.bench.datasets import SampleRequest, shared_prefix_requests  # noqa: E402
from kvserve.bench.metrics import serving_metrics  # noqa: E402
from kvserve.bench.serve import ServeConfig, run_requests, send_request  # noqa: E402

BLOCK = 16
NGINX_CONF = """worker_processes 1;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_buffer_size 8m;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    upstream kvserve {{
        least_conn;
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://kvserve;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;  # the replicas answer loopback Host names only
            proxy_buffering off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its log in a temp file, waited on until GET url answers 200."""

    def __init__(self, name: str, cmd: list[str], health_url: str, cores: list[int] | None,
                 env: dict[str, str] | None = None, timeout: float = 300.0) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"router-bench-{name}-", suffix=".log")[1])
        log = self.log_path.open("w")
        preexec = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_path.read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"{name} not up after {timeout}s:\n{tail}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_path.unlink(missing_ok=True)  # a failure already quoted its tail


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as name{labels} -> value (the model_name label dropped)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
            out[name] = float(value)
    return out


def cache_counts(replicas: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in replicas:
        m = scrape(url)
        hits += m["vllm:prefix_cache_hits_total"]
        queries += m["vllm:prefix_cache_queries_total"]
    return hits, queries


def default_num_blocks(a: argparse.Namespace) -> int:
    """Room for one more than half the system prompts, plus each running request's own
    blocks at half the clients (block 0 is the null block)."""
    prefix_blocks = -(-a.prefix_len // BLOCK)
    per_request = -(-(a.suffix_len + a.output_len + 8) // BLOCK) + 1
    share = -(-a.concurrency // 2)
    return (a.num_prefixes // 2 + 1) * prefix_blocks + share * per_request + 1


def core_plan(replica_cores: int | None) -> tuple[list[list[int]], list[int] | None]:
    """Two disjoint core sets for the replicas; what is left (if any) for the proxies and
    the client, which otherwise run unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    k = replica_cores or max(1, (len(cores) - (1 if len(cores) >= 4 else 0)) // 2)
    if 2 * k > len(cores):
        raise ValueError(f"--replica-cores {k} x 2 replicas needs {2 * k} cores, this process "
                         f"may use {len(cores)}")
    rest = cores[2 * k:]
    return [cores[:k], cores[k:2 * k]], rest or None


def start_nginx(replicas: list[str], port: int, cores: list[int] | None
                ) -> tuple[subprocess.Popen, Path]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        raise RuntimeError("nginx is not installed: apt-get install -y nginx")
    d = Path(tempfile.mkdtemp(prefix="router-bench-nginx-"))
    os.chmod(d, 0o755)
    (d / "tmp").mkdir()
    os.chmod(d / "tmp", 0o777)  # workers run as nobody when started by root
    servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in replicas)
    (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, servers=servers, port=port))
    proc = subprocess.Popen([nginx, "-p", str(d), "-c", str(d / "nginx.conf"), "-g",
                             "daemon off;"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    return proc, d


def wait_up(url: str, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not up after {timeout}s")
        time.sleep(0.2)


def measure(name: str, base_url: str, replicas: list[str], requests: list[SampleRequest],
            a: argparse.Namespace, router_url: str) -> dict[str, Any]:
    cfg = ServeConfig(base_url=base_url, model=a.model or "smollm2-135m",
                      max_concurrency=a.concurrency, ignore_eos=True)

    async def warm() -> None:
        async with httpx.AsyncClient(timeout=600) as c:
            for _ in range(2):  # both replicas, whichever way the proxy sends them
                rec = await send_request(c, cfg, SampleRequest("Hello, my name is", 5, 2))
                if not rec.success:
                    raise RuntimeError(f"warm-up through {name} failed: {rec.error}")

    asyncio.run(warm())
    h0, q0 = cache_counts(replicas)
    r0 = scrape(router_url)
    records, duration = asyncio.run(run_requests(cfg, requests, warmups=0))
    h1, q1 = cache_counts(replicas)
    r1 = scrape(router_url)
    m = serving_metrics(records, duration, (90,))
    decisions = {k.split('"')[1]: r1[k] - r0.get(k, 0.0) for k in r1
                 if k.startswith("kvserve_router_routing_decisions_total")}
    errors = [r.error for r in records if not r.success]
    return {"proxy": name, "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
            "median_ttft_ms": m["median_ttft_ms"], "p90_ttft_ms": m["p90_ttft_ms"],
            "output_throughput": m["output_throughput"], "duration_s": duration,
            "completed": m["completed"], "failed": m["failed"], "errors": errors[:3],
            "router_decisions": decisions if name == "router" else None}


def table(summary: dict[str, dict[str, float]], rounds: int) -> str:
    lines = ["| proxy | prefix-cache hit rate | median TTFT (ms) | p90 TTFT (ms) | "
             "output tok/s |", "|---|---|---|---|---|"]
    for name, label in (("router", "kvserve router"), ("nginx", "nginx least_conn")):
        s = summary[name]
        lines.append(f"| {label} | {s['hit_rate']:.1%} | {s['median_ttft_ms']:.0f} | "
                     f"{s['p90_ttft_ms']:.0f} | {s['output_throughput']:.1f} |")
    lines.append(f"\nmedians of {rounds} rounds per proxy")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m")
    p.add_argument("--num-prefixes", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=600)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=96, help="requests per measurement")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default: one more than half the prefixes' "
                        "blocks plus the running requests' share)")
    p.add_argument("--replica-cores", type=int, default=None,
                   help="cores per replica (default: half the cores, one left for the "
                        "proxies and the client from 4 cores on)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny, one round")
    p.add_argument("--out", default=None, help="default: results/router.json "
                                               "(--quick: a temp file)")
    a = p.parse_args()
    if a.quick:
        a.num_prefixes, a.prefix_len, a.suffix_len, a.output_len = 3, 96, 8, 4
        a.num_prompts, a.concurrency, a.rounds = 12, 2, 1
    out = Path(a.out) if a.out else (Path(tempfile.gettempdir()) / "router_quick.json"
                                     if a.quick else BENCH / "results" / "router.json")
    num_blocks = a.num_blocks or default_num_blocks(a)
    max_len = -(-(a.prefix_len + a.suffix_len + a.output_len + 64) // BLOCK) * BLOCK
    replica_cores, proxy_cores = core_plan(a.replica_cores)
    model = a.model or "smollm2-135m"

    from kvserve.loader import load_checkpoint, resolve_model

    tokenizer = load_checkpoint(resolve_model(a.model)).tokenizer
    env = {"KVSERVE_API_KEY": "", "VLLM_API_KEY": ""}  # keyless replicas
    procs: list[Proc] = []
    nginx: subprocess.Popen | None = None
    nginx_dir: Path | None = None
    try:
        replicas = []
        for i, cores in enumerate(replica_cores):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs.append(Proc(f"replica{i}", [
                sys.executable, "-m", "kvserve.cli", "serve", model, "--port", str(port),
                "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_len),
                "--disable-web-ui", "--log-level", "warning"], f"{url}/health", cores,
                {**env, "KVSERVE_NUM_THREADS": str(len(cores))}))
            replicas.append(url)
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        backends = [x for u in replicas for x in ("--backend", u)]
        procs.append(Proc("router", [sys.executable, "-m", "kvserve.cli", "router", *backends,
                                     "--model", model, "--port", str(router_port),
                                     "--log-level", "warning"], f"{router_url}/health",
                          proxy_cores))
        nginx_port = free_port()
        nginx, nginx_dir = start_nginx(replicas, nginx_port, proxy_cores)
        nginx_url = f"http://127.0.0.1:{nginx_port}"
        wait_up(f"{nginx_url}/health", nginx, "nginx")
        if proxy_cores:
            os.sched_setaffinity(0, proxy_cores)  # the client, off the replicas' cores
        print(f"replicas {replicas} ({num_blocks} KV blocks each, cores {replica_cores}); "
              f"router {router_url}; nginx {nginx_url}", file=sys.stderr)

        runs: list[dict[str, Any]] = []
        seed = 0
        for rnd in range(a.rounds):
            order = [("router", router_url), ("nginx", nginx_url)]
            if rnd % 2:
                order.reverse()
            for name, url in order:
                seed += 1
                requests = shared_prefix_requests(tokenizer, a.num_prompts, a.prefix_len,
                                                  a.suffix_len, a.output_len,
                                                  num_prefixes=a.num_prefixes, seed=seed)
                r = measure(name, url, replicas, requests, a, router_url)
                r["round"] = rnd
                runs.append(r)
                print(f"round {rnd} {name}: hit rate {r['hit_rate']:.1%}, median TTFT "
                      f"{r['median_ttft_ms']:.0f} ms, {r['failed']} failed", file=sys.stderr)
    finally:
        if nginx is not None and nginx.poll() is None:
            nginx.send_signal(signal.SIGQUIT)
            nginx.wait(10)
        if nginx_dir is not None:
            shutil.rmtree(nginx_dir, ignore_errors=True)
        for proc in reversed(procs):
            proc.stop()

    summary = {name: {k: statistics.median(r[k] for r in runs if r["proxy"] == name)
                      for k in ("hit_rate", "median_ttft_ms", "p90_ttft_ms",
                                "output_throughput")}
               for name in ("router", "nginx")}
    machine = cpu_info()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": describe(machine), "cpu": machine,
        "config": {"model": model, "num_prefixes": a.num_prefixes, "prefix_len": a.prefix_len,
                   "suffix_len": a.suffix_len, "output_len": a.output_len,
                   "num_prompts": a.num_prompts, "concurrency": a.concurrency,
                   "rounds": a.rounds, "num_blocks": num_blocks, "max_model_len": max_len,
                   "replica_cores": replica_cores, "proxy_cores": proxy_cores,
                   "quick": a.quick},
        "summary": summary, "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{describe(machine)}; {a.num_prefixes} prefixes x {a.prefix_len} tokens, "
          f"{a.num_prompts} requests x {a.concurrency} clients, {num_blocks} KV blocks per "
          f"replica -> {out}\n")
    print(table(summary, a.rounds))
    failed = sum(r["failed"] for r in runs)
    if failed:
        print(f"{failed} requests failed; first errors: "
              f"{next(r['errors'] for r in runs if r['errors'])}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
