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

import sys

from common import run_flows

# Each module registers its flows with `common.flow`.
import openai_client  # noqa: F401
import openai_agents  # noqa: F401
import langchain_flows  # noqa: F401
import pydantic_ai_flows  # noqa: F401
import instructor_flows  # noqa: F401
import smolagents_flows  # noqa: F401
import llama_index_flows  # noqa: F401


if __name__ == "__main__":
    sys.exit(run_flows())
