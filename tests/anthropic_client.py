"""Drives pensieve's Messages API with the official `anthropic` client, as users' programs (and
Claude Code's SDK) do; tests/server_messages.rs runs it and checks what it prints (one JSON
object).

Usage: anthropic_client.py BASE_URL chat
       anthropic_client.py BASE_URL agent
       anthropic_client.py BASE_URL errors [API_KEY]
"""

import asyncio
import json
import sys

import anthropic

MODEL = "pensieve"
# The client's latest release has no sampling parameters (Claude's newest models take none);
# older releases and other clients send `temperature`, which the server takes.
GREEDY = {"temperature": 0}


def client(base, key="unused"):
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=600)


def usage(u):
    return {"input": u.input_tokens, "output": u.output_tokens,
            "cache_read": u.cache_read_input_tokens,
            "cache_creation": u.cache_creation_input_tokens}


def chat(base):
    """A chat that resends its history, its last block marked for the cache (as Claude Code
    marks it), whole and streamed, sync and async; each request's prompt counted first."""
    c = client(base)
    # Long enough to fill chunks of KV, which fresh conversations share by content.
    system = [{"type": "text", "text": "You are a helpful assistant. " + " ".join(
        f"Rule {i}: answer briefly, in plain words, and never invent facts." for i in range(8)),
               "cache_control": {"type": "ephemeral"}}]
    history = []
    turns = []
    for q in ["Name a fruit.", "Name another one.", "And a third?"]:
        history.append({"role": "user", "content": [
            {"type": "text", "text": q, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]})
        counted = c.messages.count_tokens(model=MODEL, system=system, messages=history)
        m = c.messages.create(model=MODEL, system=system, messages=history, max_tokens=24,
                              extra_body=GREEDY)
        text = "".join(b.text for b in m.content if b.type == "text")
        history.append({"role": "assistant", "content": m.content})
        turns.append({"text": text, "stop_reason": m.stop_reason, "usage": usage(m.usage),
                      "counted": counted.input_tokens, "id": m.id, "type": m.type,
                      "role": m.role, "model": m.model})
    # The same question streamed, with the SDK's helpers: the text as it comes, then the
    # message whole.
    fresh = [{"role": "user", "content": "Name a fruit."}]
    with c.messages.stream(model=MODEL, system=system, messages=fresh, max_tokens=24,
                           extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    streamed = {"pieces": len(pieces), "text": "".join(pieces),
                "final": "".join(b.text for b in final.content if b.type == "text"),
                "stop_reason": final.stop_reason, "usage": usage(final.usage)}
    # A stop sequence, named in the reply.
    stopped = c.messages.create(model=MODEL, messages=fresh, max_tokens=24, extra_body=GREEDY,
                                stop_sequences=[turns[0]["text"][2:4]])

    async def asynchronous():
        a = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
        m = await a.messages.create(model=MODEL, system=system, messages=fresh, max_tokens=24,
                                    extra_body=GREEDY)
        events = []
        async with a.messages.stream(model=MODEL, system=system, messages=fresh,
                                     max_tokens=24, extra_body=GREEDY) as s:
            async for e in s:
                events.append(e.type)
            final = await s.get_final_message()
        return {"text": m.content[0].text, "events": events,
                "streamed": final.content[0].text}

    # Warming the cache without a reply (`max_tokens: 0`).
    warmed = c.messages.create(model=MODEL, system=system, max_tokens=0, messages=[
        {"role": "user", "content": "Warm this prompt up."}])
    return {"turns": turns, "streamed": streamed,
            "stopped": {"stop_reason": stopped.stop_reason,
                        "stop_sequence": stopped.stop_sequence,
                        "text": stopped.content[0].text if stopped.content else ""},
            "async": asyncio.run(asynchronous()),
            "warmed": {"content": len(warmed.content), "stop_reason": warmed.stop_reason,
                       "usage": usage(warmed.usage)}}


TOOLS = [
    {"name": "read_file", "description": "Read a file.",
     "input_schema": {"type": "object",
                      "properties": {"path": {"type": "string", "maxLength": 40}},
                      "required": ["path"], "additionalProperties": False}},
    {"name": "write_file", "description": "Write a file.",
     "input_schema": {"type": "object",
                      "properties": {"path": {"type": "string", "maxLength": 40},
                                     "content": {"type": "string", "maxLength": 40}},
                      "required": ["path", "content"], "additionalProperties": False},
     "cache_control": {"type": "ephemeral"}},
]


def agent(base):
    """A coding agent's loop as Claude Code runs one: streamed turns that must call a tool,
    each call's result sent back in a user message with the whole history; then a turn that
    may not call (tool_choice none)."""
    c = client(base)
    system = "You are a coding agent. Use the tools."
    messages = [{"role": "user", "content": "The tests in main.py fail. Fix the bug."}]
    steps = []
    for step in range(3):
        deltas = 0
        with c.messages.stream(model=MODEL, system=system, messages=messages, tools=TOOLS,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               max_tokens=128, extra_body=GREEDY) as s:
            for e in s:
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                    deltas += 1
            final = s.get_final_message()
        calls = [b for b in final.content if b.type == "tool_use"]
        steps.append({"stop_reason": final.stop_reason, "deltas": deltas,
                      "calls": [{"id": b.id, "name": b.name, "input": b.input} for b in calls],
                      "blocks": [b.type for b in final.content], "usage": usage(final.usage)})
        messages.append({"role": "assistant", "content": final.content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id,
             "content": [{"type": "text", "text": f"result {step}: def add(a, b): return a - b"}],
             "is_error": step == 1}]})
    messages.append({"role": "user", "content": "Now say in one line what you changed."})
    said = c.messages.create(model=MODEL, system=system, messages=messages, tools=TOOLS,
                             tool_choice={"type": "none"}, max_tokens=32, extra_body=GREEDY)
    return {"steps": steps, "said": {"stop_reason": said.stop_reason,
                                     "blocks": [b.type for b in said.content],
                                     "usage": usage(said.usage)}}


def errors(base, key="unused"):
    """What a client is told of requests the server refuses: Anthropic's error types."""
    c = client(base, key)
    out = {}
    tries = {
        "unknown_model": dict(model="claude-opus-4", max_tokens=8,
                              messages=[{"role": "user", "content": "Hi"}]),
        "image": dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]),
        "unknown_field": dict(model=MODEL, max_tokens=8, extra_body={"temprature": 1},
                              messages=[{"role": "user", "content": "Hi"}]),
        "container": dict(model=MODEL, max_tokens=8, container="c_1",
                          messages=[{"role": "user", "content": "Hi"}]),
    }
    for name, kwargs in tries.items():
        try:
            c.messages.create(**kwargs)
            out[name] = {"status": 200}
        except anthropic.APIStatusError as e:
            out[name] = {"status": e.status_code, "type": e.body["error"]["type"],
                         "message": e.body["error"]["message"], "class": type(e).__name__}
    return out


def main():
    base, command, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    result = {"chat": chat, "agent": agent, "errors": errors}[command](base, *rest)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
