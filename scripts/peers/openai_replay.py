#!/usr/bin/env python3
"""Replays a pensieve trace against an OpenAI-compatible server (vLLM, or pensieve's
pensieve-server), closed or open loop.

Closed loop (`--concurrency N`): N conversations are in flight; each sends its next turn as
soon as its reply is complete, and a new conversation takes the place of one that ended, as
`examples/replay --concurrency N` does. Open loop (`--open`): each conversation starts at its
`arrival_s` in the trace (written by `examples/replay --write-trace` without
`--concurrency`) and its user thinks before each next turn as `examples/replay` has it: 100 ms
per output token of the reply, at least 5 s, times `--think-scale`. Each turn's prompt is the whole history rendered with the model's chat
template (the stateless client's way: `/v1/completions`), each reply forced to the trace's
length (`max_tokens`, `ignore_eos`), streamed with usage so that the server's prefix-cache hits
(`prompt_tokens_details.cached_tokens`) are counted. With `--api chat` the client sends the
message list to `/v1/chat/completions` instead (the server renders the template).

`--url` may list several servers, comma-separated (a fleet behind a load balancer): turn `t`
of the trace's conversation `k` goes to server `(k + t) % n`, so consecutive turns of a
conversation land on different servers. With `--session-headers` each request carries its
conversation's key in the headers routers hash on (`X-Session-Id`: vLLM's router and the Envoy
configuration of docs/FLEET.md; `X-SMG-Routing-Key`: SGLang's router's `manual` policy).

Prints one JSON line with the same fields as `examples/replay --json` that apply.
"""

import argparse
import json
import queue
import threading
import time
import urllib.request

from summary import summarize


def stream_completion(url, model, prompt, max_tokens, key=None):
    """`prompt`: text for /v1/completions, or a message list for /v1/chat/completions; `key`:
    the conversation's routing key, sent in the routers' headers."""
    chat = isinstance(prompt, list)
    body = json.dumps({
        "model": model, ("messages" if chat else "prompt"): prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers.update({"X-Session-Id": key, "X-SMG-Routing-Key": key})
    req = urllib.request.Request(f"{url}{path}", body, headers)
    submitted = time.perf_counter()
    first, text, usage = None, "", {}
    with urllib.request.urlopen(req) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece and first is None:
                    first = time.perf_counter()
                text += piece or ""
            usage = event.get("usage") or usage
    done = time.perf_counter()
    return text, (first or done) - submitted, done - submitted, usage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000",
                    help="server URL, or several comma-separated (turns alternate among them)")
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--chat-template",
                    help="the model's chat template: a .jinja file, or a tokenizer_config.json "
                         "holding it (with --api completions; the server renders it for chat)")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--open", action="store_true", help="open loop: the trace's arrivals, think time")
    ap.add_argument("--think-scale", type=float, default=1.0)
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--engine", default="vLLM-CPU (OpenAI server)", help="name in the summary")
    ap.add_argument("--session-headers", action="store_true",
                    help="send each conversation's key in the headers routers hash on")
    a = ap.parse_args()

    trace = [json.loads(line) for line in open(a.trace) if line.strip()]
    template = None
    if a.api == "completions":
        if not a.chat_template:
            ap.error("--api completions needs --chat-template")
        import jinja2  # only the client that renders prompts needs it

        source = open(a.chat_template).read()
        if a.chat_template.endswith(".json"):
            source = json.loads(source)["chat_template"]
        template = jinja2.Environment().from_string(source)
    urls = a.url.split(",")
    pending = queue.Queue()
    for k, conv in enumerate(trace):
        conv["index"] = k
        pending.put(conv)
    records, lock = [], threading.Lock()

    def converse(conv, think):
        messages = []
        for index, turn in enumerate(conv["turns"]):
            messages.append({"role": "user", "content": turn["user"]})
            prompt = (list(messages) if a.api == "chat"
                      else template.render(messages=messages, add_generation_prompt=True))
            url = urls[(conv["index"] + index) % len(urls)]
            key = f"conversation-{conv['index']}" if a.session_headers else None
            text, ttft, latency, usage = stream_completion(url, a.model, prompt,
                                                           turn["output_tokens"], key)
            details = usage.get("prompt_tokens_details") or {}
            output = usage.get("completion_tokens", turn["output_tokens"])
            with lock:
                records.append({"turn": index, "ttft": ttft, "latency": latency, "output": output,
                                "prompt": usage.get("prompt_tokens", 0),
                                "cached": details.get("cached_tokens", 0)})
            messages.append({"role": "assistant", "content": text})
            if think and index + 1 < len(conv["turns"]):
                time.sleep(max(0.1 * output, 5.0) * a.think_scale)

    def worker():
        while True:
            try:
                conv = pending.get_nowait()
            except queue.Empty:
                return
            converse(conv, think=False)

    def arriving(conv, started):
        time.sleep(max(0.0, started + conv.get("arrival_s", 0.0) - time.perf_counter()))
        converse(conv, think=True)

    started = time.perf_counter()
    if a.open:
        threads = [threading.Thread(target=arriving, args=(conv, started)) for conv in trace]
    else:
        threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started

    prompt = sum(r["prompt"] for r in records)
    cached = sum(r["cached"] for r in records)
    print(json.dumps(summarize(records, wall, engine=f"{a.engine}, {a.api}",
                               concurrency=None if a.open else a.concurrency,
                               conversations=len(trace), prefilled_tokens=prompt - cached,
                               cached_tokens=cached)))

if __name__ == "__main__":
    main()
