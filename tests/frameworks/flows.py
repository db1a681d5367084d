#!/usr/bin/env python3
"""The agent frameworks people build with, against pensieve-server: each library's documented
flows (plain, streamed, a tool loop sending results back, structured output in every mode
the library has, async, multi-turn with its own session types), run as a user's program runs
them. tests/frameworks.rs runs this in two pinned environments (scripts/fetch-assets).

Usage: flows.py BASE_URL [MODEL] [FLOW_SUBSTRING ...]
  BASE_URL: the server (a trailing /v1 is added when missing)
  MODEL:    the served model name (default: $PENSIEVE_MODEL or "pensieve")
Prints one JSON line per flow: {"flow", "lib", "ok", "error"} (and "skipped": true when the
flow's library is not installed here); exit status 1 when a flow that ran failed.

The flows check the protocol, not the answers: the model is tiny, so tool calls are forced
wherever the library lets a caller force them, free text is asked to be short, sampling is
greedy, and a mode that asks for JSON only in its prompt has the JSON held by vLLM's
`guided_*` extensions (common.HELD).

The pinned sets (no one openai version serves every library):
  openai 3.x: openai-agents 0.24, langchain-openai 1.8, pydantic-ai 2.78, smolagents 1.26
  openai 2.x: openai-agents 0.20, instructor 1.17, langchain-openai 1.8, pydantic-ai 2.31,
              smolagents 1.26, llama-index-llms-openai-like 0.8
"""

import contextlib
import json
import sys
import traceback

from common import FLOWS, LIB_MODULE, ONLY, Skip, need

# Each module registers its flows with `common.flow`.
import openai_client  # noqa: F401
import openai_agents  # noqa: F401
import langchain_flows  # noqa: F401
import pydantic_ai_flows  # noqa: F401
import instructor_flows  # noqa: F401
import smolagents_flows  # noqa: F401
import llama_index_flows  # noqa: F401


def main():
    failed = 0
    for lib, fn in FLOWS:
        name = fn.__name__
        if ONLY and not any(o in name for o in ONLY):
            continue
        rec = {"flow": name, "lib": lib, "ok": False, "error": None}
        try:
            need(LIB_MODULE[lib])
            with contextlib.redirect_stdout(sys.stderr):  # libraries that print (smolagents) go to stderr
                fn()
            rec["ok"] = True
        except Skip as e:
            rec["skipped"] = True
            rec["error"] = str(e)
        except BaseException as e:  # noqa: BLE001 - report every failure and go on
            if isinstance(e, KeyboardInterrupt):
                raise
            failed += 1
            tb = traceback.format_exc().strip().splitlines()
            rec["error"] = f"{type(e).__name__}: {e}"[:2000] + " | " + " / ".join(tb[-3:])[:600]
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
