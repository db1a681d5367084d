#!/usr/bin/env python3
"""Writes what llama.cpp (llama-cpp-python 0.3.36) makes of 50 ShareGPT prompts through the
endpoints the server tests call, one JSON fixture per model in tests/fixtures/llamacpp/
(server-<name>.json):

- prompt: the ids of the prompt as a raw completion encodes it (BOS where the vocabulary's
  add_bos_token asks, special tokens parsed), what /tokenize of the prompt must answer;
- completion: 16 greedy tokens after it (end tokens not stopping), with, at each step, every
  token whose log-probability is within NEAR nats of the best (at most TOP of them) and its
  log-probability: what a near-tie check needs of llama.cpp's side;
- chat_prompt: the ids of the prompt as a user message rendered by the chat template (the GGUF's,
  or pensieve's built-in one for a model that ships none), the template writing BOS;
- chat: 16 greedy tokens after that, as for the completion.

The server tests compare pensieve's answers with these: identical, or diverging only at a
near-tie (each engine's token within a bound in nats of the other's, in both engines). Run by scripts/reference/server-fixtures, which installs llama.cpp first.
"""

import argparse
import json
import os

import jinja2
import numpy as np
from llama_cpp import Llama

from llamacpp_fixtures import log_softmax, sharegpt

CASES = 50
CHARS = 300
TOKENS = 16
TOP = 20
NEAR = 1.0
# Texts holding a template's markup would be read as markup by llama.cpp's tokenizer, and as
# plain text by pensieve's chat path: left out.
MARKUP = ("<|", "|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<s>", "</s>")


def prompts(path):
    """The first user message of ShareGPT conversations from the 5,000th on (the texts the
    tokenizer fixtures use come from the first 4,000), cut to CHARS characters."""
    out = []
    for i, r in enumerate(sharegpt(path)):
        if i < 5000:
            continue
        conv = r.get("conversations", [])
        if not conv or conv[0].get("from") != "human":
            continue
        text = conv[0].get("value", "").strip()[:CHARS].strip()
        if len(text) < 16 or any(m in text for m in MARKUP):
            continue
        out.append(text)
        if len(out) == CASES:
            return out
    raise SystemExit("not enough ShareGPT prompts")


def greedy(llm, prompt):
    """TOKENS greedy tokens after `prompt`, with those within NEAR of the best per step."""
    llm.reset()
    llm.eval(prompt)
    ids, top = [], []
    for _ in range(TOKENS):
        row = log_softmax(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        best = np.argsort(-row, kind="stable")[:TOP]
        ids.append(int(best[0]))
        top.append([[int(i), round(float(row[i]), 4)] for i in best if row[i] >= row[best[0]] - NEAR])
        llm.eval([int(best[0])])
    return {"ids": ids, "top": top}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--name", required=True, help="the fixture's name: server-NAME.json")
    ap.add_argument("--template", help="a Jinja chat template, for a model that ships none")
    ap.add_argument("--sharegpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    llm = Llama(model_path=a.model, n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2,
                logits_all=True, seed=0, verbose=False)
    meta = llm.metadata
    source = open(a.template, encoding="utf-8").read() if a.template else meta["tokenizer.chat_template"]
    piece = lambda key: llm.detokenize([int(meta[key])], special=True).decode() if key in meta else ""
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(Exception(m))
    template = env.from_string(source)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", "false") == "true"

    cases = []
    for text in prompts(a.sharegpt):
        prompt = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
        rendered = template.render(messages=[{"role": "user", "content": text}],
                                   add_generation_prompt=True,
                                   bos_token=piece("tokenizer.ggml.bos_token_id"),
                                   eos_token=piece("tokenizer.ggml.eos_token_id"))
        chat_prompt = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        cases.append({"text": text, "prompt": prompt, "completion": greedy(llm, prompt),
                      "chat_prompt": chat_prompt, "chat": greedy(llm, chat_prompt)})
        print(len(cases), "of", CASES, flush=True)
    with open(os.path.join(a.out, f"server-{a.name}.json"), "w", encoding="utf-8") as f:
        json.dump({"file": os.path.basename(a.model), "template": a.template and os.path.basename(a.template),
                   "cases": cases}, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
