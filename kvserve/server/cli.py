"""`kvserve serve [MODEL]`: the OpenAI-compatible server, flags named as in `vllm serve`.

Shutdown on SIGTERM / SIGINT: uvicorn stops accepting connections; the engine refuses new
requests, gives running ones --shutdown-timeout seconds, then ends the rest with an error
event; uvicorn waits for the responses to close, and the process exits 0.

If the engine thread dies, the process exits 1 (after ending every stream with an error), so
that a supervisor restarts it instead of keeping a server that answers 503 forever.

A SIGTERM / SIGINT before the model has loaded also exits 0, as soon as uvicorn has shut down:
the stop was asked for and done, so a supervisor sees success either way. The load itself is
abandoned, not awaited (see _make_server).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import sys
from types import FrameType
from typing import Any

from kvserve.config import parse_tiers
from kvserve.engine_args import EngineArgs
from kvserve.request import DEFAULT_TIER
from kvserve.tool_calling.parsers import TOOL_PARSERS

logger = logging.getLogger("kvserve.server")

DEFAULT_MAX_WAITING = 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, an HF directory, or smollm2-135m (the default)")
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                   help="same as MODEL; repeat it as NAME=MODEL to serve several models "
                        "(model tiers, docs/models.md): a request picks one by its model "
                        "field, the first is loaded at start and serves requests without one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(repeatable: any of the keys, each key a tenant; default: "
                        "$KVSERVE_API_KEY or $VLLM_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more API keys, one 'key,tier' row each ('#' comments): each key a "
                        "tenant in the service tier named (see --tiers); --api-key keys are "
                        "in the default tier")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and responses carry (default: MODEL)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="waiting-queue bound; past it requests get 503 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    p.add_argument("--allowed-host", action="append", default=None, metavar="HOST",
                   help="a Host header value to answer (repeatable; '*' for any). Default: "
                        "loopback names only when bound to a loopback address (so a "
                        "DNS-rebinding web page cannot talk to it), else any")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="uvicorn's bound on open connections and tasks; past it new ones get "
                        "503 (default: 2 x (max-num-seqs + max-waiting-requests) + 64)")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds a response_format schema may take to compile; past it the "
                        "request gets 400")
    p.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help="/health turns 503 when requests are in flight and the engine loop "
                        "has not come round for this many seconds (a hung step)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="how the model writes tool calls (default: the format its chat "
                        "template writes, else hermes)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is always on")
    p.add_argument("--disable-web-ui", action="store_true",
                   help="serve no web page: / and /web/* are 404 (GET /engine/state, an API "
                        "route, stays)")
    p.add_argument("--max-hot-models", type=int, default=1,
                   help="with several --model: how many run at once, each an engine with "
                        "its KV cache (--kv-cache-memory split evenly between them) and its "
                        "share of the cores (default 1)")
    p.add_argument("--max-warm-models", type=int, default=1,
                   help="with several --model: how many more keep their weights in memory "
                        "after leaving hot, so that they come back without a load (default 1)")
    p.add_argument("--model-load-timeout", type=float, default=300.0,
                   help="with several --model: seconds a request waits for its model to "
                        "load (and for the model it replaces to finish its requests); past "
                        "it the request gets 503 with Retry-After")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_serve)


def _serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.async_engine import AsyncEngine
    from kvserve.loader import resolve_model
    from kvserve.platform import setup_process
    from kvserve.server.api import ServerConfig, build_app

    given = model_args(ns.model_tag, ns.model)
    served_as, ns.model = given[0]  # several: the primary model (the first)
    if ns.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {ns.max_waiting_requests}")
    if ns.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {ns.max_body_bytes}")
    if ns.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {ns.shutdown_timeout}")
    for flag, value in (("--grammar-compile-timeout", ns.grammar_compile_timeout),
                        ("--watchdog-timeout", ns.watchdog_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    limit = ns.limit_concurrency
    if limit is None:
        limit = 2 * (ns.max_num_seqs + ns.max_waiting_requests) + 64
    if limit < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {limit}")
    if served_as and ns.served_model_name and len(given) == 1:
        raise ValueError(f"the model is named twice: --model {served_as}=... and "
                         f"--served-model-name {ns.served_model_name}")
    path = resolve_model(ns.model)  # fail fast, before the socket opens, on a bad name
    args = EngineArgs.from_cli(ns)
    args.model = path
    api_key = ns.api_key or os.environ.get("KVSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    key_tiers = {} if ns.api_key_file is None else read_api_key_file(
        ns.api_key_file, {t.name for t in parse_tiers(args.tiers)} | {DEFAULT_TIER})
    name = ns.served_model_name or served_as or ns.model or "smollm2-135m"
    pool = model_pool(ns, args, given) if len(given) > 1 else None
    config = ServerConfig(model_name=name, api_key=api_key, api_key_tiers=key_tiers,
                          max_body_bytes=ns.max_body_bytes,
                          shutdown_timeout=ns.shutdown_timeout,
                          allowed_hosts=allowed_hosts(ns.host, ns.allowed_host),
                          tool_call_parser=ns.tool_call_parser,
                          web_ui=not ns.disable_web_ui)
    address = f"http://{ns.host}:{ns.port}"

    def load() -> AsyncEngine:
        # Process-wide settings (threads, gc.freeze of what loading built) are made here,
        # once, around the load.
        with setup_process(args.device):
            return AsyncEngine.from_engine_args(
                args, grammar_timeout=ns.grammar_compile_timeout,
                watchdog_timeout=ns.watchdog_timeout)

    def ready(engine: AsyncEngine) -> None:
        e = engine.engine
        bs = e.config.cache.block_size
        usable = e.num_blocks - 1  # block 0 is the null block
        print(f"kvserve {address} serving {name} ({path}); max_model_len "
              f"{e.config.scheduler.max_model_len}; KV cache {usable} blocks x {bs} tokens = "
              f"{usable * bs} tokens", file=sys.stderr, flush=True)
        if pool is not None:
            print(f"kvserve model tiers: {', '.join(pool.models)}; at most "
                  f"{ns.max_hot_models} hot and {ns.max_warm_models} warm", file=sys.stderr,
                  flush=True)
        if not ns.disable_web_ui:
            print(f"kvserve web page: {address}/", file=sys.stderr, flush=True)

    failed: list[str] = []

    def load_failed(message: str) -> None:
        print(f"error: loading the model failed: {message}", file=sys.stderr, flush=True)
        failed.append(message)
        server.should_exit = True  # a server that can never serve should not linger

    def engine_died(message: str) -> None:
        print(f"error: the engine stopped ({message}); exiting so that a supervisor restarts "
              f"the server", file=sys.stderr, flush=True)
        failed.append(message)
        server.should_exit = True

    app = build_app(config, None if pool else load, ready, load_failed, engine_died,
                    pool=pool)
    uv_config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                               # A backstop only: the engine ends streams at the timeout.
                               timeout_graceful_shutdown=ns.shutdown_timeout + 10,
                               timeout_keep_alive=5, access_log=False,
                               limit_concurrency=limit)
    server = _make_server(uv_config, app)
    print(f"kvserve listening on {address}; loading {path} (GET /health is 503 until ready)",
          file=sys.stderr, flush=True)
    server.run()
    return 1 if failed or not server.started else 0


def read_api_key_file(path: str, tiers: set[str]) -> dict[str, str]:
    """--api-key-file: key -> tier, one 'key,tier' row per key; blank lines and '#' comments
    skipped. ValueError naming the line (never the key) for a bad row, an unknown tier or a
    key given twice."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path!r} cannot be read: {e}") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        row = line.strip()
        if not row or row.startswith("#"):
            continue
        key, sep, tier = (x.strip() for x in row.partition(","))
        if not sep or not key or not tier or "," in tier:
            raise ValueError(f"--api-key-file {path}:{n}: a row is 'key,tier'")
        if tier not in tiers:
            raise ValueError(f"--api-key-file {path}:{n}: unknown tier {tier!r}; the tiers "
                             f"are {', '.join(sorted(tiers))} (--tiers)")
        if key in keys:
            raise ValueError(f"--api-key-file {path}:{n}: this key is already listed")
        keys[key] = tier
    if not keys:
        raise ValueError(f"--api-key-file {path}: no keys in it")
    return keys


