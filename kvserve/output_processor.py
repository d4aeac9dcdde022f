"""What a request's caller sees, built from what the scheduler updated (vLLM's
OutputProcessor): text, stop strings, logprobs, and an n > 1 request's samples gathered.

A request with n > 1 is n child requests (ids "<id>#<i>") in the scheduler, one parent here:

    _Parent  request_id, prompt, prompt logprobs (its first child's), finished children
      _Child i   Request "<id>#<i>" (or "<id>" when n == 1), its detokenizer, its logprobs

One RequestOutput per parent a step touched, cumulative (all text so far), finished when
every child is. The scheduler never sees a parent; this never schedules anything: a stop
string found in a step's tokens is handed back to the engine (`stop`), which finishes the
request in the scheduler before the output is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.loader.tokenizer import Tokenizer
from kvserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvserve.request import Request


@dataclass
class _Child:
    """Per-sample state the scheduler does not keep: text, logprobs."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    prompt_logprobs: dict[int, PositionLogprobs | None] | None = None
    finished_children: set[int] = field(default_factory=set)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[Request], prompt_logprobs: bool) -> None:
        """children: the request's samples in index order (each gets its detokenizer here,
        before the engine queues them: an error leaves nothing to undo in the scheduler)."""
        kids = []
        for i, req in enumerate(children):
            want_lp = req.sampling_params.logprobs is not None
            kids.append(_Child(req, i, IncrementalDetokenizer(self.tokenizer, req),
                               [] if want_lp else None, 0.0 if want_lp else None))
        for req in children:  # only once every child is made
            self._child_to_parent[req.request_id] = request_id
        self._parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, kids,
                                            {} if prompt_logprobs else None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def __len__(self) -> int:
        """Requests not yet finished (parents, not children)."""
        return len(self._parents)

    def remove(self, request_id: str) -> list[str]:
        """Forgets an unfinished request; returns its children's ids ([] if unknown)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = [ch.request.request_id for ch in parent.children]
        for cid in ids:
            self._child_to_parent.pop(cid, None)
        return ids

    def num_choices(self, request_id: str) -> int:
        """How many choices (n) an unfinished request has; 0 for an unknown id."""
        parent = self._parents.get(request_id)
        return len(parent.children) if parent is not None else 0

    def parent_id(self, child_id: str) -> str | None:
        return self._child_to_parent.get(child_id)

    def record_prompt_logprobs(self, child_id: str, first: int,
                               lps: list[PositionLogprobs | None]) -> None:
        """Prompt positions first.. of a request's first child (the others' are the same)."""
        pid = self._child_to_parent.get(child_id)
        parent = self._parents.get(pid) if pid else None
        if parent is None or parent.prompt_logprobs is None or parent.children[0].request \
                .request_id != child_id:
            return
        for i, lp in enumerate(lps):
            # setdefault: a preempted request recomputes its prompt; keep the first result.
            parent.prompt_logprobs.setdefault(first + i, lp)

    def process(self, updated: Iterable[tuple[Request, list[int]]],
                logprobs: dict[str, list[PositionLogprobs] | None],
                stop: Callable[[Request, str], None]) -> tuple[list[RequestOutput], list[str]]:
        """updated: (request, its new token ids) from Scheduler.update_from_output;
        logprobs: each request's, one per new token. A stop string inside a step's tokens
        drops those after it (nothing is emitted past a stop) and calls stop(request, the
        string) unless the request finished anyway. Returns the touched requests' outputs
        (finished ones forgotten) and the ids of the children that finished."""
        touched: dict[str, _Parent] = {}
        finished_ids: list[str] = []
        for req, new_ids in updated:
            pid = self._child_to_parent.get(req.request_id)
            if pid is None:
                continue
            parent = self._parents[pid]
            child = next(c for c in parent.children if c.request is req)
            stop_str = None
            for i, tok in enumerate(new_ids):  # several with drafts: none past a stop string
                _delta, stop_str = child.detok.update([tok])
                if stop_str is not None:
                    req.drop_output_tokens(len(new_ids) - 1 - i)
                    new_ids = new_ids[:i + 1]
                    break
            self._append_logprobs(child, new_ids, logprobs.get(req.request_id))
            if stop_str is not None and not req.is_finished():
                stop(req, stop_str)
            if req.is_finished():
                child.detok.flush()
                parent.finished_children.add(child.index)
                finished_ids.append(req.request_id)
            touched[pid] = parent
        outputs = [self._make_output(p) for p in touched.values()]
        for out in outputs:
            if out.finished:
                self.remove(out.request_id)
        return outputs, finished_ids

    @staticmethod
    def _append_logprobs(child: _Child, new_ids: list[int],
                         lps: list[PositionLogprobs] | None) -> None:
        if child.logprobs is None or lps is None:
            return
        # Token strings are not decoded here, on the engine thread: whoever formats the
        # logprobs asks Tokenizer.decode_token (cached) for the few it shows.
        for tok, lp in zip(new_ids, lps):
            child.logprobs.append(lp)
            child.cumulative_logprob = (child.cumulative_logprob or 0.0) + lp[tok].logprob

    @staticmethod
    def _make_output(parent: _Parent) -> RequestOutput:
        outs = []
        for ch in parent.children:
            req = ch.request
            outs.append(CompletionOutput(
                index=ch.index, text=ch.detok.output_text, token_ids=list(req.output_token_ids),
                cumulative_logprob=ch.cumulative_logprob, logprobs=ch.logprobs,
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason))
        plp = None
        if parent.prompt_logprobs is not None:
            plp = [parent.prompt_logprobs.get(i) for i in range(len(parent.prompt_token_ids))]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=plp, outputs=outs,
            finished=len(parent.finished_children) == len(parent.children),
            num_cached_tokens=max(parent.children[0].request.num_cached_tokens, 0))
