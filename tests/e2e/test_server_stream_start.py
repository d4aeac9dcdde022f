"""A streamed response starts only when its first token exists (serving.py,
EngineStream.first_event), on a real `kvserve serve` with one sequence slot: a stream
queued behind another gets no status line and no byte while it waits, then its first
token with the headers; a client that leaves while queued takes its request out of the
queue; a queued stream cut by the shutdown drain gets an HTTP 503, not a 200 with an error
event, while the running one (already streaming) ends with the error event. A proxy in
front relies on the first part: with nothing received it may still retry the request on
another replica (deploy/nginx)."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx

from tests.e2e.server_process import ServerProcess

C = "/v1/completions"
ARGS = ("--max-num-seqs", "1", "--max-model-len", "2048", "--kv-cache-memory", "64MiB")


def _wait_metric(srv: ServerProcess, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while srv.metrics()[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {srv.metrics()}"
        time.sleep(0.05)


class _Queued(threading.Thread):
    """A streamed completion in a thread: when its headers came, its status, its events."""

    def __init__(self, srv: ServerProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.max_tokens = srv, max_tokens
        self.headers_at: float | None = None
        self.status = 0
        self.events: list[Any] = []
        self.error_body: Any = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.srv.base_url + C, headers=self.srv.headers, json=body,
                          timeout=120) as r:
            self.headers_at = time.monotonic()
            self.status = r.status_code
            if r.status_code != 200:
                self.error_body = json.loads(r.read())
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    d = line[6:]
                    self.events.append(d if d == "[DONE]" else json.loads(d))


def _raw_request(srv: ServerProcess, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.sendall(b"POST " + C.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Authorization: Bearer " + srv.api_key.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_a_queued_stream_sends_nothing_until_its_first_token() -> None:
    with ServerProcess(*ARGS) as srv:
        runner = {"prompt": "Tell me a story", "max_tokens": 1500, "ignore_eos": True,
                  "stream": True}
        with httpx.stream("POST", srv.base_url + C, headers=srv.headers, json=runner,
                          timeout=120) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # it holds the only slot
            queued = _Queued(srv, 8)
            queued.start()
            leaver = _raw_request(srv, {**runner, "max_tokens": 8})
            _wait_metric(srv, "vllm:num_requests_waiting", 2)
            # Not a byte while queued: the raw client sees nothing, the other no headers.
            leaver.settimeout(1.5)
            try:
                got = leaver.recv(1)
            except TimeoutError:
                got = None
            assert got is None, got
            assert queued.headers_at is None
            leaver.close()  # leaves while queued: its request is taken out of the queue
            _wait_metric(srv, "vllm:num_requests_waiting", 1, timeout=10)
            assert queued.headers_at is None
            released = time.monotonic()
        # The runner's connection closed: it is aborted and the queued one runs.
        queued.join(120)
        assert queued.status == 200 and queued.headers_at is not None
        assert queued.headers_at > released
        # Its first event is a token, not a placeholder sent early.
        assert queued.events[0]["choices"][0]["text"], queued.events[:2]
        assert queued.events[-1] == "[DONE]"
        assert queued.events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in queued.events[:-1]) <= 8
        m = srv.metrics()
        assert m['vllm:request_success_total{finished_reason="length"}'] == 1  # the queued
        assert m["vllm:num_requests_waiting"] == 0


def test_a_queued_stream_cut_by_the_drain_gets_a_503() -> None:
    srv = ServerProcess(*ARGS, "--shutdown-timeout", "2")
    try:
        running = _Queued(srv, 1500)
        running.start()
        _wait_metric(srv, "vllm:num_requests_running", 1)
        queued = _Queued(srv, 8)
        queued.start()
        _wait_metric(srv, "vllm:num_requests_waiting", 1)
        assert queued.headers_at is None
        srv.proc.terminate()  # SIGTERM: the drain gives the running one 2 s, then ends both
        assert srv.proc.wait(60) == 0, srv.log()
        running.join(30)
        queued.join(30)
        # The running one had streamed: it ends with the error event.
        assert running.status == 200 and running.events[-1] == "[DONE]"
        assert running.events[-2]["error"]["code"] == "shutting_down", running.events[-2]
        # The queued one had received nothing: a plain 503 in OpenAI's shape.
        assert queued.status == 503, (queued.status, queued.events)
        assert queued.error_body["error"]["code"] == "shutting_down"
    finally:
        srv.stop()
