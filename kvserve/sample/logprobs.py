"""Logprobs of chosen tokens (sampled or prompt) with the top-k alternatives and ranks."""

from __future__ import annotations

import torch

from kvserve.outputs import Logprob, PositionLogprobs


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
