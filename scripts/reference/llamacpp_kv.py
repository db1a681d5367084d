#!/usr/bin/env python3
"""Writes tests/fixtures/llamacpp/kv-precision.json: llama.cpp's (llama-cpp-python 0.3.36)
perplexity over the 100 held-back ShareGPT replies of the model tests (see llamacpp_fixtures.py)
with its KV cache in f16, q8_0 and q4_0 (flash attention on, which a quantized V cache needs, in
all three), for SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M: what pensieve's own 8- and
4-bit KV must not lose more than. SmolLM2's replies (token ids) are written with them; Gemma's are
gemma3-270m.json's (checked equal).

Run by scripts/reference/llamacpp-kv, which installs llama.cpp first.
"""

import argparse
import json
import os

import numpy as np
from llama_cpp import Llama

from llamacpp_fixtures import held_back_replies, reply_nll, sharegpt

# ggml's type ids.
CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}


def perplexities(path, replies):
    """Perplexity of `replies` under the model at `path`, per KV cache type."""
    out = {}
    for name, ggml_type in CACHE_TYPES.items():
        llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=2, n_threads_batch=2,
                    logits_all=True, seed=0, verbose=False, flash_attn=True,
                    type_k=ggml_type, type_v=ggml_type)
        nll = sum(reply_nll(llm, r["context"], r["reply"]) for r in replies)
        tokens = sum(len(r["reply"]) for r in replies)
        out[name] = float(np.exp(nll / tokens))
        print(os.path.basename(path), name, out[name], flush=True)
        del llm
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smollm2", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--gemma", required=True, help="gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--sharegpt", required=True)
    ap.add_argument("--fixtures", required=True, help="tests/fixtures/llamacpp")
    a = ap.parse_args()
    records = list(r for _, r in zip(range(4000), sharegpt(a.sharegpt)))
    with open(os.path.join(a.fixtures, "gemma3-270m.json"), encoding="utf-8") as f:
        gemma_replies = json.load(f)["perplexity"]["replies"]
    models = {}
    for key, path in [("smollm2", a.smollm2), ("gemma3-270m", a.gemma)]:
        llm = Llama(model_path=path, n_ctx=512, n_threads=2, logits_all=True, seed=0,
                    verbose=False)
        replies = [{"context": r["context"], "reply": r["reply"]}
                   for r in held_back_replies(llm, records)]
        del llm
        entry = {"file": os.path.basename(path), "perplexity": perplexities(path, replies)}
        if key == "gemma3-270m":
            same = [(r["context"], r["reply"]) for r in gemma_replies]
            assert same == [(r["context"], r["reply"]) for r in replies], "gemma's replies moved"
        else:
            entry["replies"] = replies
        models[key] = entry
    with open(os.path.join(a.fixtures, "kv-precision.json"), "w", encoding="utf-8") as f:
        json.dump({"cache_types": list(CACHE_TYPES), "models": models}, f,
                  separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
