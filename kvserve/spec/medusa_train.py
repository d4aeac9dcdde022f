"""`kvserve train-medusa MODEL --text FILE -o DIR`: Medusa heads by self-distillation.

The target labels its own data: its final hidden states h_p and its own greedy next token
y_p = argmax lm_head(h_p) at every position p, over

    text        windows of --seq-len tokens of FILE (the first --max-tokens of them; the last
                --holdout share is kept out, for the accuracy report)
    its own     --gen-prompts prefixes of the text, each continued greedily by the engine
    generations for --gen-tokens tokens: here y_p is the token it then generated

Head k (k = 1..K) learns y_p+k from h_p, i.e. the token k + 1 positions after p (cross-entropy
on the argmax: greedy verification accepts the top-1 only). As Medusa does, each head starts
as the identity (ResBlock weights at zero) followed by the target's lm_head, so an untrained
head already speaks the target's vocabulary and only the blocks (hidden x hidden each) train;
the vocab Linear stays the lm_head, which keeps a step cheap (no vocab x hidden gradient, no
optimizer state for it) and lets the engine run every head on the target's own lm_head.
The hidden states come from the model as the engine runs it (its quantization), so the heads
learn the states they will see.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GEN_WAVE = 32  # generation requests in flight at once


@dataclass
class TrainArgs:
    num_heads: int = 4
    num_layers: int = 1
    steps: int | None = None  # None: epochs over the training positions
    epochs: float = 2.0
    lr: float = 3e-3
    batch_size: int = 128  # positions per step
    max_tokens: int = 8192  # of the text
    seq_len: int = 256
    holdout: float = 0.1
    gen_prompts: int = 64
    gen_prompt_len: int = 32
    gen_tokens: int = 96
    seed: int = 0
    save_dtype: str = "float16"


@dataclass
class Positions:
    """Training rows: hidden states [N, hidden] and head targets [N, K] (-100: past the end
    of the sequence)."""

    hidden: Any
    targets: Any


def final_hidden(model: Any, config: Any, seqs: list[list[int]], max_batch_tokens: int = 2048
                 ) -> list[tuple[Any, Any]]:
    """(hidden states [T, hidden] after the final norm, the model's greedy next token [T])
    of each sequence, from its own forward in varlen batches of about max_batch_tokens, with
    a KV cache of its own (the engine's blocks stay untouched)."""
    import torch

    from kvserve.model_runner import ModelRunner
    from kvserve.outputs import ScheduledRequest, SchedulerOutput
    from kvserve.request import Request
    from kvserve.sampling_params import SamplingParams

    bs = config.cache.block_size
    longest = max(len(s) for s in seqs)
    num_blocks = 1 + math.ceil(max(max_batch_tokens, longest) / bs) + len(seqs)
    runner = ModelRunner(config.replace(speculative=None), model, num_blocks)
    params = SamplingParams(max_tokens=1)
    out: list[tuple[Any, Any]] = []
    i = 0
    while i < len(seqs):
        batch = [seqs[i]]
        while i + len(batch) < len(seqs) and \
                sum(map(len, batch)) + len(seqs[i + len(batch)]) <= max_batch_tokens:
            batch.append(seqs[i + len(batch)])
        i += len(batch)
        # Each sequence a whole prefill in its own blocks (block 0 is the null block); the
        # runner lays the step out as the engine's (positions, slots, varlen metadata).
        scheduled, nxt = [], 1
        for b, seq in enumerate(batch):
            n = math.ceil(len(seq) / bs)
            scheduled.append(ScheduledRequest(Request(str(b), seq, params, max_tokens=1), seq,
                                              0, list(range(nxt, nxt + n)), False))
            nxt += n
        inp, _, _ = runner.prepare_inputs(SchedulerOutput(scheduled, sum(map(len, batch))))
        qsl = inp.query_start_loc.tolist()
        with torch.inference_mode():
            hidden = model(inp, runner.kv_cache)
            top = torch.cat([model.compute_logits(hidden[s: s + 512]).argmax(-1)
                             for s in range(0, hidden.shape[0], 512)])
        for b in range(len(batch)):
            s, e = int(qsl[b]), int(qsl[b + 1])
            out.append((hidden[s:e].float().cpu().clone(), top[s:e].cpu().clone()))
    return out


def head_targets(greedy: Any, num_heads: int, start: int = 0) -> tuple[Any, Any]:
    """Rows p = start .. T-2 of a sequence whose greedy next tokens are greedy [T]: the row
    indices, and targets [rows, K] with head k's = greedy[p + k] (-100 past the end)."""
    import torch

    t = greedy.shape[0]
    rows = torch.arange(start, t - 1)
    idx = rows[:, None] + torch.arange(1, num_heads + 1)[None, :]
    targets = torch.where(idx < t, greedy[idx.clamp(max=t - 1)], torch.full_like(idx, -100))
    return rows, targets


def collect(labelled: list[tuple[Any, Any]], starts: list[int], num_heads: int) -> Positions:
    import torch

    hs, ts = [], []
    for (hidden, greedy), start in zip(labelled, starts):
        rows, targets = head_targets(greedy, num_heads, start)
        hs.append(hidden[rows])
        ts.append(targets)
    return Positions(torch.cat(hs), torch.cat(ts))


def head_logits(heads: Any, lm_head: Any, x: Any) -> Any:
    """Logits [K, N, vocab] of every head at hidden states x [N, hidden] (lm_head: the
    target's weight [vocab, hidden], frozen)."""
    import torch
    from torch.nn import functional as F

    z = torch.stack([heads.hidden(i, x) for i in range(heads.num_heads)])
    return F.linear(z, lm_head)


def accuracy(heads: Any, lm_head: Any, data: Positions, chunk: int = 256) -> list[float]:
    """Head k's top-1 agreement with the target's own token, per head, over data."""
    import torch

    hit = torch.zeros(heads.num_heads)
    n = torch.zeros(heads.num_heads)
    with torch.no_grad():
        for s in range(0, data.hidden.shape[0], chunk):
            top = head_logits(heads, lm_head, data.hidden[s: s + chunk]).argmax(-1)  # [K, N]
            tgt = data.targets[s: s + chunk].T
            ok = tgt != -100
            hit += ((top == tgt) & ok).sum(1)
            n += ok.sum(1)
    return (hit / n.clamp(min=1)).tolist()


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return None


def train_heads(heads: Any, lm_head: Any, data: Positions, a: TrainArgs,
                progress: bool = True) -> list[float]:
    """Adam on the heads' blocks, cross-entropy of every head on its targets; returns the
    loss of each step."""
    import torch
    from torch.nn import functional as F

    n = data.hidden.shape[0]
    steps = a.steps if a.steps is not None else max(1, math.ceil(a.epochs * n / a.batch_size))
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(  # short warm-up, cosine to 10%
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20))
        * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    gen = torch.Generator().manual_seed(a.seed)
    order = torch.randperm(n, generator=gen)
    bar = _progress(steps, "train-medusa") if progress else None
    losses: list[float] = []
    at = 0
    t0 = time.perf_counter()
    for step in range(steps):
        if at + a.batch_size > n:
            order, at = torch.randperm(n, generator=gen), 0
        idx = order[at: at + a.batch_size]
        at += a.batch_size
        with torch.enable_grad():
            logits = head_logits(heads, lm_head, data.hidden[idx])  # [K, B, V]
            tgt = data.targets[idx].T  # [K, B]
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            ok = tgt != -100
            acc = ((logits.argmax(-1) == tgt) & ok).sum(1) / ok.sum(1).clamp(min=1)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}",
                            acc="/".join(f"{x:.2f}" for x in acc.tolist()))
            bar.update(1)
        elif progress and (step % 10 == 0 or step == steps - 1):
            print(f"step {step + 1}/{steps} loss {losses[-1]:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    if bar is not None:
        bar.close()
    return losses


def train_medusa(engine: Any, text: str, out_dir: str | None, a: TrainArgs,
                 progress: bool = True) -> dict[str, Any]:
    """Trains Medusa heads for engine's model on text (writes out_dir unless None); returns
    a report: head accuracy on the held-out text before and after, sizes, seconds."""
    import torch

    from kvserve.spec.medusa import MedusaHeads, lm_head_weight

    t_start = time.perf_counter()
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    model, config = engine.runner.model, engine.config
    mc = config.model_config
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[: a.max_tokens]
    seq_len = min(a.seq_len, config.scheduler.max_model_len)
    n_hold = int(len(ids) * a.holdout)
    if len(ids) - n_hold < a.num_heads + 2:
        raise ValueError(f"--text has {len(ids)} tokens: too few to train {a.num_heads} heads")
    train_ids, hold_ids = ids[: len(ids) - n_hold], ids[len(ids) - n_hold:]
    chunks = [train_ids[s: s + seq_len] for s in range(0, len(train_ids), seq_len)]
    chunks = [c for c in chunks if len(c) > a.num_heads + 1]
    hold = [hold_ids[s: s + seq_len] for s in range(0, len(hold_ids), seq_len)]
    hold = [c for c in hold if len(c) > 1]

    # Its own generations: greedy continuations of text prefixes (those from the held-out
    # text held out too).
    t0 = time.perf_counter()
    n_hold_gen = round(a.gen_prompts * a.holdout) if len(hold_ids) > a.gen_prompt_len else 0
    gens = _generate(engine, train_ids, a.gen_prompts - n_hold_gen, a, rng)
    hold_gens = _generate(engine, hold_ids, n_hold_gen, a, rng)
    if gens or hold_gens:
        log.info("generated %d tokens from %d prompts (%.1fs)",
                 sum(len(g) - s - 1 for g, s in gens + hold_gens), len(gens) + len(hold_gens),
                 time.perf_counter() - t0)

    t0 = time.perf_counter()
    seqs = chunks + [g for g, _ in gens] + hold + [g for g, _ in hold_gens]
    labelled = final_hidden(model, config, seqs)
    n1, n2, n3 = len(chunks), len(chunks) + len(gens), len(chunks) + len(gens) + len(hold)
    train = collect(labelled[:n2], [0] * n1 + [s for _, s in gens], a.num_heads)
    held = {name: collect(labelled[lo:hi], starts, a.num_heads)
            for name, lo, hi, starts in (("text", n2, n3, [0] * len(hold)),
                                         ("generations", n3, len(seqs),
                                          [s for _, s in hold_gens]))
            if hi > lo}
    t_label = time.perf_counter() - t0
    log.info("labelled %d training and %s held-out positions (%.1fs)", train.hidden.shape[0],
             " + ".join(str(d.hidden.shape[0]) for d in held.values()) or "no", t_label)

    lm_head = lm_head_weight(model)  # float32 [vocab, hidden], frozen
    heads = MedusaHeads(a.num_heads, a.num_layers, mc.hidden_size, mc.vocab_size,
                        base_model=config.model)
    before = {name: accuracy(heads, lm_head, d) for name, d in held.items()}
    t0 = time.perf_counter()
    losses = train_heads(heads, lm_head, train, a, progress)
    t_train = time.perf_counter() - t0
    after = {name: accuracy(heads, lm_head, d) for name, d in held.items()}
    if out_dir is not None:
        heads.save(out_dir, lm_head, getattr(torch, a.save_dtype))
    return {"heads": heads, "train_positions": int(train.hidden.shape[0]),
            "heldout_positions": {name: int(d.hidden.shape[0]) for name, d in held.items()},
            "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
            "acc_before": before, "acc_after": after, "label_s": t_label,
            "train_s": t_train, "total_s": time.perf_counter() - t_start}


def _generate(engine: Any, ids: list[int], n: int, a: TrainArgs, rng: random.Random
              ) -> list[tuple[list[int], int]]:
    """n greedy continuations of a.gen_prompt_len-token windows of ids: (prompt + its
    continuation, the first row whose target is a generated token)."""
    from kvserve.sampling_params import SamplingParams

    plen = min(a.gen_prompt_len, max(1, len(ids) // 2))
    if n <= 0 or a.gen_tokens <= 0 or not ids:
        return []
    params = SamplingParams(temperature=0, max_tokens=a.gen_tokens)
    prompts = []
    for _ in range(n):
        s = rng.randrange(0, max(1, len(ids) - plen))
        prompts.append(ids[s: s + plen])
    done: dict[str, Any] = {}
    # In waves that the KV cache holds whole (no preemption's recompute).
    wave = max(1, min(GEN_WAVE, engine.config.scheduler.max_num_seqs))
    for w in range(0, n, wave):
        for i in range(w, min(n, w + wave)):
            engine.add_request(f"medusa-gen-{i}", {"prompt_token_ids": prompts[i]}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    out = []
    for i, p in enumerate(prompts):
        gen = list(done[f"medusa-gen-{i}"].outputs[0].token_ids)
        if gen:
            out.append((p + gen, len(p) - 1))
    return out


def _run(ns: argparse.Namespace) -> int:
    from kvserve.engine_args import EngineArgs
    from kvserve.llm_engine import LLMEngine
    from kvserve.platform import setup_process

    if os.path.exists(ns.output) and (not os.path.isdir(ns.output) or os.listdir(ns.output)):
        raise ValueError(f"output {ns.output!r} exists and is not an empty directory")
    with open(ns.text, encoding="utf-8") as f:
        text = f.read()
    a = TrainArgs(num_heads=ns.num_heads, num_layers=ns.num_layers, steps=ns.steps,
                  epochs=ns.epochs, lr=ns.lr, batch_size=ns.batch_size,
                  max_tokens=ns.max_tokens, seq_len=ns.seq_len, holdout=ns.holdout,
                  gen_prompts=ns.gen_prompts, gen_tokens=ns.gen_tokens, seed=ns.seed,
                  save_dtype=ns.save_dtype)
    for name, v, lo in (("--num-heads", a.num_heads, 1), ("--num-layers", a.num_layers, 0),
                        ("--batch-size", a.batch_size, 1), ("--max-tokens", a.max_tokens, 8),
                        ("--seq-len", a.seq_len, 8)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if a.steps is not None and a.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {a.steps}")
    if not 0 <= a.holdout < 1:
        raise ValueError(f"--holdout must be in [0, 1), got {a.holdout}")
    args = EngineArgs.from_cli(ns)
    with setup_process(args.device):
        engine = LLMEngine.from_engine_args(args)
    r = train_medusa(engine, text, ns.output, a)
    print(f"trained {a.num_heads} Medusa heads ({a.num_layers} block(s) each) on "
          f"{r['train_positions']} positions, {r['steps']} steps: loss {r['first_loss']:.3f} "
          f"-> {r['last_loss']:.3f}; labelling {r['label_s']:.0f}s, training "
          f"{r['train_s']:.0f}s, {r['total_s']:.0f}s in all")
    for name, after in r["acc_after"].items():
        print(f"head top-1 accuracy on {r['heldout_positions'][name]} held-out positions of "
              f"{name} (head k: the target's own token k+1 ahead):")
        for k, (b, c) in enumerate(zip(r["acc_before"][name], after), 1):
            print(f"  head {k}: {c:.3f}  (untrained: {b:.3f})")
    print(f"wrote {ns.output}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from kvserve.engine_args import EngineArgs

    p = sub.add_parser("train-medusa", help="train Medusa heads for a model by "
                       "self-distillation (speculative_config method medusa)")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, an HF directory, or smollm2-135m (the default)")
    p.add_argument("--text", required=True, help="a text file to distill on")
    p.add_argument("-o", "--output", required=True, help="the heads directory to write")
    d = TrainArgs()
    p.add_argument("--num-heads", type=int, default=d.num_heads,
                   help=f"heads K: head k guesses the token k after the next (default "
                   f"{d.num_heads})")
    p.add_argument("--num-layers", type=int, default=d.num_layers,
                   help=f"residual blocks per head (default {d.num_layers})")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: --epochs over the training positions)")
    p.add_argument("--epochs", type=float, default=d.epochs,
                   help=f"passes over the training positions (default {d.epochs})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW's (default {d.lr})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"positions per step (default {d.batch_size})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help=f"tokens of --text to use (default {d.max_tokens})")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help=f"tokens per text window (default {d.seq_len})")
    p.add_argument("--holdout", type=float, default=d.holdout,
                   help=f"the text's last share, kept out for the accuracy report "
                   f"(default {d.holdout})")
    p.add_argument("--gen-prompts", type=int, default=d.gen_prompts,
                   help=f"text prefixes the model continues greedily, its own generations "
                   f"to train on (default {d.gen_prompts}; 0: the text only)")
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens,
                   help=f"tokens generated per prefix (default {d.gen_tokens})")
    p.add_argument("--save-dtype", default=d.save_dtype,
                   choices=["float16", "bfloat16", "float32"],
                   help=f"of the written tensors (default {d.save_dtype}, as Medusa's)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run)
