"""Request state machine. Pure Python: no tensors.

    WAITING --schedule--> RUNNING --finish--> FINISHED_*
       ^                     |
       +----- PREEMPTED <----+   (blocks freed, num_computed_tokens reset, recomputed later)
"""

from __future__ import annotations

import enum
import time
from typing import Any

from kvserve.sampling_params import SamplingParams

# The service tier of a request that names none (config.TierConfig, fair_queue.py).
DEFAULT_TIER = "default"


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, max_tokens: int, priority: int = 0,
                 arrival_time: float | None = None, eos_token_ids: tuple[int, ...] = (),
                 prompt: str | None = None, group_id: str | None = None,
                 tenant: str | None = None, tier: str | None = None) -> None:
        self.request_id = request_id
        # The service tier it is queued and bounded in (config.TierConfig; the server's map
        # of API keys to tiers); None: the default tier.
        self.tier = DEFAULT_TIER if tier is None else tier
        # Whose request this is (the server's hash of its API key; None offline): state that
        # outlives a request, the suffix proposer's cache of past outputs, is kept per tenant.
        self.tenant = tenant
        # The user's request this one belongs to (the n children of one share it).
        self.group_id = request_id if group_id is None else group_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None here
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        # prompt + output; the scheduler feeds all_token_ids[num_computed_tokens:].
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Draft tokens a proposer guessed to follow all_token_ids, for the next step to verify
        # (speculative decoding). Never part of all_token_ids: block hashes, the prefix cache
        # and the output see only tokens the target model chose. The scheduler consumes them.
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Chained hashes of the full blocks of all_token_ids (filled by the KV cache manager).
        self.block_hashes: list = []
        # sampling_params.structured_outputs compiled (an xgrammar CompiledGrammar), when set.
        self.grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_output_tokens(self, num_tokens: int) -> None:
        """Forget the last num_tokens output tokens (a stop string ended the output inside a
        step's accepted drafts: nothing after it is emitted)."""
        if num_tokens:
            del self.output_token_ids[-num_tokens:]
            del self.all_token_ids[-num_tokens:]

    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
