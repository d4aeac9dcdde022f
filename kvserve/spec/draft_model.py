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

self_draft (early_exit) is the target's own first layers: it runs in the target's cache and
feeds only the last sampled token at step 0 (nothing to catch up on, no cache of its own).
Under tensor parallelism those layers are split across the ranks as the target's are, so
each of its forwards goes to the other ranks with its layer count (the executor's step); a
draft model runs whole in rank 0's process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.engine_args import EngineArgs
from kvserve.kv.layout import model_block_bytes, resolve_kv_dtype
from kvserve.layers.linear import Linear
from kvserve.loader import load_checkpoint, resolve_model
from kvserve.model_runner import ModelRunner
from kvserve.model_setup import torch_dtype
from kvserve.models import build_model
from kvserve.ops import get_ops
from kvserve.outputs import ScheduledRequest, SchedulerOutput
from kvserve.quant import get_quant_method
from kvserve.quant.gguf_weights import GGUFWeight
from kvserve.request import Request
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import Sampler
from kvserve.spec.base import DraftStops

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.executor.tp import TPExecutor

logger = logging.getLogger(__name__)

# Draft generators must not replay the target's: a seed s drafts from s ^ _DRAFT_SEED_SALT.
_DRAFT_SEED_SALT = 0x5DEECE66D


def _lm_head_rows(model: Any, ckpt: Any, quant: Any, ids: torch.Tensor,
                  dtype: torch.dtype) -> Linear | None:
    """A new lm_head over the checkpoint's rows ids only, in the model's format for it; None
    where the checkpoint stores lm_head in a quantized layout (GPTQ's `lm_head: true`: its
    packed columns and zero points do not cut by row), whose whole 4-bit vocabulary costs
    about what a float16 cut to 32k rows does."""
    mc = ckpt.model_config
    name = "model.embed_tokens.weight" if mc.tie_word_embeddings else "lm_head.weight"
    weight = next((t for n, t in ckpt.weights(keep_quantized=quant.keeps_quantized)
                   if n == name), None)
    if weight is None:
        # The checkpoint loaded, so its lm_head came as other tensors: a quantized layout.
        return None
    rows = (GGUFWeight(weight.data.index_select(0, ids), weight.qtype, weight.k)
            if isinstance(weight, GGUFWeight) else weight.index_select(0, ids))
    head = Linear(mc.hidden_size, len(ids), bias=False, ops=model.ops, dtype=dtype,
                  quant_method=quant.linear_method("lm_head"))
    head.load_shard("weight", 0, rows)
    head.process_weights_after_loading()
    return head


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
    def __init__(self, config: EngineConfig, draft_config: EngineConfig, model: Any,
                 vocab_ids: torch.Tensor | None = None, shares_target_kv: bool = False
                 ) -> None:
        """vocab_ids: the token ids the draft's lm_head computes, in its row order (None:
        all of them). shares_target_kv: the draft is the target's first layers (self_draft),
        and runs in the target's own cache (see early_exit)."""
        self.config = draft_config
        self.model = model
        self.vocab_size = config.model_config.vocab_size
        self.vocab_ids = vocab_ids
        self.p_min = config.speculative.draft_p_min  # type: ignore[union-attr]
        self.num_lookahead_tokens = config.speculative.num_speculative_tokens  # type: ignore
        self.shares_target_kv = shares_target_kv
        self.kv_bytes_per_block = 0 if shares_target_kv else model_block_bytes(
            draft_config.model_config, draft_config.cache.block_size,
            resolve_kv_dtype(draft_config.cache.kv_cache_dtype, draft_config.dtype))
        self.runner: ModelRunner | None = None  # over the draft, once allocate_kv sized it
        self._executor: TPExecutor | None = None
        self.sampler = Sampler(seed=_draft_seed(config.seed))
        # request -> (N, fed): the draft's KV is written for its first N tokens (its last
        # proposal's start) and for the drafts that proposal fed after them, of which as
        # many as the target accepted need not be read again
        self._read: dict[str, tuple[int, list[int]]] = {}
        self._q: dict[str, torch.Tensor] = {}  # request -> q [k, V] of its pending drafts
        self.draft_forwards = "per_depth"
        self.stops_on_confidence = True
        self.last_timing: list[tuple[int, float]] | None = None
        self.last_catch_up: tuple[int, float] | None = None
        self.needs_hidden_states = False

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
        n = spec.draft_vocab_size
        if n is None:
            n = 32768 if target_vocab > 65536 else 0
        vocab_ids = None
        if 0 < n < target_vocab:
            special = (target_tokenizer.all_special_ids | set(target_tokenizer.eos_token_ids)
                       if target_tokenizer is not None else set())
            vocab_ids = torch.tensor(sorted(set(range(n)) | {i for i in special
                                                             if 0 <= i < target_vocab}))
            head = _lm_head_rows(model, ckpt, quant, vocab_ids, torch_dtype(draft_config.dtype))
            if head is None:
                vocab_ids = None  # its quantized lm_head, whole
            else:
                model.lm_head = head
        logger.info("draft model %s (%s, quantization=%s, lm_head over %d of %d tokens) for "
                    "speculative decoding, K=%d", path, ckpt.model_config.architecture,
                    draft_config.quantization,
                    target_vocab if vocab_ids is None else len(vocab_ids), target_vocab,
                    spec.num_speculative_tokens)
        return cls(config, draft_config, model, vocab_ids)

    @classmethod
    def early_exit(cls, config: EngineConfig, target: Any) -> DraftModelProposer:
        """self_draft: the target's first num_layers layers (default half) as the draft.

        It runs in the target's own KV cache: for every position the target has computed,
        the KV of its first layers is what the draft's would be (the same weights over the
        same tokens), so the draft reads no prompt and keeps no cache of its own. It writes
        only at positions the target has not computed yet (its input, the last sampled
        token, and its drafts), in blocks no other request shares (a block is shared once
        full and computed), and the target computes each of those positions, overwriting
        the slot in every layer, before anything reads it."""
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
                   EarlyExit(target, n), shares_target_kv=True)

    @property
    def executor(self) -> TPExecutor | None:
        return self._executor

    @executor.setter
    def executor(self, executor: TPExecutor | None) -> None:
        """The target's tensor-parallel ranks (set by the engine after allocate_kv). A
        self-draft runs the target's own layers, split across them, so its draft runner
        sends them each forward (and, as the target's runner under TP, replays no CUDA
        graph); a draft model runs whole on rank 0 and leaves them be."""
        self._executor = executor
        if self.shares_target_kv and self.runner is not None:
            self.runner.executor = executor

    def allocate_kv(self, num_blocks: int, target_kv: Any) -> None:
        # A self-draft's: the target's first layers (a view: the same memory).
        n = self.config.model_config.num_hidden_layers
        own = target_kv[:n] if self.shares_target_kv else None
        self.runner = ModelRunner(self.config, self.model, num_blocks, kv_cache=own,
                                  first_layers=n if self.shares_target_kv else 0)

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]], stops: DraftStops | None = None
                ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        fed_drafts: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        sure = [1.0] * len(requests)  # the product of each request's draft confidences
        active = [b for b, k in enumerate(num_drafts) if k > 0]
        self.last_timing, self.last_catch_up = [], None
        for j in range(max(num_drafts, default=0)):
            t0 = time.perf_counter()
            active = [b for b in active if num_drafts[b] > j and (
                j == 0 or stops is None or sure[b] * stops.alphas[b] >= stops.more[j])]
            if not active:
                break
            scheduled = []
            for b in active:
                req = requests[b]
                if j == 0:
                    start = self._start(req)
                    tokens = req.all_token_ids[start:]
                    if not self.shares_target_kv:  # (a self-draft's start needs no record)
                        self._read[req.request_id] = (req.num_tokens, fed_drafts[b])
                else:
                    start, tokens = req.num_tokens + j - 1, [drafts[b][-1]]
                    fed_drafts[b].append(drafts[b][-1])
                scheduled.append(ScheduledRequest(req, tokens, start, block_tables[b], True))
            logits = self._forward(scheduled)
            reqs = [requests[b] for b in active]
            meta = SamplingMetadata.from_requests(reqs, self.vocab_size, logits.device,
                                                  [drafts[b] for b in active],
                                                  last_row_only=True)
            tokens_j, q_j, conf = self._sample(logits, meta)
            confident = []
            for i, b in enumerate(active):
                if conf[i] < self.p_min:
                    continue  # a draft this unsure is likelier rejected than not: stop here
                sure[b] *= conf[i]
                if stops is not None and sure[b] < stops.keep[j]:
                    continue  # its verify row would cost more than it is likely to add
                confident.append(b)
                drafts[b].append(tokens_j[i])
                if q_j is not None and q_j[i] is not None:
                    qs[b].append(q_j[i])
            fed = sum(sr.num_tokens for sr in scheduled)
            seconds = time.perf_counter() - t0
            if fed <= (self.num_lookahead_tokens + 1) * len(active):
                self.last_timing.append((len(active), seconds))
            else:  # a catch-up over a new prompt: priced per token, once per request
                self.last_catch_up = (fed, seconds)
            active = confident
        for b, req in enumerate(requests):
            if qs[b]:
                self._q[req.request_id] = torch.stack(qs[b])
            else:
                self._q.pop(req.request_id, None)
        return drafts

    def _start(self, req: Request) -> int:
        """The first of req's tokens the draft has not read (a prefix-cache hit counts as
        read; so do the drafts its last proposal fed, as far as the target accepted them:
        their KV sits at those positions already, computed from the same tokens)."""
        if self.shares_target_kv:  # the target's cache holds all but the last token
            return req.num_tokens - 1
        read = self._read.get(req.request_id)
        if read is None:
            return min(max(req.num_cached_tokens, 0), req.num_tokens - 1)
        n, fed = read
        ids = req.all_token_ids
        for t in fed:
            if n >= len(ids) or ids[n] != t:
                break
            n += 1
        return min(n, req.num_tokens - 1)

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        # Beyond the last step's own tokens (at most K + 1), which every proposal reads.
        k1 = self.num_lookahead_tokens + 1
        return [max(0, r.num_tokens - self._start(r) - k1) for r in requests]

    def _forward(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The draft's logits [B, V'] at each scheduled request's last token, over its
        lm_head's tokens (vocab_ids' order; all V when None)."""
        assert self.runner is not None, "allocate_kv first"
        so = SchedulerOutput(scheduled, sum(s.num_tokens for s in scheduled))
        inp, _, prompt_lp = self.runner.prepare_inputs(so)
        # The sampling rows come first (prompt-logprob rows, which the draft needs not, after).
        _, logits = self.runner.forward(inp, scheduled, prompt_lp, logits_rows=len(scheduled))
        return logits.float()

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata
                ) -> tuple[list[int], list[torch.Tensor | None] | None, list[float]]:
        """A token per row, q per row (None for greedy rows; None when all are), and the
        draft's probability of each token (greedy rows: of its processed distribution)."""
        if self.vocab_ids is not None:
            ids = self.vocab_ids.to(logits.device)
            if meta.all_greedy and not Sampler.changes_logits(meta):
                # The argmax and its probability need not the other V - V' tokens (-inf):
                # vocab_ids ascend, so the first maximum is the full row's first too.
                best = logits.argmax(dim=1)
                rows = torch.arange(len(best), device=logits.device)
                conf = (logits[rows, best] - logits.logsumexp(dim=1)).exp()
                return ids[best].tolist(), None, conf.tolist()
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, ids] = logits
            logits = full
        meta.seeds = [_draft_seed(s) for s in meta.seeds]
        logits = Sampler.process_logits(logits, meta)
        tokens, probs = self.sampler.sample_rows(logits, meta)
        rows = torch.arange(len(tokens), device=logits.device)
        conf = (logits[rows, tokens] - logits.logsumexp(dim=1)).exp()
        if probs is None:
            return tokens.tolist(), None, conf.tolist()
        q: list[torch.Tensor | None] = [None] * len(meta.request_ids)
        for r, n in enumerate(meta.random_rows):
            q[n] = probs[r]
            conf[n] = probs[r, tokens[n]]
        return tokens.tolist(), q, conf.tolist()

    def draft_probs(self, requests: list[Request], drafts: list[list[int]]
                    ) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for req, d in zip(requests, drafts, strict=True):
            q = self._q.pop(req.request_id, None)
            out.append(None if q is None or not d else q[:len(d)])
        return out

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._read.pop(rid, None)
            self._q.pop(rid, None)
            self.sampler.remove(rid)
