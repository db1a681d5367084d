#!/usr/bin/env python3
"""A code-editing trace for the replay example: each conversation revises one source file over
several turns, the way coding agents do (the file pasted once, then edit requests, each reply
the whole file again). The files are this repository's own Rust sources, cut to their first
lines of code, so the trace is real code and the same on every machine.

    scripts/traces/code_editing.py OUT.jsonl [--conversations N] [--lines L]

Writes JSON lines in the replay's trace format (`src/workload.rs`, `read_trace`); each reply's
length is the file's length in tokens, estimated at 3.5 characters a token, the replay capping
it with --max-output.
"""

import argparse
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

EDITS = [
    "Add a one-line comment above each function and show the whole file.",
    "Rename `{ident}` to `{ident}_next` everywhere and show the whole file again.",
    "Make every private function `pub(crate)` and show the whole file again.",
    "Remove the comments you added in the first edit and show the final file.",
]


def snippet(path: pathlib.Path, lines: int) -> str:
    """The file's first `lines` lines of code, past its module comment and imports."""
    code = [
        line
        for line in path.read_text().splitlines()
        if not line.startswith(("//!", "use ", "mod ", "pub mod ", "#![")) and line.strip()
    ]
    return "\n".join(code[:lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    files = sorted((ROOT / "src").rglob("*.rs"))
    # Every few files, for a spread of code; the same on every machine.
    picked = files[:: max(1, len(files) // args.conversations)][: args.conversations]
    with args.out.open("w") as out:
        for i, path in enumerate(picked):
            code = snippet(path, args.lines)
            idents = re.findall(r"\bfn ([a-z_][a-z0-9_]*)", code) or ["value"]
            name = path.relative_to(ROOT).as_posix()
            reply = max(1, round(len(code) / 3.5))
            turns = [{"user": f"Here is `{name}`:\n```rust\n{code}\n```\n" + EDITS[0],
                      "output_tokens": reply}]
            turns += [{"user": e.format(ident=idents[0]), "output_tokens": reply}
                      for e in EDITS[1:]]
            out.write(json.dumps({"id": f"code-{i}", "turns": turns}) + "\n")


if __name__ == "__main__":
    main()
