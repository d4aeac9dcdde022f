"""The `kvserve` command. Subcommands register from their own modules (a line in
_SUBCOMMANDS); `kvserve generate` streams a completion to the terminal."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from kvserve.engine_args import EngineArgs
from kvserve.sampling_params import SamplingParams


def _generate(ns: argparse.Namespace) -> int:
    from kvserve.llm_engine import LLMEngine
    from kvserve.platform import setup_process

    args = EngineArgs.from_cli(ns)
    with setup_process(args.device):
        engine = LLMEngine.from_engine_args(args)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k, seed=ns.sample_seed)
    if ns.chat:
        prompt: dict | str = {"prompt_token_ids": engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": ns.prompt}], add_generation_prompt=True,
            tokenize=True)}
    else:
        prompt = ns.prompt
    engine.add_request("cli", prompt, params)
    printed = 0
    t0 = time.perf_counter()
    first = None
    n_out = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            n_out = len(out.outputs[0].token_ids)
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    dt = time.perf_counter() - (first or t0)
    rate = (n_out - 1) / dt if n_out > 1 and dt > 0 else 0.0
    print(f"[{n_out} tokens, time to first token {((first or t0) - t0):.2f}s, "
          f"{rate:.1f} tok/s after it]", file=sys.stderr)
    return 0


# Modules with add_parser(subparsers) -> None; each sets `func` on its parser. They must import
# lightly: heavy imports belong inside `func`.
_SUBCOMMANDS = ["kvserve.cli", "kvserve.bench.cli", "kvserve.server.cli", "kvserve.eval.cli",
               "kvserve.quantize", "kvserve.spec.medusa_train", "kvserve.chat",
               "kvserve.router.cli"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt, streamed")
    g.add_argument("--model", default=None,
                   help="a .gguf file, an HF directory, or smollm2-135m (the default)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sample-seed", type=int, default=None)
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for mod in _SUBCOMMANDS:
        importlib.import_module(mod).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
