"""What crosses from tensor-parallel rank 0 to the others: a step's ModelInput as one int64
array (encode_step / decode_step) with the decoder layers it runs (a self-draft's forward
runs the target's first ones), STOP, and the size of the shared-memory all-reduce. Each
rank's cores are platform.share_cores(rank, size)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.outputs import ModelInput

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

STOP = b"stop"
# n_tokens, n_requests, max_blocks, n_logits, max_query_len, max_seq_len, num_layers
_HEADER = 7


def encode_step(inp: ModelInput, num_layers: int = 0) -> bytes:
    """A step's ModelInput as one int64 array (header, then each tensor flattened);
    num_layers: the forward runs the model's first num_layers decoder layers (0: all)."""
    t, b = inp.input_ids.numel(), inp.seq_lens.numel()
    header = [t, b, inp.block_tables.shape[1], inp.logits_indices.numel(), inp.max_query_len,
              inp.max_seq_len, num_layers]
    parts = [torch.tensor(header, dtype=torch.int64)] + [
        x.reshape(-1).to(torch.int64).cpu() for x in (
            inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables, inp.seq_lens,
            inp.query_start_loc, inp.logits_indices)]
    return torch.cat(parts).numpy().tobytes()


def decode_step(data: bytes, device: torch.device) -> tuple[ModelInput, int]:
    """(the step's ModelInput, its num_layers: 0 for all)."""
    a = torch.from_numpy(np.frombuffer(data, dtype=np.int64).copy())
    t, b, max_blocks, s, max_q, max_s, num_layers = (int(x) for x in a[:_HEADER])
    sizes = [t, t, t, b * max_blocks, b, b + 1, s]
    x = a[_HEADER:].split(sizes)
    return ModelInput(
        input_ids=x[0].to(device), positions=x[1].to(device), slot_mapping=x[2].to(device),
        block_tables=x[3].reshape(b, max_blocks).to(torch.int32).to(device),
        seq_lens=x[4].to(torch.int32).to(device),
        query_start_loc=x[5].to(torch.int32).to(device), logits_indices=x[6].to(device),
        max_query_len=max_q, max_seq_len=max_s), num_layers


def shm_elements(config: EngineConfig) -> int:
    """The floats one shared-memory all-reduce carries: a step's hidden states (0: gloo)."""
    if config.parallel.all_reduce != "shm" or config.device != "cpu":
        return 0
    return config.scheduler.max_num_batched_tokens * config.model_config.hidden_size
