"""The workloads, configurations and parsers of benchmarks/compare's spec step (issue 12:
speculative decoding). Pure: no process is started here (compare runs the servers and
`kvserve bench serve`).

Two tasks, the same prompts for every engine and configuration, sent as chat turns (the
model's own chat template applied here, the text sent to /v1/completions, so every server
receives the same characters), greedy (temperature 0), up to max_tokens new tokens, ending
where the model ends (no ignore_eos: a rewrite is as long as the text it rewrites):

    grounded  input-grounded: the answer mostly copies the prompt. Code from this repository
              (kept here as literals, so the prompts do not move when the code does) with an
              edit to make (rename a function, drop its type hints), and paragraphs of
              /work/shared/reference/GPL-3.txt with one typo put in, to fix and return whole
    open      open generation: write a new function, explain an idea; little of the answer
              is in the prompt (the "poorly predictable text" of the issue's 0.95x target)

A configuration is one engine (kvserve serve or llama-server) with one proposer, or none;
every speed-up compares a configuration with the same engine's "none" on the same model,
task, concurrency and round. kvserve's "control" is a second server without speculation,
measured like a proposer (an A/A test): its speed-up should read 1.00x, and how far it
strays is what one cell can resolve.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.request import DEFAULT_TIER

TASKS = {
    "grounded": "input-grounded (rewrite / edit a given code or text, return it whole)",
    "open": "open generation (write new code or prose)",
}
# Proposers whose drafts come from a model (the "model-based"); the others look the
# continuation up in the request's own tokens.
MODEL_BASED = frozenset({"draft_model", "self_draft", "eagle", "eagle3", "medusa", "mtp",
                         "draft"})
LOOKUP = frozenset({"ngram", "suffix", "ngram-simple"})
# A second kvserve server without speculation, run and ratioed like a proposer: the A/A test
# that shows the noise of a cell's speed-up. The default model's 8-stream runs last 3-4 s,
# and three such servers side by side read 241-294 tok/s over 4 rounds (one round's ratio
# between two of them up to 1.14x): a 0.95x floor sits inside one round's spread.
CONTROL = "control"

# kvserve's --speculative-config per method, vLLM-shaped. "$DRAFT" is replaced with the
# model's draft GGUF, "$MEDUSA" with its Medusa heads (`kvserve train-medusa`, run by the spec
# step when they are missing); a method that needs one is skipped on a model without one.
# `compare --spec-config NAME=JSON` adds or replaces one.
KVSERVE_METHOD_CONFIGS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4},
    "draft_model": {"method": "draft_model", "model": "$DRAFT", "num_speculative_tokens": 4},
    # 16: suffix drafts end where its match does, so a deep K costs little where it fails
    # (Qwen2.5-Coder 1.5B, in one process, spec_pair.py: grounded 1 stream 1.91x against
    # 1.83x at 8, 8 streams 1.21x / 1.20x, open 1.06x / 1.01x).
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
    "self_draft": {"method": "self_draft", "num_speculative_tokens": 4},
    "medusa": {"method": "medusa", "model": "$MEDUSA", "num_speculative_tokens": 4},
}
DEFAULT_METHODS = ["ngram", "draft_model", "suffix", "self_draft"]  # the Qwen target
# The default model (SmolLM2-135M: no smaller draft): the lookups, its own first layers and
# Medusa heads trained on it.
DEFAULT_MODEL_METHODS = ["ngram", "suffix", "self_draft", "medusa"]

# llama-server's own speculative decoding (this llama.cpp: the --draft-max / --draft-min of
# older builds are removed; --spec-draft-n-max / -n-min replace them). "draft": -md with the
# same draft model and draft length as kvserve's draft_model; --spec-type draft-simple is
# given explicitly (without --spec-type this build infers a type only from MTP / EAGLE /
# DFlash metadata in the draft GGUF). "ngram-simple": its defaults (lookup n-gram 12
# tokens, drafts up to 48).
LLAMA_DRAFT_N_MAX = 4


@dataclass(frozen=True)
class SpecModel:
    key: str
    label: str
    target: str                  # GGUF path
    draft: str | None            # GGUF path of the draft model, or None
    methods: tuple[str, ...]     # kvserve methods to run on this model
    medusa: str | None = None    # its Medusa heads' directory (trained when missing), or None


@dataclass(frozen=True)
class SpecConfig:
    key: str                     # "kvserve:ngram", "llama_server:draft", ...
    engine: str                  # kvserve | llama_server
    method: str                  # none | a kvserve method | draft | ngram-simple
    label: str
    flags: tuple[str, ...] = ()  # server flags beyond the engine's common ones
    spec: dict[str, Any] | None = None  # kvserve's --speculative-config
    unavailable: str | None = None

    @property
    def kind(self) -> str:
        return ("none" if self.method == "none" else CONTROL if self.method == CONTROL
                else "model" if self.method in MODEL_BASED else "lookup")


def side_by_side(cfg: str) -> tuple[str, str, str]:
    """A configuration of spec_cell.py / spec_pair.py, NAME[@TREE]=JSON: (name, the other
    checkout or "", the --speculative-config JSON or "" for none)."""
    name, _, spec = cfg.partition("=")
    name, _, tree = name.partition("@")
    return name, tree, spec


def rotated(names: list[str], round_: int) -> list[str]:
    """The run order of a round of side-by-side configurations: rotated every round."""
    k = round_ % len(names)
    return names[k:] + names[:k]


def spec_configs(model: SpecModel, method_configs: dict[str, dict[str, Any]],
                 kvserve_has_spec: bool, llama_server: bool) -> list[SpecConfig]:
    """Every configuration of one model, in run order: kvserve's none, its control (none
    again) and its methods, llama-server's none, -md draft (where the model has a draft) and
    ngram-simple."""
    out = [SpecConfig("kvserve:none", "kvserve", "none", "kvserve serve, no speculation"),
           SpecConfig(f"kvserve:{CONTROL}", "kvserve", CONTROL,
                      "kvserve serve, no speculation again (A/A control)")]
    for m in model.methods:
        cfg = method_configs.get(m)
        if cfg is None:
            out.append(SpecConfig(f"kvserve:{m}", "kvserve", m, f"kvserve serve, {m}",
                                  unavailable=f"no --speculative-config for method {m!r}: "
                                              "give --spec-config NAME=JSON"))
            continue
        text = json.dumps(cfg)
        why = None
        paths = {"$DRAFT": model.draft, "$MEDUSA": model.medusa}
        if any(var in text and path is None for var, path in paths.items()):
            continue  # a method needing a draft / heads the model lacks: not a row
        for var, path in paths.items():
            if path is not None:
                text = text.replace(var, path)
        if not kvserve_has_spec:
            why = "`kvserve serve` has no --speculative-config yet"
        spec = json.loads(text)
        out.append(SpecConfig(f"kvserve:{m}", "kvserve", m, f"kvserve serve, {m}",
                              ("--speculative-config", text), spec, why))
    why = None if llama_server else "no llama-server built"
    out.append(SpecConfig("llama_server:none", "llama_server", "none",
                          "llama-server, no speculation", unavailable=why))
    if model.draft:
        out.append(SpecConfig(
            "llama_server:draft", "llama_server", "draft",
            f"llama-server -md (draft-simple, n-max {LLAMA_DRAFT_N_MAX})",
            ("-md", model.draft, "--spec-type", "draft-simple", "--spec-draft-n-max",
             str(LLAMA_DRAFT_N_MAX), "--spec-draft-n-min", "0"), unavailable=why))
    out.append(SpecConfig("llama_server:ngram-simple", "llama_server", "ngram-simple",
                          "llama-server --spec-type ngram-simple (defaults: n 12, m 48)",
                          ("--spec-type", "ngram-simple"), unavailable=why))
    return out


# ---- the prompts --------------------------------------------------------------------------

# Real code, copied from this repository (kvserve/bench/metrics.py, kvserve/bench/serve.py,
# benchmarks/quant_rows.py, kvserve/bench/datasets.py) and frozen here.
CODE = [
    ("percentile", '''def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, as
    numpy.percentile's default: position (n - 1) * q / 100 in the sorted values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
'''),
    ("request_intervals", '''def request_intervals(n: int, rate: float, seed: int) -> list[float]:
    """Gaps before each of n request starts: 0 for the first, then exponential with mean
    1/rate (a Poisson process); all 0 for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


