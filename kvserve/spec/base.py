"""The proposer protocol, the defaults of a proposer without KV, and the speculative-decoding
counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvserve.executor.tp import TPExecutor
    from kvserve.request import Request


DRAFT_FORWARDS = ("none", "per_depth", "per_step")


@dataclass(frozen=True)
class DraftStops:
    """Where a proposer that knows how sure it is of each draft (a draft model: the
    probability it gave the token) stops, priced by the policy for this step
    (SpecPolicy.draft_stops). P is the product of a request's draft confidences so far, the
    chance all its drafts are accepted (a draft model's is well calibrated: Qwen2.5-Coder
    0.5B drafting for 1.5B, open generation, greedy: 98% of its drafts at 0.9+ accepted,
    30% at 0.2-0.4). Prices are in tokens (seconds / the cost of a token without drafts):

        keep[j]   draft j (0-based) is verified iff P after it >= keep[j]: the price of its
                  verify row; one not kept ends the request's drafting
        more[j]   the forward for draft j >= 1 runs iff P so far * alpha >= more[j]: its
                  row's price plus the request's share of the forward (more[0] is unused:
                  the policy chose to start)
        alphas    per request, its measured per-draft acceptance: the chance the next
                  draft is accepted, before it is drawn
    """

    keep: list[float]
    more: list[float]
    alphas: list[float]


class Proposer(Protocol):
    """Guesses the tokens that follow each request's tokens.

    propose() runs after a step has appended its tokens, for requests whose next step is a
    decode; num_drafts[b] (0..K) is how many request b may get, and it may get fewer (an
    n-gram with no match). A proposer that samples (a draft model at temperature > 0) keeps the
    distributions q it drew from until draft_probs() asks for them; a deterministic one
    returns None there, which verification reads as one-hot.

    A proposer that reads the target's hidden states (medusa) sets needs_hidden_states =
    True; then after each sampling step, before the scheduler appends emitted[b] to
    requests[b], observe_hidden gets hidden[b], the target's hidden state (after its final
    norm) at the row whose logits produced emitted[b][-1]. Otherwise the runner hands over
    nothing.
    """

    needs_hidden_states: bool

    # KV slots past a sampling step the scheduler reserves for the proposer's own drafts.
    num_lookahead_tokens: int
    # Bytes the proposer's own KV cache needs per block of the target's (one memory budget).
    kv_bytes_per_block: int
    # What drafting costs beyond the verify rows, for the policy (DRAFT_FORWARDS): "none" (a
    # lookup: ~free), "per_depth" (a model forward per drafting depth: a draft model), or
    # "per_step" (one forward for every depth: Medusa's heads through the lm_head).
    draft_forwards: str
    # The last propose()'s model forwards, (requests drafting, seconds) each, which the
    # policy prices drafting by; None for a proposer that runs no model.
    last_timing: list[tuple[int, float]] | None
    # Whether propose() reads DraftStops: its drafts come with their probabilities.
    stops_on_confidence: bool
    # (tokens, seconds) of the last propose()'s catch-up over tokens it had not read (a new
    # prompt), None if there was none.
    last_catch_up: tuple[int, float] | None
    # The target's other tensor-parallel ranks (set by the engine; None in one process): a
    # proposer whose forwards run the target's own split layers (self_draft) sends each
    # step to them, as the target's steps are. A draft model runs whole on rank 0.
    executor: TPExecutor | None

    def allocate_kv(self, num_blocks: int, target_kv: Any) -> None:
        """Its KV cache, in the target's blocks (nothing for a proposer without a model);
        target_kv: the target's own cache, which a self-draft shares."""

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]], stops: DraftStops | None = None
                ) -> list[list[int]]:
        """stops: where to stop short of num_drafts on low confidence (a proposer with
        stops_on_confidence; others get None)."""

    def observe_hidden(self, requests: list[Request], hidden: torch.Tensor,
                       emitted: list[list[int]]) -> None:
        """See the class docstring (only called when needs_hidden_states)."""

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        """Per request, the tokens propose() would read before drafting (0 for a lookup)."""

    def draft_probs(self, requests: list[Request], drafts: list[list[int]]
                    ) -> list[torch.Tensor | None] | None: ...

    def remove(self, request_ids: list[str]) -> None:
        """Forget finished, aborted or preempted requests (a preempted one starts over)."""


class KVFreeProposer:
    """The Proposer members of a proposer that keeps no KV cache and runs no model per
    drafting depth (ngram, suffix, medusa): no lookahead slots, no bytes per block, nothing
    to catch up on, nothing timed for the policy (a subclass that runs a model says so in
    draft_forwards and last_timing), one-hot q (deterministic drafts). A subclass writes
    propose(), and what it keeps past a request."""

    draft_forwards = "none"
    stops_on_confidence = False
    num_lookahead_tokens = 0
    kv_bytes_per_block = 0
    last_timing: list[tuple[int, float]] | None = None
    last_catch_up: tuple[int, float] | None = None
    needs_hidden_states = False
    executor: TPExecutor | None = None

    def allocate_kv(self, num_blocks: int, target_kv: Any) -> None:
        pass

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        return [0] * len(requests)

    def draft_probs(self, requests: list[Request], drafts: list[list[int]]) -> None:
        return None

    def remove(self, request_ids: list[str]) -> None:
        pass


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: a draft is one request's drafts in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: accepted at position j

    def record(self, drafts: list[list[int]], emitted: list[list[int]]) -> None:
        """One verify step: drafts[b] proposed, emitted[b] = accepted drafts + 1 token."""
        for d, e in zip(drafts, emitted, strict=True):
            if not d:
                continue
            accepted = len(e) - 1
            self.num_drafts += 1
            self.num_draft_tokens += len(d)
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_pos) < len(d):
                self.accepted_per_pos.extend([0] * (len(d) - len(self.accepted_per_pos)))
            for j in range(accepted):
                self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step of a request with drafts (accepted + the one it adds)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
