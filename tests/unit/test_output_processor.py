"""OutputProcessor: a step's new tokens -> each request's cumulative RequestOutput, with a
small BPE trained in-process; the scheduler's part (appending tokens, finishing) done by hand."""

from __future__ import annotations

import pytest

from kvserve.output_processor import OutputProcessor
from kvserve.outputs import Logprob
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.unit.small_bpe import BPEAdapter, train_bpe

PROMPT = "hello"


@pytest.fixture(scope="module")
def tok() -> BPEAdapter:
    return BPEAdapter(train_bpe())


def _children(tok: BPEAdapter, rid: str, n: int, **params: object) -> list[Request]:
    ids = tok.encode(PROMPT)
    return [Request(rid if n == 1 else f"{rid}#{i}", ids, SamplingParams(**params),
                    max_tokens=100, group_id=rid) for i in range(n)]


def _step(req: Request, ids: list[int]) -> tuple[Request, list[int]]:
    """What Scheduler.update_from_output does to a request before it reports it."""
    for t in ids:
        req.append_output_token(t)
    return req, ids


def _no_stop(req: Request, stop: str) -> None:
    raise AssertionError(f"no stop string expected, got {stop!r} for {req.request_id}")


def test_n_samples_gather_into_one_output_that_finishes_with_the_last(tok: BPEAdapter) -> None:
    proc = OutputProcessor(tok)
    c0, c1 = kids = _children(tok, "r", 2)
    proc.add("r", PROMPT, tok.encode(PROMPT), kids, prompt_logprobs=False)
    assert "r" in proc and len(proc) == 1 and proc.num_choices("r") == 2
    assert proc.parent_id("r#1") == "r" and proc.parent_id("r") is None
    a, b = tok.encode(" world"), tok.encode(" there")

    outs, done = proc.process([_step(c0, a), _step(c1, b)], {}, _no_stop)
    assert done == [] and len(outs) == 1
    out = outs[0]
    assert (out.request_id, out.prompt, out.finished) == ("r", PROMPT, False)
    assert [(o.index, o.text, o.token_ids) for o in out.outputs] == [
        (0, tok.decode(a), a), (1, tok.decode(b), b)]

    c0.status = RequestStatus.FINISHED_LENGTH  # the scheduler's: max_tokens reached
    outs, done = proc.process([_step(c0, [])], {}, _no_stop)
    assert done == ["r#0"] and not outs[0].finished and "r" in proc
    assert [o.finish_reason for o in outs[0].outputs] == ["length", None]

    c1.status = RequestStatus.FINISHED_STOPPED
    outs, done = proc.process([_step(c1, [])], {}, _no_stop)
    assert done == ["r#1"] and outs[0].finished
    assert [o.finish_reason for o in outs[0].outputs] == ["length", "stop"]
    assert "r" not in proc and len(proc) == 0 and proc.parent_id("r#0") is None


def test_a_stop_string_inside_a_steps_tokens_drops_the_rest(tok: BPEAdapter) -> None:
    """Several tokens in one step (accepted drafts): nothing past the stop string is kept,
    and the engine is asked to finish the request."""
    proc = OutputProcessor(tok)
    (req,) = _children(tok, "s", 1, stop=["lazy dog"], logprobs=0)
    proc.add("s", PROMPT, tok.encode(PROMPT), [req], prompt_logprobs=False)
    text = " the quick brown fox jumps over the lazy dog again"
    ids = tok.encode(text)
    # the first token whose text completes the stop string, found by decoding prefixes
    last = next(i for i in range(len(ids)) if "lazy dog" in tok.decode(ids[:i + 1]))
    assert last < len(ids) - 1  # tokens follow it in the same step
    stops: list[tuple[str, str]] = []

    def stop(r: Request, s: str) -> None:
        stops.append((r.request_id, s))
        r.status = RequestStatus.FINISHED_STOPPED

    lps = [{t: Logprob(-0.5, 1)} for t in ids]
    outs, done = proc.process([_step(req, ids)], {"s": lps}, stop)
    assert stops == [("s", "lazy dog")] and done == ["s"]
    assert req.output_token_ids == ids[:last + 1]
    (o,) = outs[0].outputs
    assert o.text == text[:text.index("lazy dog")]
    assert o.token_ids == ids[:last + 1] and o.finish_reason == "stop"
    assert o.logprobs == lps[:last + 1] and o.cumulative_logprob == -0.5 * (last + 1)
    assert outs[0].finished and len(proc) == 0


def test_prompt_logprobs_come_from_the_first_child_and_keep_the_first_result(
        tok: BPEAdapter) -> None:
    proc = OutputProcessor(tok)
    kids = _children(tok, "p", 2, prompt_logprobs=0)
    prompt_ids = tok.encode(PROMPT)
    proc.add("p", PROMPT, prompt_ids, kids, prompt_logprobs=True)
    n = len(prompt_ids)
    first = [None] + [{prompt_ids[j]: Logprob(-1.0 * j, 1)} for j in range(1, n)]
    proc.record_prompt_logprobs("p#1", 0, [{0: Logprob(-9.0, 1)}] * n)  # another child's
    proc.record_prompt_logprobs("p#0", 0, first)
    proc.record_prompt_logprobs("p#0", 0, [{0: Logprob(-7.0, 1)}] * n)  # recomputed: kept
    outs, _ = proc.process([_step(kids[0], tok.encode(" world"))], {}, _no_stop)
    assert outs[0].prompt_logprobs == first


def test_remove_forgets_a_request_and_names_its_children(tok: BPEAdapter) -> None:
    proc = OutputProcessor(tok)
    kids = _children(tok, "x", 3)
    proc.add("x", PROMPT, tok.encode(PROMPT), kids, prompt_logprobs=False)
    assert proc.remove("x") == ["x#0", "x#1", "x#2"]
    assert proc.remove("x") == [] and proc.num_choices("x") == 0 and len(proc) == 0
    # a removed request's late updates are ignored, not an error
    assert proc.process([_step(kids[0], tok.encode(" world"))], {}, _no_stop) == ([], [])
