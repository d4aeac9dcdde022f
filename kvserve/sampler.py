"""Logits processors and sampling for one batch: one sampled position per request.

One step, in vLLM v1's order:

    raw logits --log_softmax--> logprobs returned to the user (the model's own distribution,
       |                        before any processing: vLLM's default "raw_logprobs")
       v
    logit_bias -> min_tokens (mask EOS and stop ids) -> repetition penalty
       -> frequency and presence penalties
       +--> greedy rows: argmax
       +--> random rows: / temperature -> top-k -> top-p -> min-p -> softmax
                         -> the inverse CDF at u ~ U(0, 1], one u per row

The inverse CDF picks the first token whose cumulative probability reaches u * total: token
i with probability probs[i], from one random number per row and no device sync. (The
exponential race, argmax(probs / q) with q ~ Exp(1) per token, needs V random numbers per
row; drawing them cost ~6 ms per step at 8 rows of a 49k vocabulary on the CPU, more than the
forward pass.) Each seeded request draws its u from its own generator, which lives in the
Sampler across steps, so its tokens do not depend on what else is in the batch. Unseeded rows
draw from one generator shared by the batch and seeded by the engine seed, so their tokens
repeat when the same requests arrive in the same order. Greedy rows need no random numbers.

Everything is batched; the only per-request Python loops are the ones that build the metadata
from request lists and the ones that draw seeded random rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.outputs import Logprob, PositionLogprobs
from kvserve.request import Request
from kvserve.sampling_params import _SEED_RANGE

# Same threshold as SamplingParams.greedy.
_GREEDY_TEMPERATURE = 1e-5
# Top-p slack for float error in the cumulative sum: a set whose probability is within this of
# top_p counts as reaching it, so probs [0.5, 0.3, ...] with top_p=0.8 keep exactly two tokens
# even though 0.5 + 0.3 is not exactly 0.8 in float32.
_TOP_P_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Pure processors. Each takes logits [B, V] and returns a new tensor (the input is not mutated).
# ---------------------------------------------------------------------------------------------


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """logits[rows[j], cols[j]] += values[j]: the sparse form of OpenAI's logit_bias."""
    return logits.index_put((rows, cols), values.to(logits.dtype), accumulate=True)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor,
                     cols: torch.Tensor) -> torch.Tensor:
    """logits[rows[j], cols[j]] = -inf (min_tokens: EOS and stop ids cannot be sampled yet)."""
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((rows, cols), neg_inf)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output: in row rows[g], token t survives only if bit t % 32 of
    bitmask[g, t // 32] is set (xgrammar's packed layout, int32 [G, ceil(V / 32)])."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    rows = rows.to(logits.device)
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor,
                    prompt_mask: torch.Tensor | None = None,
                    repetition_penalty: torch.Tensor | None = None,
                    frequency_penalty: torch.Tensor | None = None,
                    presence_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI) penalties.

    output_counts [B, V]: how often each token occurs in the row's output so far.
    prompt_mask [B, V] bool: tokens of the prompt (only the repetition penalty looks at it).
    Penalties are [B]; None skips that penalty.

        repetition, for tokens seen in prompt or output:  l > 0 -> l / r,  l <= 0 -> l * r
        frequency and presence, over output tokens only:  l -= count * f + (count > 0) * p
    """
    seen_in_output = output_counts > 0
    if repetition_penalty is not None:
        seen = seen_in_output if prompt_mask is None else seen_in_output | prompt_mask
        rep = repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    if presence_penalty is not None:
        logits = logits - presence_penalty.unsqueeze(1) * seen_in_output
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """temperature [B], all > 0 (greedy rows never get here)."""
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Per-row top-k and top-p; masked tokens get -inf.

    top_k [B] int64, k >= V means off for that row. Every token whose logit is >= the k-th
    largest survives, so ties at the boundary are kept (vLLM and gpt-fast do the same).
    top_p [B] in (0, 1], 1 means off. Keeps the smallest set of most likely tokens whose
    cumulative probability (renormalized after top-k) is >= top_p, within _TOP_P_EPS; the most
    likely token always survives.
    max_top_k: the largest k among rows that use top-k, if the caller knows it (saves a sync).

    With top-p, one ascending sort serves both filters. Ascending order (as in vLLM) makes the
    cumsum add the small tail probabilities first, where float error matters most:

        ascending position:  0 ........................... V-k ............ V-1
                             |-- dropped by top-k --|       |-- kept by top-k --|
        top-p drops position i while cumsum(probs[0..i]) <= 1 - top_p
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        # top-k alone: topk of the largest k needed is much cheaper than a full sort.
        k_on = top_k < vocab
        if max_top_k is None:
            max_top_k = int(torch.where(k_on, top_k, 1).max())
        max_top_k = max(1, min(max_top_k, vocab))
        top_vals = logits.topk(max_top_k, dim=1).values
        kth = top_vals.gather(1, (top_k.clamp(1, max_top_k) - 1).unsqueeze(1))
        kth = torch.where(k_on.unsqueeze(1), kth, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, sorted_idx = logits.sort(dim=1, descending=False)
    if top_k is not None:
        k = top_k.clamp(1, vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=1).cumsum(dim=1)
    drop = cum <= (1.0 - top_p + _TOP_P_EPS).unsqueeze(1)
    drop &= (top_p < 1.0).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max_prob; min_p [B], 0 means off."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row, the first token whose cumulative probability reaches u * total,
    u [R] in (0, 1]. The cumulative sum never decreases, and the target is > 0 and <= the
    total, so the token found has probability > 0: a masked (zero) token is never picked."""
    cum = probs.cumsum(dim=1)
    target = u.to(cum.dtype).unsqueeze(1) * cum[:, -1:]
    return torch.searchsorted(cum, target).squeeze(1).clamp_max(probs.shape[1] - 1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: list[int]) -> list[PositionLogprobs]:
    """For each row: the top num_logprobs[b] tokens and token_ids[b], with their ranks.

    logprobs [B, V] (already log-softmaxed), token_ids [B]. rank = 1 + the number of tokens
    with a strictly greater logprob. For a top-k token every strictly greater token is also in
    the top-k, so its rank is counted inside the [B, k, k] comparison, not over V.
    """
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    token_rank = (logprobs > token_lp.unsqueeze(1)).sum(dim=1) + 1
    max_k = max(num_logprobs, default=0)
    top_lp_l: list[list[float]] = []
    top_ids_l: list[list[int]] = []
    top_rank_l: list[list[int]] = []
    if max_k > 0:
        top_lp, top_ids = logprobs.topk(max_k, dim=1)
        top_rank = (top_lp.unsqueeze(1) > top_lp.unsqueeze(2)).sum(dim=2) + 1
        top_lp_l, top_ids_l, top_rank_l = top_lp.tolist(), top_ids.tolist(), top_rank.tolist()
    out: list[PositionLogprobs] = []
    for b, (tok, lp, rank) in enumerate(zip(token_ids.tolist(), token_lp.tolist(),
                                            token_rank.tolist(), strict=True)):
        entry: PositionLogprobs = {tok: Logprob(lp, rank, None)}
        for j in range(num_logprobs[b]):
            entry.setdefault(top_ids_l[b][j], Logprob(top_lp_l[b][j], top_rank_l[b][j], None))
        out.append(entry)
    return out


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> list[PositionLogprobs]:
    """logits [N, V] at prompt positions, target_ids [N] the prompt token that follows each.

    Raw logprobs, like the sampled ones: the top k tokens plus the actual prompt token.
    """
    logprobs = torch.log_softmax(logits.float(), dim=1)
    return gather_logprobs(logprobs, target_ids.to(logprobs.device, torch.int64),
                           [k] * logits.shape[0])


