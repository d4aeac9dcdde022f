"""`kvserve chat [MODEL]`: an interactive conversation in the terminal on the offline engine,
like `ollama run` or `llama-cli -cnv`.

Every turn renders the whole conversation through the model's chat template and submits it
as one request; the prefix cache makes the repeated history cost little beyond its new
tokens. The reply streams to stdout; everything else (banner, per-reply stats, notices)
goes to stderr, so `kvserve chat < questions.txt > answers.txt` keeps only the replies.

Ctrl-C during a reply stops it between engine steps (the request is aborted) and keeps what
was already written in the history, as llama-cli keeps it in its context; the next turn
continues from there. Ctrl-C or Ctrl-D at the prompt exits with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.engine_args import EngineArgs
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's imports are heavy; a subcommand's module must import lightly
    from kvserve.llm_engine import LLMEngine

PROMPT = ">>> "
CONTINUATION = "... "
HELP = """\
/reset          clear the conversation (the system prompt stays)
/system TEXT    set the system prompt and clear the conversation (/system alone: the model's
                default)
/exit, /quit    leave (also /bye, Ctrl-D, or Ctrl-C at the prompt)
/help           this list
End a line with \\ to continue the message on the next line. Ctrl-C stops a reply."""


@dataclass(frozen=True)
class ReplyStats:
    num_tokens: int
    time_to_first_token: float  # seconds from submitting the turn; the whole reply if none
    tokens_per_second: float  # decode rate after the first token (0 with fewer than two)
    finish_reason: str  # "stop" | "length" | "abort" (Ctrl-C)
    context_full: bool  # stopped because the conversation filled the context (context_len)

    def line(self) -> str:
        head = "stopped: " if self.finish_reason == "abort" else ""
        tail = "; the context is full, /reset to start over" if self.context_full else ""
        return (f"[{head}{self.num_tokens} tokens, time to first token "
                f"{self.time_to_first_token:.2f}s, {self.tokens_per_second:.1f} tok/s after "
                f"it{tail}]")


class ChatSession:
    """One conversation on an LLMEngine that serves nothing else: its system prompt, its
    history of user / assistant messages, one reply at a time."""

    def __init__(self, engine: LLMEngine, params: SamplingParams,
                 system: str | None = None) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.history: list[dict[str, str]] = []
        self._ids = itertools.count()

    @property
    def context_len(self) -> int:
        """The most tokens a conversation can reach: max_model_len, or fewer when the KV cache
        holds fewer (a request that could never fit it is refused; block 0 is the null
        block)."""
        e = self.engine
        return min(e.config.scheduler.max_model_len,
                   (e.num_blocks - 1) * e.config.cache.block_size)

    @property
    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def reset(self) -> None:
        self.history = []

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self.reset()

    def reply(self, text: str, write: Callable[[str], None],
              stop: Callable[[], bool]) -> ReplyStats:
        """Answer the user message `text`, writing the reply's text deltas as they come.

        stop() is polled between engine steps; once true, the request is aborted and the
        partial reply kept (an empty one is dropped with its user message). Raises ValueError,
        the history unchanged, when the conversation with this message does not fit the
        context."""
        engine = self.engine
        user = {"role": "user", "content": text}
        ids = engine.tokenizer.apply_chat_template(self.messages + [user],
                                                   add_generation_prompt=True, tokenize=True)
        max_len = self.context_len
        room = max_len - len(ids)
        if room < 1:
            raise ValueError(f"with this message the conversation has {len(ids)} tokens, and "
                             f"the context holds {max_len}: /reset to start over, or send a "
                             f"shorter message")
        # A reply ends at the context's end rather than being refused for a long max_tokens.
        max_tokens = room if self.params.max_tokens is None else min(self.params.max_tokens,
                                                                     room)
        params = dataclasses.replace(self.params, max_tokens=max_tokens)
        rid = f"chat-{next(self._ids)}"
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        reply, n_out, first, reason = "", 0, None, "abort"
        try:
            while engine.has_unfinished_requests():
                if stop():
                    engine.abort_request(rid)
                    break
                for out in engine.step():
                    comp = out.outputs[0]
                    if first is None and comp.token_ids:
                        first = time.perf_counter()
                    n_out = len(comp.token_ids)
                    write(comp.text[len(reply):])
                    reply = comp.text
                    if out.finished:
                        reason = comp.finish_reason or "stop"
        except BaseException:
            engine.abort_request(rid)
            raise
        end = time.perf_counter()
        if reply or reason != "abort":
            self.history += [user, {"role": "assistant", "content": reply}]
        rate = (n_out - 1) / (end - first) if first is not None and n_out > 1 else 0.0
        return ReplyStats(n_out, (first or end) - t0, rate, reason,
                          reason == "length" and len(ids) + n_out >= max_len)


@contextlib.contextmanager
def _sigint_sets(event: threading.Event) -> Iterator[None]:
    """SIGINT sets `event` instead of raising KeyboardInterrupt, so a reply stops between
    engine steps and never leaves the scheduler half-updated."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _read_message(interactive: bool) -> str:
    """One message from stdin; a line ending in a backslash continues on the next. Prompts
    only on a terminal (input() writes them to stdout, which then holds just the replies).
    Raises EOFError (Ctrl-D, end of input) and KeyboardInterrupt (Ctrl-C)."""
    lines = [input(PROMPT if interactive else "")]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input(CONTINUATION if interactive else ""))
    return "\n".join(lines)


