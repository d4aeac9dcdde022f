"""A tensor-parallel rank r >= 1: its shard of the model and of the KV cache, and a loop that
runs each step rank 0 sends (tp.py has the whole picture)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any

import torch

from kvserve.distributed.group import TPGroup
from kvserve.executor.step import STOP, decode_step, shm_elements
from kvserve.platform import pin_thread

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15


def _name_process(rank: int) -> None:
    """kvserve-tpR in ps / top (Linux). No PR_SET_PDEATHSIG: it fires when the *thread*
    that started this process exits (the server loads in a short-lived thread), not the
    process. Rank 0's death still ends this one: its pipe end closes (EOF below), and a
    collective with a dead peer raises."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, f"kvserve-tp{rank}".encode())
    except OSError:
        pass


def _check_parent(parent: int) -> None:
    if os.getppid() != parent:
        raise RuntimeError("tensor-parallel rank 0 is gone")


def worker_main(args: Any, rank: int, size: int, port: int, conn: Any, cores: list[int],
                spin: bool = True) -> None:
    _name_process(rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{rank}: %(message)s",
                        stream=sys.stderr)
    pin_thread(cores)  # the OpenMP threads started from here inherit it
    try:
        from kvserve.loader import load_checkpoint, resolve_model
        from kvserve.model_setup import allocate_kv_cache, load_model, num_kv_blocks

        path = resolve_model(args.model)
        ckpt = load_checkpoint(path)
        config = args.create_engine_config(path, ckpt.model_config)
        group = TPGroup.connect(rank, size, port, config.device, config.parallel.timeout_s,
                                shm_elements(config), spin)
        if group.shm is not None:
            parent = os.getppid()
            group.shm.alive = lambda: _check_parent(parent)
        config, _ops, model = load_model(args, ckpt, config, group)
        conn.send(("ready", num_kv_blocks(config)))
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    _kind, num_blocks = conn.recv()
    kv_cache = allocate_kv_cache(config, num_blocks)
    device = torch.device(config.device)
    # A self-draft's forwards run the first n layers in their part of the cache (a view):
    # one list per n, kept, since the fused layer stack is built once per list (ops/cpu.py's
    # fused_llama_stack).
    first_layers: dict[int, tuple[Any, Any]] = {0: (None, kv_cache)}
    with torch.inference_mode():
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if data == STOP:
                return
            inp, n = decode_step(data, device)
            if n not in first_layers:
                first_layers[n] = (model.layers[:n], kv_cache[:n])
            layers, cache = first_layers[n]
            hidden = model(inp, cache, layers=layers)
            model.compute_logits(hidden[inp.logits_indices])  # this rank's slice, to rank 0
