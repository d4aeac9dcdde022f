"""`kvserve bench {serve,latency,throughput}`: registered in kvserve.cli._SUBCOMMANDS.

Imports stay light here: each subcommand imports its module (and torch) when it runs."""

from __future__ import annotations

import argparse
import importlib

_BENCHMARKS = {
    "serve": ("kvserve.bench.serve", "load-test an OpenAI-compatible server (/v1/completions)"),
    "latency": ("kvserve.bench.latency", "batch-1 prefill and decode speed, in process"),
    "throughput": ("kvserve.bench.throughput", "offline throughput through LLM.generate"),
}


def _runner(module: str):  # type: ignore[no-untyped-def]
    def func(ns: argparse.Namespace) -> int:
        return int(importlib.import_module(module).run(ns))
    return func


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: serve, latency, throughput")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in _BENCHMARKS.items():
        p = bsub.add_parser(name, help=help_text, description=help_text)
        # add_cli_args lives beside run() in the module; importing it is cheap for serve and
        # pulls only engine_args for the others.
        importlib.import_module(module).add_cli_args(p)
        p.set_defaults(func=_runner(module))
