"""Medusa heads (Cai et al., 2024): K small heads on the target's last hidden state guess
the tokens after the next one, with no draft model and no KV cache of their own.

A head is medusa_num_layers residual blocks, then a Linear hidden -> vocab without bias:

    h <- h + SiLU(W h + b)       (each block; W, b: hidden x hidden, hidden)
    logits = W_vocab h            (W_vocab: vocab x hidden, initialised from the lm_head)

Applied to the target's hidden state (after its final norm) at position p, whose lm_head
row predicts token p + 1, head k (k = 1..K) predicts token p + 1 + k. In the engine: at the
row that produced a request's last emitted token t, head k guesses the token k positions
after t. The drafts are the top-1 of heads 1..k, a chain that the target verifies in its
next step like any deterministic proposer's (one-hot q; greedy: exact match). Medusa's
tree of top-k candidates would need tree attention in the verify step; a chain needs
nothing new, and here a verify row is cheap next to the weights a step streams.

The checkpoint is Medusa's (FasterDecoding/Medusa), a directory of

    config.json                   medusa_num_heads, medusa_num_layers, base_model_name_or_path
    medusa_lm_head.safetensors    (or medusa_lm_head.pt, a torch state dict) with, for head
                                  i = 0..K-1 and block j = 0..L-1:
        {i}.{j}.linear.weight [hidden, hidden]    {i}.{j}.linear.bias [hidden]
        {i}.{L}.weight        [vocab, hidden]

(Medusa's nn.ModuleList of nn.Sequential(ResBlock * L, Linear): its state dict's names.
Medusa repeats one ResBlock object L times; here each block has its own weights, and a
file whose blocks share theirs loads the same.)

The vocab Linear is the bulk of a head (vocab x hidden: 113 MB in float32 for the default
model, the whole target's lm_head again). A head whose Linear is the target's lm_head, as
Medusa initialises it and as `kvserve train-medusa` leaves it (it trains the blocks only),
runs through the target's own lm_head instead, in the target's format: all heads' rows in
one call, i.e. one more pass over the lm_head's weights per step rather than K float ones.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.request import Request
from kvserve.spec.base import DraftStops, KVFreeProposer

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"
TORCH_WEIGHTS_FILE = "medusa_lm_head.pt"


class ResBlock(nn.Module):
    """h + SiLU(W h + b); W and b start at zero, an identity."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of num_layers ResBlocks each; lm_heads[i] is head i's vocab Linear weight
    [vocab, hidden], or None where it is the target's lm_head (shared: not stored here)."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
                 dtype: torch.dtype = torch.float32, base_model: str = "") -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa heads need medusa_num_heads >= 1 and "
                             f"medusa_num_layers >= 0, got {num_heads} and {num_layers}")
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.base_model = base_model
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size, dtype) for _ in range(num_layers)))
            for _ in range(num_heads))
        self.lm_heads: list[torch.Tensor | None] = [None] * num_heads

    def hidden(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Head i's blocks over hidden states h [N, hidden] (its vocab Linear's input)."""
        return self.blocks[i](h)

    # -- Medusa's checkpoint format --------------------------------------------------------

    def medusa_state_dict(self, lm_head: torch.Tensor | None = None
                          ) -> dict[str, torch.Tensor]:
        """Medusa's names -> tensors; lm_head: the target's weight [vocab, hidden], written
        for the heads that share it."""
        out: dict[str, torch.Tensor] = {}
        for i in range(self.num_heads):
            for j, block in enumerate(self.blocks[i]):
                out[f"{i}.{j}.linear.weight"] = block.linear.weight.detach()
                out[f"{i}.{j}.linear.bias"] = block.linear.bias.detach()
            w = self.lm_heads[i] if self.lm_heads[i] is not None else lm_head
            if w is None:
                raise ValueError(f"head {i} shares the target's lm_head: pass its weight")
            out[f"{i}.{self.num_layers}.weight"] = w.detach()
        return out

    def save(self, out_dir: str, lm_head: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float16) -> None:
        """Writes config.json and medusa_lm_head.safetensors (in dtype) to out_dir."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        tensors = {k: v.to(dtype).contiguous().cpu()
                   for k, v in self.medusa_state_dict(lm_head).items()}
        save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
        cfg = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
               "base_model_name_or_path": self.base_model,
               "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str, target_lm_head: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32) -> MedusaHeads:
        """Reads a Medusa directory. A head whose vocab Linear equals target_lm_head (the
        target's weight [vocab, hidden], to the file's precision) keeps None there: it runs
        on the target's lm_head. ValueError naming a missing file, key or bad shape."""
        cfg_path = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(cfg_path):
            raise ValueError(f"Medusa heads {path!r}: no {CONFIG_FILE}")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        try:
            num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg["medusa_num_layers"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Medusa heads {path!r}: {CONFIG_FILE} needs integer "
                             f"medusa_num_heads and medusa_num_layers") from e
        tensors = _read_tensors(path)
        # Some writers nest the heads under their module's name.
        tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
        vocab_key = f"0.{num_layers}.weight"
        if vocab_key not in tensors:
            raise ValueError(f"Medusa heads {path!r}: no tensor {vocab_key!r} "
                             f"(medusa_num_layers={num_layers})")
        vocab, hidden = tensors[vocab_key].shape
        heads = cls(num_heads, num_layers, hidden, vocab, dtype,
                    str(cfg.get("base_model_name_or_path") or ""))
        shared = 0
        for i in range(num_heads):
            for j, block in enumerate(heads.blocks[i]):
                for name, param in (("weight", block.linear.weight),
                                    ("bias", block.linear.bias)):
                    param.data.copy_(_take(tensors, f"{i}.{j}.linear.{name}",
                                           tuple(param.shape), path))
            w = _take(tensors, f"{i}.{num_layers}.weight", (vocab, hidden), path)
            if target_lm_head is not None and _same_weight(w, target_lm_head):
                shared += 1
            else:
                heads.lm_heads[i] = w.to(dtype)
        if tensors:
            raise ValueError(f"Medusa heads {path!r}: unexpected tensors "
                             f"{', '.join(sorted(tensors)[:8])} for {num_heads} heads of "
                             f"{num_layers} blocks")
        logger.info("Medusa heads %s: %d heads of %d blocks, hidden %d, vocab %d; %d run on "
                    "the target's lm_head", path, num_heads, num_layers, hidden, vocab, shared)
        return heads


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, WEIGHTS_FILE), os.path.join(path, TORCH_WEIGHTS_FILE)
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.isfile(pt):
        state = torch.load(pt, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"Medusa heads {pt!r}: not a state dict")
        return dict(state)
    raise ValueError(f"Medusa heads {path!r}: neither {WEIGHTS_FILE} nor {TORCH_WEIGHTS_FILE}")


