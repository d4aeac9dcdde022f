"""Ops backends behind a registry. `reference` is pure torch and is the oracle.

get_ops("auto") picks the fastest backend available on the device; backends import lazily so
that `import kvserve` needs no compiler and no CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "reference": "kvserve.ops.reference:ReferenceOps",
    "cpu": "kvserve.ops.cpu:CpuOps",
}


def register_ops(name: str, target: str) -> None:
    _REGISTRY[name] = target


def available_ops() -> list[str]:
    return sorted(_REGISTRY)


def get_ops(name: str = "auto", device: str = "cpu") -> Any:
    if name == "auto":
        name = "cpu" if device == "cpu" and "cpu" in _REGISTRY else "reference"
        if name == "cpu":
            try:
                return get_ops("cpu")
            except Exception:  # no compiler / unsupported CPU: the reference still works
                return get_ops("reference")
    if name not in _REGISTRY:
        raise ValueError(f"ops backend must be one of {', '.join(['auto'] + available_ops())}, "
                         f"got {name!r}")
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)()
