"""`kvserve bench serve`: load-test any OpenAI-compatible server through /v1/completions.

Each request streams (SSE) and asks for usage in the last chunk (stream_options.include_usage);
where a server sends no usage, output tokens are counted as chunks with text. With
--ignore-eos every request asks for exactly output_len tokens: ignore_eos (vLLM, llama.cpp's
server), min_tokens = max_tokens (vLLM, kvserve, llama-cpp-python's server) and n_predict
(llama.cpp's server); a server ignores the fields it does not know.

Load: requests start as a Poisson process of --request-rate (inf: all at once) and at most
--max-concurrency run at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import RequestRecord, format_table, serving_metrics


@dataclass(frozen=True)
class ServeConfig:
    base_url: str
    model: str
    max_concurrency: int | None = None
    request_rate: float = math.inf
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 3600.0
    percentiles: tuple[float, ...] = (99,)
    extra_body: tuple[tuple[str, Any], ...] = ()
    # Sent as 'Authorization: Bearer <key>' (a server with --api-key); on kvserve each key is
    # a tenant, so a run with its own key shares nothing per tenant with other runs.
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got "
                             f"{self.request_rate}")


def completion_body(cfg: ServeConfig, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.output_len, n_predict=req.output_len)
    body.update(dict(cfg.extra_body))
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact_key(argv: Sequence[str]) -> list[str]:
    """argv with an --api-key value hidden, for the result file."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out