# ---------------------------------------------------------------------------------------------
# Per-step metadata and the stateful sampler.
# ---------------------------------------------------------------------------------------------


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


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B]
    # [B]: None for rows that asked no logprobs; the whole list is None when no row did.
    logprobs: list[PositionLogprobs | None] | None
    sampled: torch.Tensor  # [B] int64 on the logits' device (for feeding the next step)


class Sampler:
    """Samples one token per row and keeps the per-request generators between steps.

    seed seeds the generator shared by unseeded requests: the same seed and the same steps
    draw the same tokens (the engine passes EngineConfig.seed); None: fresh entropy. A
    request's own seed always wins, and its draws ignore the engine seed and the batch. The
    sampler never reads torch's global generator. Call remove(request_id) when a request
    finishes or is aborted, or its generator leaks.
    """

    def __init__(self, seed: int | None = None) -> None:
        # Checked here, not at the first random row: there a bad seed would fail a step.
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{_SEED_RANGE[0]}, "
                             f"{_SEED_RANGE[1]}], got {seed!r}")
        self._seed = seed
        self._shared: torch.Generator | None = None
        self._generators: dict[str, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self._generators)

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] of the model (not modified); rows in the order of meta.request_ids."""
        logits = logits.float()
        raw_logprobs = None if meta.no_logprobs else torch.log_softmax(logits, dim=1)
        logits = self.process_logits(logits, meta)

        if meta.all_greedy:
            sampled = logits.argmax(dim=1)
        elif meta.random_index is None:
            sampled = self._sample_random(logits, meta)
        else:
            rand_tokens = self._sample_random(logits[meta.random_index], meta)
            sampled = logits.argmax(dim=1).index_copy(0, meta.random_index, rand_tokens)

        logprobs: list[PositionLogprobs | None] | None = None
        if raw_logprobs is not None:
            want = [b for b, k in enumerate(meta.num_logprobs) if k is not None]
            idx = torch.tensor(want, dtype=torch.int64, device=logits.device)
            rows = gather_logprobs(raw_logprobs[idx], sampled[idx],
                                   [meta.num_logprobs[b] or 0 for b in want])
            logprobs = [None] * len(meta.num_logprobs)
            for b, entry in zip(want, rows, strict=True):
                logprobs[b] = entry
        return SamplerOutput(sampled.tolist(), logprobs, sampled)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The processors that apply to greedy and random rows alike."""
        if meta.token_bitmask is not None:
            logits = apply_token_bitmask(logits, *meta.token_bitmask)
        if meta.logit_bias is not None:
            logits = apply_logit_bias(logits, *meta.logit_bias)
        if meta.min_tokens_mask is not None:
            logits = apply_token_mask(logits, *meta.min_tokens_mask)
        if not meta.no_penalties:
            assert meta.output_counts is not None
            logits = apply_penalties(logits, meta.output_counts, meta.prompt_mask,
                                     meta.repetition_penalty, meta.frequency_penalty,
                                     meta.presence_penalty)
        return logits

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [R, V] of the random rows."""
        assert meta.temperature is not None
        logits = apply_temperature(logits, meta.temperature)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        probs = logits.softmax(dim=1)
        return sample_from_probs(probs, self._uniforms(probs, meta))

    def _uniforms(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """u [R] ~ U(0, 1]: seeded rows from their own generator, the rest from the shared one.

        A seeded row's draw depends only on its generator's state, never on its row position
        or the batch size, which is what makes seeded output batch-independent.
        """
        device = probs.device
        u = torch.empty(probs.shape[0], dtype=torch.float64, device=device)
        seeded = [(r, b) for r, b in enumerate(meta.random_rows) if meta.seeds[b] is not None]
        if len(seeded) < len(meta.random_rows):
            shared = self._shared_generator(device)
            if not seeded:
                return 1 - u.uniform_(generator=shared)  # [0, 1) -> (0, 1]
            unseeded = [r for r, b in enumerate(meta.random_rows) if meta.seeds[b] is None]
            draws = torch.empty(len(unseeded), dtype=u.dtype, device=device)
            u[torch.tensor(unseeded, device=device)] = draws.uniform_(generator=shared)
        for r, b in seeded:
            gen = self._request_generator(meta.request_ids[b], meta.seeds[b], device)
            u[r:r + 1].uniform_(generator=gen)
        return 1 - u

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._shared is None or self._shared.device != device:
            self._shared = torch.Generator(device=device)
            if self._seed is None:
                self._shared.seed()
            else:
                self._shared.manual_seed(self._seed)
        return self._shared

    def _request_generator(self, request_id: str, seed: int | None,
                           device: torch.device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            # Created on the logits' device: a CPU generator cannot fill a CUDA tensor.
            gen = torch.Generator(device=device).manual_seed(seed)
            self._generators[request_id] = gen
        return gen
