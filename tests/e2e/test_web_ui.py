"""The web page at / in a real headless browser: the system's chromium (Debian's package, which
`make setup` installs), driven by Playwright, on a real `kvserve serve` process with an API
key. References are independent of the page: the API's own non-streamed answer to the same
greedy request (text, tokens, their ranks), the block count the server prints at start-up,
the number of requests this test starts.

A screenshot of the page under load is saved to $KVSERVE_SCREENSHOT_DIR (docs/webui.png is
one: KVSERVE_SCREENSHOT_DIR=docs pytest tests/e2e/test_web_ui.py -s), else to pytest's
tmp_path; its path is printed.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvserve.server.web import PAGE_FILES, STATIC_DIR
from tests.e2e.server_process import ServerProcess

if not os.environ.get("CI"):  # CI installs the test extras: a missing package fails there
    pytest.importorskip("playwright.sync_api")
import playwright.sync_api as playwright_api  # noqa: E402

MODEL = "smollm2-135m"
MAX_TOKENS = 48
QUESTION = "Tell me about the moon in three sentences."
# Long enough that the load requests share full prefix blocks (drawn as "shared").
SYSTEM = ("You are a patient storyteller. Every story has a beginning, a middle and an end, "
          "and every story is about a lighthouse keeper and the sea.")


def chromium() -> str:
    path = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        msg = f"no chromium at {path} (make setup installs Debian's package)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "200MiB", "--max-model-len", "1024",
                       "--max-num-seqs", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, server: ServerProcess) -> Iterator[Any]:
    """The page in a fresh context (no key stored), its key entered; page errors collected."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.base_url + "/")
    enter_key(pg, server.api_key)
    yield pg
    context.close()
    assert not errors, errors


def enter_key(pg: Any, key: str) -> None:
    pg.wait_for_selector("#key-dialog[open]", timeout=10_000)
    pg.fill("#key-input", key)
    pg.press("#key-input", "Enter")


def text(pg: Any, selector: str) -> str:
    return pg.text_content(selector) or ""


def wait_until(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)


def updates(pg: Any) -> int:
    return int(pg.get_attribute("#engine", "data-updates") or 0)


def screenshot_path(tmp_path: Path) -> Path:
    out = Path(os.environ.get("KVSERVE_SCREENSHOT_DIR") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out / "webui.png"


# ---- the page and its files ------------------------------------------------------------------

def test_page_loads_without_key_api_needs_it(server: ServerProcess) -> None:
    url = server.base_url
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp and r.headers["x-content-type-options"] == "nosniff"
    # Everything the page loads is its own: no other origin, no inline script or style.
    refs = re.findall(r'(?:src|href)="([^"]*)"', r.text)
    assert refs and all(ref.startswith("/web/") for ref in refs), refs
    assert "<script>" not in r.text and "style=" not in r.text and "<style" not in r.text
    for name, media in PAGE_FILES.items():
        path = "/" if name == "index.html" else f"/web/{name}"
        r = httpx.get(url + path)
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] == \
            media.split(";")[0], path
        assert r.content == (STATIC_DIR / name).read_bytes()
        if name != "favicon.svg":  # an SVG's xmlns names a namespace, it fetches nothing
            for other in ("http:", "https:", "@import", "url("):
                assert other not in r.text, f"{path} has {other!r}"
    # The data stays behind the key: the state endpoint and any other path under /web/.
    for path in ("/engine/state", "/web/nope.js", "/web/", "/v1/models"):
        assert httpx.get(url + path).status_code == 401, path
    r = httpx.get(url + "/engine/state", headers=server.headers)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    # Host checks still come first: a rebinding page cannot even fetch the page.
    assert httpx.get(url + "/", headers={"Host": "evil.example"}).status_code == 421


