#!/usr/bin/env python3
"""Writes the reference logits of tests/llamacpp_gguf_reference.rs: pensieve's `random_gguf`
example writes a small gpt-oss GGUF of seeded random weights with its experts in MXFP4,
llama.cpp (llama-cpp-python 0.3.36) runs it on a fixed prompt, and the last position's logits
go to tests/fixtures/llamacpp/gpt-oss-mxfp4.json with the seed and the prompt. The test
writes the same file again from the seed, so CI needs no llama.cpp.

Run with the python scripts/peers/llamacpp --install-only prints:
    OMP_WAIT_POLICY=PASSIVE $(scripts/peers/llamacpp --install-only) \
        scripts/reference/llamacpp_gguf_logits.py
"""

import json
import pathlib
import subprocess
import tempfile

import llama_cpp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "llamacpp" / "gpt-oss-mxfp4.json"
SEED = 42
PROMPT = [(i * 37 + 11) % 300 for i in range(24)]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "gpt-oss.gguf"
        subprocess.run(["cargo", "run", "--release", "--quiet", "--example", "random_gguf", "--",
                        str(SEED), str(path)], cwd=ROOT, check=True)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2,
                              logits_all=True, verbose=False)
        llm.eval(PROMPT)
        logits = np.array(llm.scores[len(PROMPT) - 1], dtype=np.float32)
    OUT.write_text(json.dumps({
        "reference": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "seed": SEED,
        "prompt": PROMPT,
        "logits": [float(x) for x in logits],
    }) + "\n")
    print(f"{OUT}: {len(logits)} logits, max |x| {np.abs(logits).max():.3f}")


if __name__ == "__main__":
    main()