def request_intervals(n: int, rate: float, seed: int) -> list[float]:
    """Gaps before each of n request starts: 0 for the first, then exponential with mean
    1/rate (a Poisson process); all 0 for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


async def send_request(client: Any, cfg: ServeConfig, req: SampleRequest) -> RequestRecord:
    rec = RequestRecord(prompt_len=req.prompt_len)
    url = cfg.base_url.rstrip("/") + "/v1/completions"
    body = completion_body(cfg, req)
    rec.start = time.perf_counter()
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body, timeout=cfg.timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for ev in _sse_events(resp.aiter_lines()):
                now = time.perf_counter()
                if "error" in ev:
                    rec.error = json.dumps(ev["error"])[:300]
                    return rec
                if ev.get("usage"):
                    usage = ev["usage"]
                for choice in ev.get("choices") or []:
                    if choice.get("text"):
                        rec.chunk_times.append(now)
                        chunks += 1
        rec.end = time.perf_counter()
    except Exception as e:  # noqa: BLE001  (a failed request is a result, not a crash)
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if usage and usage.get("completion_tokens"):
        rec.output_len = int(usage["completion_tokens"])
        rec.prompt_len = int(usage.get("prompt_tokens") or rec.prompt_len)
    else:
        rec.output_len = chunks
    rec.success = bool(rec.chunk_times)
    if not rec.success:
        rec.error = "the stream carried no text"
    return rec


async def run_requests(cfg: ServeConfig, requests: Sequence[SampleRequest],
                       warmups: int = 1) -> tuple[list[RequestRecord], float]:
    import httpx

    limits = httpx.Limits(max_connections=max(len(requests), 1) + 4,
                          max_keepalive_connections=max(len(requests), 1) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s,
                                 headers=auth_headers(cfg.api_key)) as client:
        for _ in range(warmups):
            # A short prompt unrelated to the dataset: it must not warm a shared prefix.
            warm = SampleRequest("Hello, my name is", 5, 4)
            rec = await send_request(client, cfg, warm)
            if not rec.success:
                raise RuntimeError(f"warm-up request to {cfg.base_url} failed: {rec.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)

        async def limited(req: SampleRequest) -> RequestRecord:
            async with sem:
                return await send_request(client, cfg, req)

        tasks = []
        t0 = time.perf_counter()
        for gap, req in zip(request_intervals(len(requests), cfg.request_rate, cfg.seed),
                            requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return records, duration


async def first_model_id(base_url: str, api_key: str | None = None) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30, headers=auth_headers(api_key)) as client:
        r = await client.get(base_url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
        return str(data[0]["id"])


def load_dataset(ns: argparse.Namespace) -> list[SampleRequest]:
    from kvserve.bench import datasets
    from kvserve.loader import load_checkpoint, resolve_model

    tokenizer = load_checkpoint(resolve_model(ns.tokenizer)).tokenizer
    if ns.dataset_name == "random":
        return datasets.random_requests(tokenizer, ns.num_prompts, ns.input_len, ns.output_len,
                                        seed=ns.seed, range_ratio=ns.random_range_ratio)
    if ns.dataset_name == "shared-prefix":
        return datasets.shared_prefix_requests(tokenizer, ns.num_prompts, ns.prefix_len,
                                               ns.suffix_len, ns.output_len,
                                               num_prefixes=ns.num_prefixes, seed=ns.seed)
    if ns.dataset_path is None:
        raise ValueError("--dataset-name file needs --dataset-path")
    return datasets.file_requests(tokenizer, ns.dataset_path, ns.output_len, ns.num_prompts)


def run(ns: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    requests = load_dataset(ns)
    api_key = ns.api_key or os.environ.get("OPENAI_API_KEY") or None
    model = ns.served_model_name or asyncio.run(first_model_id(ns.base_url, api_key))
    extra = tuple(json.loads(ns.extra_body).items()) if ns.extra_body else ()
    cfg = ServeConfig(base_url=ns.base_url, model=model, max_concurrency=ns.max_concurrency,
                      request_rate=ns.request_rate, ignore_eos=ns.ignore_eos,
                      temperature=ns.temperature, seed=ns.seed,
                      percentiles=tuple(float(p) for p in ns.metric_percentiles.split(",")),
                      extra_body=extra, api_key=api_key)
    print(f"{len(requests)} requests ({ns.dataset_name}), concurrency "
          f"{cfg.max_concurrency or 'unlimited'}, rate {cfg.request_rate} req/s -> "
          f"{cfg.base_url} ({model})", file=sys.stderr)
    records, duration = asyncio.run(run_requests(cfg, requests, warmups=ns.num_warmups))
    m = serving_metrics(records, duration, cfg.percentiles)
    print(format_table(ns.label or "Serving Benchmark Result", m, cfg.percentiles))
    errors = [r.error for r in records if not r.success]
    if errors:
        print(f"{len(errors)} failed; first error: {errors[0]}", file=sys.stderr)
    expected = [r.output_len for r in requests]
    got = [r.output_len for r in records if r.success]
    if ns.ignore_eos and got and (min(got) != min(expected) or max(got) != max(expected)):
        print(f"warning: asked for {min(expected)}..{max(expected)} output tokens per request, "
              f"got {min(got)}..{max(got)}: the server may not honour ignore_eos/min_tokens",
              file=sys.stderr)
    if ns.result_file:
        result = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "label": ns.label, "base_url": cfg.base_url, "model": model,
            "dataset_name": ns.dataset_name, "num_prompts": len(requests),
            "input_len": ns.input_len, "output_len": ns.output_len,
            "prefix_len": ns.prefix_len if ns.dataset_name == "shared-prefix" else None,
            "max_concurrency": cfg.max_concurrency,
            "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
            "ignore_eos": cfg.ignore_eos, "seed": cfg.seed,
            "command": " ".join(redact_key(sys.argv)),
            **m,
            "output_lens": [r.output_len for r in records],
            "ttfts_ms": [r.ttft * 1000 if r.success else None for r in records],
            "errors": errors[:10],
        }
        with open(ns.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if not errors else 1


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--model", dest="served_model_name", default=None,
                   help="the model name sent in requests; default: the first of /v1/models")
    p.add_argument("--tokenizer", default=None,
                   help="a .gguf file or HF directory whose tokenizer builds and counts the "
                        "prompts; default: kvserve's default model")
    p.add_argument("--dataset-name", default="random",
                   choices=["random", "shared-prefix", "file"])
    p.add_argument("--dataset-path", default=None,
                   help="for --dataset-name file: JSON lines with 'prompt' or plain lines")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int,
                   default=200)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int,
                   default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=1024,
                   help="shared-prefix: tokens of the common system prompt")
    p.add_argument("--suffix-len", type=int, default=32,
                   help="shared-prefix: tokens of each request's own question")
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates exactly its output length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--extra-body", default=None, help="JSON merged into each request body")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--label", default=None, help="a name for this run in the table and JSON")
    p.add_argument("--result-file", default=None, help="write the metrics as JSON here")
