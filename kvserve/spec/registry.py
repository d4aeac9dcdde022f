"""speculative_config.method -> its proposer."""

from __future__ import annotations

from typing import Any

from kvserve.config import EngineConfig
from kvserve.spec.base import Proposer
from kvserve.spec.draft_model import DraftModelProposer
from kvserve.spec.medusa import MedusaProposer
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.suffix import SuffixProposer


def build_proposer(config: EngineConfig, target_tokenizer: Any = None,
                   target_model: Any = None) -> Proposer | None:
    """The proposer config.speculative names (None without speculation); a draft model is
    loaded here, and refused when its vocabulary is not the target's; self_draft runs the
    target_model's first layers; medusa's heads read the target_model's hidden states. Its
    KV cache comes later (allocate_kv), once the engine has sized the blocks with
    kv_bytes_per_block."""
    spec = config.speculative
    if spec is None:
        return None
    respace_with = target_tokenizer if spec.respace_prompt else None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, respace_with)
    if spec.method == "suffix":
        return SuffixProposer(spec.suffix_decoding_max_tree_depth,
                              spec.suffix_decoding_max_cached_tokens,
                              spec.suffix_decoding_max_spec_factor,
                              spec.suffix_decoding_min_token_prob, respace_with)
    if spec.method == "medusa":
        return MedusaProposer.load(config, target_model)
    if spec.method == "self_draft":
        return DraftModelProposer.early_exit(config, target_model)
    return DraftModelProposer.load(config, target_tokenizer)
