"""SamplingMetadata: one step's sampling inputs as batched tensors, built from the requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from kvserve.request import Request

# Same threshold as SamplingParams.greedy.
_GREEDY_TEMPERATURE = 1e-5

_T = TypeVar("_T")


@dataclass
class SamplingMetadata:
    """Sampling inputs of one step: B requests, N >= B rows, V = vocab_size.

    A row is one distribution to sample from. Request b owns the R_b >= 1 consecutive rows
    row_offsets[b] .. row_offsets[b + 1] - 1. Its row j samples the token that follows the
    request's tokens plus the first j of its draft tokens (spec_token_ids in from_requests),
    so that row's penalties and min_tokens count those j tokens as output:

        request      a            b, with drafts d0 d1                     c
        row          0            1            2            3              4
        row sees     a's tokens   b's tokens   b's + d0     b's + d0 d1    c's tokens
        row_offsets  [0, 1, 4, 5]

    Without drafts R_b = 1 and N = B: row b is request b's last computed token. A draft
    model drafting its j-th token wants one row per request that sees j drafts
    (last_row_only in from_requests).

    Optional tensors are None when no row needs them, so the common case (greedy, or plain
    temperature sampling) skips every processor. Random-path tensors cover only the Nr random
    (non-greedy) rows, in the order of random_rows.
    """

    request_ids: list[str]  # [B]
    row_offsets: list[int]  # [B + 1], row_offsets[0] = 0, row_offsets[B] = N
    # [B]: the draft tokens the rows verify (row j of request b is followed by draft j);
    # with last_row_only, the tokens the request's one row sees after its own.
    spec_token_ids: list[list[int]]
    vocab_size: int
    all_greedy: bool
    # Indices (into the N rows) of the random rows; random_index is the same on the device,
    # None when every row is random.
    random_rows: list[int]
    random_index: torch.Tensor | None
    temperature: torch.Tensor | None  # [Nr] float32 > 0; None when all_greedy
    top_k: torch.Tensor | None  # [Nr] int64, V = off; None when no random row uses top-k
    max_top_k: int  # largest k used by a random row, 0 if none
    top_p: torch.Tensor | None  # [Nr] float32 in (0, 1], 1 = off
    min_p: torch.Tensor | None  # [Nr] float32, 0 = off
    # Penalties, [N]: output_counts is set whenever any penalty is, prompt_mask only for
    # repetition penalty.
    no_penalties: bool
    output_counts: torch.Tensor | None  # [N, V] float32
    prompt_mask: torch.Tensor | None  # [N, V] bool
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, cols, values
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # rows, cols
    seeds: list[int | None]  # [B]
    num_logprobs: list[int | None]  # [N]; None = the row wants no logprobs
    # Structured output: (rows [G] of the N, packed allowed-token bitmask [G, ceil(V / 32)]
    # int32); set by the model runner after from_requests, None when no row has a grammar.
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return self.row_offsets[-1]

    @property
    def row_requests(self) -> list[int]:
        """[N]: the index of the request that owns each row."""
        return [b for b in range(len(self.request_ids))
                for _ in range(self.row_offsets[b], self.row_offsets[b + 1])]

    def per_request(self, values: list[_T]) -> list[list[_T]]:
        """A value per row [N] -> for each request, the values of its rows [B][R_b]."""
        off = self.row_offsets
        return [values[off[b]:off[b + 1]] for b in range(len(self.request_ids))]

    @property
    def no_logprobs(self) -> bool:
        return all(k is None for k in self.num_logprobs)

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int,
                      device: torch.device | str = "cpu",
                      spec_token_ids: list[list[int]] | None = None,
                      last_row_only: bool = False) -> SamplingMetadata:
        """spec_token_ids[b]: the draft tokens that follow request b's tokens (none if None);
        request b gets 1 + len(spec_token_ids[b]) rows, or with last_row_only the last of
        them alone (the row after all its drafts)."""
        drafts = spec_token_ids if spec_token_ids is not None else [[] for _ in requests]
        if len(drafts) != len(requests):
            raise ValueError(f"spec_token_ids needs one list per request ({len(requests)}), "
                             f"got {len(drafts)}")
        # Row n: request row_req[n], after row_ahead[n] of its drafts.
        if last_row_only:
            row_req = list(range(len(drafts)))
            row_ahead = [len(d) for d in drafts]
        else:
            row_req = [b for b, d in enumerate(drafts) for _ in range(1 + len(d))]
            row_ahead = [j for d in drafts for j in range(1 + len(d))]
        row_offsets = [0]
        for b in range(len(drafts)):
            row_offsets.append(row_offsets[-1] + (1 if last_row_only else 1 + len(drafts[b])))
        n_rows = row_offsets[-1]
        params = [requests[b].sampling_params for b in row_req]  # [N]
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_TEMPERATURE]
        rparams = [params[i] for i in random_rows]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = top_k = top_p = min_p = random_index = None
        max_top_k = 0
        if rparams:
            temperature = tensor([p.temperature for p in rparams], torch.float32)
            if len(random_rows) < n_rows:
                random_index = tensor(random_rows, torch.int64)
            ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in rparams]
            if any(k < vocab_size for k in ks):
                top_k = tensor(ks, torch.int64)
                max_top_k = max(k for k in ks if k < vocab_size)
            if any(p.top_p < 1.0 for p in rparams):
                top_p = tensor([p.top_p for p in rparams], torch.float32)
            if any(p.min_p > 0.0 for p in rparams):
                min_p = tensor([p.min_p for p in rparams], torch.float32)

        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 for p in params)
        use_pres = any(p.presence_penalty != 0.0 for p in params)
        no_penalties = not (use_rep or use_freq or use_pres)
        output_counts = prompt_mask = None
        if not no_penalties:
            outputs = [requests[b].output_token_ids + drafts[b][:j]
                       for b, j in zip(row_req, row_ahead, strict=True)]
            output_counts = _token_histogram(outputs, vocab_size, device)
            if use_rep:
                # One histogram per request, then a copy per row: a prompt is the same for
                # every row of its request and may be long.
                prompt_mask = _token_histogram([r.prompt_token_ids for r in requests],
                                               vocab_size, device) > 0
                if n_rows > len(requests):
                    prompt_mask = prompt_mask[tensor(row_req, torch.int64)]

        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                if 0 <= tok < vocab_size:  # out-of-range ids are rejected at add_request
                    rows.append(i)
                    cols.append(tok)
                    vals.append(bias)
        logit_bias = ((tensor(rows, torch.int64), tensor(cols, torch.int64),
                       tensor(vals, torch.float32)) if rows else None)

        mrows: list[int] = []
        mcols: list[int] = []
        for i, (b, j, p) in enumerate(zip(row_req, row_ahead, params, strict=True)):
            r = requests[b]
            if r.num_output_tokens + j < p.min_tokens:
                # With ignore_eos, EOS is not a stop token, so min_tokens leaves it alone.
                stop_ids = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    stop_ids.update(r.eos_token_ids)
                for tok in sorted(stop_ids):
                    if 0 <= tok < vocab_size:
                        mrows.append(i)
                        mcols.append(tok)
        min_tokens_mask = ((tensor(mrows, torch.int64), tensor(mcols, torch.int64))
                           if mrows else None)

        def penalty(used: bool, get) -> torch.Tensor | None:
            return tensor([float(get(p)) for p in params], torch.float32) if used else None

        return cls(
            request_ids=[r.request_id for r in requests],
            row_offsets=row_offsets,
            spec_token_ids=[list(d) for d in drafts],
            vocab_size=vocab_size,
            all_greedy=not random_rows,
            random_rows=random_rows,
            random_index=random_index,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            no_penalties=no_penalties,
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            repetition_penalty=penalty(use_rep, lambda p: p.repetition_penalty),
            frequency_penalty=penalty(use_freq, lambda p: p.frequency_penalty),
            presence_penalty=penalty(use_pres, lambda p: p.presence_penalty),
            logit_bias=logit_bias,
            min_tokens_mask=min_tokens_mask,
            seeds=[r.sampling_params.seed for r in requests],
            num_logprobs=[p.logprobs for p in params],
        )


def _token_histogram(token_lists: list[list[int]], vocab_size: int,
                     device: torch.device | str) -> torch.Tensor:
    """[len(token_lists), V] float32 counts via one scatter_add over the lists padded with id V.

    The pad id lands in an extra column V that is sliced off, so padding needs no weights.
    """
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.int64)
    for i, toks in enumerate(token_lists):
        if toks:
            padded[i, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
    padded = padded.clamp_(0, vocab_size).to(device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
