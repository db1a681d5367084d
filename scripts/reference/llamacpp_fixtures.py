#!/usr/bin/env python3
"""Writes the reference outputs of llama.cpp (llama-cpp-python 0.3.36) that the model tests
compare pensieve against, as small JSON fixtures in tests/fixtures/llamacpp/:

- texts.json: 200 ShareGPT message texts (user and assistant, 50 of them with non-ASCII letters),
  each cut to 200 characters;
- tokens-<vocab>.json: llama.cpp's token ids of every text (no BOS, special tokens not parsed) for
  the Gemma 3 270M file and the vocabulary-only GGUFs of Llama 3, Qwen2 and Llama 2;
- gemma3-270m.json: for Gemma 3 270M Q4_K_M, next-token logits (the top 20) at 20 prompt lengths
  from 16 to 2,000 tokens (prefixes of 4 documents, past the 512-token window), the perplexity of
  100 held-back ShareGPT replies given their user turns, and greedy continuations of 32 tokens
  with the gap between the best two logits at each step.

Run by scripts/reference/llamacpp-fixtures, which installs llama.cpp first.
"""

import argparse
import json
import os
import unicodedata

import numpy as np
from llama_cpp import Llama

TEXTS = 200
MULTILINGUAL = 50
CHARS = 200
LOGIT_TOP = 20
DOC_TOKENS = 2000
PROMPT_LENGTHS = [[16, 100, 511, 512, 2000], [40, 300, 513, 1000, 1900],
                  [64, 400, 700, 1200, 1800], [200, 600, 800, 1400, 1600]]
REPLIES = 100
CONTEXT_TOKENS = 48
REPLY_TOKENS = 96
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 32


def sharegpt(path):
    """ShareGPT's records in file order; the dump is cut short at the end, so parse tolerantly."""
    data = open(path, encoding="utf-8").read()
    dec = json.JSONDecoder()
    pos = data.index("[") + 1
    while True:
        while pos < len(data) and data[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(data) or data[pos] == "]":
            return
        try:
            record, pos = dec.raw_decode(data, pos)
        except json.JSONDecodeError:
            return
        yield record


def non_ascii_letters(text):
    return any(ord(c) > 127 and unicodedata.category(c).startswith("L") for c in text)


def pick_texts(records):
    plain, multi = [], []
    for r in records:
        for m in r.get("conversations", []):
            text = m.get("value", "").strip()[:CHARS]
            if m.get("from") not in ("human", "gpt") or len(text) < 8:
                continue
            if non_ascii_letters(text):
                if len(multi) < MULTILINGUAL:
                    multi.append(text)
            elif len(plain) < TEXTS - MULTILINGUAL:
                plain.append(text)
        if len(plain) + len(multi) == TEXTS:
            return plain + multi
    raise SystemExit("not enough ShareGPT texts")


def log_softmax(row):
    row = row.astype(np.float64)
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum()))


def held_back_replies(llm, records):
    """The first REPLIES ShareGPT replies from record 2,000 on (one per conversation: its first
    user turn and the answer), as token ids after BOS (context cut to CONTEXT_TOKENS, reply to
    REPLY_TOKENS), each with its negative log-likelihood under `llm`."""
    bos = llm.token_bos()
    replies = []
    for r in records[2000:]:
        conv = r.get("conversations", [])
        for user, reply in zip(conv, conv[1:]):
            if user.get("from") != "human" or reply.get("from") != "gpt":
                continue
            context = [bos] + llm.tokenize(user["value"].encode(), add_bos=False, special=False)
            target = llm.tokenize(reply["value"].encode(), add_bos=False, special=False)
            if len(context) < 4 or len(target) < 8:
                continue
            context, target = context[:CONTEXT_TOKENS], target[:REPLY_TOKENS]
            replies.append({"context": context, "reply": target,
                            "nll": reply_nll(llm, context, target)})
            break
        if len(replies) == REPLIES:
            break
    return replies


def reply_nll(llm, context, target):
    """The negative log-likelihood of `target` after `context` (token ids) under `llm`."""
    llm.reset()
    llm.eval(context + target)
    return float(-sum(log_softmax(np.array(llm.scores[len(context) + i - 1]))[t]
                      for i, t in enumerate(target)))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gemma", required=True, help="gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--vocabs", required=True, help="folder of llama.cpp's ggml-vocab-*.gguf")
    ap.add_argument("--sharegpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    def write(name, value):
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")

    records = list(r for _, r in zip(range(4000), sharegpt(a.sharegpt)))
    texts = pick_texts(records)
    write("texts.json", texts)
    for vocab, path in [("gemma3", a.gemma)] + [
            (v, os.path.join(a.vocabs, f"ggml-vocab-{v}.gguf")) for v in ("llama-bpe", "qwen2", "llama-spm")]:
        tok = Llama(model_path=path, vocab_only=True, verbose=False)
        ids = [tok.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
        write(f"tokens-{vocab}.json", {"file": os.path.basename(path), "ids": ids})
        print(vocab, sum(map(len, ids)), "tokens", flush=True)

    llm = Llama(model_path=a.gemma, n_ctx=4096, n_batch=512, n_threads=2, n_threads_batch=2,
                logits_all=True, seed=0, verbose=False)
    bos = llm.token_bos()

    # Documents: whole conversations, one message after another, until 2,000 tokens.
    docs, text = [], ""
    for r in records[1000:]:
        for m in r.get("conversations", []):
            text += m.get("value", "") + "\n\n"
        ids = [bos] + llm.tokenize(text.encode(), add_bos=False, special=False)
        if len(ids) >= DOC_TOKENS:
            docs.append(ids[:DOC_TOKENS])
            text = ""
            if len(docs) == len(PROMPT_LENGTHS):
                break
    logits = []
    for doc, lengths in zip(docs, PROMPT_LENGTHS):
        llm.reset()
        llm.eval(doc)
        for n in lengths:
            row = np.array(llm.scores[n - 1], dtype=np.float32)
            top = np.argsort(-row, kind="stable")[:LOGIT_TOP]
            logits.append({"doc": len(logits) // 5, "tokens": n, "top_ids": top.tolist(),
                           "top_logits": [float(row[i]) for i in top]})
        print("logits of a document", flush=True)

    replies = held_back_replies(llm, records)
    total_nll = sum(r["nll"] for r in replies)
    total_tokens = sum(len(r["reply"]) for r in replies)
    print("perplexity", float(np.exp(total_nll / total_tokens)), flush=True)

    greedy = []
    for doc in docs:
        for n in (24, 700)[: GREEDY_PROMPTS // len(docs)]:
            prompt = doc[:n]
            llm.reset()
            llm.eval(prompt)
            out, gaps = [], []
            for _ in range(GREEDY_TOKENS):
                row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                best = np.argsort(-row, kind="stable")[:2]
                out.append(int(best[0]))
                gaps.append(float(row[best[0]] - row[best[1]]))
                llm.eval([int(best[0])])
            greedy.append({"prompt": prompt, "ids": out, "gaps": gaps})
    write("gemma3-270m.json", {
        "file": os.path.basename(a.gemma),
        "documents": docs,
        "logits": logits,
        "perplexity": {"replies": replies, "perplexity": float(np.exp(total_nll / total_tokens)),
                       "tokens": total_tokens},
        "greedy": greedy,
    })


if __name__ == "__main__":
    main()
