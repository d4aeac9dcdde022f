"""Frozen engine configuration.

Every config is a frozen dataclass validated at construction: a bad value raises ValueError
naming the field and the allowed range. Values discovered at run time (the number of KV blocks,
the device's free memory) live in runtime state, never here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvserve.kv.layout import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES

_DTYPES = ("float32", "bfloat16", "float16")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, named as in HF config.json."""

    architecture: str  # registry key, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3-style scaling as a sorted tuple of (key, value) pairs so the config stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # config.json's quantization_config (GPTQ, AWQ checkpoints), frozen as sorted items.
    quantization_config: tuple[tuple[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _require(getattr(self, name) >= 1, f"ModelConfig.{name} must be >= 1, "
                     f"got {getattr(self, name)}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a "
                 f"multiple of num_key_value_heads ({self.num_key_value_heads})")

    @property
    def quantization_dict(self) -> dict[str, Any] | None:
        return dict(self.quantization_config) if self.quantization_config else None

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @staticmethod
    def freeze_rope_scaling(d: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
        if not d:
            return None
        return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


_MEM_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20,
              "mb": 1000**2, "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_memory(value: int | str | None, name: str = "kv_cache_memory") -> int | None:
    """'2GiB', '512M', '1e9' or an int -> bytes. None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _MEM_UNITS:
        raise ValueError(f"{name} must be a byte count like 2147483648, '2GiB' or '512MiB', "
                         f"got {value!r}")
    return int(float(m.group(1)) * _MEM_UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for the whole KV cache. None: a share of the device's free memory.
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.1
    # Exact block count, for tests and debugging; overrides the memory budget.
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # "auto" = the model dtype; int8 / fp8_e4m3 (vLLM's "fp8"): quantized with a float32 scale
    # per token, K/V and kv head (kvserve/kv/layout.py), about half float16's bytes per token.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 f"block_size must be a power of two in [1, 256], got {self.block_size}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        _require(0.0 < self.kv_cache_memory_fraction <= 0.95,
                 f"kv_cache_memory_fraction must be in (0, 0.95], "
                 f"got {self.kv_cache_memory_fraction}")
        _require(self.num_blocks_override is None or self.num_blocks_override >= 2,
                 f"num_blocks_override must be >= 2 (block 0 is the null block), "
                 f"got {self.num_blocks_override}")
        canonical = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", canonical)
        aliases = ", ".join(f"{a}: {c}" for a, c in KV_CACHE_DTYPE_ALIASES.items())
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} ({aliases}), "
                 f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class TierConfig:
    """A service tier (the server maps each API key to one; kvserve/fair_queue.py).

    weight: the tier's share of admissions when several tiers wait (paid 8, free 1: paid gets
    8 of every 9). max_running / max_waiting: the tier's own bounds (None: only the engine's);
    a full waiting queue is the server's 429. allow_priority: whether a request's own
    priority field counts, ordering it within its tier only; otherwise a priority is refused
    with a 400. priority_aging_s: within the tier, one priority level is worth this many
    seconds of waiting, so a low-priority request is not passed over forever."""

    name: str
    weight: float = 1.0
    max_running: int | None = None
    max_waiting: int | None = None
    allow_priority: bool = False
    priority_aging_s: float | None = 10.0  # None: strict priorities (no ageing)

    def __post_init__(self) -> None:
        _require(bool(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name or "")),
                 f"a tier name must be 1-64 letters, digits, '_', '.' or '-', got "
                 f"{self.name!r}")
        _require(isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool)
                 and 0 < self.weight <= 1e6,
                 f"tier {self.name!r}: weight must be in (0, 1e6], got {self.weight}")
        for name in ("max_running", "max_waiting"):
            v = getattr(self, name)
            _require(v is None or (isinstance(v, int) and v >= 1),
                     f"tier {self.name!r}: {name} must be an integer >= 1, got {v!r}")
        _require(isinstance(self.allow_priority, bool),
                 f"tier {self.name!r}: allow_priority must be true or false, got "
                 f"{self.allow_priority!r}")
        _require(self.priority_aging_s is None or (
                     isinstance(self.priority_aging_s, (int, float))
                     and self.priority_aging_s > 0),
                 f"tier {self.name!r}: priority_aging_s must be > 0, got "
                 f"{self.priority_aging_s}")


def parse_tiers(spec: dict | str | None) -> tuple[TierConfig, ...]:
    """--tiers: {"paid": {"weight": 8, "max_running": 48, ...}, "free": {...}} (TierConfig's
    fields but name), as a dict, its JSON text, or the path of a JSON file holding it."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        text = spec
        if not spec.lstrip().startswith("{"):
            try:
                with open(spec, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"tiers: {spec!r} is neither a JSON object nor a readable "
                                 f"file ({e.strerror})") from None
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"tiers is not valid JSON: {e}") from None
    _require(isinstance(spec, dict) and bool(spec),
             "tiers must be a non-empty JSON object of tier name -> settings")
    known = {f.name for f in dataclasses.fields(TierConfig)} - {"name"}
    tiers = []
    for name, fields in spec.items():
        _require(isinstance(fields, dict), f"tiers: tier {name!r} must map to an object of "
                                           f"settings ({', '.join(sorted(known))})")
        unknown = sorted(set(fields) - known)
        _require(not unknown, f"tiers: tier {name!r} has unknown setting(s) "
                              f"{', '.join(unknown)}; known: {', '.join(sorted(known))}")
        tiers.append(TierConfig(name, **fields))
    return tuple(tiers)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None  # None: unbounded (the server sets a bound)
    # Service tiers (TierConfig); empty: one tier, strict (priority, arrival) order, as
    # vLLM's priority policy. A request names its tier (Request.tier; None: request.DEFAULT_TIER).
    tiers: tuple[TierConfig, ...] = ()

    def __post_init__(self) -> None:
        _require(1 <= self.max_num_seqs <= 4096,
                 f"max_num_seqs must be in [1, 4096], got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len >= 1,
                 f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(self.enable_chunked_prefill
                 or self.max_num_batched_tokens >= self.max_model_len,
                 f"without chunked prefill max_num_batched_tokens "
                 f"({self.max_num_batched_tokens}) must be >= max_model_len "
                 f"({self.max_model_len})")
        names = [t.name for t in self.tiers]
        _require(len(set(names)) == len(names), f"tier names must be distinct, got {names}")


@dataclass(frozen=True)
class QuantConfig:
    """Which quantization method (a name in kvserve.quant's registry) runs the weights.

    none: every weight in the model dtype. gguf: a GGUF file's Q4_1 / Q8_0 linear weights keep
    their bytes (repacked) and multiply int8-quantized activations, llama.cpp's arithmetic.
    gguf_exact: the same blocks as stored, computed in float32, the float32 model's output bit
    for bit. int8 / int4: a float checkpoint quantized at load (kvserve/quant/rtn.py);
    group_size: int4's group of inputs (32, 64 or 128)."""

    method: str = "none"
    group_size: int | None = None
    # The checkpoint's own quantization_config (ModelConfig.quantization_config), which a
    # method that loads quantized checkpoints (gptq, awq) reads its settings from.
    checkpoint_config: tuple[tuple[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        # The method's own checks (its name in the registry, the knobs it takes) are the
        # registry's: kvserve.quant.quant_config builds a checked QuantConfig, and the engine
        # checks the one it is given (kvserve.quant.check_engine_config).
        _require(isinstance(self.method, str) and bool(self.method),
                 f"quantization must be a method name, got {self.method!r}")
        _require(self.group_size is None or (isinstance(self.group_size, int)
                                             and self.group_size >= 1),
                 f"group_size must be a positive integer or None, got {self.group_size!r}")


SPEC_METHODS = ("ngram", "draft_model", "self_draft", "suffix", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's speculative_config shape (kvserve/spec/).

    method: the proposer (SPEC_METHODS). num_speculative_tokens: the most draft tokens a
    request verifies per step (K); adaptive: choose 0..K per request and step from measured
    acceptance and step cost (spec/policy.py), False: always K where the proposer has them.
    ngram: the longest suffix of prompt_lookup_max .. prompt_lookup_min tokens that occurred
    before proposes what followed it. draft_model: model, a checkpoint with the target's
    vocabulary, run with quantization (None: its own default); draft_vocab_size: its lm_head
    computes only the first N token ids (BPE ids run in merge order, most frequent first) and
    the special ones, the rest getting probability 0 in q: still exact, a few percent fewer
    accepted drafts, and a draft token that reads far fewer bytes (None: 32768 for a
    vocabulary over 65536 tokens, else all; 0: all); draft_p_min: a draft model stops drafting
    for a request at a token it gives less than this probability (llama.cpp's --draft-p-min;
    the decision is the draft's alone, so verification stays exact). self_draft: the target's own
    first num_layers decoder layers (None: half of them), then its final norm and lm_head,
    sharing its weights (an early exit). suffix (vLLM's names): the longest match, up to
    suffix_decoding_max_tree_depth tokens, of the request's latest tokens in its own tokens
    and in the finished outputs of the same tenant (API key), at most
    suffix_decoding_max_cached_tokens of them (0: the request's own tokens only), proposes
    the continuation seen most often after it; at most suffix_decoding_max_spec_factor x the
    match length drafts, stopping where the continuation's estimated probability falls below
    suffix_decoding_min_token_prob (spec/suffix.py). respace_prompt: ngram and suffix also
    look the continuation up in the prompt with its wrapped lines joined and its runs of
    blanks single (spec/respace.py: a rewrite of a hard-wrapped text writes each paragraph as
    one line); kvserve's own, not vLLM's.
    medusa: model, a directory of Medusa heads for the
    target (config.json and medusa_lm_head.safetensors, as `kvserve train-medusa` writes
    them), at least num_speculative_tokens of them; their hidden size and vocabulary must be
    the target's."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    num_layers: int | None = None
    draft_vocab_size: int | None = None
    draft_p_min: float = 0.0
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_tokens: int = 1 << 20
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    respace_prompt: bool = True
    adaptive: bool = True

    def __post_init__(self) -> None:
        _require(self.method in SPEC_METHODS,
                 f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                 f"got {self.method!r}")
        _require(isinstance(self.num_speculative_tokens, int)
                 and 1 <= self.num_speculative_tokens <= 16,
                 f"speculative_config.num_speculative_tokens must be an integer in [1, 16], "
                 f"got {self.num_speculative_tokens!r}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64,
                 f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64,"
                 f" got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _require(self.num_layers is None or (self.method == "self_draft"
                                             and isinstance(self.num_layers, int)
                                             and self.num_layers >= 1),
                 f"speculative_config.num_layers is a positive integer for method self_draft, "
                 f"got {self.num_layers!r} with {self.method!r}")
        _require(self.draft_vocab_size is None or (isinstance(self.draft_vocab_size, int)
                                                   and self.draft_vocab_size >= 0),
                 f"speculative_config.draft_vocab_size must be an integer >= 0, "
                 f"got {self.draft_vocab_size!r}")
        _require(0.0 <= self.draft_p_min < 1.0,
                 f"speculative_config.draft_p_min must be in [0, 1), got {self.draft_p_min!r}")
        _require(isinstance(self.suffix_decoding_max_tree_depth, int)
                 and 2 <= self.suffix_decoding_max_tree_depth <= 256,
                 f"speculative_config.suffix_decoding_max_tree_depth must be an integer in "
                 f"[2, 256], got {self.suffix_decoding_max_tree_depth!r}")
        _require(isinstance(self.suffix_decoding_max_cached_tokens, int)
                 and self.suffix_decoding_max_cached_tokens >= 0,
                 f"speculative_config.suffix_decoding_max_cached_tokens must be an integer "
                 f">= 0, got {self.suffix_decoding_max_cached_tokens!r}")
        _require(isinstance(self.suffix_decoding_max_spec_factor, (int, float))
                 and self.suffix_decoding_max_spec_factor > 0,
                 f"speculative_config.suffix_decoding_max_spec_factor must be > 0, "
                 f"got {self.suffix_decoding_max_spec_factor!r}")
        _require(isinstance(self.suffix_decoding_min_token_prob, (int, float))
                 and 0.0 <= self.suffix_decoding_min_token_prob <= 1.0,
                 f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], "
                 f"got {self.suffix_decoding_min_token_prob!r}")
        for name in ("respace_prompt", "adaptive"):
            _require(isinstance(getattr(self, name), bool),
                     f"speculative_config.{name} must be true or false, "
                     f"got {getattr(self, name)!r}")
        needs_model = self.method in ("draft_model", "medusa")
        _require(needs_model == (self.model is not None),
                 f"speculative_config.model is {'required' if needs_model else 'not used'} "
                 f"with method {self.method!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """From the user's dict (LLM(speculative_config=...), --speculative-config JSON):
        ValueError naming an unknown or missing key."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got "
                             f"{type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(names)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config.{key} is required")
        return cls(**d)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (kvserve/executor/, kvserve/distributed/): tensor_parallel_size
    processes, each with 1/N of every layer's heads and MLP columns and of the KV cache
    (vLLM's name).
    timeout_s: how long a collective may wait for a rank before the engine gives up on it
    (a hung worker); a dead worker is noticed at once."""

    tensor_parallel_size: int = 1
    timeout_s: float = 60.0
    # The CPU ranks' all-reduce: "shm" (shared memory, distributed/shm.py) or "gloo" (TCP on
    # loopback, ~20x slower per decode all-reduce here: BENCHMARKS.md). CUDA uses NCCL.
    all_reduce: str = "shm"

    def __post_init__(self) -> None:
        _require(1 <= self.tensor_parallel_size <= 64,
                 f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}")
        _require(self.all_reduce in ("shm", "gloo"),
                 f"tp_all_reduce must be shm or gloo, got {self.all_reduce!r}")
        _require(self.timeout_s > 0, f"tp_timeout must be > 0 seconds, got {self.timeout_s}")

    def check_model(self, mc: ModelConfig) -> None:
        """Every split is even: heads, KV heads, MLP columns and the vocabulary."""
        n = self.tensor_parallel_size
        for what, count in (("attention heads", mc.num_attention_heads),
                            ("KV heads", mc.num_key_value_heads),
                            ("MLP columns (intermediate_size)", mc.intermediate_size),
                            ("vocabulary entries", mc.vocab_size)):
            _require(count % n == 0, f"tensor_parallel_size {n} does not divide the model's "
                     f"{count} {what} (model: {mc.num_attention_heads} attention heads, "
                     f"{mc.num_key_value_heads} KV heads); pick a divisor of the head counts")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # resolved path to a .gguf file or an HF directory
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    ops_backend: str = "auto"  # "auto" | "reference" | "cpu" | "torch" (kvserve.ops registry)
    # True: no CUDA graphs (kvserve/graphs.py), every step launched op by op (vLLM's name).
    enforce_eager: bool = False
    quant: QuantConfig = field(default_factory=QuantConfig)
    # Bound of the compiled-grammar cache (response_format schemas), in bytes; 0: no cache.
    grammar_cache_bytes: int = 256 << 20
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        self.parallel.check_model(self.model_config)
        _require(self.grammar_cache_bytes >= 0,
                 f"grammar_cache_bytes must be >= 0, got {self.grammar_cache_bytes}")
        _require(self.dtype in _DTYPES,
                 f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        _require(self.scheduler.max_model_len <= self.model_config.max_position_embeddings,
                 f"max_model_len ({self.scheduler.max_model_len}) must be <= the model's "
                 f"context length ({self.model_config.max_position_embeddings})")

    @property
    def quantization(self) -> str:
        """The quantization method's name (quant.method)."""
        return self.quant.method

    def replace(self, **kw: Any) -> EngineConfig:
        return dataclasses.replace(self, **kw)
