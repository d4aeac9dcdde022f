"""A real `kvserve serve` process on a free port, for the HTTP tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, api_key: str = "test-key", startup_timeout: float = 120.0,
                 module: str = "kvserve.cli") -> None:
        """module: what `python -m` runs (a test launcher that injects a fault, say)."""
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-", suffix=".log",
                                                delete=False)
        cmd = [sys.executable, "-m", module, "serve", "--port", str(self.port),
               "--api-key", api_key, "--log-level", "warning", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        self._wait_healthy(startup_timeout)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        saw_503 = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=2.0)
                if r.status_code == 200:
                    self.saw_503_while_loading = saw_503
                    return
                saw_503 = saw_503 or r.status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: 'name' -> value (model_name label dropped; other
        labels kept in the name, e.g. vllm:request_success_total{finished_reason="stop"})."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
            out[name] = float(value)
        return out

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    """Waits until the server runs and queues nothing and holds no KV blocks; its metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.1)
