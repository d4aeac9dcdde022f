"""Convert a GGUF file to an all-F32 GGUF: every tensor dequantized with gguf.quants, every
metadata key copied (general.file_type set to ALL_F32).

kvserve dequantizes GGUF weights to float32 at load, so llama.cpp on this file runs the very
same weights in the same format.

    python benchmarks/to_f32_gguf.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys

import numpy as np


def convert(src: str, dst: str) -> None:
    import gguf

    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        # GGUF shapes are ggml's (fastest dimension first); numpy's are the reverse.
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = data.reshape(shape)
        tensors.append((t.name, data))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                               gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, data in tensors:
        writer.write_tensor_data(data)
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(sys.argv[1], sys.argv[2])
