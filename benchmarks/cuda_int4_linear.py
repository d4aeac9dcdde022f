"""4-bit weights on CUDA (kvserve/ops/int4mm.py: torch's tinygemm) against bfloat16.

Per linear, on Llama-8B-sized shapes: bfloat16 F.linear against tinygemm and against
int4mm.dequantize_cuda + F.linear (int4mm.matmul's two paths) at group size 128, CUDA events,
the mean of 50 calls after 5 warm-ups. Then, with --e2e, a whole model: a random-weight Llama
of TinyLlama-1.1B's shape (22 layers, hidden 2048, a byte vocabulary so that the linears are
the weights), loaded in bfloat16 as is (quantization none) and with `--quantization int4`
(round to nearest at load, group 128, on int4mm): the model's parameter bytes, greedy decode
tok/s at 1 and 16 sequences, and the time to the first token of a 1024-token prompt (medians
of 3). Needs a CUDA GPU:

    PYTHONPATH=. python benchmarks/cuda_int4_linear.py [--e2e]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_int8_linear import cuda_us  # benchmarks/, beside this file

from kvserve.ops import int4mm
from kvserve.quant.int4_groups import Int4Groups


def _dequantized_linear(x, packed, pairs, g):
    return F.linear(x, int4mm.dequantize_cuda(packed, pairs, g))


def per_linear() -> None:
    dev, g = torch.device("cuda"), 128
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
        wb = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        groups = Int4Groups(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                            torch.rand(n, k // g) / 64, torch.randn(n, k // g) / 64, g, None)
        packed, pairs = int4mm.pack(groups, dev, torch.bfloat16)
        for m in (1, 16, 32, 64, 128, 256, 1024):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            bf16 = cuda_us(F.linear, x, wb)
            tiny = cuda_us(torch.ops.aten._weight_int4pack_mm, x, packed, g, pairs)
            deq = cuda_us(_dequantized_linear, x, packed, pairs, g)
            print(f"N={n} K={k} M={m}: bf16 {bf16:.1f} us, tinygemm {tiny:.1f} us, "
                  f"dequantized + cuBLAS {deq:.1f} us", flush=True)


def _random_llama(path: Path, device: str, layers: int) -> None:
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(str(path), safe_serialization=True)
    byte_level = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())  # 256 symbols
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(byte_level)},
                                                     []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": byte_level[0]}))


def e2e(device: str = "cuda", layers: int = 22, ops: str = "auto") -> None:
    from kvserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as d:
        path = Path(d)
        _random_llama(path, device, layers)
        for quant in ("none", "int4"):
            kw = {"quant_group_size": 128} if quant == "int4" else {}
            t0 = time.perf_counter()
            llm = LLM(model=str(path), device=device, ops_backend=ops, dtype="bfloat16",
                      quantization=quant, kv_cache_memory="2GiB", **kw)
            load = time.perf_counter() - t0
            model = llm.llm_engine.model
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            line = f"{quant}: load {load:.1f} s, parameters {held / 2**20:.0f} MiB"
            sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
            gen = torch.Generator().manual_seed(1)
            for batch in (1, 16):
                prompts = [{"prompt_token_ids": torch.randint(0, 256, (32,), generator=gen)
                            .tolist()} for _ in range(batch)]
                llm.generate(prompts, sp, use_tqdm=False)  # warm-up
                rates = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, sp, use_tqdm=False)
                    dt = time.perf_counter() - t0
                    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                line += f", batch {batch}: {statistics.median(rates):.0f} tok/s"
            prompt = [{"prompt_token_ids": torch.randint(0, 256, (1024,), generator=gen)
                       .tolist()}]
            one = SamplingParams(max_tokens=1, temperature=0)
            llm.generate(prompt, one, use_tqdm=False)
            ttft = []
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(prompt, one, use_tqdm=False)
                ttft.append(time.perf_counter() - t0)
            line += f", 1024-token prompt: {statistics.median(ttft) * 1000:.0f} ms"
            print(line, flush=True)
            del llm, model
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    per_linear()
    if "--e2e" in sys.argv:
        e2e()
