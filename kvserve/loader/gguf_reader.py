"""A fast reader for a GGUF file's header: its metadata and tensor infos, with the tensors'
data as views of one read-only memmap.

gguf.GGUFReader builds a numpy view for every part of every metadata value: for a 49k-token
vocabulary that is ~200k views and 1.6 s, plus 0.8 s to turn them into Python values. This
walks the same bytes once with struct and gives the same values (strings as str, arrays as
lists, scalars as Python numbers) and the same tensor views as GGUFReader, in ~0.1 s.
tests/unit/test_loader.py holds the two readers equal.

Layout (GGUF v2/v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata = (string key, u32 type, value)*; tensor infos = (string name, u32 n_dims,
u64 dims[n_dims] (innermost first), u32 ggml type, u64 offset)*; the data section starts at
the next multiple of general.alignment (32 by default). A string is u64 length + UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"

# GGUFValueType -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
# Tensor types GGUFReader exposes with their element dtype; all others as bytes.
_TENSOR_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims, innermost first (GGUF order)
    n_bytes: int
    data_offset: int
    data: np.ndarray  # as GGUFReader: numpy dims reversed; quantized types as uint8 bytes


class GGUFFile:
    """metadata: key -> value; tensors: in file order. Raises ValueError on malformed bytes
    (the caller words it for the user); a file cut inside the data section still opens, and
    a tensor's `data` is then shorter than n_bytes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm = np.memmap(path, mode="r")
        self._buf = memoryview(self._mm)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"bad magic {bytes(self._buf[:4])!r}")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
                raise ValueError("a big-endian GGUF file; kvserve reads little-endian ones")
            raise ValueError(f"unsupported GGUF version {version}")
        self.version = version
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<IQ")
            infos.append((name, dims, ttype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, ttype, start + offset))

    # ---- parsing ------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._buf):
            raise ValueError(f"the file ends at byte {len(self._buf)}, inside its header")
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._buf):
            raise ValueError(f"the file ends at byte {len(self._buf)}, inside its header")
        s = str(self._buf[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._string()
        if vtype == 9:
            itype, count = self._unpack("<IQ")
            if itype == 8:
                return [self._string() for _ in range(count)]
            if itype == 9:
                return [self._value(9) for _ in range(count)]
            if itype not in _NUMPY:
                raise ValueError(f"unknown metadata array type {itype}")
            dtype = np.dtype(_NUMPY[itype])
            end = self._pos + count * dtype.itemsize
            if end > len(self._buf):
                raise ValueError(f"the file ends at byte {len(self._buf)}, inside its header")
            arr = np.frombuffer(self._buf[self._pos:end], dtype=dtype)
            self._pos = end
            return arr.tolist()
        if vtype not in _SCALAR:
            raise ValueError(f"unknown metadata value type {vtype}")
        (v,) = self._unpack(_SCALAR[vtype])
        return v

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: int, offset: int) -> GGUFTensor:
        qtype = GGMLQuantizationType(ttype)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        n_bytes = n_elems * type_size // block_size
        np_dims = tuple(reversed(dims))
        dtype = _TENSOR_DTYPES.get(qtype)
        if dtype is None:
            dtype = np.uint8
            np_dims = (*np_dims[:-1], np_dims[-1] // block_size * type_size)
        raw = self._mm[offset:offset + n_bytes]
        # A truncated tensor stays a short uint8 view, for the caller's size check.
        data = raw.view(dtype).reshape(np_dims) if raw.nbytes == n_bytes else raw
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_bytes, offset, data)
