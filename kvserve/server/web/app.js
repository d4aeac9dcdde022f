// kvserve's web page: a chat playground on /v1/chat/completions (SSE read from fetch's
// ReadableStream) and a live view of the engine polled from GET /engine/state.
// Hand-written, no build step, nothing from another origin. Model text only ever reaches the
// page as textContent, never as markup.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "kvserve.apiKey";
  const POLL_MS = 1000;
  const COLORS = { u: "#4f8cff", s: "#b57bff", c: "#2fb37a", f: "#2a3140" };
  const ORDER = ["u", "s", "c", "f"]; // bottom to top in an aggregated cell

  // ---- the API key: asked for once, when a call gets 401 -------------------------------

  let apiKey = sessionStorage.getItem(KEY_STORE) || "";
  let keyWaiters = [];

  function askKey(error) {
    const dialog = $("key-dialog");
    $("key-error").hidden = !error;
    $("key-error").textContent = error || "";
    if (!dialog.open) {
      $("key-input").value = "";
      dialog.showModal();
      $("key-input").focus();
    }
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    apiKey = key;
    sessionStorage.setItem(KEY_STORE, key);
    $("key-dialog").close();
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  });
  $("key-dialog").addEventListener("cancel", (ev) => ev.preventDefault()); // no key, no API
  $("key-button").addEventListener("click", () => askKey(""));

  // fetch with the key; a 401 asks for a (new) key and retries.
  async function api(path, options = {}) {
    for (;;) {
      const headers = { ...(options.headers || {}) };
      if (apiKey) headers.Authorization = "Bearer " + apiKey;
      const res = await fetch(path, { ...options, headers });
      if (res.status !== 401) return res;
      await askKey(apiKey ? "The server refused that key." : "");
    }
  }

  async function errorText(res) {
    try {
      const body = await res.json();
      return `${res.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
    } catch {
      return `${res.status} ${res.statusText}`;
    }
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- the model -----------------------------------------------------------------------

  let model = null;

  async function loadModel() {
    for (;;) {
      try {
        const res = await api("/v1/models");
        if (res.ok) {
          const m = (await res.json()).data[0];
          model = m.id;
          $("model").textContent = `${m.id} · ${m.max_model_len} tokens`;
          return;
        }
        $("model").textContent = await errorText(res);
      } catch (e) {
        $("model").textContent = "server unreachable";
      }
      await new Promise((r) => setTimeout(r, 2000));
    }
  }

  // ---- chat ----------------------------------------------------------------------------

  const conversation = []; // {role, content}: what the next request sends after the system
  let current = null; // the AbortController of the reply streaming now
  const messageEntries = new WeakMap(); // message element -> its tokens' logprob entries

  function addMessage(role, text) {
    const hint = document.querySelector("#messages .hint");
    if (hint) hint.remove();
    const msg = el("div", `msg ${role}`);
    msg.append(el("div", "role", role));
    const body = el("div", "body");
    const plain = el("div", "text", text);
    body.append(plain);
    msg.append(body);
    const m = { root: msg, body, text: plain, tokens: null, meta: null, entries: [] };
    if (role === "assistant") {
      m.tokens = el("div", "tokens");
      body.append(m.tokens);
      m.meta = el("div", "meta");
      msg.append(m.meta);
      messageEntries.set(msg, m.entries);
    }
    $("messages").append(msg);
    scrollDown();
    return m;
  }

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function numberField(id) {
    const v = $(id).value.trim();
    return v === "" ? null : Number(v);
  }

  function unescapeStop(s) {
    return s.replace(/\\(n|t|\\)/g, (_, c) => ({ n: "\n", t: "\t", "\\": "\\" })[c]);
  }

  function buildRequest() {
    const messages = [];
    const system = $("system").value;
    if (system.trim()) messages.push({ role: "system", content: system });
    messages.push(...conversation);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (model) body.model = model;
    for (const [id, name] of [["temperature", "temperature"], ["top-p", "top_p"],
      ["top-k", "top_k"], ["max-tokens", "max_tokens"], ["seed", "seed"]]) {
      const v = numberField(id);
      if (v !== null) body[name] = v;
    }
    const stop = $("stop-strings").value.split("\n").filter((s) => s !== "").map(unescapeStop);
    if (stop.length) body.stop = stop;
    const k = numberField("top-logprobs");
    if (k) {
      body.logprobs = true;
      body.top_logprobs = k;
    }
    return body;
  }

  // Tokens coloured by probability: class p0 (below 10%) .. p9 (90% and above).
  function addTokens(m, entries) {
    for (const e of entries) {
      const span = el("span", `tok p${Math.min(9, Math.floor(Math.exp(e.logprob) * 10))}`,
        e.token);
      span.dataset.i = String(m.entries.length);
      m.entries.push(e);
      m.tokens.append(span);
    }
  }

  function formatMs(s) {
    if (s === null || s === undefined) return "–";
    if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
    if (s < 0.01) return `${(s * 1e3).toFixed(2)} ms`;
    if (s < 1) return `${(s * 1e3).toFixed(1)} ms`;
    return `${s.toFixed(2)} s`;
  }

  async function send(text) {
    conversation.push({ role: "user", content: text });
    addMessage("user", text);
    const m = addMessage("assistant", "");
    m.root.classList.add("streaming");
    const ctrl = new AbortController();
    current = ctrl;
    $("send").disabled = true;
    $("stop").disabled = false;
    const t0 = performance.now();
    let tFirst = null;
    let finish = null;
    let usage = null;
    let error = null;
    let reply = "";
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(buildRequest()), signal: ctrl.signal,
      });
      if (!res.ok) {
        error = await errorText(res);
      } else {
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        let done = false;
        while (!done) {
          const chunk = await reader.read();
          if (chunk.done) break;
          buf += chunk.value;
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const event = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            for (const line of event.split("\n")) {
              if (!line.startsWith("data:")) continue;
              const data = line.slice(5).trim();
              if (data === "[DONE]") {
                done = true;
                break;
              }
              const obj = JSON.parse(data);
              if (obj.error) {
                error = obj.error.message;
                continue;
              }
              if (obj.usage) usage = obj.usage;
              const choice = obj.choices && obj.choices[0];
              if (!choice) continue;
              const delta = choice.delta || {};
              if (delta.content) {
                if (tFirst === null) tFirst = performance.now();
                reply += delta.content;
                m.text.textContent = reply;
              }
              if (choice.logprobs && choice.logprobs.content) {
                addTokens(m, choice.logprobs.content);
                m.root.classList.add("has-tokens");
              }
              if (choice.finish_reason) finish = choice.finish_reason;
              scrollDown();
            }
          }
        }
      }
    } catch (e) {
      error = e.name === "AbortError" ? null : String(e);
      if (e.name === "AbortError") finish = "stopped";
    }
    current = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    m.root.classList.remove("streaming");
    if (error) {
      m.root.classList.add("error");
      m.meta.textContent = error;
      if (!reply) {
        conversation.pop(); // the turn never happened: the user can edit and resend
        m.text.textContent = "(no reply)";
      }
    }
    if (reply) conversation.push({ role: "assistant", content: reply });
    if (!error) {
      const secs = (performance.now() - t0) / 1000;
      const parts = [];
      if (usage) {
        const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
        parts.push(`prompt ${usage.prompt_tokens}` + (cached ? ` (${cached} cached)` : ""));
        parts.push(`${usage.completion_tokens} tokens`);
        if (tFirst !== null && usage.completion_tokens > 1) {
          const rate = (usage.completion_tokens - 1) / ((performance.now() - tFirst) / 1000);
          parts.push(`${rate.toFixed(1)} tok/s`);
        }
      }
      if (tFirst !== null) parts.push(`first token ${formatMs((tFirst - t0) / 1000)}`);
      parts.push(`${secs.toFixed(2)} s`);
      parts.push(`finish: ${finish || "?"}`);
      m.meta.textContent = parts.join(" · ");
    }
    m.root.dataset.done = "1";
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || current) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => current && current.abort());
  $("clear").addEventListener("click", () => {
    if (current) current.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
    hidePopover(true);
  });
  const showProbs = () => document.body.classList.toggle("probs", $("show-probs").checked);
  $("show-probs").addEventListener("change", showProbs);
  showProbs();

  // ---- the token popover: the top alternatives of one position --------------------------

  let pinned = null;

  function showPopover(span) {
    const m = span.closest(".msg");
    const entries = m && messageEntries.get(m);
    if (!entries) return;
    const e = entries[Number(span.dataset.i)];
    const pop = $("token-popover");
    pop.replaceChildren();
    const head = el("div", "pop-head");
    head.append(el("code", "", JSON.stringify(e.token)));
    head.append(el("span", "", ` ${(Math.exp(e.logprob) * 100).toFixed(1)}% · logprob ` +
      e.logprob.toFixed(3)));
    pop.append(head);
    const list = el("ol", "alts");
    for (const alt of e.top_logprobs || []) {
      const li = el("li", alt.token === e.token ? "chosen" : "");
      const p = Math.exp(alt.logprob);
      const bar = el("span", "bar");
      bar.style.width = `${Math.max(1, p * 100).toFixed(1)}%`; // CSSOM: allowed by the CSP
      li.append(el("code", "", JSON.stringify(alt.token)), el("span", "pct",
        `${(p * 100).toFixed(1)}%`), bar);
      list.append(li);
    }
    pop.append(list);
    pop.hidden = false;
    const r = span.getBoundingClientRect();
    const w = pop.offsetWidth;
    pop.style.left = `${Math.max(4, Math.min(window.innerWidth - w - 4, r.left))}px`;
    pop.style.top = `${r.bottom + 6 + window.scrollY}px`;
  }

  function hidePopover(force) {
    if (pinned && !force) return;
    if (pinned) pinned.classList.remove("pinned");
    pinned = null;
    $("token-popover").hidden = true;
  }

  $("messages").addEventListener("mouseover", (ev) => {
    const span = ev.target.closest(".tok");
    if (span && !pinned && document.body.classList.contains("probs")) showPopover(span);
  });
  $("messages").addEventListener("mouseout", (ev) => {
    if (ev.target.closest(".tok")) hidePopover(false);
  });
  $("messages").addEventListener("click", (ev) => {
    const span = ev.target.closest(".tok");
    if (!span) return hidePopover(true);
    if (pinned === span) return hidePopover(true);
    hidePopover(true);
    showPopover(span);
    pinned = span;
    span.classList.add("pinned");
  });

  // ---- the engine view -----------------------------------------------------------------

  let updates = 0;

  function fitCanvas(canvas, height) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { ctx, w };
  }

  // One cell per block; when they do not fit in MAX_GRID_H, each cell stands for `per`
  // consecutive blocks, filled bottom up in proportion: used, shared, cached, free.
  const MAX_GRID_H = 200;
  let grid = null; // {per, cols, cell, n}: for the hover title

  function drawGrid(states) {
    const canvas = $("kv-grid");
    const blocks = states.slice(1); // block 0 is the null block
    const n = blocks.length;
    const w = canvas.clientWidth;
    const gap = 1;
    let cell = 12;
    let per = 1;
    let cols = 1;
    for (;;) {
      cols = Math.max(1, Math.floor((w + gap) / (cell + gap)));
      if (Math.ceil(n / cols) * (cell + gap) <= MAX_GRID_H || cell <= 5) break;
      cell -= 1;
    }
    const maxRows = Math.floor(MAX_GRID_H / (cell + gap));
    if (Math.ceil(n / cols) > maxRows) per = Math.ceil(n / (cols * maxRows));
    const cells = Math.ceil(n / per);
    const rows = Math.max(1, Math.ceil(cells / cols));
    const { ctx } = fitCanvas(canvas, rows * (cell + gap));
    for (let i = 0; i < cells; i++) {
      const x = (i % cols) * (cell + gap);
      const y = Math.floor(i / cols) * (cell + gap);
      const part = blocks.slice(i * per, (i + 1) * per);
      if (per === 1) {
        ctx.fillStyle = COLORS[part] || COLORS.f;
        ctx.fillRect(x, y, cell, cell);
        continue;
      }
      let bottom = y + cell;
      for (const s of ORDER) {
        let count = 0;
        for (const ch of part) if (ch === s) count++;
        if (!count) continue;
        const h = (cell * count) / part.length;
        ctx.fillStyle = COLORS[s];
        ctx.fillRect(x, bottom - h, cell, h);
        bottom -= h;
      }
    }
    grid = { per, cols, cell: cell + gap, n, states: blocks };
    $("kv-scale").textContent = per === 1 ? "1 cell = 1 block" : `1 cell = ${per} blocks`;
  }

  $("kv-grid").addEventListener("mousemove", (ev) => {
    if (!grid) return;
    const r = ev.target.getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / grid.cell);
    const row = Math.floor((ev.clientY - r.top) / grid.cell);
    const i = row * grid.cols + col;
    const first = i * grid.per;
    if (col >= grid.cols || first >= grid.n) return;
    const part = grid.states.slice(first, first + grid.per);
    const names = { u: "used", s: "shared", c: "cached", f: "free" };
    const counts = ORDER.map((s) => [names[s], [...part].filter((c) => c === s).length])
      .filter(([, c]) => c).map(([k, c]) => `${c} ${k}`).join(", ");
    const last = first + part.length;
    ev.target.title = grid.per === 1 ? `block ${first + 1}: ${counts.replace(/^1 /, "")}`
      : `blocks ${first + 1}–${last}: ${counts}`;
  });

  // A line over one value a second; a gap where a value is null.
  function spark(id, series, colors) {
    const canvas = $(id);
    const { ctx, w } = fitCanvas(canvas, 36);
    const h = 36;
    let max = 0;
    for (const values of series) for (const v of values) if (v !== null) max = Math.max(max, v);
    ctx.clearRect(0, 0, w, h);
    if (!max) return;
    series.forEach((values, k) => {
      ctx.strokeStyle = ctx.fillStyle = colors[k];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      const at = (i) => [(i / Math.max(1, values.length - 1)) * (w - 4) + 2,
        h - 2 - (values[i] / max) * (h - 4)];
      values.forEach((v, i) => {
        if (v === null) return;
        const [x, y] = at(i);
        const prev = i > 0 && values[i - 1] !== null;
        const next = i + 1 < values.length && values[i + 1] !== null;
        if (prev) ctx.lineTo(x, y);
        else ctx.moveTo(x, y);
        if (!prev && !next) ctx.fillRect(x - 1.5, y - 1.5, 3, 3); // a lone second: a dot
      });
      ctx.stroke();
    });
  }

  function pct(x) {
    return x === null || x === undefined ? "–" : `${(x * 100).toFixed(1)}%`;
  }

  function render(st) {
    const rq = st.requests;
    $("eng-running").textContent = rq.running;
    $("eng-waiting").textContent = rq.waiting;
    $("eng-preemptions").textContent = rq.preemptions;
    const kv = st.kv;
    for (const k of ["used", "shared", "cached", "free"]) $(`kv-${k}`).textContent = kv[k];
    $("kv-total").textContent = kv.num_blocks;
    $("kv-block-size").textContent = kv.block_size;
    if (kv.states) drawGrid(kv.states);
    $("hit-rate-total").textContent = pct(st.prefix_cache.hit_rate);
    const win = st.window;
    if (win) {
      $("hit-rate").textContent = pct(win.prefix_cache.hit_rate);
      $("tps-prompt").textContent = win.prompt_tokens_per_s.toFixed(1);
      $("tps-gen").textContent = win.generation_tokens_per_s.toFixed(1);
      $("ttft-p50").textContent = formatMs(win.ttft.p50);
      $("ttft-p90").textContent = formatMs(win.ttft.p90);
      $("itl-p50").textContent = formatMs(win.itl.p50);
      $("itl-p90").textContent = formatMs(win.itl.p90);
      spark("spark-tps", [win.series.generation_tokens, win.series.prompt_tokens],
        [COLORS.u, COLORS.c]);
      spark("spark-ttft", [win.series.ttft_mean], [COLORS.s]);
      spark("spark-itl", [win.series.itl_mean], [COLORS.u]);
    }
    const rows = $("req-rows");
    rows.replaceChildren();
    for (const r of rq.list) {
      const tr = el("tr", r.status);
      const id = el("td", "id", r.id ? r.id.slice(0, 10) : "another key");
      if (r.id) id.title = r.id;
      tr.append(id, el("td", "", r.status), el("td", "", r.prompt_tokens),
        el("td", "", `${r.output_tokens} / ${r.max_tokens}`), el("td", "", r.cached_tokens),
        el("td", "", r.blocks));
      rows.append(tr);
    }
    const more = rq.running + rq.waiting - rq.list.length;
    if (!rq.list.length) {
      const tr = el("tr", "empty");
      const td = el("td", "", "none");
      td.colSpan = 6;
      tr.append(td);
      rows.append(tr);
    } else if (more > 0) {
      const tr = el("tr", "empty");
      const td = el("td", "", `and ${more} more`);
      td.colSpan = 6;
      tr.append(td);
      rows.append(tr);
    }
    updates += 1;
    $("engine").dataset.updates = String(updates);
  }

  function setConn(ok, text) {
    const c = $("conn");
    c.classList.toggle("ok", ok);
    c.classList.toggle("bad", !ok);
    c.textContent = text;
  }

  async function poll() {
    if (!document.hidden) {
      try {
        const res = await api("/engine/state?blocks=1");
        if (res.ok) {
          render(await res.json());
          setConn(true, "live");
          $("eng-updated").textContent = new Date().toLocaleTimeString();
        } else {
          setConn(false, await errorText(res));
        }
      } catch (e) {
        setConn(false, "server unreachable");
      }
    }
    setTimeout(poll, POLL_MS);
  }

  loadModel();
  poll();
})();