def _take(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...],
          path: str) -> torch.Tensor:
    t = tensors.pop(key, None)
    if t is None:
        raise ValueError(f"Medusa heads {path!r}: missing tensor {key!r}")
    if tuple(t.shape) != shape:
        raise ValueError(f"Medusa heads {path!r}: tensor {key!r} has shape {tuple(t.shape)}, "
                         f"expected {shape}")
    return t.float()


def _same_weight(w: torch.Tensor, ref: torch.Tensor) -> bool:
    """w is ref as a checkpoint stores it: equal to float16 / bfloat16 rounding."""
    if w.shape != ref.shape:
        return False
    ref = ref.to(w.device, torch.float32)
    tol = 8e-3 * ref.abs() + 1e-4 * float(ref.abs().max())  # bfloat16 keeps 8 bits
    return bool(((w.float() - ref).abs() <= tol).all())


def lm_head_weight(model: Any, chunk: int = 1024) -> torch.Tensor:
    """The target's lm_head as a float32 weight [vocab, hidden], whatever format it runs
    in: its logits for the unit vectors (exact for float and row-quantized weights)."""
    hidden = model.config.hidden_size
    dev = model.embed_tokens.device
    dtype = model.act_dtype
    rows = []
    with torch.inference_mode():
        for s in range(0, hidden, chunk):
            eye = torch.zeros(min(chunk, hidden - s), hidden, dtype=dtype, device=dev)
            eye[:, s: s + eye.shape[0]] = torch.eye(eye.shape[0], dtype=dtype, device=dev)
            rows.append(model.compute_logits(eye).float())
    return torch.cat(rows).T.contiguous()


