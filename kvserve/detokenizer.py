"""Incremental detokenization and stop strings for one request.

Decoding the whole output every step costs O(output length) per token. Instead we decode a
small window of recent token ids twice and take the difference (vLLM's
detokenize_incrementally, working on ids and decode() instead of token strings):

    ids  | ... already emitted ... | prefix window | unread |
         0                   prefix_offset   read_offset    len(ids)

    new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

The prefix window gives the new tokens their left context, which tokenizers need for things
like SentencePiece's leading space (decoded alone, "▁Hello" loses its space). It starts as the
last few prompt tokens, so the first output token gets its space too, as in vLLM; the streamed
text can therefore begin with a space that decode(output_ids) strips.

When the new text ends in U+FFFD the last token(s) end inside a UTF-8 sequence; the offsets
stay put and the text comes out once the next token completes the character.

Stop strings are searched only in the part of the text that can hold a new match: the
held-back tail plus the new text. While not finished, the last max_stop_len - 1 characters are
held back (unless include_stop_str_in_output) so a client never sees the start of a stop
string that later completes; flush() releases them when the request ends for another reason.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.request import Request

# Prompt tokens used as left context for the first output token (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# Bound on the decode window. Waiting normally spans a token or two (a UTF-8 character is at
# most 4 bytes); past this many tokens (a run of skipped special tokens, or bytes that never
# form valid UTF-8) we move on and emit what decode() gives, U+FFFD included.
_MAX_WINDOW_TOKENS = 32


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, request: Request) -> None:
        params = request.sampling_params
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stop_strings = list(params.stop_strings)
        self._include_stop = params.include_stop_str_in_output
        max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        # A new match ends in the new text and starts at most max_stop_len - 1 chars before it.
        self._tail_len = max(max_stop_len - 1, 0)
        self._hold_len = 0 if self._include_stop else self._tail_len

        context = request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

        self._chunks: list[str] = []  # emitted text, in order
        self._joined = ""  # "".join(self._chunks), refreshed lazily
        self._num_joined = 0
        self._held = ""  # decoded but not yet emitted (a possible stop-string start)
        self._tail = ""  # the last _tail_len chars of the text, for the stop-string search
        self.finished = False
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """All text decoded so far (emitted plus held back), cut at a matched stop string.

        Tokens that end inside a UTF-8 sequence are not in it until they complete.
        """
        if self._num_joined != len(self._chunks):
            self._joined += "".join(self._chunks[self._num_joined:])
            self._num_joined = len(self._chunks)
        return self._joined + self._held

    def update(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Feed the newly sampled ids; returns (delta_text, matched stop string or None).

        After a stop string matched, the request is finished and further calls return ("",
        None).
        """
        if self.finished or not new_token_ids:
            return "", None
        new_text = self._decode_new(new_token_ids)
        if not new_text:
            return "", None

        if self._stop_strings:
            # Matches ending in the new text start inside (tail + new text); the tail itself
            # was searched in an earlier step.
            window = self._tail + new_text
            match = self._find_stop(window, len(self._tail))
            if match is not None:
                start, stop = match
                cut = start + len(stop) if self._include_stop else start
                # held is a suffix of tail (all of it without include_stop, empty with it), so
                # the never-emitted part of window starts at len(tail) - len(held); cut lies
                # past that point in both cases (with include_stop the match ends in new_text).
                delta = window[len(self._tail) - len(self._held):cut]
                self._held = ""
                self._emit(delta)
                self.finished = True
                self.stop_string = stop
                return delta, stop
            self._tail = window[-self._tail_len:] if self._tail_len else ""

        text = self._held + new_text
        if self._hold_len:
            split = max(len(text) - self._hold_len, 0)
            delta, self._held = text[:split], text[split:]
        else:
            delta, self._held = text, ""
        self._emit(delta)
        return delta, None

    def flush(self) -> str:
        """The request ended for another reason (EOS, length, abort): release what was held.

        Returns the held-back stop-string tail plus the text of any tokens still waiting for
        the rest of a UTF-8 character (decoded with U+FFFD, as decode() would), so the deltas
        joined equal the decode of all output ids.
        """
        if self.finished:
            return ""
        self.finished = True
        pending = ""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            pending = full[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)
        delta = self._held + pending
        self._held = ""
        self._emit(delta)
        return delta

    # -- internals ------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, new_token_ids: list[int]) -> str:
        self._ids.extend(new_token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        waiting = full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(prefix)
        if waiting and len(self._ids) - self._prefix_offset <= _MAX_WINDOW_TOKENS:
            # An unfinished UTF-8 sequence, or tokens that decode to nothing (skipped special
            # tokens): wait for more tokens. The window keeps them, so nothing is lost.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _find_stop(self, window: str, new_start: int) -> tuple[int, str] | None:
        """The stop string that completes first in window (it must end past new_start).

        Among matches ending at the same place the longest wins, i.e. the earliest start.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop_strings:
            start = window.find(stop, max(new_start - len(stop) + 1, 0))
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < best[:2]:
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _emit(self, delta: str) -> None:
        if delta:
            self._chunks.append(delta)
