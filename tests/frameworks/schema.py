#!/usr/bin/env python3
"""Every request parameter the installed `openai` client can send is taken by pensieve-server.

Usage: schema.py BASE_URL

For each parameter of the client's `*CreateParams` types (chat completions, completions,
responses), one request carrying a valid value of it (built from the parameter's type) goes to
the server beside a minimal request. The verdict: no answer is a 400 that calls the field
unsupported, and a field the server refuses by value (audio output, say) is refused naming it.
Prints one JSON object: {"client": version, "checked": N, "failures": [...]}; exit 1 on any.
"""

import json
import sys
import typing
import urllib.error
import urllib.request

import openai
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

try:  # Python 3.11+: typing's NotRequired/Required wrappers
    from typing import NotRequired, Required
except ImportError:  # pragma: no cover
    from typing_extensions import NotRequired, Required

BASE = sys.argv[1].rstrip("/")

# Values the type alone does not make valid here (a model's name, the messages' shape), or
# that would make a request long (a large limit).
CHOSEN = {
    "model": "pensieve",
    "max_tokens": 2,
    "max_completion_tokens": 2,
    "max_output_tokens": 16,
    "n": 1,
    "best_of": 1,
    "top_logprobs": 0,
    "logprobs": None,  # set per endpoint below
    "temperature": 0,
    "top_p": 1,
    "stream": False,
    "seed": 1,
    "stop": ["\n\n"],
    "logit_bias": {"0": 0},
    "prompt": "Hi",
    "input": "Hi",
    "messages": [{"role": "user", "content": "Hi"}],
    "conversation": None,  # made on the server below
    "previous_response_id": None,  # made on the server below
    "tools": None,  # per endpoint below
    "tool_choice": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}],
    "function_call": "auto",
    "response_format": {"type": "json_object"},
    "text": {"format": {"type": "text"}},
    "include": [],
    "suffix": "",
    "instructions": "Be brief.",
}


def unwrap(t):
    origin = typing.get_origin(t)
    if origin in (Required, NotRequired) or str(origin).endswith("Annotated"):
        return unwrap(typing.get_args(t)[0])
    return t


def value_of(t, depth=0):
    """A valid value of type `t`: the first member of a union, a literal's first value, a
    typed dict with its required keys."""
    t = unwrap(t)
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if depth > 6:
        return None
    if t is type(None):
        return None
    if origin is typing.Literal:
        return args[0]
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        members = [a for a in args if unwrap(a) is not type(None)]
        return value_of(members[0], depth + 1) if members else None
    if t is str:
        return "x"
    if t is bool:
        return False
    if t is int:
        return 1
    if t is float:
        return 0.5
    if origin in (list, typing.List) or str(origin).endswith("Iterable'>") or str(
        origin
    ).endswith("Sequence'>"):
        return [value_of(args[0], depth + 1)] if args else []
    if origin in (dict, typing.Dict) or str(origin).endswith("Mapping'>"):
        return {"k": value_of(args[1], depth + 1)} if len(args) == 2 else {}
    if isinstance(t, type) and hasattr(t, "__annotations__") and hasattr(t, "__total__"):
        hints = typing.get_type_hints(t, include_extras=True)
        required = getattr(t, "__required_keys__", set())
        return {k: value_of(v, depth + 1) for k, v in hints.items() if k in required}
    return None


def params_of(typed_dict):
    return typing.get_type_hints(typed_dict, include_extras=True)


def post(path, body):
    request = urllib.request.Request(
        BASE + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def main():
    status, conversation = post("/v1/conversations", {})
    assert status == 200, conversation
    status, previous = post("/v1/responses", {"input": "Hi", "max_output_tokens": 2})
    assert status == 200, previous
    endpoints = [
        (
            "/v1/chat/completions",
            chat_create_params.CompletionCreateParamsNonStreaming,
            {"messages": CHOSEN["messages"], "max_tokens": 2},
            {"logprobs": True, "tools": [], "top_logprobs": 0},
        ),
        (
            "/v1/completions",
            completion_create_params.CompletionCreateParamsNonStreaming,
            {"prompt": "Hi", "max_tokens": 2},
            {"logprobs": 0},
        ),
        (
            "/v1/responses",
            response_create_params.ResponseCreateParamsNonStreaming,
            {"input": "Hi", "max_output_tokens": 16},
            {
                "tools": [],
                "conversation": conversation["id"],
                "previous_response_id": previous["id"],
            },
        ),
    ]
    checked, failures = 0, []
    for path, params, base, special in endpoints:
        for name, t in params_of(params).items():
            if name in special:
                value = special[name]
            elif CHOSEN.get(name) is not None:
                value = CHOSEN[name]
            else:
                value = value_of(t)
            body = dict(base)
            body[name] = value
            if name == "function_call":
                body["functions"] = CHOSEN["functions"]
            status, answer = post(path, body)
            checked += 1
            if status != 200:
                # Refusals by value, for whoever reads the log.
                print(path, name, status, json.dumps(answer)[:200], file=sys.stderr)
            message = json.dumps((answer.get("error") or {}).get("message", ""))
            if status == 400 and "unsupported field" in message:
                failures.append({"path": path, "field": name, "value": value, "answer": answer})
            elif status == 400 and "unsupported value" in message and name not in message:
                failures.append({"path": path, "field": name, "value": value, "answer": answer})
            elif status >= 500:
                failures.append({"path": path, "field": name, "value": value, "answer": answer})
    print(json.dumps({"client": openai.__version__, "checked": checked, "failures": failures}))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
