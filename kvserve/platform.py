"""Device detection, thread settings (and in_own_thread, the thread a model loads in), the
memory budget of the KV cache, and the one process-wide set-up that entry points make
(setup_process)."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

_T = TypeVar("_T")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def available_memory(device: str) -> int:
    """Bytes the KV cache may take from: free device memory (CUDA) or MemAvailable (CPU)."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def physical_cores() -> int:
    """Cores this process may run on. SMT siblings do not add matmul throughput, but on the
    small VMs we target each vCPU is a core, so the affinity mask is the right count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def share_cores(index: int, count: int) -> list[int]:
    """Share `index` of `count` of the cores the calling thread may use: disjoint slices
    while there are enough, else one core each, shared round-robin (more shares than cores
    still run). Tensor-parallel ranks and a server's hot models (model tiers) split the
    cores this way."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // count
    if per >= 1:
        return cores[index * per:(index + 1) * per]
    return [cores[index % len(cores)]]


def pin_thread(cores: list[int]) -> None:
    """Pins the calling thread (and the OpenMP threads it starts after this) to cores, with
    one intra-op thread each. Thread-local: other threads keep theirs."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def configure_threads(device: str) -> int:
    """One intra-op thread per core; inter-op parallelism only adds contention here."""
    if device != "cpu":
        return torch.get_num_threads()
    n = int(os.environ.get("KVSERVE_NUM_THREADS", physical_cores()))
    torch.set_num_threads(n)
    return n


@contextmanager
def setup_process(device: str = "auto") -> Iterator[int]:
    """The process-wide settings, made once by an entry point around building its engines
    (LLM, `kvserve generate`, the server's load, the benchmarks), never by an engine: one
    process may hold several (draft models, model tiers), and building one must not change
    another's behaviour.

        with setup_process(args.device) as threads:  # intra-op threads of this thread
            engine = LLMEngine.from_engine_args(args)  # (and any further engines)
        # here: gc.collect(); gc.freeze()

    On entry: the thread count (configure_threads). OpenMP keeps it per thread, so a thread
    that later runs the kernels sets its own too (AsyncEngine's engine thread does).
    On a clean exit: what start-up built (modules, parameters, tokenizer, cache views) lives
    until shutdown; frozen, the cyclic collector stops walking it on every full collection
    during serving (~1% of a decode step's CPU time otherwise), as vLLM and SGLang do. A
    second call freezes what was built since; a failed build freezes nothing.
    No global seed: each engine's Sampler owns generators seeded from EngineConfig.seed, so
    torch's global generator stays the caller's.
    """
    yield configure_threads(default_device() if device == "auto" else device)
    gc.collect()
    gc.freeze()


def in_own_thread(fn: Callable[[], _T]) -> _T:
    """fn() in a short-lived thread of its own (the caller waits): how model loads run.

    Why a thread: libgomp keeps an OpenMP worker pool per thread that ever ran a parallel
    region, and once it manages more threads than there are CPUs it stops spinning between
    regions. Loading a model (large tensor copies) in a long-lived thread, the caller's or an
    executor's, left such a pool behind, and every decode step of the engine thread then
    paid for ~300 sleeping-worker wake-ups: 18 ms instead of 12.5 on 2 cores. A thread that
    exits frees its pool."""
    done: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(e)

    loader = threading.Thread(target=run, name="kvserve-load")
    loader.start()
    loader.join()
    if failed:
        raise failed[0]
    return done[0]
