"""Shared test helpers: tiny random-weight HF models and a one-sequence paged forward."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.kv.layout import kv_cache_shape
from kvserve.models import get_model_class
from kvserve.outputs import ModelInput


def assert_close_exact_dtype(actual: torch.Tensor, expected: torch.Tensor, atol: float,
                             rtol: float) -> None:
    """assert_close that also requires the same shape and dtype (no silent promotion)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Within rel of ref's largest magnitude (and rel relatively), compared on the CPU in
    float32: the tolerance test_parity_tiny.py explains."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours.float().cpu(), ref.float().cpu(), rtol=rel, atol=rel * scale)


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random HF model in float32, with GQA (4 heads / 2 kv heads)."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**common, "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **overrides})
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**common, "sliding_window": None, **overrides})
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        model = transformers.Qwen2ForCausalLM(cfg)
        # HF initialises biases to zero; random ones make the parity test see them.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(arch)
    return model.float().eval()


def model_config_from_hf(hf_cfg: Any, architecture: str) -> ModelConfig:
    rope = getattr(hf_cfg, "rope_scaling", None) or None
    if rope and rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    return ModelConfig(
        architecture=architecture, vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size, intermediate_size=hf_cfg.intermediate_size,
        num_hidden_layers=hf_cfg.num_hidden_layers,
        num_attention_heads=hf_cfg.num_attention_heads,
        num_key_value_heads=hf_cfg.num_key_value_heads,
        head_dim=getattr(hf_cfg, "head_dim", None)
        or hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        max_position_embeddings=hf_cfg.max_position_embeddings,
        rms_norm_eps=hf_cfg.rms_norm_eps,
        rope_theta=getattr(hf_cfg, "rope_theta", None)
        or (getattr(hf_cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        rope_scaling=ModelConfig.freeze_rope_scaling(rope),
        tie_word_embeddings=hf_cfg.tie_word_embeddings,
        attention_bias=architecture == "Qwen2ForCausalLM")


def kvserve_model_from_hf(hf_model: Any, architecture: str, ops: Any) -> Any:
    cfg = model_config_from_hf(hf_model.config, architecture)
    model = get_model_class(architecture)(cfg, ops, torch.float32)
    model.load_weights((k, v.detach().clone()) for k, v in hf_model.state_dict().items())
    return model.eval()


class PagedSequence:
    """Runs one or more sequences through a kvserve model with a real paged KV cache,
    using deliberately scattered block ids."""

    def __init__(self, model: Any, num_blocks: int = 64, block_size: int = 4,
                 device: str = "cpu") -> None:
        cfg = model.config
        self.model = model
        self.bs = block_size
        self.device = device
        kv_heads = model.layers[0].self_attn.num_kv_heads  # a tensor-parallel rank's share
        self.kv = torch.zeros(kv_cache_shape(cfg.num_hidden_layers, num_blocks, block_size,
                                             kv_heads, cfg.head_dim), device=device)
        gen = torch.Generator().manual_seed(1)
        self.free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def new_seq(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    @torch.inference_mode()
    def forward(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feed chunks[seq] tokens to each sequence in ONE varlen batch; returns per sequence
        the logits [len(chunk), vocab] of every fed position."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        order = list(chunks)
        for s in order:
            toks = chunks[s]
            start = self.lens[s]
            end = start + len(toks)
            while len(self.tables[s]) * self.bs < end:
                self.tables[s].append(self.free.pop())
            for p in range(start, end):
                pos.append(p)
                slots.append(self.tables[s][p // self.bs] * self.bs + p % self.bs)
            ids += toks
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            self.lens[s] = end
        mb = max(len(self.tables[s]) for s in order)
        bt = torch.zeros(len(order), mb, dtype=torch.int32)
        for b, s in enumerate(order):
            bt[b, : len(self.tables[s])] = torch.tensor(self.tables[s])
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        dev = self.device
        inp = ModelInput(
            input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots, device=dev), block_tables=bt.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=qsl_t.to(dev), logits_indices=torch.arange(len(ids), device=dev),
            max_query_len=int((qsl_t[1:] - qsl_t[:-1]).max()), max_seq_len=max(seq_lens))
        hidden = self.model(inp, self.kv)
        logits = self.model.compute_logits(hidden)
        return [logits[qsl[b]:qsl[b + 1]] for b in range(len(order))]


def paged_model_input(tables: torch.Tensor, block_size: int, seq_lens: list[int],
                      q_lens: list[int]) -> ModelInput:
    """A varlen step over block tables [B, blocks]: request b feeds the last q_lens[b] of its
    seq_lens[b] tokens (slots from its table), every position producing logits."""
    pos = [p for s, q in zip(seq_lens, q_lens) for p in range(s - q, s)]
    rows = [b for b, q in enumerate(q_lens) for _ in range(q)]
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size
             for b, p in zip(rows, pos)]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return ModelInput(input_ids=torch.zeros(len(pos), dtype=torch.int64),
                      positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
                      block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                      query_start_loc=qsl, logits_indices=torch.arange(len(pos)),
                      max_query_len=max(q_lens), max_seq_len=max(seq_lens))


def next_token_kl(model: Any, ref: Any, prompt: list[int]) -> tuple[float, float]:
    """(mean KL(ref || model) of the next-token distributions at every prompt position, the
    share of positions whose greedy tokens agree), one prefill of the prompt each; asserts
    the fused C++ stack took model's layers where its ops fuse."""
    logps = []
    for m in (model, ref):
        runner = PagedSequence(m, num_blocks=16, block_size=16)
        logps.append(torch.log_softmax(runner.forward({runner.new_seq(): prompt})[0], -1))
    ours, theirs = logps
    if getattr(model.ops, "fuse_layers", False):
        assert model.ops._stacks.get(model.layers) is not None
    kl = float((theirs.exp() * (theirs - ours)).sum(-1).mean())
    return kl, float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
