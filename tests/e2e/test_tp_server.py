"""`kvserve serve --tensor-parallel-size 2` as a real process: it serves; a worker killed
mid-stream ends the stream with an error, /health stops answering 200 within 10 s, and every
process exits (the server with 1, for its supervisor; no rank is left behind); SIGTERM stops
every rank."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ServerProcess
from tests.e2e.test_tensor_parallel import save_tiny


def _workers(pid: int) -> list[int]:
    """The server's tensor-parallel ranks: its children named kvserve-tpR (worker.py)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if Path(f"/proc/{child}/comm").read_text().startswith("kvserve-tp"):
                    out.append(int(child))
            except OSError:
                pass
    return out


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return "gone"


def _signal_mid_stream(srv: ServerProcess, worker: int, sig: int) -> tuple[list[str], float]:
    """Streams a long completion and sends sig to the worker after its third event: the
    stream's SSE data lines to its end, and when the signal went."""
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
    events: list[str] = []
    sent = 0.0
    with httpx.stream("POST", srv.base_url + "/v1/completions", headers=srv.headers,
                      json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3 and not sent:
                os.kill(worker, sig)
                sent = time.monotonic()
    return events, sent


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    save_tiny(tmp_path, "llama", seed=5)
    return str(tmp_path)


def test_killed_worker_ends_the_stream_and_the_server(model_dir: str) -> None:
    srv = ServerProcess(model_dir, "--tensor-parallel-size", "2", "--max-model-len", "512",
                        "--kv-cache-memory", "16MiB")
    try:
        (worker,) = _workers(srv.proc.pid)
        r = httpx.post(srv.base_url + "/v1/completions", headers=srv.headers, json={
            "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        events, t_kill = _signal_mid_stream(srv, worker, signal.SIGKILL)
        assert len(events) > 3
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert "error" in err and "engine" in err["error"]["message"], err
        assert sum("choices" in e for e in events) < 500  # it did not run to the end
        while True:  # /health: 503 or no answer (the server exits) within 10 s
            try:
                ok = httpx.get(srv.base_url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                ok = False
            if not ok:
                break
            assert time.monotonic() - t_kill < 10, "/health still 200 10 s after the kill"
            time.sleep(0.1)
        assert srv.proc.wait(timeout=20) == 1
        log = srv.log()
        assert "rank 1" in log and str(worker) in log, log[-2000:]
        assert _gone([worker], 5)
    finally:
        srv.stop()


def test_hung_worker_ends_the_engine_after_the_timeout(model_dir: str) -> None:
    """A rank that stops answering (SIGSTOP) holds the others in their all-reduce: after
    --tp-timeout seconds the engine gives up with the late rank's number, the stream ends
    with an error, and the stopped rank is killed, not left behind."""
    srv = ServerProcess(model_dir, "--tensor-parallel-size", "2", "--max-model-len", "512",
                        "--kv-cache-memory", "16MiB", "--tp-timeout", "3")
    worker = -1
    try:
        (worker,) = _workers(srv.proc.pid)
        events, t_stop = _signal_mid_stream(srv, worker, signal.SIGSTOP)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert time.monotonic() - t_stop < 15
        assert srv.proc.wait(timeout=20) == 1
        # Stopped in an all-reduce (shared memory: the late rank named) or in the logits
        # gather (gloo: one of the others late), as the signal falls.
        assert re.search(r"ranks \[1\] did not arrive within 3s|the logits gather did not "
                         r"complete within 3s: one of ranks \[1\] is late", srv.log()), \
            srv.log()[-2000:]
        assert _gone([worker], 10), _state(worker)
    finally:
        if worker > 0 and Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)
        srv.stop()


def test_sigterm_stops_every_rank(model_dir: str) -> None:
    srv = ServerProcess(model_dir, "--tensor-parallel-size", "2", "--max-model-len", "512",
                        "--kv-cache-memory", "16MiB")
    try:
        workers = _workers(srv.proc.pid)
        assert len(workers) == 1
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0
        assert _gone(workers, 10), [_state(p) for p in workers]
    finally:
        srv.stop()