class MedusaProposer(KVFreeProposer):
    """The heads over the hidden state the runner hands over after each sampling step
    (needs_hidden_states): per request, the row that produced its last emitted token. No KV
    of its own, and one batched call for every depth: not priced per depth."""

    needs_hidden_states = True
    draft_forwards = "per_step"  # every head at once: one pass over the lm_head per step

    def __init__(self, heads: MedusaHeads, target: Any) -> None:
        self.heads = heads
        self.target = target
        # request -> (the token count its hidden state is for, that hidden state [hidden])
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}

    @classmethod
    def load(cls, config: EngineConfig, target: Any) -> MedusaProposer:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        mc = config.model_config
        heads = MedusaHeads.load(spec.model, lm_head_weight(target),
                                 target.act_dtype)
        if (heads.hidden_size, heads.vocab_size) != (mc.hidden_size, mc.vocab_size):
            raise ValueError(
                f"speculative_config.model {spec.model!r}: Medusa heads of hidden size "
                f"{heads.hidden_size} and vocabulary {heads.vocab_size}, the target "
                f"{config.model!r} has hidden size {mc.hidden_size} and vocabulary "
                f"{mc.vocab_size}: the heads must be trained for the target")
        if spec.num_speculative_tokens > heads.num_heads:
            raise ValueError(
                f"speculative_config.num_speculative_tokens is {spec.num_speculative_tokens}, "
                f"but {spec.model!r} has only {heads.num_heads} Medusa heads")
        if heads.base_model and os.path.basename(heads.base_model.rstrip("/")) != \
                os.path.basename(config.model.rstrip("/")):
            logger.warning("Medusa heads %s were trained for %s, the target is %s",
                           spec.model, heads.base_model, config.model)
        heads = heads.to(config.device)
        heads.lm_heads = [None if w is None else w.to(config.device) for w in heads.lm_heads]
        return cls(heads, target)

    def observe_hidden(self, requests: list[Request], hidden: torch.Tensor,
                       emitted: list[list[int]]) -> None:
        """After a sampling step (before its tokens are appended): hidden[b] is the row
        that produced emitted[b][-1], request b's last token once they are."""
        for b, req in enumerate(requests):
            self._hidden[req.request_id] = (req.num_tokens + len(emitted[b]), hidden[b])

    def propose(self, requests: list[Request], num_drafts: list[int],
                block_tables: list[list[int]], stops: DraftStops | None = None
                ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        self.last_timing = None
        # A request gets drafts where its hidden state is for its current last token (a
        # stop string or preemption since then leaves none).
        live = []
        for b, (req, k) in enumerate(zip(requests, num_drafts)):
            got = self._hidden.get(req.request_id)
            if k and got is not None and got[0] == req.num_tokens:
                live.append(b)
        if not live:
            return drafts
        t0 = time.perf_counter()
        h = torch.stack([self._hidden[requests[b].request_id][1] for b in live])
        k_max = min(max(num_drafts[b] for b in live), self.heads.num_heads)
        shared_x, shared_at, tokens = [], [], {}
        for i in range(k_max):
            rows = [n for n, b in enumerate(live) if num_drafts[b] > i]
            x = self.heads.hidden(i, h[rows])
            w = self.heads.lm_heads[i]
            if w is None:
                shared_x.append(x)
                shared_at.append((i, rows))
            else:
                tokens[i] = (rows, F.linear(x, w).argmax(-1).tolist())
        if shared_x:
            # Every head on the target's lm_head in one call: its weights streamed once.
            top = self.target.compute_logits(torch.cat(shared_x)).argmax(-1).tolist()
            n = 0
            for i, rows in shared_at:
                tokens[i] = (rows, top[n: n + len(rows)])
                n += len(rows)
        for i in range(k_max):
            rows, top1 = tokens[i]
            for n, t in zip(rows, top1):
                drafts[live[n]].append(t)
        seconds = time.perf_counter() - t0
        self.last_timing = [(len(live), seconds)]
        logger.debug("medusa: %d drafts in %.2f ms", sum(map(len, drafts)), seconds * 1e3)
        return drafts

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._hidden.pop(rid, None)
