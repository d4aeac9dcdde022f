"""Logits processors and sampling for one batch of rows: one per request, or several (a
request's rows are laid out in metadata.py).

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
Sampler across steps, so its tokens do not depend on what else is in the batch; a request with
several rows draws their u in row order, so its row j draws what a one-row step would draw j
steps later. Unseeded rows draw from one generator shared by the batch and seeded by the engine
seed, so their tokens repeat when the same requests arrive in the same order. Greedy rows need
no random numbers.

Everything is batched; the only per-request Python loops are the ones that build the metadata
from request lists and the ones that draw seeded random rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.outputs import PositionLogprobs
from kvserve.sample.logprobs import gather_logprobs
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.processors import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_token_mask,
    apply_top_k_top_p,
    sample_from_probs,
)
from kvserve.sample.rejection import verify_drafts
from kvserve.sampling_params import _SEED_RANGE


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N], a token per row (SamplingMetadata.per_request splits them)
    # [N]: None for rows that asked no logprobs; the whole list is None when no row did.
    logprobs: list[PositionLogprobs | None] | None
    sampled: torch.Tensor  # [N] int64 on the logits' device (for feeding the next step)


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # [B]: a request's accepted drafts, then one token
    # [B]: the target's logprobs of those tokens, None for requests that asked none.
    logprobs: list[list[PositionLogprobs] | None]


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
        """logits [N, V] of the model (not modified), in meta's row order: request b's rows
        at meta.row_offsets[b] .. meta.row_offsets[b + 1] - 1."""
        logits = logits.float()
        raw_logprobs = None if meta.no_logprobs else torch.log_softmax(logits, dim=1)
        logits = self.process_logits(logits, meta)

        sampled, _ = self.sample_rows(logits, meta)

        logprobs: list[PositionLogprobs | None] | None = None
        if raw_logprobs is not None:
            want = [n for n, k in enumerate(meta.num_logprobs) if k is not None]
            idx = torch.tensor(want, dtype=torch.int64, device=logits.device)
            rows = gather_logprobs(raw_logprobs[idx], sampled[idx],
                                   [meta.num_logprobs[n] or 0 for n in want])
            logprobs = [None] * len(meta.num_logprobs)
            for n, entry in zip(want, rows, strict=True):
                logprobs[n] = entry
        return SamplerOutput(sampled.tolist(), logprobs, sampled)

    def verify(self, logits: torch.Tensor, meta: SamplingMetadata,
               draft_probs: list[torch.Tensor | None] | None = None) -> VerifyOutput:
        """Rejection sampling of meta.spec_token_ids (rejection.py): logits [N, V] of the
        model, request b's k_b + 1 rows as __call__ takes them; draft_probs[b] the q [k_b, V]
        its drafts were drawn from (None: a deterministic proposer's one-hot).

        With no drafts this is __call__: the same processors, argmax and draws."""
        logits = logits.float()
        raw_logprobs = None if meta.no_logprobs else torch.log_softmax(logits, dim=1)
        logits = self.process_logits(logits, meta)
        argmax = logits.argmax(dim=1)
        probs = u = None
        random_pos = [-1] * meta.num_rows
        if not meta.all_greedy:
            probs, u = self._random_draws(logits, meta)
            for r, n in enumerate(meta.random_rows):
                random_pos[n] = r
        greedy = [random_pos[meta.row_offsets[b]] < 0 for b in range(len(meta.request_ids))]
        tokens = verify_drafts(meta.row_offsets, meta.spec_token_ids, greedy, argmax, probs,
                               random_pos, u, draft_probs or [None] * len(greedy))
        logprobs: list[list[PositionLogprobs] | None] = [None] * len(tokens)
        if raw_logprobs is not None:
            want = [b for b in range(len(tokens)) if meta.num_logprobs[meta.row_offsets[b]]
                    is not None]
            rows = [meta.row_offsets[b] + j for b in want for j in range(len(tokens[b]))]
            chosen = [t for b in want for t in tokens[b]]
            entries = gather_logprobs(
                raw_logprobs[torch.tensor(rows, dtype=torch.int64, device=logits.device)],
                torch.tensor(chosen, dtype=torch.int64, device=logits.device),
                [meta.num_logprobs[n] or 0 for n in rows])
            i = 0
            for b in want:
                logprobs[b] = entries[i:i + len(tokens[b])]
                i += len(tokens[b])
        return VerifyOutput(tokens, logprobs)

    @staticmethod
    def changes_logits(meta: SamplingMetadata) -> bool:
        """Whether process_logits would change any row (else it returns logits as given)."""
        return (meta.token_bitmask is not None or meta.logit_bias is not None
                or meta.min_tokens_mask is not None or not meta.no_penalties)

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

    def sample_rows(self, logits: torch.Tensor, meta: SamplingMetadata
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A token per row [N] from processed logits (process_logits): the argmax of greedy
        rows, a draw from the random rows' distributions, which come back too ([Nr, V] in
        meta.random_rows' order; None when every row is greedy)."""
        if meta.all_greedy:
            return logits.argmax(dim=1), None
        probs, u = self._random_draws(logits, meta)
        drawn = sample_from_probs(probs, u)
        if meta.random_index is None:
            return drawn, probs
        return logits.argmax(dim=1).index_copy(0, meta.random_index, drawn), probs

    def _random_draws(self, logits: torch.Tensor, meta: SamplingMetadata
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The random rows' distributions [Nr, V] (temperature, top-k / top-p, min-p on the
        processed logits [N, V]) and their uniforms u [Nr]."""
        assert meta.temperature is not None
        if meta.random_index is not None:
            logits = logits[meta.random_index]
        logits = apply_temperature(logits, meta.temperature)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        probs = logits.softmax(dim=1)
        return probs, self._uniforms(probs, meta)

    def _uniforms(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """u [Nr] ~ U(0, 1]: seeded rows from their own generator, the rest from the shared one.

        A seeded row's draw depends only on its generator's state, never on its row position
        or the batch size, which is what makes seeded output batch-independent. Its draws are
        one per row in row order (a request's rows are consecutive, row 0 first).
        """
        device = probs.device
        u = torch.empty(probs.shape[0], dtype=torch.float64, device=device)
        row_req = meta.row_requests
        # (index into u, request) of each random row.
        owners = [(r, row_req[n]) for r, n in enumerate(meta.random_rows)]
        seeded = [(r, b) for r, b in owners if meta.seeds[b] is not None]
        if len(seeded) < len(meta.random_rows):
            shared = self._shared_generator(device)
            if not seeded:
                return 1 - u.uniform_(generator=shared)  # [0, 1) -> (0, 1]
            unseeded = [r for r, b in owners if meta.seeds[b] is None]
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
