"""User-facing engine settings with vLLM's names -> a frozen EngineConfig.

EngineArgs is what LLM(**kwargs) and the CLI fill in; create_engine_config() resolves the
defaults that depend on the model and the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory,
    parse_tiers,
)
from kvserve.kv.layout import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES
from kvserve.platform import default_device
from kvserve.quant import (
    QUANT_METHOD_ALIASES,
    check_engine_config,
    detect_quantization,
    get_quant_method_class,
    quant_config,
    quant_method_names,
)


@dataclass
class EngineArgs:
    model: str | None = None  # None or "smollm2-135m": the default model
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: 512 on CPU, 2048 on CUDA
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes or "2GiB"; None: a share of free memory
    num_gpu_blocks_override: int | None = None  # exact block count (tests, debugging)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # None: float16 with quantization "gguf" (llama.cpp's default KV type, and half the bytes
    # a decode streams), else "auto" (the model dtype).
    kv_cache_dtype: str | None = None
    max_waiting_requests: int | None = None
    # Seeds the sampler's generator for requests without their own seed. 0 by default, as in
    # vLLM V1: the same requests in the same order sample the same tokens run after run.
    seed: int = 0
    ops_backend: str = "auto"
    # CUDA only: True runs every step op by op; False captures decode steps as CUDA graphs.
    enforce_eager: bool = False
    # None (auto): "gguf" for a .gguf file in float32 on the CPU (the kernels read its Q4_1 /
    # Q8_0 blocks as stored, like llama.cpp), else "none" (dequantize at load).
    quantization: str | None = None
    # int4's group of inputs (32, 64 or 128); None: the method's default (32).
    quant_group_size: int | None = None
    # The compiled-grammar cache's bound: bytes or "256MiB" (every distinct response_format
    # schema would otherwise stay compiled in memory for good).
    grammar_cache_memory: int | str = "256MiB"
    # vLLM's speculative_config: {"method": "ngram" | "suffix" | "draft_model" | "self_draft",
    # "num_speculative_tokens": K, ...} (kvserve.config.SpeculativeConfig), or its JSON text;
    # None: no speculation.
    speculative_config: dict | str | None = None
    # Tensor parallelism: N processes, each with 1/N of every layer (kvserve/executor/).
    tensor_parallel_size: int = 1
    tp_timeout: float = 60.0  # seconds a collective waits for a rank (a hung worker)
    tp_all_reduce: str = "shm"  # the CPU ranks' all-reduce: shm or gloo
    # Service tiers: {"paid": {"weight": 8, "max_running": 48, "max_waiting": 256,
    # "allow_priority": true}, "free": {...}} (kvserve.config.TierConfig), its JSON text or a
    # JSON file's path; None: one tier. The server maps API keys to tiers (--api-key-file).
    tiers: dict | str | None = None

    def create_engine_config(self, model_path: str, mc: ModelConfig) -> EngineConfig:
        device = default_device() if self.device == "auto" else self.device
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        max_len = self.max_model_len or mc.max_position_embeddings
        if mc.sliding_window is not None and self.max_model_len is None:
            # Full attention equals sliding-window attention only within the window.
            max_len = min(max_len, mc.sliding_window)
        if mc.sliding_window is not None and max_len > mc.sliding_window:
            raise ValueError(f"max_model_len ({max_len}) must be <= the model's sliding window "
                             f"({mc.sliding_window}): kvserve runs full attention")
        budget = self.max_num_batched_tokens or (512 if device == "cpu" else 2048)
        quantization = self.quantization or detect_quantization(
            model_path, device, dtype, self.ops_backend, mc.quantization_dict)
        if not self.enable_chunked_prefill:
            budget = max(budget, max_len)
        return check_engine_config(EngineConfig(
            model=model_path,
            model_config=mc,
            cache=CacheConfig(block_size=self.block_size,
                              kv_cache_memory=parse_memory(self.kv_cache_memory),
                              num_blocks_override=self.num_gpu_blocks_override,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype or get_quant_method_class(
                                  quantization).default_kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=budget, max_model_len=max_len,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      max_waiting_requests=self.max_waiting_requests,
                                      tiers=parse_tiers(self.tiers)),
            dtype=dtype, device=device, seed=self.seed, ops_backend=self.ops_backend,
            enforce_eager=self.enforce_eager,
            quant=quant_config(quantization, self.quant_group_size, mc.quantization_config),
            grammar_cache_bytes=parse_memory(self.grammar_cache_memory,
                                             "grammar_cache_memory") or 0,
            speculative=self.speculative(),
            parallel=ParallelConfig(self.tensor_parallel_size, self.tp_timeout,
                                    self.tp_all_reduce)))

    def speculative(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return None if spec is None else SpeculativeConfig.from_dict(spec)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names))}")
        return cls(**kwargs)  # type: ignore[arg-type]

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16",
                                                             "float16"])
        p.add_argument("--device", default=d.device)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        p.add_argument("--max-num-batched-tokens", type=int, default=None)
        p.add_argument("--block-size", type=int, default=d.block_size)
        p.add_argument("--kv-cache-memory", default=None,
                       help="KV cache size in bytes or with a unit (2GiB); default: a share "
                            "of free memory")
        p.add_argument("--num-gpu-blocks-override", type=int, default=None)
        p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false")
        p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false")
        p.add_argument("--kv-cache-dtype", default=None,
                       choices=[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES],
                       help="auto: the model dtype; int8 / fp8_e4m3 (fp8): quantized, one float32 "
                       "scale per token, K/V and kv head (about 2x float16's tokens in the "
                       "same memory); default: float16 for the quantizations the CPU kernels "
                       "run (gguf, int8, int4, gptq, awq, w8a8: as llama.cpp), else auto")
        p.add_argument("--seed", type=int, default=d.seed,
                       help="seeds sampling for requests without their own seed: the same "
                       "requests in the same order give the same outputs run after run "
                       "(default 0, as vLLM; a request's seed still wins and stays "
                       "independent of the batch). Pass another value for other samples")
        p.add_argument("--grammar-cache-memory", default=d.grammar_cache_memory,
                       help="bound of the compiled response_format grammars kept for reuse, "
                            "in bytes or with a unit (default 256MiB; 0: no cache)")
        p.add_argument("--quantization", "-q", default=d.quantization,
                       choices=[*quant_method_names(), *QUANT_METHOD_ALIASES],
                       help="for a GGUF file's Q4_1 / Q8_0 weights. gguf (default for .gguf "
                       "files on the CPU): keep their bytes and multiply them by activations "
                       "quantized to int8 per 32 values, as llama.cpp does; gguf_exact: keep "
                       "the blocks and compute in float32 (the float32 model's output bit for "
                       "bit, ~3-6x more compute); int8 / int4: quantize a float checkpoint's "
                       "linear weights at load (per output channel / per group of "
                       "--quant-group-size inputs, round to nearest) for the same kernels; "
                       "none: every weight in --dtype")
        p.add_argument("--quant-group-size", type=int, default=None,
                       help="int4's group of inputs sharing a scale and minimum: 32 (default), "
                            "64 or 128")
        p.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON, vLLM\'s shape: {"method": "ngram", '
                       '"num_speculative_tokens": 5} (prompt lookup; prompt_lookup_min / '
                       'prompt_lookup_max), {"method": "suffix", "num_speculative_tokens": '
                       '8} (suffix_decoding_max_tree_depth / _max_cached_tokens / '
                       '_max_spec_factor / _min_token_prob), {"method": "draft_model", '
                       '"model": PATH, "num_speculative_tokens": 4} or {"method": "medusa", '
                       '"model": HEADS_DIR, "num_speculative_tokens": 3} (kvserve '
                       'train-medusa); "adaptive": false always drafts K (default: K per step '
                       'from measured acceptance and cost)')
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="split every layer across N processes (torch.distributed: gloo "
                            "on CPU, NCCL on CUDA), each on its share of the cores or its "
                            "GPU; the heads, KV heads, MLP columns and vocabulary must "
                            "divide by N (default 1)")
        p.add_argument("--tp-timeout", type=float, default=d.tp_timeout,
                       help="seconds a tensor-parallel collective waits for a rank before "
                            "the engine stops (a hung worker; a dead one is noticed at once)")
        p.add_argument("--tp-all-reduce", choices=["shm", "gloo"], default=d.tp_all_reduce,
                       help="how CPU ranks sum their partial outputs: shm (shared memory, "
                            "default) or gloo (torch.distributed over loopback TCP)")
        p.add_argument("--tiers", default=None, metavar="JSON|FILE",
                       help='service tiers, e.g. \'{"paid": {"weight": 8, "max_running": 48, '
                            '"max_waiting": 256, "allow_priority": true}, "free": {"weight": '
                            '1, "max_running": 16, "max_waiting": 64}}\' (or a JSON file): '
                            'admissions by weighted fair share, each tier\'s own bounds '
                            '(429 past max_waiting), request priorities within a tier only '
                            'where allowed, aged by priority_aging_s (default 10 s per '
                            'level); the server\'s --api-key-file puts each key in one')
        p.add_argument("--ops-backend", default=d.ops_backend,
                       help="auto (cpu kernels on CPU, torch elsewhere), cpu, torch or "
                       "reference (the pure-torch oracle)")
        p.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run decode steps op by op, not as captured CUDA graphs")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
