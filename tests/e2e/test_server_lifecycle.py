"""`kvserve serve` before it is ready: what it answers while the model loads, and that SIGTERM
then ends the process promptly (it used to live on until the load finished).

The load is held deterministically: the test itself holds the kernel build lock of a temp
KVSERVE_EXTENSIONS_DIR, as another process compiling the kernels would, so the server's load
waits on it for as long as the test likes, and nothing compiles.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.ops import build
from kvserve.ops import cpu_extension as cpu_mod
from tests.e2e.server_process import ROOT, free_port

API_KEY = "test-key"

pytestmark = pytest.mark.skipif(not cpu_mod.cpu_has_avx2_fma(),
                                reason="only the CPU kernels' load takes the build lock")


class LoadingServer:
    """A `kvserve serve` process that is not waited on to become healthy."""

    def __init__(self, env: dict[str, str], port: int | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-", suffix=".log",
                                                delete=False)
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(self.port),
               "--api-key", API_KEY, "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in the log after {timeout}s:\n{self.log()}")
            time.sleep(0.2)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=10,
                         headers={"Authorization": f"Bearer {API_KEY}"})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()
        os.unlink(self._log.name)


@pytest.fixture
def held_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The env of a server whose kernel build directory another live process (this one) is
    building in: the build lock held, torch's baton in place."""
    monkeypatch.setenv("KVSERVE_EXTENSIONS_DIR", str(tmp_path))
    build_dir = cpu_mod.build_directory()
    with build.build_lock(build_dir):
        (build_dir / build.TORCH_BATON).touch()
        yield {"KVSERVE_EXTENSIONS_DIR": str(tmp_path)}


@pytest.fixture
def loading_server(held_build: dict[str, str]) -> Iterator[LoadingServer]:
    server = LoadingServer(held_build)
    try:
        server.wait_for_log(f"waiting for process {os.getpid()}, which is building", 120)
        yield server
    finally:
        server.close()


def assert_openai_503(r: httpx.Response, retry_after: bool) -> None:
    assert r.status_code == 503, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "service_unavailable"
    assert "loading" in body["error"]["message"]
    if retry_after:
        assert int(r.headers["Retry-After"]) > 0


def test_endpoints_answer_503_while_loading(loading_server: LoadingServer) -> None:
    health = None
    deadline = time.monotonic() + 60
    while health is None:  # the load starts before the socket opens
        with contextlib.suppress(httpx.TransportError):
            health = httpx.get(f"{loading_server.base_url}/health", timeout=10)
        if health is None and time.monotonic() > deadline:
            raise AssertionError(f"the server never answered:\n{loading_server.log()}")
        time.sleep(0.2)
    assert_openai_503(health, retry_after=False)
    models = loading_server.get("/v1/models")
    assert_openai_503(models, retry_after=True)
    assert models.json()["error"]["code"] == "loading"
    assert_openai_503(loading_server.get("/metrics"), retry_after=True)
    # Still loading, still answering: the build lock was never taken from its live owner.
    assert loading_server.proc.poll() is None
    assert "stale" not in loading_server.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_while_loading_exits_promptly_with_0(loading_server: LoadingServer,
                                                     sig: signal.Signals) -> None:
    loading_server.proc.send_signal(sig)
    try:
        rc = loading_server.proc.wait(20)  # it used to wait for the load: here, forever
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 20 s after {sig.name}:\n"
                             f"{loading_server.log()}") from None
    log = loading_server.log()
    assert rc == 0, log
    assert "stopped before the model finished loading" in log
    assert "Traceback" not in log


def test_a_port_in_use_ends_the_process_though_the_load_is_under_way(
        held_build: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LoadingServer(held_build, port=taken.getsockname()[1])
        try:
            try:
                rc = server.proc.wait(60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running 60 s after a failed bind:\n"
                                     f"{server.log()}") from None
            assert rc == 3, server.log()  # uvicorn's STARTUP_FAILURE
            assert "address already in use" in server.log()
        finally:
            server.close()


def test_ready_only_after_a_warm_up_generation_that_is_not_counted() -> None:
    """/health turns 200 only once a warm-up generation has run through the engine (its
    log line says so, before the server reports itself serving), and the warm-up is no
    request in /metrics: a replica joins its load balancer warm, with clean counters."""
    from tests.e2e.server_process import ServerProcess

    with ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", "512",
                       "--log-level", "info") as srv:
        log = srv.log()
        assert "warmed up in" in log
        assert log.index("warmed up in") < log.index("serving")
        m = srv.metrics()
        assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) == 0
        assert m.get("vllm:generation_tokens_total", 0) == 0
        r = httpx.post(srv.base_url + "/v1/completions", headers=srv.headers, json={
            "prompt": "Hi", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200
        m = srv.metrics()
        assert sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")) == 1
        assert m["vllm:generation_tokens_total"] == 3
