"""The header of a gpt-oss-20b MXFP4 GGUF file, written from the published config
(openai/gpt-oss-20b `config.json`) for `gguf_replica.py` to fill with synthetic blocks: no
header of the real file is on PyPI. Tensor types follow ggml-org's `gpt-oss-20b-mxfp4.gguf`
(12.1 GB): MXFP4 experts, Q8_0 embedding, output and attention, f32 norms, biases, sinks and
routers. The o200k vocabulary itself is not at hand either: the header lists 201,088
placeholder pieces (the real vocabulary's size, so the embedding and output have its rows)
and no merges, with the `gpt-4o` pre-tokenizer the real file names.

Usage: python gpt_oss_header.py OUT.gguf [--layers N]
"""

import argparse
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_header import FLOAT32, STRING, UINT32, kv, string, write_header  # noqa: E402

# The published config of gpt-oss-20b.
CONFIG = {
    "hidden": 2880,
    "layers": 24,
    "heads": 64,
    "kv_heads": 8,
    "head_dim": 64,
    "experts": 32,
    "experts_used": 4,
    "expert_ff": 2880,
    "vocab": 201088,
    "context": 131072,
    "window": 128,
    "rope_base": 150000.0,
    "yarn_factor": 32.0,
    "yarn_original": 4096,
    "eps": 1e-5,
}
F32, Q8_0, MXFP4 = 0, 8, 39
BLOCKS = {F32: (4, 1), Q8_0: (34, 32), MXFP4: (17, 32)}
ARRAY = 9


def strings(key, items):
    body = struct.pack("<IQ", STRING, len(items)) + b"".join(string(s) for s in items)
    return string(key) + struct.pack("<I", ARRAY) + body


def tensors(c):
    """(name, dims as GGUF lists them: columns first, type) of every tensor."""
    h, q, kv_w = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    e, ff, v = c["experts"], c["expert_ff"], c["vocab"]
    out = [("token_embd.weight", [h, v], Q8_0), ("output_norm.weight", [h], F32),
           ("output.weight", [h, v], Q8_0)]
    for i in range(c["layers"]):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", [h], F32),
            (b + "attn_q.weight", [h, q], Q8_0), (b + "attn_q.bias", [q], F32),
            (b + "attn_k.weight", [h, kv_w], Q8_0), (b + "attn_k.bias", [kv_w], F32),
            (b + "attn_v.weight", [h, kv_w], Q8_0), (b + "attn_v.bias", [kv_w], F32),
            (b + "attn_output.weight", [q, h], Q8_0), (b + "attn_output.bias", [h], F32),
            (b + "attn_sinks.weight", [c["heads"]], F32),
            (b + "post_attention_norm.weight", [h], F32),
            (b + "ffn_gate_inp.weight", [h, e], F32), (b + "ffn_gate_inp.bias", [e], F32),
            (b + "ffn_gate_exps.weight", [h, ff, e], MXFP4), (b + "ffn_gate_exps.bias", [ff, e], F32),
            (b + "ffn_up_exps.weight", [h, ff, e], MXFP4), (b + "ffn_up_exps.bias", [ff, e], F32),
            (b + "ffn_down_exps.weight", [ff, h, e], MXFP4), (b + "ffn_down_exps.bias", [h, e], F32),
        ]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=CONFIG["layers"])
    args = p.parse_args()
    c = dict(CONFIG, layers=args.layers)
    a = "gpt-oss"
    meta = [
        kv("general.architecture", STRING, a),
        kv("general.name", STRING, f"gpt-oss-20b replica ({c['layers']} layers)"),
        kv("general.alignment", UINT32, 32),
        kv(f"{a}.block_count", UINT32, c["layers"]),
        kv(f"{a}.context_length", UINT32, c["context"]),
        kv(f"{a}.embedding_length", UINT32, c["hidden"]),
        kv(f"{a}.feed_forward_length", UINT32, c["expert_ff"]),
        kv(f"{a}.expert_feed_forward_length", UINT32, c["expert_ff"]),
        kv(f"{a}.attention.head_count", UINT32, c["heads"]),
        kv(f"{a}.attention.head_count_kv", UINT32, c["kv_heads"]),
        kv(f"{a}.attention.key_length", UINT32, c["head_dim"]),
        kv(f"{a}.attention.value_length", UINT32, c["head_dim"]),
        kv(f"{a}.attention.layer_norm_rms_epsilon", FLOAT32, c["eps"]),
        kv(f"{a}.attention.sliding_window", UINT32, c["window"]),
        kv(f"{a}.rope.freq_base", FLOAT32, c["rope_base"]),
        kv(f"{a}.rope.scaling.type", STRING, "yarn"),
        kv(f"{a}.rope.scaling.factor", FLOAT32, c["yarn_factor"]),
        kv(f"{a}.rope.scaling.original_context_length", UINT32, c["yarn_original"]),
        kv(f"{a}.expert_count", UINT32, c["experts"]),
        kv(f"{a}.expert_used_count", UINT32, c["experts_used"]),
        kv("tokenizer.ggml.model", STRING, "gpt2"),
        kv("tokenizer.ggml.pre", STRING, "gpt-4o"),
        strings("tokenizer.ggml.tokens", [f"t{i}" for i in range(c["vocab"])]),
        strings("tokenizer.ggml.merges", []),
    ]
    write_header(args.out, meta, tensors(c), BLOCKS)

if __name__ == "__main__":
    main()
