"""Exact rejection sampling of draft tokens (speculative decoding).

A request with k draft tokens d_0 .. d_k-1 has k + 1 rows (metadata.py): row j is the target
model's distribution p_j for the token after the request's tokens and d_0 .. d_j-1, already
processed (bias, masks, penalties, temperature, top-k / top-p / min-p) exactly as a step
without drafts would process it. The proposer drew d_j from its own distribution q_j (one-hot
for a deterministic proposer: n-gram, suffix). For j = 0, 1, ...:

    accept d_j   with probability min(1, p_j(d_j) / q_j(d_j)):   u_j * q_j(d_j) <= p_j(d_j)
    on the first rejection, at row a: emit one token from max(0, p_a - q_a), normalized
    when all k are accepted:           emit a bonus token from p_k

Every emitted token is then distributed as the target alone would sample it (Leviathan et
al. 2023, Chen et al. 2023), whatever q is; q only sets how many drafts survive. A greedy
request is the case p_j = one-hot(argmax): accept while d_j equals the target's argmax, then
emit the argmax of the first row that disagreed (or of row k).

Draw order: a random request uses its rows' uniforms u (one per row, in row order, from its
generator, as sampler.py draws them): u_0 .. u_k-1 decide the drafts, u_k draws the emitted
token, whichever row it comes from. So a seeded request draws k + 1 numbers per step, the same
for the same drafts.
"""

from __future__ import annotations

import torch

from kvserve.sample.processors import sample_from_probs


def verify_drafts(row_offsets: list[int], drafts: list[list[int]], greedy: list[bool],
                  argmax: torch.Tensor, probs: torch.Tensor | None, random_pos: list[int],
                  u: torch.Tensor | None, draft_probs: list[torch.Tensor | None]
                  ) -> list[list[int]]:
    """The tokens each request emits: its accepted drafts, then one token.

    row_offsets [B + 1], drafts [B][k_b]; greedy [B]: the request's rows take the argmax
    (argmax [N], of the processed logits). The random rows' probabilities are probs [Nr, V]
    and their uniforms u [Nr] in (0, 1]; random_pos [N] maps a row to its index in them (-1
    for greedy rows). draft_probs[b]: q [k_b, V] of a random request's drafts, None for one-hot.
    """
    out: list[list[int]] = [[] for _ in drafts]
    argmax_list = argmax.tolist()
    # Greedy requests: exact match, then the target's own token.
    for b, (d, g) in enumerate(zip(drafts, greedy, strict=True)):
        if g:
            row = row_offsets[b]
            a = 0
            while a < len(d) and d[a] == argmax_list[row + a]:
                a += 1
            out[b] = d[:a] + [argmax_list[row + a]]
    rand = [b for b, g in enumerate(greedy) if not g]
    if not rand:
        return out
    assert probs is not None and u is not None
    device = probs.device
    # Acceptance of every random draft at once: p_j(d_j) >= u_j * q_j(d_j).
    p_rows: list[int] = []
    p_cols: list[int] = []
    q_vals: list[torch.Tensor] = []
    for b in rand:
        for j, tok in enumerate(drafts[b]):
            p_rows.append(random_pos[row_offsets[b] + j])
            p_cols.append(tok)
        q = draft_probs[b]
        if drafts[b]:
            q_vals.append(torch.ones(len(drafts[b]), dtype=probs.dtype, device=device)
                          if q is None else
                          q[torch.arange(len(drafts[b]), device=device),
                            torch.tensor(drafts[b], device=device)].to(probs.dtype))
    accept: list[bool] = []
    if p_rows:
        r = torch.tensor(p_rows, device=device)
        p_at = probs[r, torch.tensor(p_cols, device=device)]
        accept = (u[r].to(probs.dtype) * torch.cat(q_vals) <= p_at).tolist()
    # The row each random request emits from, and the distribution there.
    dists: list[torch.Tensor] = []
    final_u: list[int] = []
    n = 0
    for b in rand:
        d, k = drafts[b], len(drafts[b])
        a = 0
        while a < k and accept[n + a]:
            a += 1
        n += k
        out[b] = d[:a]
        p = probs[random_pos[row_offsets[b] + a]]
        if a < k:
            q = draft_probs[b]
            if q is None:
                residual = p.clone()
                residual[d[a]] = 0.0  # max(0, p - one-hot(d_a)): p(d_a) < u <= 1
            else:
                residual = (p - q[a].to(p.dtype)).clamp_min_(0.0)
            # p = q exactly can only reject by rounding; then p itself is the residual's limit.
            p = torch.where(residual.sum() > 0, residual, p)
        dists.append(p)
        final_u.append(random_pos[row_offsets[b] + k])
    tokens = sample_from_probs(torch.stack(dists), u[torch.tensor(final_u, device=device)])
    for b, tok in zip(rand, tokens.tolist(), strict=True):
        out[b].append(tok)
    return out
