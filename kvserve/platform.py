"""Device detection, thread settings and the memory budget of the KV cache."""

from __future__ import annotations

import os

import torch


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


def configure_threads(device: str) -> int:
    """One intra-op thread per core; inter-op parallelism only adds contention here."""
    if device != "cpu":
        return torch.get_num_threads()
    n = int(os.environ.get("KVSERVE_NUM_THREADS", physical_cores()))
    torch.set_num_threads(n)
    return n