def model_args(tag: str | None, flags: list[str] | None) -> list[tuple[str | None, str | None]]:
    """MODEL and the --model flags -> (name, model) in the order given; name None: unnamed
    (one model alone: --served-model-name or the model), model None: the default model.
    Several models must each be NAME=MODEL, with distinct names."""
    if tag and flags and flags != [tag]:
        if len(flags) == 1:
            raise ValueError(f"the model is given twice: {tag!r} and --model {flags[0]!r}")
        raise ValueError("with several --model NAME=MODEL, give no MODEL argument")
    out: list[tuple[str | None, str | None]] = []
    for item in flags or [tag]:
        name, sep, model = (item or "").partition("=")
        if item and sep and name and model and not os.path.exists(item):
            out.append((name, model))
        else:
            out.append((None, item))
    if len(out) > 1:
        unnamed = next((m for n, m in out if n is None), None)
        if unnamed is not None:
            raise ValueError(f"with several models each --model must be NAME=MODEL, got "
                             f"{unnamed!r}")
        names = [n for n, _ in out]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"--model names must be distinct; {dup!r} is given twice")
    return out


def model_pool(ns: argparse.Namespace, args: EngineArgs,
               given: list[tuple[str | None, str | None]]) -> Any:
    """The ModelPool of several --model NAME=MODEL: each model's engine settings are the
    flags', with the KV budget and the cores split between the hot slots."""
    from kvserve.loader import resolve_model
    from kvserve.server.model_pool import EngineLoader, ModelPool, ModelSpec, hot_slot_args

    if ns.served_model_name:
        raise ValueError("--served-model-name names a single model; with several, name each "
                         "as --model NAME=MODEL")
    if args.tensor_parallel_size > 1:
        raise ValueError("--tensor-parallel-size > 1 serves a single model; it cannot be "
                         "combined with several --model")
    if ns.max_hot_models < 1:
        raise ValueError(f"--max-hot-models must be >= 1, got {ns.max_hot_models}")
    if ns.max_warm_models < 0:
        raise ValueError(f"--max-warm-models must be >= 0, got {ns.max_warm_models}")
    max_hot = min(ns.max_hot_models, len(given))  # no budget for slots no model can fill
    slot = hot_slot_args(args, max_hot)
    specs = [ModelSpec(str(name), dataclasses.replace(slot, model=resolve_model(model)))
             for name, model in given]
    loader = EngineLoader(max_hot, grammar_timeout=ns.grammar_compile_timeout,
                          watchdog_timeout=ns.watchdog_timeout)
    return ModelPool(specs, max_hot, ns.max_warm_models, loader, ns.model_load_timeout)