def test_page_asks_for_the_key_once(browser: Any, server: ServerProcess) -> None:
    context = browser.new_context()
    pg = context.new_page()
    pg.goto(server.base_url + "/")
    enter_key(pg, "wrong-key")
    pg.wait_for_selector("#key-error:not([hidden])")
    assert "refused" in text(pg, "#key-error")
    assert pg.is_visible("#key-dialog")
    pg.fill("#key-input", server.api_key)
    pg.press("#key-input", "Enter")
    pg.wait_for_selector("#key-dialog", state="hidden")
    wait_until(lambda: updates(pg) >= 1, 10, "an engine update")
    assert text(pg, "#conn") == "live"
    assert text(pg, "#model").startswith(MODEL)
    # The block count the server printed when it started.
    printed = re.search(r"KV cache (\d+) blocks x (\d+) tokens", server.log())
    assert printed, server.log()
    assert text(pg, "#kv-total") == printed.group(1)
    assert text(pg, "#kv-block-size") == printed.group(2)
    # Kept for the tab: a reload does not ask again.
    pg.reload()
    wait_until(lambda: updates(pg) >= 1, 10, "an engine update after reload")
    assert not pg.is_visible("#key-dialog")
    assert pg.evaluate("() => sessionStorage.getItem('kvserve.apiKey')") == server.api_key
    context.close()


# ---- chat --------------------------------------------------------------------------------

def send(pg: Any, prompt: str) -> Any:
    """Sends prompt; returns the new assistant message (a locator), once it is done."""
    n = pg.locator(".msg.assistant").count()
    pg.fill("#prompt", prompt)
    pg.press("#prompt", "Enter")
    # Messages finish in order: the n-th finished one is the new one.
    pg.locator(".msg.assistant[data-done]").nth(n).wait_for(state="attached", timeout=90_000)
    return pg.locator(".msg.assistant").nth(n)


