"""SamplingParams with vLLM's names and OpenAI semantics.

Every bad value raises ParamError (a ValueError) naming the field and the allowed range, and
carrying the field's name, so the server can turn it into a 400 without knowing the rules
itself, or reading the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Bounds on what a client controls (the server relies on these too).
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGIT_BIAS = 1024
# Logprob entries (sampled token + top-k, per token, per choice) one request may hold:
# ~150 bytes each as Python objects, so about 150 MB.
MAX_LOGPROB_ENTRIES = 1 << 20
_SEED_RANGE = (-(2**63), 2**64 - 1)


class ParamError(ValueError):
    """A request's bad value. param: the request field it is about (OpenAI's error.param:
    "logit_bias" for logit_bias[5]), or None; the message names it and what is allowed."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _field(name: str) -> str:
    """The request field of a checked name: logit_bias[5] and stop_token_ids[] are in
    logit_bias and stop_token_ids."""
    return name.split("[", 1)[0]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to JSON, enforced at sampling time (kvserve/structured_output.py).

    Exactly one of: json, a JSON schema (a dict or its JSON text); json_object, any JSON
    object; structural_tag, an xgrammar structural tag (a dict or its JSON text: text and
    tagged JSON, as tool calls are written in a model's own format).
    """

    json: str | dict | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, bool(self.json_object), self.structural_tag is not None]
        if sum(given) != 1:
            raise ParamError("structured_outputs", "structured_outputs needs exactly one of "
                             "json (a JSON schema), json_object=True or structural_tag")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ParamError("structured_outputs", f"structured_outputs.structural_tag must be "
                             f"a dict or a string, got {type(self.structural_tag).__name__}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError("structured_outputs", f"structured_outputs.json must be a JSON "
                             f"schema as a dict or a string, got {type(self.json).__name__}")


def _check_number(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False,
                  hi_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(_field(name), f"{name} must be a number, got {type(value).__name__}")
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and (
        value < hi if hi_open else value <= hi)
    if not ok:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ParamError(_field(name), f"{name} must be in {lb}{lo}, {hi}{rb}, got {value}")


def _check_int(name: str, value: int | None, lo: int, hi: int | None = None,
               allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(_field(name), f"{name} must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ParamError(_field(name), f"{name} must be {rng}, got {value}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs returned with each sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, not by users.
    _stop_list: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, 0.0, 100.0)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        # Logits are divided by it: below 0.01 it is no penalty but an overflow (1e-300 is 0
        # in float32, and a division by zero).
        _check_number("repetition_penalty", self.repetition_penalty, 0.01, 2.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, _SEED_RANGE[0], _SEED_RANGE[1], allow_none=True)
        _check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True)
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ParamError("logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS} "
                                 f"entries, got {len(self.logit_bias)}")
            clean: dict[int, float] = {}
            for tok, bias in self.logit_bias.items():
                try:
                    tok_id = int(tok)
                except (TypeError, ValueError):
                    raise ParamError("logit_bias",
                                     f"logit_bias keys must be token ids, got {tok!r}") from None
                _check_number(f"logit_bias[{tok_id}]", bias, -100.0, 100.0)
                clean[tok_id] = float(bias)
            self.logit_bias = clean
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop may have at most {MAX_STOP_STRINGS} strings, got "
                                     f"{len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_LEN:
                raise ParamError("stop", f"each stop string must be a string of 1 to "
                                 f"{MAX_STOP_STRING_LEN} characters, got {s!r:.40}")
        self._stop_list = stops
        for t in self.stop_token_ids or []:
            _check_int("stop_token_ids[]", t, 0)
        if self.top_k == 0:
            self.top_k = -1
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            got = type(self.structured_outputs).__name__
            raise ParamError("structured_outputs", f"structured_outputs must be a "
                             f"StructuredOutputsParams, got {got}")
        if self.structured_outputs is not None and (self.min_tokens > 0 or self.ignore_eos):
            # The grammar's end allows only the stop token; forbidding it there leaves no token
            # allowed, and the sample falls outside the grammar.
            raise ParamError("response_format", "structured output (response_format) cannot "
                             "be combined with min_tokens > 0 or ignore_eos: the output must be "
                             "able to end where the grammar ends")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate_token_ids(self, vocab_size: int) -> None:
        """Checks that depend on the model; the engine calls this at add_request."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})),
                          ("stop_token_ids", self.stop_token_ids or [])):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ParamError(name, f"{name} token id must be in [0, {vocab_size - 1}], "
                                           f"got {t}")
