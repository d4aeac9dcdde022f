"""Boundary types between scheduler, model runner and the user.

    Scheduler --SchedulerOutput--> ModelRunner --ModelOutput--> Scheduler --RequestOutput--> user

Everything above ModelInput is pure Python; ModelInput holds the device tensors of one step.
Below RequestOutput, what a serving layer (AsyncEngine) reads from LLMEngine between steps,
so that it never walks the scheduler itself: EngineStats, RequestInfo, EngineSnapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvserve.request import Request
    from kvserve.spec.base import SpecStats


@dataclass
class ScheduledRequest:
    """One request's share of an engine step.

    The step computes all_token_ids[start_pos : start_pos + len(token_ids)], then the draft
    tokens when there are any (a decode with k drafts feeds 1 + k tokens):

        all_token_ids  |== computed ==|==== token_ids ====|== not yet ==|
                       0          start_pos        start_pos+n      num_tokens

        with drafts    |== computed ==|last|d0 d1 .. dk-1|   token_ids = [last] + drafts
    """

    request: Request
    token_ids: list[int]  # the tokens fed this step (a prefill chunk, or 1 for a decode)
    start_pos: int  # == request.num_computed_tokens when scheduled
    block_ids: list[int]  # the request's whole block table after allocation
    sample: bool  # True when this step reaches the last known token: a new token is sampled
    # The draft tokens at the end of token_ids, to verify this step (only when sample).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A decode (with its drafts): every token it feeds gets logits, none is a prompt
        chunk's (whose rows, but the last, need none)."""
        return self.sample and self.num_tokens == 1 + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelInput:
    """One flat varlen batch: prefill chunks and decodes together.

    T = total tokens this step, B = scheduled requests, S = positions that produce logits.
    Request b owns tokens query_start_loc[b] : query_start_loc[b+1] and, after this step,
    seq_lens[b] tokens of context in the KV cache (its computed prefix plus these tokens).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (the null block)
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    logits_indices: torch.Tensor  # [S] int64 rows of the hidden states to project to logits
    max_query_len: int
    max_seq_len: int


class Logprob(NamedTuple):
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: the chosen token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class ModelOutput:
    """Results of one forward, for the requests whose step sampled."""

    req_ids: list[str]
    # One list per request: a single token normally; with k draft tokens the accepted drafts
    # plus one the target chose (1 to k + 1 tokens).
    sampled_token_ids: list[list[int]]
    logprobs: list[list[PositionLogprobs] | None]
    # request_id -> (first position, logprobs of this step's prompt positions from it on);
    # entry j is the logprob of prompt token first + j given the tokens before it (None at 0).
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs | None]]] = field(
        default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """Scheduler counters (LLMEngine.stats), published by AsyncEngine's engine thread after
    every step."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_groups: int = 0  # waiting as the queue bound counts them (n children once)
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use, [0, 1]
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    num_preemptions: int = 0
    # Speculative decoding (None without it): the runner's SpecStats, copied.
    spec: SpecStats | None = None
    # Service tiers (only when configured): tier -> (running, waiting, waiting groups: n
    # children once, as max_waiting counts) requests, and tier ->
    # requests refused for its full waiting queue (counted on the event loop; in `stats`).
    tiers: dict[str, tuple[int, int, int]] | None = None
    tier_rejections: dict[str, int] | None = None


@dataclass(frozen=True)
class RequestInfo:
    """One request as the engine holds it (token counts only, never text)."""

    request_id: str
    tenant: str | None
    status: str  # "running", "waiting" or "preempted"
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at first scheduling; 0 before
    num_blocks: int


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine at one moment between two steps, taken by the engine thread
    (LLMEngine.snapshot)."""

    stats: EngineStats
    block_states: str  # BlockPool.block_states(): one character per block id
    block_size: int
    # Running (schedule order), then waiting (queue order); at most the snapshot's limit.
    requests: tuple[RequestInfo, ...]
