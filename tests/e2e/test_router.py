"""`kvserve router` in front of two real `kvserve serve` replicas, all three real processes.

Which replica served a request is read from the router's own counter
kvserve_router_requests_total{backend} (requests here are sequential, so each one moves
exactly one backend's count), and what the replicas' prefix caches did from their
vllm:prefix_cache_hits. The last test kills a replica, so it runs last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server_process import ROOT, ServerProcess, free_port

# Two long system prompts (~150 tokens each: 9 full blocks), questions a few tokens each.
SYSTEM = {
    "astro": "You are an astronomy tutor. " + " ".join(
        f"Fact {i}: the star catalogue entry {i} lists a magnitude and a distance." for i in
        range(12)),
    "cook": "You are a cooking assistant. " + " ".join(
        f"Rule {i}: recipe card {i} gives the oven temperature and the baking time." for i in
        range(12)),
}
QUESTIONS = ["What is rule two?", "Say hello.", "Name a colour.", "Count to three."]


class RouterProcess:
    def __init__(self, backends: list[str], *args: str, timeout: float = 60.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-router-", suffix=".log",
                                                delete=False)
        cmd = [sys.executable, "-m", "kvserve.cli", "router", "--port", str(self.port),
               "--log-level", "warning", *args]
        for b in backends:
            cmd += ["--backend", b]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router not healthy after {timeout}s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {name: float(value) for name, value in
                (line.rsplit(" ", 1) for line in text.splitlines()
                 if line and not line.startswith("#"))}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    # One thread each: two replicas on a small machine would otherwise each spin a thread per
    # core, and a step then waits on threads the other replica has descheduled (~50x here).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_NUM_THREADS", "1")
        a = ServerProcess("--disable-web-ui", "--max-num-seqs", "4")
        try:
            b = ServerProcess("--disable-web-ui", "--max-num-seqs", "4")
        except BaseException:
            a.stop()
            raise
    try:
        yield [a, b]
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def router(replicas: list[ServerProcess]) -> Iterator[RouterProcess]:
    r = RouterProcess([s.base_url for s in replicas], "--health-interval", "0.3",
                      "--health-timeout", "1")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def headers(replicas: list[ServerProcess]) -> dict[str, str]:
    return replicas[0].headers


def chat(base_url: str, headers: dict[str, str], system: str, question: str,
         **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}], **extra})
    assert r.status_code == 200, r.text
    return r.json()


def served_by(router: RouterProcess, send: Any) -> tuple[str, Any]:
    """Runs send(); the one backend whose request count moved, and send's result."""
    before = router.metrics()
    out = send()
    after = router.metrics()
    moved = [k for k in after if k.startswith("kvserve_router_requests_total")
             and after[k] != before.get(k, 0.0)]
    assert len(moved) == 1, (before, after)
    assert after[moved[0]] - before.get(moved[0], 0.0) == 1
    return re.search(r'backend="([^"]+)"', moved[0]).group(1), out  # type: ignore[union-attr]


