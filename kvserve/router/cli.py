"""`kvserve router --backend URL --backend URL ...`: cache-aware routing across replicas of
one model (docs/router.md). Registered in kvserve.cli._SUBCOMMANDS; imports stay light here."""

from __future__ import annotations

import argparse
import sys

from kvserve.tool_calling.parsers import TOOL_PARSERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    from kvserve.router.policy import RoutingConfig

    d = RoutingConfig()
    p = sub.add_parser("router", help="route OpenAI requests across kvserve replicas by "
                                      "prompt prefix (cache-aware)")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a replica, http://HOST:PORT (repeatable; the order breaks ties)")
    p.add_argument("--model", default=None,
                   help="the model the replicas serve, for its tokenizer and chat template "
                        "(a .gguf file, an HF directory, or smollm2-135m, the default)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="the replicas' --block-size (hashes match only at the same size)")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="route by prefix when matched tokens / prompt tokens exceeds this "
                        "(SGLang's cache_threshold); else to the least loaded replica")
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="the preferred replica is overloaded when its in-flight requests "
                        "exceed the least loaded one's by more than this ...")
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... and are more than this times the least loaded one's; then the "
                        "request goes to the least loaded replica")
    p.add_argument("--max-prefix-blocks", type=int, default=d.max_blocks,
                   help="block hashes the prefix map keeps (least recently used dropped)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between /health polls of each replica")
    p.add_argument("--health-timeout", type=float, default=5.0)
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the replicas' --tool-call-parser, so tool prompts render as theirs")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_router)


def _router(ns: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.loader import load_checkpoint, resolve_model
    from kvserve.router.app import RouterConfig, build_app
    from kvserve.router.policy import RoutingConfig
    from kvserve.tool_calling.support import tool_support

    routing = RoutingConfig(block_size=ns.block_size, cache_threshold=ns.cache_threshold,
                            balance_abs_threshold=ns.balance_abs_threshold,
                            balance_rel_threshold=ns.balance_rel_threshold,
                            max_blocks=ns.max_prefix_blocks)
    config = RouterConfig(backends=tuple(u.rstrip("/") for u in ns.backend), routing=routing,
                          health_interval=ns.health_interval, health_timeout=ns.health_timeout,
                          connect_timeout=ns.connect_timeout, max_body_bytes=ns.max_body_bytes)
    path = resolve_model(ns.model)
    tokenizer = load_checkpoint(path).tokenizer  # the weights are never read
    tools = tool_support(tokenizer, ns.tool_call_parser)
    app = build_app(config, tokenizer, tools)
    print(f"kvserve router http://{ns.host}:{ns.port} -> {', '.join(config.backends)} "
          f"(tokenizer of {path}, block size {routing.block_size})", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=False,
                timeout_keep_alive=5)
    return 0
