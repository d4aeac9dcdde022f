"""4-bit weights as integers and an affine pair per group of inputs, in the convention of
torch's int4 matmul (kvserve/ops/int4mm.py), which a backend without kvserve's CPU kernels runs:

    w[n, k] = (q[n, k] - 8) * scale[n, k / G] + zero[n, k / G],   q in [0, 15]

A method whose weights are 4-bit groups hands them over as Int4Groups
(LinearMethod.int4_groups): GPTQ-4, AWQ and int4, which kvserve holds as Q4_1 blocks
(w = d q + m: scale d, zero m + 8 d), and under an explicit "gguf" a file's Q4_0
(w = d (q - 8): zero 0), Q4_1 and Q4_K matrices (a sub-block of 32, dl q - dm: scale dl,
zero 8 dl - dm): kernel_runs.int4_runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 matmul takes, on CUDA and on the CPU


class Int4Groups(NamedTuple):
    """A linear's weight as 4-bit integers and an affine pair per group of inputs, in torch's
    int4 convention: w[n, k] = (q[n, k] - 8) * scale[n, k / G] + zero[n, k / G]."""

    q: torch.Tensor  # uint8 [N, K] in [0, 15]; column j is input perm[j] (input j if no perm)
    scale: torch.Tensor  # float32 [N, K / G]
    zero: torch.Tensor  # float32 [N, K / G]
    group_size: int
    perm: torch.Tensor | None  # act-order GPTQ: x's inputs in q's column order

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the inputs' own order."""
        g = self.group_size
        w = ((self.q.float() - 8) * self.scale.repeat_interleave(g, dim=1)
             + self.zero.repeat_interleave(g, dim=1))
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def coarsest(self) -> Int4Groups:
        """The same weight with the largest group size whose groups each repeat one pair (a
        GPTQ group of 128 arrives as four Q4_1 blocks of 32): fewer pairs to store and read."""
        g, k = self.group_size, self.q.shape[1]
        for size in sorted(GROUP_SIZES, reverse=True):
            if size <= g or k % size:
                continue
            per = size // g
            s = self.scale.reshape(self.scale.shape[0], -1, per)
            z = self.zero.reshape(self.zero.shape[0], -1, per)
            if torch.equal(s, s[..., :1].expand_as(s)) and torch.equal(z, z[..., :1].expand_as(z)):
                return self._replace(scale=s[..., 0].contiguous(), zero=z[..., 0].contiguous(),
                                     group_size=size)
        return self