def test_router_prompt_ids_are_the_replicas(replicas: list[ServerProcess],
                                            headers: dict[str, str]) -> None:
    """The router's ids (what it hashes) equal the replica's /tokenize, token for token."""
    from kvserve.loader import load_checkpoint, resolve_model
    from kvserve.router.prompt import prompt_token_ids
    from kvserve.tool_calling.support import tool_support

    tok = load_checkpoint(resolve_model(None)).tokenizer
    tools = tool_support(tok, None)
    messages = [{"role": "developer", "content": SYSTEM["astro"]},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    tool = {"type": "function", "function": {"name": "get_time", "description": "Time now.",
                                             "parameters": {"type": "object"}}}
    for body in ({"messages": messages}, {"messages": messages, "tools": [tool]},
                 {"messages": messages, "add_generation_prompt": False}):
        r = httpx.post(f"{replicas[0].base_url}/tokenize", headers=headers, json=body)
        assert r.status_code == 200, r.text
        assert prompt_token_ids(tok, tools, "/v1/chat/completions", body) == r.json()["tokens"]
    text = "Once upon a time"
    r = httpx.post(f"{replicas[0].base_url}/tokenize", headers=headers, json={"prompt": text})
    assert prompt_token_ids(tok, tools, "/v1/completions", {"prompt": text}) == \
        r.json()["tokens"]


def test_passthrough_routes_and_auth(router: RouterProcess, headers: dict[str, str]) -> None:
    r = httpx.get(f"{router.base_url}/v1/models", headers=headers)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2-135m"
    r = httpx.post(f"{router.base_url}/tokenize", headers=headers, json={"prompt": "Hi there"})
    assert r.status_code == 200 and r.json()["count"] == 2
    r = httpx.post(f"{router.base_url}/detokenize", headers=headers,
                   json={"tokens": r.json()["tokens"]})
    assert r.json()["prompt"] == "Hi there"
    # the replicas' keys are theirs: without one, the replica's own 401 comes back
    r = httpx.get(f"{router.base_url}/v1/models")
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_shared_prompts_stick_to_one_replica_each(router: RouterProcess,
                                                  replicas: list[ServerProcess],
                                                  headers: dict[str, str]) -> None:
    hits_before = [s.metrics()["vllm:prefix_cache_hits_total"] for s in replicas]
    seen: dict[str, set[str]] = {"astro": set(), "cook": set()}
    for q in QUESTIONS:
        for name in ("astro", "cook"):
            backend, _ = served_by(router, lambda: chat(router.base_url, headers,  # noqa: B023
                                                        SYSTEM[name], q))  # noqa: B023
            seen[name].add(backend)
    assert len(seen["astro"]) == 1 and len(seen["cook"]) == 1, seen
    assert seen["astro"] != seen["cook"]  # the second prompt went to the idle, empty one
    m = router.metrics()
    # first sight of each prompt: no_match; every repeat: a prefix hit
    assert m['kvserve_router_routing_decisions_total{decision="no_match"}'] >= 2
    assert m['kvserve_router_routing_decisions_total{decision="prefix_hit"}'] >= 6
    # each replica hit the cache on its three repeats: at least 9 blocks of 16 tokens each
    hits = [s.metrics()["vllm:prefix_cache_hits_total"] - h0
            for s, h0 in zip(replicas, hits_before)]
    assert all(h >= 3 * 9 * 16 for h in hits), hits


def test_outputs_equal_the_direct_outputs(router: RouterProcess, replicas: list[ServerProcess],
                                          headers: dict[str, str]) -> None:
    for name, q in (("astro", "Why is the sky dark?"), ("cook", "How hot is the oven?")):
        via = chat(router.base_url, headers, SYSTEM[name], q, max_tokens=16)
        for s in replicas:
            direct = chat(s.base_url, headers, SYSTEM[name], q, max_tokens=16)
            assert via["choices"][0]["message"] == direct["choices"][0]["message"]
            # (cached_tokens differ: the second of the same prompt hits the whole of it)
            for k in ("prompt_tokens", "completion_tokens"):
                assert via["usage"][k] == direct["usage"][k]


def _stream(base_url: str, headers: dict[str, str], body: dict[str, Any]
            ) -> tuple[list[str], list[float]]:
    texts, times = [], []
    with httpx.stream("POST", f"{base_url}/v1/completions", headers=headers, json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                for c in ev.get("choices") or []:
                    if c.get("text"):
                        texts.append(c["text"])
                        times.append(time.perf_counter())
    return texts, times


def test_streaming_is_relayed_as_it_arrives(router: RouterProcess,
                                            replicas: list[ServerProcess],
                                            headers: dict[str, str]) -> None:
    body = {"prompt": SYSTEM["astro"] + "\nQ: list the facts.\nA:", "max_tokens": 48,
            "min_tokens": 48, "temperature": 0, "stream": True}
    texts, times = _stream(router.base_url, headers, body)
    direct, _ = _stream(replicas[0].base_url, headers, body)
    # The same text; not always the same events: a server whose reader lags a step sends
    # the tokens of both in one event (async_engine.py: the latest output wins), so two
    # streams of one prompt can cut it differently (seen in CI: ' distance' then '.\n'
    # through the router, ' distance.\n' directly).
    assert "".join(texts) == "".join(direct) and len(texts) > 10
    # buffered, every event would arrive at once; relayed, they spread over the decode
    assert times[-1] - times[0] > 0.05, times


def test_a_client_gone_aborts_the_replicas_request(router: RouterProcess,
                                                   replicas: list[ServerProcess],
                                                   headers: dict[str, str]) -> None:
    """Gone during the prefill (before the first byte) and gone mid-stream: either way the
    router closes the replica's connection, which aborts the request there."""
    body = {"prompt": "word " * 1500, "max_tokens": 200, "min_tokens": 200, "stream": True}

    def aborts() -> float:
        return sum(s.metrics().get('vllm:request_success_total{finished_reason="abort"}', 0)
                   for s in replicas)

    before = aborts()
    with pytest.raises(httpx.TimeoutException):  # a 1500-token prefill takes longer
        httpx.post(f"{router.base_url}/v1/completions", headers=headers, json=body,
                   timeout=0.3)
    _wait(lambda: aborts() == before + 1, 20, router)
    with httpx.stream("POST", f"{router.base_url}/v1/completions", headers=headers,
                      json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    _wait(lambda: aborts() == before + 2, 20, router)
    _wait(lambda: all(v == 0 for k, v in router.metrics().items()
                      if k.startswith("kvserve_router_backend_in_flight")), 10, router)


def test_a_stopped_replica_is_taken_out_and_put_back(router: RouterProcess,
                                                     replicas: list[ServerProcess],
                                                     headers: dict[str, str]) -> None:
    """SIGSTOP: its /health stops answering (a hung replica); SIGCONT: 200 again."""
    urls = [s.base_url for s in replicas]
    key = 'kvserve_router_backend_healthy{{backend="{}"}}'
    b = replicas[1]
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        _wait(lambda: router.metrics()[key.format(urls[1])] == 0, 10, router)
        for q in QUESTIONS[:2]:  # both prompts, the stopped replica's too, go to the other
            backend, _ = served_by(router, lambda: chat(router.base_url, headers,  # noqa: B023
                                                        SYSTEM["cook"], q))  # noqa: B023
            assert backend == urls[0]
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    _wait(lambda: router.metrics()[key.format(urls[1])] == 1, 10, router)


def test_a_killed_replica_is_taken_out_and_requests_still_succeed(
        router: RouterProcess, replicas: list[ServerProcess], headers: dict[str, str]) -> None:
    """A second router that polls once a minute lists the victim first, so it sends the
    first request there (an idle tie goes to the first --backend) before any poll could
    notice: the connection fails, the request is retried on the other replica."""
    victim, survivor = replicas[1], replicas[0]
    slow = RouterProcess([victim.base_url, survivor.base_url], "--health-interval", "60")
    try:
        victim.proc.kill()
        victim.proc.wait(10)
        for name in ("cook", "astro", "cook"):
            backend, out = served_by(slow, lambda: chat(slow.base_url, headers,  # noqa: B023
                                                        SYSTEM[name], "Hi"))  # noqa: B023
            assert backend == survivor.base_url and out["choices"][0]["message"]["content"]
        m = slow.metrics()
        assert m[f'kvserve_router_retries_total{{backend="{victim.base_url}"}}'] == 1
        assert m[f'kvserve_router_backend_healthy{{backend="{victim.base_url}"}}'] == 0
        # streaming still works, on the survivor
        texts, _ = _stream(slow.base_url, headers, {"prompt": "Hello", "max_tokens": 4,
                                                    "temperature": 0, "stream": True})
        assert texts
    finally:
        slow.stop()
    # the first router's polls take it out too; requests through it succeed
    key = f'kvserve_router_backend_healthy{{backend="{victim.base_url}"}}'
    _wait(lambda: router.metrics()[key] == 0, 10, router)
    for name in ("cook", "astro"):
        backend, _ = served_by(router, lambda: chat(router.base_url, headers,  # noqa: B023
                                                    SYSTEM[name], "Hi"))  # noqa: B023
        assert backend == survivor.base_url
    assert httpx.get(f"{router.base_url}/health").status_code == 200


def test_no_replica_left_is_a_503(router: RouterProcess, replicas: list[ServerProcess],
                                  headers: dict[str, str]) -> None:
    for s in replicas:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)
    r = httpx.post(f"{router.base_url}/v1/completions", headers=headers,
                   json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"
    assert "127.0.0.1" not in r.text  # the replicas' addresses stay in the log
    _wait(lambda: httpx.get(f"{router.base_url}/health").status_code == 503, 10, router)


def _wait(cond: Any, timeout: float, router: RouterProcess) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {router.metrics()}\n{router.log()}")
        time.sleep(0.1)