def summarize(values: Sequence[float], percentiles: Sequence[float] = (99,)) -> dict[str, float]:
    """mean, median, std and the given percentiles of a sample."""
    out = {"mean": mean(values), "median": percentile(values, 50)}
    m = out["mean"]
    out["std"] = (math.sqrt(sum((v - m) ** 2 for v in values) / len(values)) if values
                  else math.nan)
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out
'''),
    ("parse_ppl", '''def parse_ppl(text: str) -> dict[str, float]:
    """{"ppl", "stderr"} from kvserve's `PPL = x +/- y` or llama-perplexity's `Final estimate:
    PPL = x +/- y` (the last such line)."""
    found = re.findall(r"PPL = ([0-9.]+|nan|inf) \\+/- ([0-9.]+|nan|inf)", text)
    if not found:
        raise ValueError("no `PPL = x +/- y` line in the output")
    ppl, err = found[-1]
    return {"ppl": float(ppl), "stderr": float(err)}


def peer_kv_types(peer_flags: tuple[str, ...]) -> tuple[str, str]:
    flags = list(peer_flags)

    def get(name: str) -> str:
        return flags[flags.index(name) + 1] if name in flags else "f16"

    return get("-ctk"), get("-ctv")
'''),
    ("_parse_line", '''def _parse_line(line: str, output_len: int, where: str) -> tuple[str, int]:
    if not line.lstrip().startswith("{"):
        return line, output_len
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: a JSON line needs a non-empty string 'prompt'")
    n_out = obj.get("output_len", output_len)
    if not isinstance(n_out, int) or n_out < 1:
        raise ValueError(f"{where}: 'output_len' must be an integer >= 1, got {n_out!r}")
    return prompt, n_out
