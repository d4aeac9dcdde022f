"""Logit processors as pure functions. Each takes logits [B, V] and returns a new tensor (the
input is not mutated); the order they run in is sampler.py's. Last, the draw itself
(sample_from_probs), which the sampler and rejection sampling share."""

from __future__ import annotations

import torch

# Top-p slack for float error in the cumulative sum: a set whose probability is within this of
# top_p counts as reaching it, so probs [0.5, 0.3, ...] with top_p=0.8 keep exactly two tokens
# even though 0.5 + 0.3 is not exactly 0.8 in float32.
_TOP_P_EPS = 1e-6


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
    """Inverse CDF: per row, the first token whose cumulative probability reaches u * total;
    probs [M, V], u [M] in (0, 1]. The cumulative sum never decreases, and the target is > 0
    and <= the total, so the token found has probability > 0: a masked (zero) token is never
    picked."""
    cum = probs.cumsum(dim=1)
    target = u.to(cum.dtype).unsqueeze(1) * cum[:, -1:]
    return torch.searchsorted(cum, target).squeeze(1).clamp_max(probs.shape[1] - 1)
