"""SamplingMetadata: one step's sampling inputs as batched tensors, built from the requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.request import Request

# Same threshold as SamplingParams.greedy.
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Sampling inputs of one step, B rows (one per request), V = vocab_size.

    Optional tensors are None when no row needs them, so the common case (greedy, or plain
    temperature sampling) skips every processor. Per-row random-path tensors cover only the
    R random (non-greedy) rows, in the order of random_rows.
    """

    request_ids: list[str]
    vocab_size: int
    all_greedy: bool
    # Indices (into the batch) of the random rows; random_index is the same on the device,
    # None when every row is random.
    random_rows: list[int]
    random_index: torch.Tensor | None
    temperature: torch.Tensor | None  # [R] float32 > 0; None when all_greedy
    top_k: torch.Tensor | None  # [R] int64, V = off; None when no random row uses top-k
    max_top_k: int  # largest k used by a random row, 0 if none
    top_p: torch.Tensor | None  # [R] float32 in (0, 1], 1 = off
    min_p: torch.Tensor | None  # [R] float32, 0 = off
    # Penalties, [B]: output_counts is set whenever any penalty is, prompt_mask only for
    # repetition penalty.
    no_penalties: bool
    output_counts: torch.Tensor | None  # [B, V] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, cols, values
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # rows, cols
    seeds: list[int | None]  # [B]
    num_logprobs: list[int | None]  # [B]; None = the row wants no logprobs
    # Structured output: (rows [G], packed allowed-token bitmask [G, ceil(V / 32)] int32);
    # set by the model runner after from_requests, None when no row has a grammar.
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def no_logprobs(self) -> bool:
        return all(k is None for k in self.num_logprobs)

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int,
                      device: torch.device | str = "cpu") -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        batch = len(requests)
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_TEMPERATURE]
        rparams = [params[i] for i in random_rows]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = top_k = top_p = min_p = random_index = None
        max_top_k = 0
        if rparams:
            temperature = tensor([p.temperature for p in rparams], torch.float32)
            if len(random_rows) < batch:
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
            output_counts = _token_histogram([r.output_token_ids for r in requests], vocab_size,
                                             device)
            if use_rep:
                prompt_mask = _token_histogram([r.prompt_token_ids for r in requests],
                                               vocab_size, device) > 0

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
        for i, (r, p) in enumerate(zip(requests, params, strict=True)):
            if r.num_output_tokens < p.min_tokens:
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
            seeds=[p.seed for p in params],
            num_logprobs=[p.logprobs for p in params],
        )


def _token_histogram(token_lists: list[list[int]], vocab_size: int,
                     device: torch.device | str) -> torch.Tensor:
    """[B, V] float32 counts via one scatter_add over the lists padded with id V.

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
