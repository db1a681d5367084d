"""llama.cpp's single-sequence prefill and decode rates on a GGUF file, measured the way
examples/bench_model.rs measures pensieve's: a prompt of N ordinary token ids (tokens/s of one
forward pass over it), and 16 decode steps after C tokens of context (tokens/s); the median of
--repeats runs each. Prints one JSON object."""

import argparse
import json
import statistics
import time

import llama_cpp


def tokens(n):
    # The same ids as bench_model: ordinary vocabulary ids.
    return [100 + (i * 7919) % 40000 for i in range(n)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    lengths = lambda v: [int(x) for x in v.split(",") if x]
    p.add_argument("--prefill", type=lengths, default=[32, 256, 1024],
                   help="prompt lengths, comma-separated (default 32,256,1024)")
    p.add_argument("--decode", type=lengths, default=[64, 1024],
                   help="contexts of the decode steps, comma-separated; '' for none")
    args = p.parse_args()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=2048,
        n_batch=1024,
        n_ubatch=1024,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    out = {"model": args.model, "threads": args.threads}
    for n in args.prefill:
        times = []
        for _ in range(args.repeats):
            llm.reset()
            started = time.perf_counter()
            llm.eval(tokens(n))
            times.append(time.perf_counter() - started)
        out[f"prefill_{n}"] = n / statistics.median(times)
    for c in args.decode:
        times = []
        for _ in range(args.repeats):
            llm.reset()
            llm.eval(tokens(c))
            started = time.perf_counter()
            for i in range(16):
                # Which token is fed does not change the work of a step.
                llm.eval(tokens(c + i + 1)[-1:])
            times.append(time.perf_counter() - started)
        out[f"decode_{c}"] = 16 / statistics.median(times)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
