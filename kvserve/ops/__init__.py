"""Ops backends behind a registry. `reference` is pure torch and is the oracle.

get_ops("auto") picks the fastest backend available on the device (cpu on CPUs, torch
elsewhere); backends import lazily so that `import kvserve` needs no compiler and no CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "reference": "kvserve.ops.reference:ReferenceOps",
    "cpu": "kvserve.ops.cpu:CpuOps",
    "torch": "kvserve.ops.torch_ops:TorchOps",
}


def register_ops(name: str, target: str) -> None:
    _REGISTRY[name] = target


def available_ops() -> list[str]:
    return sorted(_REGISTRY)


def get_ops(name: str = "auto", device: str = "cpu") -> Any:
    if name == "auto":
        # CPU: kvserve's C++ kernels. Elsewhere (CUDA), or where they cannot be built: the
        # batched torch backend.
        if device == "cpu":
            try:
                return get_ops("cpu")
            except Exception:  # no compiler / unsupported CPU
                return get_ops("torch")
        name = "torch"
    if name not in _REGISTRY:
        raise ValueError(f"ops backend must be one of {', '.join(['auto'] + available_ops())}, "
                         f"got {name!r}")
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)()