'''),
]

OPEN = [
    "Write a Python function that merges overlapping intervals in a list of (start, end) "
    "pairs and returns the merged list sorted by start. Include a docstring.",
    "Explain in a few paragraphs how a hash table handles collisions, and compare chaining "
    "with open addressing.",
    "Write a Python class implementing an LRU cache with get and put methods in O(1) time, "
    "without using functools.",
    "Write a short story, about 150 words, about a lighthouse keeper who finds a message in "
    "a bottle.",
    "Write a Python function that parses a duration string like '1h30m15s' into a number "
    "of seconds, raising ValueError on bad input.",
    "Describe the differences between TCP and UDP, and give two applications suited to "
    "each.",
    "Write a bash script that finds the ten largest files under a directory given as its "
    "argument and prints their sizes in human-readable form.",
    "Write a Python generator that yields the prime numbers in increasing order, using an "
    "incremental sieve, and explain how it works.",
]


def gpl_paragraphs(path: str | Path, min_words: int = 50, max_words: int = 140) -> list[str]:
    """The paragraphs of the GPL text (blank-line separated, whitespace kept inside) of
    min_words..max_words words, in file order."""
    text = Path(path).read_text(encoding="utf-8")
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if min_words <= len(p.split()) <= max_words]


def add_typo(text: str, k: int) -> str:
    """text with one typo: the two middle letters of the k-th word of 7+ letters swapped
    (a word whose two middle letters are equal is passed over)."""
    words = list(re.finditer(r"[A-Za-z]{7,}", text))
    for m in words[k % len(words):] + words[:k % len(words)]:
        w = m.group(0)
        i = len(w) // 2
        if w[i - 1] != w[i]:
            typo = w[:i - 1] + w[i] + w[i - 1] + w[i + 1:]
            return text[:m.start()] + typo + text[m.end():]
    raise ValueError("no word to put a typo in")


def strip_hints_task(name: str, code: str) -> str:
    return ("Remove every type hint (argument and return annotations) from this Python code "
            "and return the whole code, changing nothing else:\n\n```python\n" + code + "```")


def rename_task(name: str, code: str) -> str:
    return (f"Rename the function `{name}` to `{name}_v2` in this Python code and return the "
            "whole code, changing nothing else:\n\n```python\n" + code + "```")


def grounded_turns(gpl: str | Path) -> list[str]:
    """8 user turns: 4 code edits and 4 typo fixes, interleaved."""
    code = [rename_task(*CODE[0]), strip_hints_task(*CODE[1]), strip_hints_task(*CODE[2]),
            rename_task(*CODE[3])]
    paras = gpl_paragraphs(gpl)
    picks = [paras[i * len(paras) // 4] for i in range(4)]
    text = [("Fix the typo in this text and return the whole text, changing nothing else:"
             "\n\n" + add_typo(p, 3 * i + 1)) for i, p in enumerate(picks)]
    return [t for pair in zip(code, text, strict=True) for t in pair]


def task_turns(task: str, gpl: str | Path) -> list[str]:
    if task == "grounded":
        return grounded_turns(gpl)
    if task == "open":
        return list(OPEN)
    raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}")


def prompt_lines(tokenizer: Any, task: str, n: int, max_tokens: int, gpl: str | Path
                 ) -> list[dict[str, Any]]:
    """The first n prompts of a task as `kvserve bench serve --dataset-name file` lines:
    the user turn through the model's chat template (with its generation prompt), and
    output_len = max_tokens (a cap: generation ends at the model's end of turn)."""
    turns = task_turns(task, gpl)
    if n > len(turns):
        raise ValueError(f"task {task} has {len(turns)} prompts, {n} asked for")
    out = []
    for turn in turns[:n]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}],
                                             add_generation_prompt=True)
        out.append({"prompt": text, "output_len": max_tokens})
    return out


# The workload: new tokens per request at most (a rewrite ends where the text does) and
# prompts per concurrency level. Each kvserve server's KV budget is bounded: a model's
# servers are up at once.
MAX_TOKENS = 256
PROMPTS = {1: 4, 8: 8}
KV_MEMORY = "512MiB"


def kvserve_serve_flags(api_key_file: Path) -> list[str]:
    """`kvserve serve MODEL --host H --port P`'s other flags in a spec run. Prefix caching
    is off, so every round prefills its prompts again and the rounds are the same work.
    Every (task, streams, round) sends its own API key (run_key), and each key is a
    tenant: the suffix proposer indexes only its tenant's past outputs, so a round cannot
    draft from an earlier round's answers to the same prompts."""
    return ["--kv-cache-memory", KV_MEMORY, "--no-enable-prefix-caching",
            "--api-key-file", str(api_key_file)]


# kvserve's servers take one API key per (task, streams, round), and one for the warm-up
# request: each key is a tenant, and the suffix proposer drafts only from its tenant's past
# outputs. With one tenant for the whole run, round 2 would draft round 1's answers to the
# very same prompts word for word, a speed-up no user sees.
WARM_UP_KEY = "spec-warm-up"


def run_key(task: str, concurrency: int, round_: int) -> str:
    return f"spec-{task}-c{concurrency}-r{round_}"


def api_key_file(tasks: list[str], concurrencies: list[int], rounds: int) -> str:
    """`kvserve serve --api-key-file` text: every run's key and the warm-up's, default tier."""
    keys = [WARM_UP_KEY] + [run_key(t, c, r) for t in tasks for c in concurrencies
                            for r in range(rounds)]
    return "".join(f"{k},{DEFAULT_TIER}\n" for k in keys)


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def split_jsonl(path: Path) -> list[Path]:
    """A prompt file's lines, each in a file of its own beside it (<stem>_p<i>.jsonl)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        part = path.with_name(f"{path.stem}_p{i}.jsonl")
        part.write_text(line, encoding="utf-8")
        out.append(part)
    return out


# ---- /metrics -----------------------------------------------------------------------------

_COUNTER = re.compile(r"^(vllm|llamacpp):spec_decode_num_(drafts|draft_tokens|accepted_tokens)"
                      r"(_total)?(\{[^}]*\})?\s+([-+0-9.eEinfa]+)\s*$")
_PER_POS = re.compile(r"^(vllm|llamacpp):spec_decode_num_accepted_tokens_per_pos(_total)?"
                      r"\{[^}]*position=\"(\d+)\"[^}]*\}\s+([-+0-9.eE]+)\s*$")


def parse_spec_metrics(text: str) -> dict[str, Any]:
    """The speculative-decoding counters of a Prometheus /metrics page, kvserve's vLLM names
    (`vllm:spec_decode_num_drafts[_total]`, `..._draft_tokens`, `..._accepted_tokens`) or
    llama-server's (`llamacpp:` prefix, same names): {"drafts", "draft_tokens",
    "accepted_tokens"} summed over label sets, and "accepted_per_pos" (a list, position 0
    first) where the server has it. A counter the page lacks is absent (`_created` series
    are not counters and are ignored)."""
    found: dict[str, dict[bool, float]] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _COUNTER.match(line)
        if m:
            d = found.setdefault(m.group(2), {})
            total = bool(m.group(3))
            d[total] = d.get(total, 0.0) + float(m.group(5))
            continue
        m = _PER_POS.match(line)
        if m:
            pos = int(m.group(3))
            per_pos[pos] = per_pos.get(pos, 0.0) + float(m.group(4))
    out: dict[str, Any] = {k: (v[True] if True in v else v[False]) for k, v in found.items()}
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in ("drafts", "draft_tokens", "accepted_tokens"):
        if k in after:
            out[k] = after[k] - before.get(k, 0.0)
    if "accepted_per_pos" in after:
        b = before.get("accepted_per_pos") or []
        pos = [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(after["accepted_per_pos"])]
        while pos and pos[-1] == 0:  # llama-server lists every position up to its n-max
            pos.pop()
        out["accepted_per_pos"] = pos
    return out


def acceptance(delta: dict[str, Any]) -> dict[str, Any]:
    """acceptance_rate = accepted / drafted tokens (vLLM's draft acceptance rate);
    mean_acceptance_length = 1 + accepted / drafts (tokens per target step while
    speculating, the bonus token included)."""
    dt, acc, n = (delta.get(k) for k in ("draft_tokens", "accepted_tokens", "drafts"))
    return {"acceptance_rate": acc / dt if dt else None,
            "mean_acceptance_length": 1 + acc / n if n and acc is not None else None,
            **{k: delta[k] for k in ("drafts", "draft_tokens", "accepted_tokens",
                                     "accepted_per_pos") if k in delta}}


def add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two deltas summed (rounds of one configuration)."""
    out = dict(a)
    for k in ("drafts", "draft_tokens", "accepted_tokens"):
        if k in b:
            out[k] = out.get(k, 0.0) + b[k]
    if "accepted_per_pos" in b:
        x, y = out.get("accepted_per_pos") or [], b["accepted_per_pos"]
        n = max(len(x), len(y))
        out["accepted_per_pos"] = [(x[i] if i < len(x) else 0.0) + (y[i] if i < len(y) else 0.0)
                                   for i in range(n)]
    return out


def merge_runs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One round's run of a one-stream cell from its prompts' runs (compare runs each prompt
    on every server in turn, so a speed-up compares runs seconds apart): requests, tokens
    and seconds summed, output_throughput their ratio, the latency medians the median of
    the parts' (one request each: the requests' median), mean_e2el_ms weighted by requests,
    output_lens joined, the /metrics deltas summed."""
    out: dict[str, Any] = {"round": parts[0]["round"]}
    for k in ("duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens"):
        out[k] = sum(p.get(k) or 0 for p in parts)
    out["output_throughput"] = (out["total_output_tokens"] / out["duration_s"]
                                if out["duration_s"] else None)
    for k in ("median_ttft_ms", "median_tpot_ms", "median_itl_ms"):
        vals = [p[k] for p in parts if p.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    done = [(p["mean_e2el_ms"], p.get("completed") or 0) for p in parts
            if p.get("mean_e2el_ms") is not None]
    n = sum(c for _, c in done)
    out["mean_e2el_ms"] = sum(v * c for v, c in done) / n if n else None
    out["output_lens"] = [x for p in parts for x in p.get("output_lens") or []]
    spec: dict[str, Any] = {}
    for p in parts:
        spec = add_counts(spec, p.get("spec") or {})
    out["spec"] = spec
    errors = [e for p in parts for e in p.get("errors") or []]
    if errors:
        out["errors"] = errors[:3]
    return out


@dataclass
class Cell:
    """One configuration on one (model, task, concurrency): its rounds."""

    runs: list[dict[str, Any]] = field(default_factory=list)  # bench-serve results, trimmed
    counts: dict[str, Any] = field(default_factory=dict)     # metric deltas summed over runs
    errors: list[str] = field(default_factory=list)