def _command(session: ChatSession, line: str) -> bool:
    """Run a /command; False for /exit."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/reset":
        session.reset()
        print("(conversation cleared)", file=sys.stderr)
    elif name == "/system":
        session.set_system(arg.strip())
        print(f"(system prompt {'set' if session.system else 'cleared'}; conversation "
              f"cleared)", file=sys.stderr)
    elif name == "/help":
        print(HELP, file=sys.stderr)
    else:
        print(f"unknown command {name}; commands: /reset, /system TEXT, /exit, /help",
              file=sys.stderr)
    return True


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _chat(ns: argparse.Namespace) -> int:
    from kvserve.llm_engine import LLMEngine
    from kvserve.platform import setup_process

    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}")
    ns.model = ns.model or ns.model_tag
    # Checked before the model loads, so a bad flag costs no load.
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k, seed=ns.sample_seed)
    args = EngineArgs.from_cli(ns)
    try:
        with setup_process(args.device):
            engine = LLMEngine.from_engine_args(args)
    except KeyboardInterrupt:
        return 130
    if engine.tokenizer.chat_template is None:
        raise ValueError(f"{ns.model} has no chat template to render a conversation with; "
                         f"`kvserve generate --prompt` completes plain text")
    session = ChatSession(engine, params, ns.system)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (input() then edits lines and keeps their history)
    print(f"kvserve chat: {ns.model or 'smollm2-135m'}, context {session.context_len} "
          f"tokens. /help for commands, Ctrl-D to exit.", file=sys.stderr)
    stop = threading.Event()
    while True:
        try:
            line = _read_message(interactive)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.startswith("/"):
            if not _command(session, line.strip()):
                return 0
            continue
        stop.clear()
        with _sigint_sets(stop):
            try:
                stats = session.reply(line, _write, stop.is_set)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            _write("\n")
            print(stats.line(), file=sys.stderr, flush=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, an HF directory, or smollm2-135m (the default)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--system", default=None, help="the system prompt (default: the model's "
                   "template's own, if it has one)")
    # llama-cli's sampling defaults (ollama's are close); --temperature 0 is greedy.
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    p.add_argument("--top-k", type=int, default=40, help="default 40; -1: off")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the most tokens of one reply (default: up to the context's end)")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="each reply's sampling seed (default: the engine's --seed stream)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_chat)