def allowed_hosts(host: str, flags: list[str] | None) -> tuple[str, ...] | None:
    """The Host values to answer (gate.host_allowed): the flags; by default loopback names
    only when bound to loopback (a keyless local server is what a rebinding page targets)."""
    if flags:
        return None if "*" in flags else tuple(h.strip().lower() for h in flags)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return ("loopback",) if loopback else None


def _make_server(config: Any, app: Any) -> Any:
    """A uvicorn.Server whose signal handler also starts the engine's drain, and which exits
    0 after a graceful shutdown instead of re-raising the signal."""
    import asyncio

    import uvicorn

    from kvserve.server.api import app_state

    class Server(uvicorn.Server):
        async def serve(self, sockets: Any = None) -> None:
            code = 0
            try:
                await super().serve(sockets)
            except SystemExit as e:  # uvicorn's exit 3 (STARTUP_FAILURE): no socket
                code = e.code if isinstance(e.code, int) else 1
                raise
            finally:
                state = app_state(app)
                if state.pool is not None:
                    # A later model's load under way is left as the first one is.
                    if (not state.pool.started or state.pool.loading) \
                            and state.load_error is None:
                        _leave_while_loading(code)
                elif state.engine is None and state.load_error is None:
                    _leave_while_loading(code)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after its shutdown (so the process dies by
            # the signal); ours is graceful, so the process exits 0 instead.
            self._captured_signals.clear()
            if first:
                try:
                    loop = asyncio.get_running_loop()  # the handler runs on the loop's thread
                except RuntimeError:
                    return
                loop.call_soon_threadsafe(app_state(app).begin_shutdown)

    return Server(config)


def _leave_while_loading(code: int) -> None:
    """Ends the process now, the model still loading. The load runs in threads that nothing
    can interrupt (weight copies, a kernel compile, a wait on another process's build lock),
    and the interpreter joins them on the way out: asyncio.run's executor shutdown, then
    threading's non-daemon threads. So a supervisor's `kill; wait` would wait for the load,
    forever on a build lock that is never released. Nothing of a half-done load is worth
    keeping: the kernel drops the build flock with the process. (A kernel compile under way
    is orphaned, not stopped: its ninja runs on to the end, and a start in that time compiles
    beside it.)"""
    logger.warning("stopped before the model finished loading; exiting without waiting for "
                   "the load")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
