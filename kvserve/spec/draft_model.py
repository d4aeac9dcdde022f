"""Draft-model proposer: a smaller model with the target's vocabulary guesses k tokens.

The draft keeps its own paged KV cache with as many blocks as the target's and reads it
through the target's block tables: a request's block b holds the target's KV and the draft's
for the same positions, in two tensors that one memory budget sizes (kv_bytes_per_block).
The scheduler reserves num_lookahead_tokens = K slots past each sampling step, where the
draft writes its drafts' KV before the target verifies them.

One proposal for requests whose next step is a decode, N = request.num_tokens:

    step 0    feed all_token_ids[computed : N] (what the draft has not seen: the last step's
              accepted tokens, or a whole prompt), sample d_0 from its last row
    step j    feed d_j-1 at position N + j - 1, sample d_j    (j = 1 .. k - 1)

Each step is one varlen batch of the requests still drafting (ModelRunner.prepare_inputs,
the target's machinery), and each row is processed as the target's would be (bias, min_tokens,
penalties counting the drafts so far, temperature, top-k / top-p / min-p): q is then close to
p, which is what acceptance needs. Grammar masks are left to the target: verification is
exact for any q. A greedy request drafts the argmax; a random one samples q with the
draft's own generators (seeds derived from the request's, never the target's streams, whose
draws decide acceptance) and keeps q until draft_probs() hands it to verification.

A prefix-cache hit is trusted for the draft too: the draft ran over those blocks when the
request that computed them drafted. Where it never did, its KV there is stale and it drafts
badly, never wrongly.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.engine_args import EngineArgs
from kvserve.kv.layout import model_block_bytes, resolve_kv_dtype
from kvserve.loader import load_checkpoint, resolve_model
from kvserve.model_runner import ModelRunner, torch_dtype
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.outputs import ScheduledRequest, SchedulerOutput
from kvserve.quant import get_quant_method
from kvserve.request import Request
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

# Draft generators must not replay the target's: a seed s drafts from s ^ _DRAFT_SEED_SALT.
_DRAFT_SEED_SALT = 0x5DEECE66D


class EarlyExit(nn.Module):
    """A model's first num_layers decoder layers, then its own final norm and lm_head: its
    weights, shared (the KV cache it is given holds only those layers)."""

    def __init__(self, target: Any, num_layers: int) -> None:
        super().__init__()
        self.target = target
        self.layers = nn.ModuleList(list(target.layers)[:num_layers])

    def forward(self, inp: Any, kv_cache: Any) -> torch.Tensor:
        return self.target(inp, kv_cache, layers=self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def _draft_seed(seed: int | None) -> int | None:
    return None if seed is None else (seed ^ _DRAFT_SEED_SALT) & ((1 << 63) - 1)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft_config: EngineConfig, model: Any) -> None:
        self.config = draft_config
        self.model = model
        self.vocab_size = config.model_config.vocab_size
        self.num_lookahead_tokens = config.speculative.num_speculative_tokens  # type: ignore
        self.kv_bytes_per_block = model_block_bytes(
            draft_config.model_config, draft_config.cache.block_size,
            resolve_kv_dtype(draft_config.cache.kv_cache_dtype, draft_config.dtype))
        self.runner: ModelRunner | None = None  # over the draft, once allocate_kv sized it
        self.sampler = Sampler(seed=_draft_seed(config.seed))
        self._computed: dict[str, int] = {}  # request -> tokens whose draft KV is written
        self._q: dict[str, torch.Tensor] = {}  # request -> q [k, V] of its pending drafts

    @classmethod
    def load(cls, config: EngineConfig, target_tokenizer: Any = None) -> DraftModelProposer:
        """Loads speculative_config.model like the target (same dtype, device, context,
        block size and KV dtype); ValueError when its vocabulary differs from the target's."""
        spec = config.speculative
        assert spec is not None and spec.model is not None
        path = resolve_model(spec.model)
        ckpt = load_checkpoint(path)
        target_vocab = config.model_config.vocab_size
        if ckpt.model_config.vocab_size != target_vocab:
            raise ValueError(
                f"speculative_config.model {spec.model!r} has a vocabulary of "
                f"{ckpt.model_config.vocab_size} tokens, the target {config.model!r} one of "
                f"{target_vocab}: a draft model must share the target's tokenizer")
        if target_tokenizer is not None and \
                ckpt.tokenizer.backend.get_vocab() != target_tokenizer.backend.get_vocab():
            raise ValueError(
                f"speculative_config.model {spec.model!r} and the target {config.model!r} "
                f"have different tokenizers (same size, other tokens): a draft model must "
                f"share the target's tokenizer")
        args = EngineArgs(model=path, dtype=config.dtype, device=config.device,
                          max_model_len=config.scheduler.max_model_len,
                          block_size=config.cache.block_size,
                          kv_cache_dtype=config.cache.kv_cache_dtype,
                          ops_backend=config.ops_backend, quantization=spec.quantization,
                          seed=config.seed)
        draft_config = args.create_engine_config(path, ckpt.model_config)
        ops = get_ops(draft_config.ops_backend, draft_config.device)
        quant = get_quant_method(draft_config.quant)
        model = build_model(ckpt, ops, torch_dtype(draft_config.dtype), quant,
                            draft_config.scheduler.max_model_len).to(draft_config.device)
        logger.info("draft model %s (%s, quantization=%s) for speculative decoding, K=%d",
                    path, ckpt.model_config.architecture, draft_config.quantization,
                    spec.num_speculative_tokens)
        return cls(config, draft_config, model)

    @classmethod
    def early_exit(cls, config: EngineConfig, target: Any) -> DraftModelProposer:
        """self_draft: the target's first num_layers layers (default half) as the draft."""
        spec = config.speculative
        assert spec is not None
        total = config.model_config.num_hidden_layers
        n = spec.num_layers if spec.num_layers is not None else max(1, total // 2)
        if n >= total:
            raise ValueError(f"speculative_config.num_layers must be below the target's "
                             f"{total} layers, got {n}")
        mc = dataclasses.replace(config.model_config, num_hidden_layers=n)
        logger.info("self-drafting with the target's first %d of %d layers, K=%d", n, total,
                    spec.num_speculative_tokens)
        return cls(config, config.replace(model_config=mc, speculative=None),
                   EarlyExit(target, n))

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.config, self.model, num_blocks)

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [b for b, k in enumerate(num_drafts) if k > 0]
        for j in range(max(num_drafts, default=0)):
            active = [b for b in active if num_drafts[b] > j]
            scheduled = []
            for b in active:
                req = requests[b]
                if j == 0:
                    start = min(self._computed.get(req.request_id, max(req.num_cached_tokens, 0)),
                                req.num_tokens - 1)
                    tokens = req.all_token_ids[start:]
                    self._computed[req.request_id] = req.num_tokens
                else:
                    start, tokens = req.num_tokens + j - 1, [drafts[b][-1]]
                scheduled.append(ScheduledRequest(req, tokens, start, block_tables[b], True))
            logits = self._forward(scheduled)
            reqs = [requests[b] for b in active]
            meta = SamplingMetadata.from_requests(reqs, self.vocab_size, logits.device,
                                                  [drafts[b] for b in active],
                                                  last_row_only=True)
            tokens_j, q_j = self._sample(logits, meta)
            for i, b in enumerate(active):
                drafts[b].append(tokens_j[i])
                if q_j is not None and q_j[i] is not None:
                    qs[b].append(q_j[i])
        for b, req in enumerate(requests):
            if qs[b]:
                self._q[req.request_id] = torch.stack(qs[b])
            else:
                self._q.pop(req.request_id, None)
        return drafts

    def _forward(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The draft's logits [B, V] at each scheduled request's last token."""
        assert self.runner is not None, "allocate_kv first"
        so = SchedulerOutput(scheduled, sum(s.num_tokens for s in scheduled))
        inp, _, _ = self.runner.prepare_inputs(so)
        hidden = self.model(inp, self.runner.kv_cache)
        # The sampling rows come first (prompt-logprob rows, which the draft needs not, after).
        return self.model.compute_logits(hidden[inp.logits_indices[:len(scheduled)]]).float()

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata
                ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """A token per row, and q per row (None for greedy rows; None when all are)."""
        meta.seeds = [_draft_seed(s) for s in meta.seeds]
        tokens, probs = self.sampler.sample_rows(Sampler.process_logits(logits, meta), meta)
        if probs is None:
            return tokens.tolist(), None
        q: list[torch.Tensor | None] = [None] * len(meta.request_ids)
        for r, n in enumerate(meta.random_rows):
            q[n] = probs[r]
        return tokens.tolist(), q

    def draft_probs(self, requests: list[Request], drafts: list[list[int]]
                    ) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for req, d in zip(requests, drafts, strict=True):
            q = self._q.pop(req.request_id, None)
            out.append(None if q is None or not d else q[:len(d)])
        return out

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._computed.pop(rid, None)
            self._q.pop(rid, None)
            self.sampler.remove(rid)
