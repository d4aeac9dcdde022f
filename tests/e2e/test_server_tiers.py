"""Service tiers per API key, on a real `kvserve serve` under overload: two slots, a free
tier flooded to its waiting bound, paid requests arriving behind the flood.

  - the paid tier's median TTFT is at most 1/3 of the free tier's;
  - every accepted free request completes, with the tokens an idle server gives;
  - past the free tier's max_waiting a free request gets 429 with Retry-After, while paid
    requests are still accepted;
  - a free key's priority is refused (400 naming priority): the free tier does not allow it,
    and no priority could order a request outside its own tier (tests/unit/test_fair_queue.py);
  - the metrics are labelled by tier.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server_process import ServerProcess

TIERS = {"paid": {"weight": 8, "allow_priority": True},
         "free": {"weight": 1, "max_waiting": 16}}
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village,"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tiers")
    keys = d / "keys.csv"
    keys.write_text("# key,tier\npaid-key,paid\nfree-key, free\n")
    with ServerProcess("--tiers", json.dumps(TIERS), "--api-key-file", str(keys),
                       "--max-num-seqs", "2", "--max-waiting-requests", "64",
                       api_key="admin-key") as srv:
        yield srv


def client(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=key, max_retries=0,
                         timeout=300)


class Stream(threading.Thread):
    """One streamed greedy completion: its TTFT, text and finish reason."""

    def __init__(self, srv: ServerProcess, key: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.c, self.prompt = client(srv, key), prompt
        self.error: BaseException | None = None
        self.ttft = self.text = self.finish = None

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            stream = self.c.completions.create(model="smollm2-135m", prompt=self.prompt,
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            parts = []
            for chunk in stream:
                if self.ttft is None and chunk.choices[0].text:
                    self.ttft = time.monotonic() - t0
                parts.append(chunk.choices[0].text)
                self.finish = chunk.choices[0].finish_reason or self.finish
            self.text = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            self.error = e


def tier_metrics(srv: ServerProcess) -> dict[str, float]:
    return {k: v for k, v in srv.metrics().items() if k.startswith("kvserve:tier")}


def test_paid_is_served_first_and_every_free_request_completes(server: ServerProcess) -> None:
    admin = client(server, "admin-key")
    want = {p: admin.completions.create(model="smollm2-135m", prompt=p, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True}
                                        ).choices[0].text for p in PROMPTS}

    # Flood the free tier at once: 2 run, 16 wait, the rest are refused with 429. (A stream's
    # response starts with its first token, so a client cannot tell queued from refused
    # sooner; the refusals come at once.)
    flood = [Stream(server, "free-key", PROMPTS[i % 2]) for i in range(40)]
    for s in flood:
        s.start()
    deadline = time.monotonic() + 60
    while not any(isinstance(s.error, openai.RateLimitError) for s in flood):
        assert time.monotonic() < deadline, "the free tier's queue never filled"
        time.sleep(0.05)
    refused = next(s.error for s in flood if isinstance(s.error, openai.RateLimitError))
    assert refused.response.headers.get("retry-after") == "1"
    assert refused.body["code"] == "tier_queue_full" and "tier 'free'" in refused.message

    # A paid user behind the flood, one request after another: each takes the next slot
    # that frees, ahead of the free requests that wait.
    paid = []
    for i in range(4):
        s = Stream(server, "paid-key", PROMPTS[i % 2])
        s.start()
        s.join(300)
        paid.append(s)
    for s in flood:
        s.join(300)
    free = [s for s in flood if not isinstance(s.error, openai.RateLimitError)]
    # The queue took at least its 16 (more as the first ones ran or finished meanwhile).
    assert 16 <= len(free) <= 30, len(free)
    for s in free + paid:
        assert s.error is None, s.error
        assert s.finish == "length" and s.text == want[s.prompt]
    paid_ttft = statistics.median(s.ttft for s in paid)
    free_ttft = statistics.median(s.ttft for s in free)
    print(f"median TTFT: paid {paid_ttft:.2f} s, free {free_ttft:.2f} s")
    assert paid_ttft <= free_ttft / 3, (paid_ttft, free_ttft)

    m = tier_metrics(server)
    assert m['kvserve:tier_request_success_total{finished_reason="length",tier="free"}'] \
        == len(free)
    assert m['kvserve:tier_request_success_total{finished_reason="length",tier="paid"}'] \
        == len(paid)
    assert m['kvserve:tier_time_to_first_token_seconds_count{tier="paid"}'] == len(paid)
    assert m['kvserve:tier_num_requests_waiting{tier="free"}'] == 0
    assert m['kvserve:tier_requests_rejected_total{tier="free"}'] == sum(
        isinstance(s.error, openai.RateLimitError) for s in flood)
    assert m['kvserve:tier_requests_rejected_total{tier="paid"}'] == 0


def test_a_free_keys_priority_is_refused_and_a_paid_one_accepted(server: ServerProcess
                                                                  ) -> None:
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   headers={"Authorization": "Bearer free-key"},
                   json={"prompt": "Hi", "max_tokens": 2, "priority": -100})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "tier 'free' does not allow" in err["message"]
    ok = client(server, "paid-key").completions.create(
        model="smollm2-135m", prompt="Hi", max_tokens=2, extra_body={"priority": -100})
    assert ok.choices[0].finish_reason == "length"


def test_unknown_tier_in_the_key_file_fails_the_start(tmp_path: Path) -> None:
    keys = tmp_path / "keys.csv"
    keys.write_text("k1,paid\nk2,gold\n")
    with pytest.raises(RuntimeError, match=r"keys.csv:2: unknown tier 'gold'; the tiers are "
                                           r"default, free, paid"):
        ServerProcess("--tiers", json.dumps(TIERS), "--api-key-file", str(keys))
