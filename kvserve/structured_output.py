"""Structured output (JSON object / JSON schema) enforced at sampling time with xgrammar.

    compile(spec)        -> CompiledGrammar (ValueError on a bad schema); xgrammar caches it,
                            within cache_limit_bytes: every distinct schema a client sends
                            would otherwise stay in memory for good
    token_bitmask(reqs)  -> rows + packed [G, ceil(V / 32)] int32 masks for the sampler
                            (a row per draft token too, the matcher rolled back after)
    accept(req_id, tok)  -> advances that request's matcher by the token it sampled
    remove(req_id)       -> drops the matcher when the request finishes or is aborted

One GrammarMatcher per request (per child of an n > 1 request). It is created the first time
the request samples, so a preempted request keeps its matcher: its output tokens survive
preemption and the matcher state still describes them.

xgrammar is imported lazily: `import kvserve` must not need it, and a server without it
answers response_format with a 400 instead of failing to start.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from kvserve.sampling_params import ParamError, StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.loader.tokenizer import Tokenizer
    from kvserve.request import Request

logger = logging.getLogger(__name__)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:  # ImportError, or a broken native extension
        return False
    return True


# The compiled-grammar cache's default bound (xgrammar's own default is unbounded).
DEFAULT_CACHE_BYTES = 256 << 20


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 cache_limit_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """vocab_size: the model's logits width (may exceed the tokenizer's vocabulary)."""
        if cache_limit_bytes < 0:
            raise ValueError(f"the grammar cache limit must be >= 0 bytes, got "
                             f"{cache_limit_bytes}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_limit_bytes = cache_limit_bytes
        self.num_compiled = 0  # compile() calls that reached xgrammar (tests, stats)
        self._compiler: Any = None
        # Guards lazy compiler construction only: the server compiles in a thread pool while
        # the engine thread may compile the same (cached) grammar.
        self._lock = threading.Lock()
        self._matchers: dict[str, Any] = {}

    # -- compilation (any thread) -----------------------------------------------------------

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except Exception as e:
                    raise ParamError("response_format", "structured output (response_format "
                                     "json_object or json_schema) is unavailable: xgrammar "
                                     f"cannot be imported ({type(e).__name__})") from None
                info = xgr.TokenizerInfo(_encoded_vocab(self.tokenizer, self.vocab_size),
                                         vocab_type=_vocab_type(self.tokenizer, xgr),
                                         vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.tokenizer.eos_token_ids),
                                         add_prefix_space=_add_prefix_space(self.tokenizer))
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=2, cache_enabled=self.cache_limit_bytes > 0,
                    cache_limit_bytes=self.cache_limit_bytes or -1)
            return self._compiler

    @property
    def cache_size_bytes(self) -> int:
        return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """ValueError naming the field when the schema is not valid JSON or not supported."""
        compiler = self._get_compiler()
        if spec.structural_tag is not None:
            return self._compile_structural_tag(compiler, spec.structural_tag)
        # json_object as the schema {"type": "object"}: OpenAI's json_object is an object,
        # and xgrammar's builtin JSON grammar allows any value with unbounded whitespace,
        # which a small model can loop in until max_tokens.
        schema = ('{"type": "object"}' if spec.json_object
                  else spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
        self.num_compiled += 1
        try:
            return compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError/InvalidJSONError subclasses
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ParamError("response_format", f"json_schema is not a valid or supported JSON "
                             f"schema: {msg}") from None

    def _compile_structural_tag(self, compiler: Any, tag: str | dict) -> Any:
        self.num_compiled += 1
        try:
            return compiler.compile_structural_tag(tag if isinstance(tag, str)
                                                   else json.dumps(tag))
        except Exception as e:
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            # Structural tags come from tool definitions (tool_calling/grammar.py).
            raise ParamError("tools", f"tools: a function's parameters is not a valid or "
                             f"supported JSON schema: {msg}") from None

    # -- per-step use (engine thread) -------------------------------------------------------

    def token_bitmask(self, requests: list[Request], row_offsets: list[int] | None = None,
                      drafts: list[list[int]] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Masks for the sampling rows of requests that have a grammar: (rows [G] int64,
        bitmask [G, ceil(V / 32)] int32, bit t % 32 of word t // 32 set = token t allowed).
        None when no row has a grammar.

        Request b owns rows row_offsets[b] .. (one each without row_offsets); with draft
        tokens drafts[b], its row j gets the grammar's mask after the first j drafts: the
        matcher accepts them, fills each row, and rolls back. Rows after a draft the grammar
        refuses get no mask: that draft's own row gives it probability 0, so rejection
        sampling never reaches them."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        for i, req in enumerate(requests):
            spec = req.sampling_params.structured_outputs
            if spec is None:
                continue
            matcher = self._matchers.get(req.request_id)
            if matcher is None:
                matcher = self._new_matcher(req.grammar or self.compile(spec))
                self._matchers[req.request_id] = matcher
            first = i if row_offsets is None else row_offsets[i]
            ahead = drafts[i] if drafts is not None else []
            accepted = 0
            for j in range(len(ahead) + 1):
                if matcher.is_terminated():
                    break  # the stop token was accepted; the scheduler finishes the request
                mask = self._allocate_bitmask()
                matcher.fill_next_token_bitmask(mask)
                rows.append(first + j)
                masks.append(mask)
                if j == len(ahead) or not matcher.accept_token(ahead[j]):
                    break
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.int64), torch.cat(masks)

    def accept(self, request_id: str, token_id: int) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return
        if not matcher.accept_token(token_id):
            # Only possible if a processor after the bitmask (none today) re-enabled a masked
            # token; the grammar can no longer hold for this request.
            logger.warning("request %s: sampled token %d violates its grammar", request_id,
                           token_id)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def _new_matcher(self, grammar: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar)

    def _allocate_bitmask(self) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(1, self.vocab_size)


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """id -> token string as the vocabulary stores it. Special tokens (other than the stop
    tokens, which xgrammar handles itself) become "", which xgrammar never allows: otherwise
    "<|im_start|>" would count as seven literal characters inside a JSON string."""
    backend = tokenizer.backend
    stop = set(tokenizer.eos_token_ids)
    out = []
    for i in range(vocab_size):
        tok = backend.id_to_token(i) if i < tokenizer.vocab_size else None
        if tok is None or (i in tokenizer.all_special_ids and i not in stop):
            tok = ""
        out.append(tok)
    return out


def _vocab_type(tokenizer: Tokenizer, xgr: Any) -> Any:
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    if "<0x0A>" in vocab:
        return xgr.VocabType.BYTE_FALLBACK  # SentencePiece: "▁" spaces, <0xNN> byte tokens
    if "Ġ" in vocab or "Ċ" in vocab:
        return xgr.VocabType.BYTE_LEVEL  # GPT-2 byte-level BPE
    return xgr.VocabType.RAW


def _add_prefix_space(tokenizer: Tokenizer) -> bool:
    # SentencePiece tokenizers prepend "▁" to the first word; byte-level BPE does not.
    return "<0x0A>" in tokenizer.backend.get_vocab(with_added_tokens=False)
