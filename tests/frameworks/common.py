"""What the framework flows share: the server's address and model from the command line, the
registry of flows, and the small model's aids (short answers, JSON held by vLLM's guided
decoding where a mode only asks for it in the prompt). See flows.py."""

import asyncio
import contextlib
import json
import os
import sys
import traceback

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
BASE = BASE.rstrip("/")
if not BASE.endswith("/v1"):
    BASE += "/v1"
ROOT = BASE[: -len("/v1")]
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("PENSIEVE_MODEL", "pensieve")
ONLY = sys.argv[3:]
KEY = "unused"
MAXTOK = 256
# What keeps a tiny model's free text short, and its JSON (where only a JSON object is asked
# for) the one the test reads.
SHORT = "Answer in one short sentence."
CITY_JSON = 'Reply with exactly this JSON: {"city": "Paris"}'

try:
    from pydantic import BaseModel
except ImportError:  # pragma: no cover
    BaseModel = object


class City(BaseModel):
    city: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
RESP_WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather in a city.",
                     "parameters": WEATHER_TOOL["function"]["parameters"], "strict": True}


def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return f"It is sunny in {city}."


FLOWS = []


LIB_MODULE = {"openai": "openai", "openai-agents": "agents", "langchain-openai": "langchain_openai",
              "pydantic-ai": "pydantic_ai", "instructor": "instructor", "smolagents": "smolagents",
              "llama-index": "llama_index.llms.openai_like",
              "langchain-anthropic": "langchain_anthropic",
              "pydantic-ai-anthropic": "pydantic_ai.models.anthropic", "litellm": "litellm"}


def flow(lib):
    def deco(fn):
        FLOWS.append((lib, fn))
        return fn
    return deco


class Skip(Exception):
    pass


def need(mod):
    try:
        __import__(mod)
    except ImportError as e:
        raise Skip(f"{mod} not installed: {e}")


def run_async(coro):
    return asyncio.run(coro)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# What holds a tiny model's reply where a mode only asks for JSON in the prompt: vLLM's
# `guided_*` extensions (the protocol is what the test checks, not the model).
HELD = {
    "JSON": {"guided_json": City.model_json_schema()},
    "MD_JSON": {"guided_regex": '```json\\n\\{"city": "[A-Za-z]{1,20}"\\}\\n```'},
}


def run_flows():
    """Runs the registered flows (those ONLY names), one JSON line each; 1 if one failed."""
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
