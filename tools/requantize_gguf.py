#!/usr/bin/env python3
"""Requantize an F32 GGUF file's matrices to one GGML type with gguf-py's port of ggml's
reference quantizers (what llama-quantize runs for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 without an
importance matrix). Every tensor of two or more dimensions becomes TYPE; the rest (norms) stay
as they are; the metadata is copied.

Usage: python3 tools/requantize_gguf.py IN.gguf OUT.gguf Q4_1
"""
import sys

import gguf
import numpy as np
from gguf import quants


def main():
    src, dst, tname = sys.argv[1:4]
    qtype = getattr(gguf.GGMLQuantizationType, tname)
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    w.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + tname))
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            sys.exit(f"{t.name}: expected an F32 source, got {t.tensor_type.name}")
        if len(t.shape) >= 2:
            q = quants.quantize(data.astype(np.float32), qtype)
            w.add_tensor(t.name, q, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
