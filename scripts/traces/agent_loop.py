#!/usr/bin/env python3
"""W4, an agent loop, for the replay example: each conversation is a task, then rounds of a
short tool call answered by a long tool result, the way coding agents work. A round's user turn
is the tool's result (a file of this repository's sources or docs, the same on every machine)
and its reply is the next call (`--call` tokens); the last reply is the answer (`--answer`
tokens). Results are sized so that the context grows to about `--context` tokens over the
rounds.

    scripts/traces/agent_loop.py OUT.jsonl [--tasks N] [--rounds R] [--context TOKENS]

Writes JSON lines in the replay's trace format (`src/workload.rs`, `read_trace`). Tokens are
estimated at 3.5 characters each; the replay's `--max-input` must let the results through.
"""

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

TASKS = [
    "Find where {name} handles a failed write and explain what the caller sees.",
    "Add a test for the error path of {name}; read what you need first.",
    "Summarise what {name} does and list the functions another module calls.",
    "Find the places {name} allocates in a loop and propose one change.",
]

CALLS = ["read_file", "grep", "read_file", "list_dir", "read_file", "run_tests"]


def texts() -> list[tuple[str, str]]:
    """(name, text) of every source and doc file, in a fixed order."""
    files = sorted((ROOT / "src").rglob("*.rs")) + sorted((ROOT / "docs").glob("*.md"))
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--context", type=int, default=8192, help="tokens the context grows to")
    parser.add_argument("--call", type=int, default=32, help="tokens of each tool call")
    parser.add_argument("--answer", type=int, default=256, help="tokens of the final answer")
    args = parser.parse_args()
    corpus = texts()
    # What each result may take: the context's share of a round, less the calls' tokens.
    result_chars = int(3.5 * max(64, args.context // args.rounds - args.call))
    at = 0
    with args.out.open("w") as out:
        for task in range(args.tasks):
            name, _ = corpus[(task * 7) % len(corpus)]
            turns = [{"user": TASKS[task % len(TASKS)].format(name=f"`{name}`"),
                      "output_tokens": args.call}]
            for r in range(args.rounds):
                # The next file long enough to fill a result, cut to its size.
                while len(corpus[at % len(corpus)][1]) < result_chars // 2:
                    at += 1
                source, text = corpus[at % len(corpus)]
                at += 1
                call = CALLS[r % len(CALLS)]
                last = r == args.rounds - 1
                turns.append({
                    "user": f"Result of {call}(\"{source}\"):\n```\n{text[:result_chars]}\n```",
                    "output_tokens": args.answer if last else args.call,
                })
            out.write(json.dumps({"id": f"agent-{task}", "turns": turns}) + "\n")


if __name__ == "__main__":
    main()
