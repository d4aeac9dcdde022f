"""Serving metrics against hand-computed values."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import (
    RequestRecord,
    format_table,
    percentile,
    serving_metrics,
    summarize,
)
from kvserve.bench.serve import ServeConfig, completion_body, request_intervals, send_request


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4; position (n-1)*q/100
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5  # position 1.5
    assert percentile(xs, 99) == pytest.approx(3.97)  # position 2.97: 3 + 0.97
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        percentile(xs, 101)


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0, 10.0], percentiles=(50, 99))
    assert s["mean"] == 4.0
    assert s["median"] == 2.5
    assert s["p50"] == 2.5
    assert s["std"] == pytest.approx(math.sqrt((9 + 4 + 1 + 36) / 4))


def _rec(start: float, chunks: list[float], end: float, prompt_len: int, out: int
         ) -> RequestRecord:
    return RequestRecord(prompt_len=prompt_len, output_len=out, start=start, end=end,
                         chunk_times=chunks, success=True)


def test_request_ttft_itl_tpot() -> None:
    r = _rec(10.0, [10.5, 10.6, 10.8, 11.1], 11.2, prompt_len=7, out=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.latency == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    assert _rec(0.0, [1.0], 1.0, 3, 1).tpot is None


def test_serving_metrics_hand_computed() -> None:
    a = _rec(0.0, [1.0, 2.0, 3.0], 3.0, prompt_len=10, out=3)  # ttft 1, itl 1 1, tpot 1
    b = _rec(1.0, [3.0, 3.5], 4.0, prompt_len=20, out=2)  # ttft 2, itl 0.5, tpot 1.0
    bad = RequestRecord(prompt_len=5, error="HTTP 500")
    m = serving_metrics([a, b, bad], duration=4.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == 0.5
    assert m["output_throughput"] == 1.25
    assert m["total_token_throughput"] == 35 / 4
    assert m["mean_ttft_ms"] == pytest.approx(1500)
    assert m["median_ttft_ms"] == pytest.approx(1500)
    assert m["p99_ttft_ms"] == pytest.approx(1000 + 1000 * 0.99)
    assert m["mean_tpot_ms"] == pytest.approx(1000)  # a: (3-1)/2; b: (3-2)/1
    assert m["mean_itl_ms"] == pytest.approx(2500 / 3)
    assert m["median_itl_ms"] == pytest.approx(1000)
    assert m["mean_e2el_ms"] == pytest.approx(3000)
    assert "Median TTFT (ms):" in format_table("t", m)
    with pytest.raises(ValueError, match="duration"):
        serving_metrics([a], duration=0)


def test_request_intervals_poisson_and_burst() -> None:
    assert request_intervals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = request_intervals(2001, 4.0, seed=1)
    assert gaps[0] == 0.0
    assert gaps == request_intervals(2001, 4.0, seed=1)  # reproducible
    assert sum(gaps) / 2000 == pytest.approx(0.25, rel=0.1)  # mean 1/rate


def test_completion_body_ignore_eos_asks_for_exact_length() -> None:
    cfg = ServeConfig(base_url="http://x", model="m", ignore_eos=True)
    body = completion_body(cfg, SampleRequest("hi", 2, 128))
    assert body["max_tokens"] == body["min_tokens"] == body["n_predict"] == 128
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    plain = completion_body(ServeConfig(base_url="http://x", model="m"),
                            SampleRequest("hi", 2, 8))
    assert "ignore_eos" not in plain and "min_tokens" not in plain
    with pytest.raises(ValueError, match="max_concurrency"):
        ServeConfig(base_url="http://x", model="m", max_concurrency=0)


def _sse(events: list[dict], usage: dict | None = None) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    if usage is not None:
        lines.append(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n")
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def _client(body: bytes, status: int = 200) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True and request.url.path == "/v1/completions"
        return httpx.Response(status, content=body,
                              headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _send(body: bytes, status: int = 200) -> RequestRecord:
    cfg = ServeConfig(base_url="http://server", model="m", ignore_eos=True)

    async def go() -> RequestRecord:
        async with _client(body, status) as client:
            return await send_request(client, cfg, SampleRequest("hi", 2, 3))

    return asyncio.run(go())


def test_send_request_counts_usage_or_text_chunks() -> None:
    chunks = [{"choices": [{"text": t}]} for t in ("a", "", "b", "c")]
    rec = _send(_sse(chunks, usage={"prompt_tokens": 5, "completion_tokens": 4}))
    assert rec.success and rec.error == ""
    assert len(rec.chunk_times) == 3  # the empty chunk carries no token time
    assert (rec.output_len, rec.prompt_len) == (4, 5)  # usage wins where sent
    rec = _send(_sse(chunks))
    assert (rec.output_len, rec.prompt_len) == (3, 2)  # no usage: chunks with text
    assert rec.start <= rec.chunk_times[0] <= rec.end


def test_send_request_failures_are_records() -> None:
    rec = _send(b'{"error": "overloaded"}', status=503)
    assert not rec.success and rec.error.startswith("HTTP 503")
    rec = _send(_sse([{"error": {"message": "boom"}}]))
    assert not rec.success and "boom" in rec.error
    rec = _send(_sse([]))
    assert not rec.success and "no text" in rec.error


def test_result_file_command_hides_the_api_key() -> None:
    from kvserve.bench.serve import redact_key

    argv = ["kvserve", "bench", "serve", "--api-key", "sk-1", "--label", "x",
            "--api-key=sk-2"]
    assert redact_key(argv) == ["kvserve", "bench", "serve", "--api-key", "***", "--label",
                                "x", "--api-key=***"]
