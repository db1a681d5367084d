#!/usr/bin/env python3
"""Replays a pensieve trace through llama.cpp (llama-cpp-python), the way its users chat.

Conversations run one after another (llama.cpp serves one request at a time); within a
conversation one `Llama` object keeps its KV and reuses the longest common token prefix of the
previous call (llama.cpp's prompt-cache reuse). Each turn's prompt is the whole history rendered
with the model's own chat template, and each reply is forced to the trace's length (the
end-of-turn and end-of-text tokens are masked), as `examples/replay` forces ours.

Prints one JSON line with the same fields as `examples/replay --json` that apply.
"""

import argparse
import json
import math
import time

import jinja2
from llama_cpp import Llama, LogitsProcessorList
from summary import summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--trace", required=True, help="JSON-lines trace (examples/replay --write-trace)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--chat-template", help="Jinja file, for models that ship no template")
    a = ap.parse_args()

    trace = [json.loads(line) for line in open(a.trace) if line.strip()]
    llm = Llama(model_path=a.model, n_ctx=a.n_ctx, n_threads=a.threads,
                n_threads_batch=a.threads, n_batch=512, verbose=False)
    source = (open(a.chat_template).read() if a.chat_template
              else llm.metadata["tokenizer.chat_template"])
    template = jinja2.Environment().from_string(source)
    stops = {llm.token_eos()}
    for name in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>"):
        ids = llm.tokenize(name.encode(), add_bos=False, special=True)
        if len(ids) == 1:
            stops.add(ids[0])

    def force_length(_ids, scores):
        for t in stops:
            scores[t] = -math.inf
        return scores

    records = []
    started = time.perf_counter()
    for conv in trace:
        messages = []
        for index, turn in enumerate(conv["turns"]):
            messages.append({"role": "user", "content": turn["user"]})
            prompt = template.render(messages=messages, add_generation_prompt=True)
            submitted = time.perf_counter()
            first, text = None, ""
            for chunk in llm.create_completion(
                prompt, max_tokens=turn["output_tokens"], temperature=0.0, stream=True,
                logits_processor=LogitsProcessorList([force_length]),
            ):
                if first is None:
                    first = time.perf_counter()
                text += chunk["choices"][0]["text"]
            done = time.perf_counter()
            records.append({"turn": index, "ttft": first - submitted, "latency": done - submitted,
                            "output": turn["output_tokens"]})
            messages.append({"role": "assistant", "content": text})
    wall = time.perf_counter() - started

    print(json.dumps(summarize(records, wall, engine="llama.cpp (llama-cpp-python, prompt reuse)",
                               conversations=len(trace))))

if __name__ == "__main__":
    main()