def test_chat_streams_the_greedy_reply_the_api_gives(page: Any, server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                           max_retries=0, timeout=120)
    ref = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5).choices[0]
    ref_tokens = [t.token for t in ref.logprobs.content]
    assert ref.message.content and len(ref_tokens) > 8

    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.uncheck("#show-probs")  # the plain text while it streams
    # Every length the reply's text takes in the DOM, as the browser renders it.
    page.evaluate("""() => {
        window.lens = [];
        new MutationObserver(() => {
            const t = document.querySelector('.msg.assistant .text');
            if (t) window.lens.push(t.textContent.length);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    msg = send(page, QUESTION)
    lens = page.evaluate("() => window.lens")
    grown = sorted(set(lens) - {0})
    assert len(grown) >= 3, f"the reply did not stream in pieces: {lens}"
    assert lens == sorted(lens)  # it only ever grew
    assert msg.locator(".text").text_content() == ref.message.content
    assert msg.locator(".text").is_visible() and not msg.locator(".tokens").is_visible()
    meta = msg.locator(".meta").text_content()
    assert f"finish: {ref.finish_reason}" in meta and f"{len(ref_tokens)} tokens" in meta

    # The tokens, coloured by probability, are the API's tokens; the popover lists the top 5
    # alternatives and, greedy, the token chosen is the first of them.
    page.check("#show-probs")
    spans = msg.locator(".tokens .tok")
    assert spans.all_text_contents() == ref_tokens
    assert not msg.locator(".text").is_visible()
    for i in (0, len(ref_tokens) // 2):
        p = math.exp(ref.logprobs.content[i].logprob)
        assert f"p{min(9, int(p * 10))}" in (spans.nth(i).get_attribute("class") or "")
    spans.nth(2).click()
    pop = page.locator("#token-popover")
    pop.wait_for(state="visible")
    alts = pop.locator(".alts li")
    assert alts.count() == 5
    assert "chosen" in (alts.first.get_attribute("class") or "")
    assert [t.token for t in ref.logprobs.content[2].top_logprobs][0] == ref_tokens[2]
    spans.nth(2).click()
    pop.wait_for(state="hidden")

    # A stop string from the settings ends the reply before it, as the API does.
    cut = len(ref.message.content) // 2
    stop = ref.message.content[cut:cut + 6]
    page.click("#clear")
    page.fill("#stop-strings", stop)
    msg = send(page, QUESTION)
    expected = ref.message.content[:ref.message.content.index(stop)]
    assert msg.locator(".text").text_content() == expected
    assert "finish: stop" in msg.locator(".meta").text_content()


# ---- the engine view -----------------------------------------------------------------------

def _load(server: ServerProcess, n: int, stop: threading.Event, errors: list[str]) -> None:
    """n streamed requests that run until stop is set (closing them aborts them; 900 tokens
    outlast the test on any machine). The first is generating before the others start, so
    that they find its prompt blocks in the prefix cache."""
    generating = threading.Event()

    def one(i: int) -> None:
        body = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "stream": True,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Story number {i}, please."}]}
        try:
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                              headers=server.headers, timeout=120) as r:
                for k, _ in enumerate(r.iter_lines()):
                    if k >= 4:  # the role's chunk, a token's, and their blank lines
                        generating.set()
                    if stop.is_set():
                        return
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(repr(e))
        finally:
            generating.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    threads[0].start()
    generating.wait(60)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()


def test_engine_view_follows_the_load(page: Any, server: ServerProcess,
                                      tmp_path: Path) -> None:
    n = 4
    wait_until(lambda: updates(page) >= 1, 10, "a first engine update")
    wait_until(lambda: text(page, "#eng-running") == "0" and text(page, "#kv-used") == "0",
               30, "an idle engine before the load")
    # A reply of the page's own first, for the screenshot.
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    send(page, QUESTION)
    stop, errors = threading.Event(), []
    load = threading.Thread(target=_load, args=(server, n, stop, errors))
    load.start()
    try:
        def busy() -> bool:
            return (text(page, "#eng-running") == str(n)
                    and int(text(page, "#kv-shared") or 0) > 0
                    and page.locator("#req-rows tr.running").count() == n)

        wait_until(busy, 60, f"the page showing {n} running requests sharing blocks")
        start = updates(page)
        wait_until(lambda: updates(page) >= start + 2 and float(text(page, "#tps-gen")) > 0
                   and text(page, "#ttft-p50") != "–", 20,
                   "updates with tokens per second and TTFT while the requests run")
        used, shared = int(text(page, "#kv-used")), int(text(page, "#kv-shared"))
        # Each request holds its prompt's blocks at least, and a partial block of its own
        # (never shared: only full blocks are hashed).
        prompt_tokens = int(page.locator("#req-rows tr.running td").nth(2).text_content())
        assert used >= math.ceil(prompt_tokens / 16) and used >= shared + n
        assert text(page, "#eng-waiting") == "0" and text(page, "#eng-running") == str(n)
        page.locator(".msg.assistant .tok").nth(7).click()  # its alternatives, pinned
        page.locator("#token-popover").wait_for(state="visible")
        path = screenshot_path(tmp_path)
        page.screenshot(path=str(path))
        print(f"\nscreenshot of the web page: {path}")
    finally:
        stop.set()
        load.join(60)
    assert not errors, errors
    # Closed streams free their blocks: the view returns to zero, the blocks stay cached.
    wait_until(lambda: text(page, "#eng-running") == "0" and text(page, "#kv-used") == "0"
               and page.locator("#req-rows tr.empty").count() == 1, 20,
               "the page back to zero after the requests ended")
    assert int(text(page, "#kv-cached")) > 0
    assert text(page, "#itl-p50") != "–"


# ---- --disable-web-ui ----------------------------------------------------------------------

def test_disable_web_ui_leaves_the_api() -> None:
    with ServerProcess("--disable-web-ui", "--kv-cache-memory", "64MiB", "--max-model-len",
                       "1024") as srv:
        url = srv.base_url
        for path in ("/", "/web/app.js", "/web/style.css"):
            assert httpx.get(url + path).status_code == 401, path  # not public any more
            r = httpx.get(url + path, headers=srv.headers)
            assert r.status_code == 404 and r.json()["error"]["message"] == f"no route {path}"
        r = httpx.get(url + "/engine/state", params={"blocks": "maybe"}, headers=srv.headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "blocks"
        # The state endpoint stays, and its picture of the pool adds up: a fresh server after
        # one request holds no block and keeps the request's full blocks cached.
        out = httpx.post(url + "/v1/chat/completions", headers=srv.headers, timeout=60, json={
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20,
            "temperature": 0}).json()
        st = httpx.get(url + "/engine/state", params={"blocks": "1"}, headers=srv.headers).json()
        kv = st["kv"]
        states = kv["states"]
        assert len(states) == kv["num_blocks"] + 1 and states[0] == "n"
        computed = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] - 1
        assert kv["used"] == 0 and kv["cached"] == computed // kv["block_size"]
        assert kv["free"] == kv["num_blocks"] - kv["cached"] == states.count("f")
        assert st["requests"] == {"running": 0, "waiting": 0, "preemptions": 0,
                                  "list_max": 64, "list": []}
        assert st["prefix_cache"]["queries"] == out["usage"]["prompt_tokens"]
