"""Token-budget continuous batching (vLLM v1 style).

There are no prefill and decode phases. Every request has all_token_ids and
num_computed_tokens; a step gives each request some of its uncomputed tokens, within a token
budget (max_num_batched_tokens) and a request cap (max_num_seqs):

    all_token_ids  |======= computed =======|== this step ==|... later chunks ...|
                   0           num_computed_tokens                       num_tokens

A decode is the case num_tokens - num_computed_tokens == 1, a prefill chunk any larger
slice, and a decode with k draft tokens (request.spec_token_ids, speculative decoding) the
slice plus the k drafts, 1 + k tokens and their KV slots:

    all_token_ids  |======= computed =======|last| d0 d1 .. dk-1 |   fed this step: 1 + k
    after the step, a drafts accepted:  num_computed_tokens -= k - a  (the rejected ones)

The rejected drafts' KV slots hold garbage that the next step overwrites: attention never
reads past seq_len. None of this needs a special case elsewhere here.

Order of one schedule():
  1. RUNNING requests, most important first: the heaviest service tier first, then by key
     (fair_queue.py). When one cannot get blocks, the least important running request is
     preempted: its blocks are freed and it goes back to WAITING to be recomputed later,
     prefix cache helping.
  2. WAITING requests as the FairQueue hands them out (weighted fair share across tiers,
     within a tier (priority, arrival_time)) while budget, max_num_seqs, the tier's
     max_running and blocks allow; skipped in a step that preempted. A waiting request never
     preempts a running one (see _schedule_waiting).

num_computed_tokens advances in schedule(), right after a request is scheduled, so that the
next schedule() already knows what is in flight; update_from_output() only appends tokens.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.fair_queue import FairQueue, OrderKey
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.layout import cdiv
from kvserve.outputs import ModelOutput, ScheduledRequest, SchedulerOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import ParamError


class QueueFullError(RuntimeError):
    """The waiting queue is at SchedulerConfig.max_waiting_requests (the server's 503), or
    the request's tier is at its max_waiting (tier is its name then; the server's 429)."""

    def __init__(self, message: str, tier: str | None = None) -> None:
        super().__init__(message)
        self.tier = tier


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, num_lookahead_tokens: int = 0) -> None:
        self.config = scheduler_config
        # KV slots reserved past a sampling step's tokens, for a draft model to write its
        # drafts' KV into before the next step verifies them (vLLM's num_lookahead_tokens).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.block_pool = BlockPool(num_blocks, cache_config.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(self.block_pool, self.block_size,
                                               cache_config.enable_prefix_caching)
        # Every unfinished request, waiting or running.
        self.requests: dict[str, Request] = {}
        self._order: dict[str, OrderKey] = {}
        self.waiting = FairQueue(scheduler_config.tiers)
        # Kept sorted by key, most important first. Then the preemption victim is always the
        # last entry, which schedule() reaches last: a victim is never a request that was
        # already scheduled in the same step (its blocks would hold uncomputed KV).
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- intake -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request. ValueError if it can never run; QueueFullError if full now."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.num_prompt_tokens < 1:
            raise ValueError(f"request {rid!r}: the prompt must have at least 1 token")
        max_len = request.num_prompt_tokens + request.max_tokens
        if max_len > self.config.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {max_len} exceeds max_model_len "
                f"({self.config.max_model_len})")
        blocks_needed = cdiv(max_len, self.block_size)
        if blocks_needed > self.num_blocks - 1:
            raise ParamError(
                "max_tokens", f"request {rid!r}: prompt + max_tokens = {max_len} tokens needs "
                f"{blocks_needed} KV blocks of {self.block_size} tokens, but the cache holds "
                f"only {self.num_blocks - 1} usable blocks")
        self.waiting.check(request)
        limit = self.config.max_waiting_requests
        room, full_tier = self.waiting.has_room(request, limit)
        if full_tier is not None:
            cap = self.waiting.tiers[full_tier].max_waiting
            raise QueueFullError(f"the waiting queue of tier {full_tier!r} is full ({cap} "
                                 f"requests); retry later", tier=full_tier)
        if not room:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        request.status = RequestStatus.WAITING
        self._order[rid] = self.waiting.new_key(request)
        self.requests[rid] = request
        self.waiting.push(self._order[rid], request)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted_ids)
        if not preempted_ids:
            # After a preemption memory is short: admitting more would only cause more.
            budget = self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(scheduled=scheduled,
                               num_batched_tokens=self.config.max_num_batched_tokens - budget,
                               preempted_ids=preempted_ids)

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted_ids: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            num_spec = 0
            if req.spec_token_ids and num_new == req.num_tokens - req.num_computed_tokens:
                num_spec = min(len(req.spec_token_ids), self.max_drafts(req), budget - num_new)
            if not self._allocate_or_preempt(req, num_new + num_spec, preempted_ids):
                break  # req itself was preempted: it was the last running request
            scheduled.append(self._commit(req, num_new, num_spec))
            budget -= num_new + num_spec
            i += 1
        return budget

    def max_drafts(self, req: Request) -> int:
        """How many draft tokens req's next step may verify: it yields up to k + 1 tokens,
        which must fit its max_tokens and max_model_len."""
        return max(0, min(req.max_tokens - req.num_output_tokens,
                          self.config.max_model_len - req.num_tokens) - 1)

    def _slots(self, req: Request, num_computed: int, num_new: int) -> int:
        """The KV slots a step of num_new tokens after num_computed needs: those, plus the
        lookahead slots when it reaches req's last token (it samples), within the room req's
        own length limits leave."""
        total = num_computed + num_new
        if total < req.num_tokens:
            return num_new
        limit = min(req.num_prompt_tokens + req.max_tokens, self.config.max_model_len)
        return num_new + max(0, min(self.num_lookahead_tokens, limit - total))

    def _allocate_or_preempt(self, req: Request, num_new: int, preempted_ids: list[str]
                             ) -> bool:
        """Preempts least important running requests until req gets its blocks; False when
        req itself had to go."""
        num_new = self._slots(req, req.num_computed_tokens, num_new)
        while self.kv_cache_manager.allocate_slots(req, num_new) is None:
            # running[-1] is the least important. It sits at or after req in self.running,
            # so it has not been scheduled in this step.
            victim = self.running.pop()
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admits waiting requests in order; the first that does not fit blocks the rest, so
        a large request is not starved by smaller ones behind it.

        Not done (as in vLLM v1): preempting a running request in favour of a more important
        waiting one. The victim would usually be scheduled in this step already, with blocks
        registered in the prefix index whose KV would then never be computed.
        """
        tiers = self.waiting.tiers
        running = Counter(r.tier for r in self.running)

        def eligible(tier: str) -> bool:
            cap = tiers[tier].max_running
            return cap is None or running[tier] < cap

        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.head(eligible)
            if req is None:
                break
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(req)
            num_new = req.num_tokens - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            num_alloc = self._slots(req, num_computed, num_new)
            if self.kv_cache_manager.allocate_slots(req, num_alloc, computed_blocks) is None:
                break
            self.waiting.pop(req)
            running[req.tier] += 1
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, req, key=self._key)
            scheduled.append(self._commit(req, num_new))
            budget -= num_new
        return budget

    def _commit(self, req: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        drafts = req.spec_token_ids[:num_spec]
        out = ScheduledRequest(request=req, token_ids=req.all_token_ids[start:end] + drafts,
                               start_pos=start,
                               block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
                               sample=end == req.num_tokens, spec_token_ids=drafts)
        # Drafts are for one step: the proposer makes new ones after it.
        req.spec_token_ids = []
        req.num_computed_tokens = end + num_spec
        return out

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Same key as on arrival: it returns ahead of everything that arrived after it.
        self.waiting.push(self._order[req.request_id], req)

    def _key(self, req: Request) -> tuple[int, OrderKey]:
        """The running list's order: heavier tiers first, then the queue key."""
        return self.waiting.rank[req.tier], self._order[req.request_id]

    # -- results ----------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, model_output: ModelOutput
                           ) -> list[tuple[Request, list[int]]]:
        """Appends sampled tokens and runs the token-level stop checks.

        Returns (request, new token ids) for every request that got tokens, finished ones
        included. A step that verified k drafts returns the a accepted ones plus one token;
        the k - a rejected drafts leave num_computed_tokens. Tokens after a stop token are
        dropped. Stop strings are the detokenizer's job; it calls finish_request().
        """
        sampled = dict(zip(model_output.req_ids, model_output.sampled_token_ids, strict=True))
        results: list[tuple[Request, list[int]]] = []
        now = time.monotonic()
        for sched in scheduler_output.scheduled:
            req = sched.request
            new_ids = sampled.get(req.request_id)
            # Aborted between schedule() and now: its tokens are of no use.
            if not sched.sample or not new_ids or req.status != RequestStatus.RUNNING:
                continue
            num_spec = len(sched.spec_token_ids)
            if not 1 <= len(new_ids) <= num_spec + 1:
                raise RuntimeError(f"request {req.request_id}: {len(new_ids)} tokens for a "
                                   f"step with {num_spec} drafts")
            # The accepted drafts' KV stays; the rejected ones' is overwritten next step.
            req.num_computed_tokens -= num_spec - (len(new_ids) - 1)
            accepted: list[int] = []
            for token_id in new_ids:
                req.append_output_token(token_id)
                accepted.append(token_id)
                if self._check_stop(req, token_id):
                    break
            if req.first_token_time is None:
                req.first_token_time = now
            if req.is_finished():
                self._remove(req)
            results.append((req, accepted))
        return results

    def _check_stop(self, req: Request, token_id: int) -> bool:
        """Sets a finished status; order: EOS, stop_token_ids, then length limits."""
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token_id
                return True
        if (req.num_output_tokens >= req.max_tokens
                or req.num_tokens >= self.config.max_model_len):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        """Finishes a waiting or running request (stop string, abort); unknown id: no-op."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        req = self.requests.get(request_id)
        if req is None:
            return
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self._remove(req)

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _remove(self, req: Request) -> None:
        """Drops a finished request from the queues and frees its blocks."""
        rid = req.request_id
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(self._order[rid], req)
        self.kv_cache_manager.free(req)
        del self.requests[rid]
        del self._order[rid]

    # -- queries and stats ------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_groups(self) -> int:
        """Waiting requests as max_waiting_requests counts them (n children count once)."""
        return self.waiting.num_groups

    def tier_counts(self) -> dict[str, tuple[int, int, int]]:
        """tier -> (running, waiting, waiting as its max_waiting counts them: a request's n
        children once), every tier listed."""
        running = Counter(r.tier for r in self.running)
        w = self.waiting
        return {t: (running[t], w.num_waiting(t), w.num_waiting_groups(t)) for t in w.tiers}

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits
