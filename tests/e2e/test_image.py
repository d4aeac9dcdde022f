"""The container image, built and run: `make image`, then the container serves the default
model on its exposed port, answers a completion, compiles nothing at start (the kernels were
built into the image), runs as a user other than root, and exits 0 on `docker stop` (SIGTERM
drains). Needs a docker daemon; skipped without one (`docker info` fails). The first build
downloads torch's CPU wheel and compiles the kernels: several minutes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = f"kvserve:e2e-{os.getpid()}"


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def no_daemon_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        r = docker("info", timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if r.returncode != 0:
        first = (r.stderr.strip().splitlines() or ["(no output)"])[0]
        return f"no docker daemon (`docker info` failed: {first})"
    return None


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    reason = no_daemon_reason()
    if reason:
        pytest.skip(reason)
    r = subprocess.run(["make", "image", f"IMAGE={IMAGE}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=3600)
    assert r.returncode == 0, f"make image failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    yield IMAGE
    docker("rmi", "-f", IMAGE)


class Container:
    def __init__(self, image: str) -> None:
        r = docker("run", "-d", "-p", "127.0.0.1::8000", image)
        assert r.returncode == 0, r.stderr
        self.id = r.stdout.strip()
        port = docker("port", self.id, "8000/tcp").stdout.split()[0]  # 127.0.0.1:NNNNN
        self.base_url = f"http://{port}"

    def logs(self) -> str:
        r = docker("logs", self.id)
        return r.stdout + r.stderr

    def running(self) -> bool:
        return docker("inspect", "-f", "{{.State.Running}}", self.id).stdout.strip() == "true"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.running(), f"the container exited:\n{self.logs()}"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise AssertionError(f"/health not 200 after {timeout} s:\n{self.logs()}")


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    c = Container(image)
    try:
        c.wait_healthy(300)
        yield c
    finally:
        docker("rm", "-f", c.id)


def test_the_container_serves_a_completion(container: Container) -> None:
    r = httpx.post(f"{container.base_url}/v1/completions", timeout=120, json={
        "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"].strip()
    assert 1 <= body["usage"]["completion_tokens"] <= 8


def test_the_container_compiled_nothing_and_is_not_root(container: Container) -> None:
    logs = container.logs()
    assert "compiling the kvserve CPU kernels" not in logs, logs
    assert "serving smollm2-135m" in logs, logs
    uid = docker("exec", container.id, "id", "-u").stdout.strip()
    assert uid and uid != "0"


def test_docker_stop_drains_and_exits_0(container: Container) -> None:
    """Last in the module: it stops the container."""
    r = docker("stop", "-t", "60", container.id, timeout=90)
    assert r.returncode == 0, r.stderr
    code = docker("inspect", "-f", "{{.State.ExitCode}}", container.id).stdout.strip()
    assert code == "0", container.logs()
