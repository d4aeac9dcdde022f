"""`kvserve eval perplexity [MODEL] --text FILE --ctx 512`: registered in
kvserve.cli._SUBCOMMANDS.

Same output as llama.cpp's `llama-perplexity -m MODEL -f FILE -c 512` (kvserve.eval.perplexity
holds the chunking and the formulas): `[1]18.1234,[2]...` as each chunk finishes, then
`PPL = <value> +/- <stderr>`. The engine flags are `kvserve serve`'s (EngineArgs), so the
quantization and KV cache dtype that serve runs are the ones measured.

Imports stay light here: the engine and torch load when the command runs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from kvserve.engine_args import EngineArgs

# llama.cpp's default n_batch, so the two tools batch alike by default: 4 chunks of 512 per
# forward (serving's CPU default of 512 tokens would run one).
DEFAULT_BATCH = 2048


def add_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="evaluations on the engine: perplexity")
    esub = ev.add_subparsers(dest="eval_command", required=True)
    help_text = "perplexity of a text file, chunked and scored as llama.cpp's llama-perplexity"
    p = esub.add_parser("perplexity", help=help_text, description=help_text)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, an HF directory, or smollm2-135m (the default)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--text", "-f", required=True, metavar="FILE",
                   help="the text (UTF-8), read as llama.cpp's -f reads it: one trailing "
                        "newline dropped")
    p.add_argument("--ctx", "-c", type=int, default=512,
                   help="tokens per chunk, an even number >= 4; each chunk scores its second "
                        "half (default 512)")
    p.add_argument("--chunks", type=int, default=None,
                   help="score only the first N chunks (default: every whole chunk)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--batch", "-b", type=int, dest="max_num_batched_tokens", default=None,
                   metavar="N",
                   help=f"tokens per engine step, as llama.cpp's -b; several chunks run in one "
                        f"step (default {DEFAULT_BATCH}; same as --max-num-batched-tokens)")
    # None: derived from --ctx and --batch in run(); an explicit value is kept.
    p.set_defaults(max_num_seqs=None, func=run)


def check_args(ns: argparse.Namespace) -> None:
    """The flag checks that need no model, so a bad flag costs no model load."""
    if ns.ctx < 4 or ns.ctx % 2:
        raise ValueError(f"--ctx must be an even number >= 4 (each chunk scores the tokens "
                         f"after its first ctx/2), got {ns.ctx}")
    if ns.chunks is not None and ns.chunks < 1:
        raise ValueError(f"--chunks must be >= 1, got {ns.chunks}")
    if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens < 1:
        raise ValueError(f"--batch must be >= 1, got {ns.max_num_batched_tokens}")
    if ns.max_model_len is not None and ns.max_model_len <= ns.ctx:
        raise ValueError(f"--max-model-len must be > --ctx ({ns.ctx}): a chunk of ctx tokens "
                         f"plus the one token the engine samples after it; got "
                         f"{ns.max_model_len}")
    if not os.path.isfile(ns.text):
        raise ValueError(f"--text {ns.text!r}: no such file")
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model "
                         f"{ns.model!r}")


def read_text(path: str) -> str:
    # Bytes, not read_text(): universal newlines would turn \r\n into \n, which llama.cpp's
    # reader does not. One trailing newline goes, as in llama.cpp's -f.
    try:
        text = open(path, "rb").read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path!r} is not UTF-8: {e}") from None
    return text[:-1] if text.endswith("\n") else text


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """serve's EngineArgs from the flags, with the settings perplexity derives from --ctx."""
    args = EngineArgs.from_cli(argparse.Namespace(**{**vars(ns),
                                                     "model": ns.model or ns.model_tag}))
    batch = ns.max_num_batched_tokens or DEFAULT_BATCH
    # Each chunk is one request of ctx prompt tokens and one sampled token: the KV cache is
    # sized for exactly that, and for the chunks one step can hold (one more is part-way
    # through its prefill when batch is not a multiple of ctx).
    return dataclasses.replace(
        args, max_num_batched_tokens=batch,
        max_model_len=ns.max_model_len or ns.ctx + 1,
        max_num_seqs=ns.max_num_seqs or -(-batch // ns.ctx) + 1)


def run(ns: argparse.Namespace) -> int:
    check_args(ns)
    text = read_text(ns.text)
    args = engine_args(ns)

    from kvserve.eval.perplexity import perplexity
    from kvserve.llm_engine import LLMEngine
    from kvserve.loader import CheckpointError, resolve_model
    from kvserve.platform import setup_process

    resolve_model(args.model)  # an unknown model fails here, before the note below
    try:
        with setup_process(args.device):
            engine = LLMEngine.from_engine_args(args)
    except CheckpointError:
        raise
    except ValueError as e:
        if ns.max_model_len is not None:
            raise
        # A config error may come from the one engine setting this command makes up itself
        # (a --ctx past the model's context): say where that setting came from.
        raise ValueError(f"{e} (here max_model_len is --ctx + 1 = {ns.ctx + 1})") from None

    def progress(i: int, ppl: float) -> None:
        sys.stdout.write(f"[{i}]{ppl:.4f},")
        sys.stdout.flush()

    t0 = time.perf_counter()
    result = perplexity(engine, text, ctx=ns.ctx, chunks=ns.chunks, on_chunk=progress)
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    print(f"PPL = {result.ppl:.4f} +/- {result.stderr:.5f}")
    cfg = engine.config
    kv = cfg.dtype if cfg.cache.kv_cache_dtype == "auto" else cfg.cache.kv_cache_dtype
    print(f"[{result.num_chunks} chunks x {result.count // result.num_chunks} scored tokens of "
          f"{result.num_tokens} in the text; ctx {ns.ctx}, batch {args.max_num_batched_tokens},"
          f" quantization {cfg.quantization}, KV cache {kv}; "
          f"{dt:.1f}s]", file=sys.stderr)
    return 0
