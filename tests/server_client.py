"""Drives pensieve's OpenAI-compatible server with the official `openai` client, as users'
programs do; tests/server.rs runs it and checks what it prints (one JSON object).

Usage: server_client.py BASE_URL resend MESSAGES_FILE MAX_TOKENS
       server_client.py BASE_URL stream
       server_client.py BASE_URL concurrent CLIENTS TURNS
       server_client.py BASE_URL reasoning FRESH_BASE_URL
       server_client.py BASE_URL agent
       server_client.py BASE_URL responses FLEET_BASE_URL
       server_client.py BASE_URL responses_agent
       server_client.py BASE_URL responses_reasoning
       server_client.py BASE_URL responses_socket [ROUNDS]
       server_client.py BASE_URL responses_compaction
"""

import json
import sys
import threading
import time

import openai

MODEL = "pensieve"


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def resend(base, path, max_tokens):
    """A conversation that resends its whole history every turn, as stateless clients do."""
    c = client(base)
    history = []
    turns = []
    with open(path) as f:
        questions = [line.strip() for line in f if line.strip()]
    for q in questions:
        history.append({"role": "user", "content": q})
        r = c.chat.completions.create(
            model=MODEL, messages=history, temperature=0, max_tokens=int(max_tokens)
        )
        text = r.choices[0].message.content
        history.append({"role": "assistant", "content": text})
        details = r.usage.prompt_tokens_details
        turns.append(
            {
                "reply": text,
                "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details else None,
                "completion_tokens": r.usage.completion_tokens,
            }
        )
    return {"turns": turns}


def logprob_entries(kind, logprobs):
    """A choice's log-probabilities as (token, logprob, best alternative's logprob) triples."""
    if logprobs is None:
        return []
    if kind == "chat":
        return [
            (e.token, e.logprob, max((t.logprob for t in e.top_logprobs), default=None))
            for e in logprobs.content or []
        ]
    return [
        (tok, lp, max(top.values(), default=None))
        for tok, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    ]


def stream(base):
    """The same requests streamed and whole: the texts, the usage and the log-probabilities
    must agree."""
    c = client(base)
    out = []
    for kind in ("chat", "completion"):
        args = dict(model=MODEL, temperature=0, max_tokens=24, stop=["\n\n"], seed=7)
        if kind == "chat":
            msgs = [{"role": "user", "content": "List three colours of the rainbow."}]
            args.update(logprobs=True, top_logprobs=3)
            whole = c.chat.completions.create(messages=msgs, **args)
            chunks = c.chat.completions.create(
                messages=msgs, stream=True, stream_options={"include_usage": True}, **args
            )
            whole_text = whole.choices[0].message.content
        else:
            prompt = "The three primary colours are"
            args.update(logprobs=3)
            whole = c.completions.create(prompt=prompt, **args)
            chunks = c.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **args
            )
            whole_text = whole.choices[0].text
        whole_lp = logprob_entries(kind, whole.choices[0].logprobs)
        text, reasons, usage, streamed_lp = "", [], None, []
        for ch in chunks:
            if ch.usage is not None:
                usage = ch.usage
            for choice in ch.choices:
                if kind == "chat":
                    text += choice.delta.content or ""
                else:
                    text += choice.text or ""
                streamed_lp += logprob_entries(kind, choice.logprobs)
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        out.append(
            {
                "kind": kind,
                "whole": whole_text,
                "streamed": text,
                "whole_reason": whole.choices[0].finish_reason,
                "streamed_reasons": reasons,
                "whole_completion_tokens": whole.usage.completion_tokens,
                "streamed_completion_tokens": usage.completion_tokens if usage else None,
                "whole_logprobs": whole_lp,
                "streamed_logprobs": streamed_lp,
            }
        )
    return {"pairs": out}


def concurrent(base, clients, turns):
    """`clients` conversations at once, each `turns` turns resending its history."""
    clients, turns = int(clients), int(turns)
    results = [None] * clients

    def one(i):
        c = client(base)
        history = [{"role": "system", "content": "You are a terse assistant."}]
        done, cached = 0, 0
        try:
            for t in range(turns):
                history.append({"role": "user", "content": f"Client {i}, turn {t}: name a fruit."})
                r = c.chat.completions.create(
                    model=MODEL,
                    messages=history,
                    max_tokens=8,
                    temperature=0.7,
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
                history.append({"role": "assistant", "content": r.choices[0].message.content})
                if r.usage.completion_tokens == 8:
                    done += 1
                if t > 0 and r.usage.prompt_tokens_details.cached_tokens > 0:
                    cached += 1
            results[i] = {"done": done, "cached_turns": cached}
        except Exception as e:  # reported, and the test fails on it
            results[i] = {"error": repr(e)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"clients": results}


def reasoning(base, fresh_base):
    """A thinking model's replies (forced into shape by a regex) through a reasoning parser:
    the thought as `reasoning_content`, whole and streamed; then two more turns, each with
    the history sent back with the answers only as clients do, the last also on a fresh
    server."""
    c = client(base)
    shape = r"<think>\n[a-z ]{6,20}\n</think>\n\n[A-Za-z ]{4,20}"
    args = dict(model=MODEL, temperature=0, max_tokens=80, extra_body={"guided_regex": shape})
    first = [{"role": "user", "content": "Say hello."}]
    r = c.chat.completions.create(messages=first, **args)
    m = r.choices[0].message
    whole = {"reasoning": getattr(m, "reasoning_content", None), "content": m.content}
    streamed = {"reasoning": "", "content": "", "order_ok": True}
    for chunk in c.chat.completions.create(messages=first, stream=True, **args):
        for choice in chunk.choices:
            thought = getattr(choice.delta, "reasoning_content", None) or ""
            if thought and streamed["content"]:
                streamed["order_ok"] = False
            streamed["reasoning"] += thought
            streamed["content"] += choice.delta.content or ""
    history = first + [{"role": "assistant", "content": m.content}]

    def ask(cl, question):
        r = cl.chat.completions.create(
            messages=history + [{"role": "user", "content": question}], **args)
        details = r.usage.prompt_tokens_details
        msg = r.choices[0].message
        return {
            "reply": msg.content,
            "reasoning": getattr(msg, "reasoning_content", None),
            "prompt_tokens": r.usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details else None,
        }

    # Two more turns, each sending back the answers only; the last also to a fresh server.
    second = ask(c, "And goodbye?")
    history += [{"role": "user", "content": "And goodbye?"},
                {"role": "assistant", "content": second["reply"]}]
    return {
        "whole": whole,
        "streamed": streamed,
        "first_prompt_tokens": r.usage.prompt_tokens,
        "second": second,
        "next": ask(c, "Thanks."),
        "fresh": ask(client(fresh_base), "Thanks."),
    }


# Strings bounded, so that a call always closes within the requests' max_tokens: what the
# tests check is how calls stream and round trip, whatever path a 135M model makes up (one
# has looped on "_with_errors_to_file" past 128 tokens).
AGENT_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object",
                       "properties": {"path": {"type": "string", "maxLength": 40}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40},
                       "content": {"type": "string", "maxLength": 40}},
                       "required": ["path", "content"], "additionalProperties": False}}},
]


def agent(base):
    """A coding agent's loop: streamed turns that call tools, the calls and their results sent
    back each turn with the whole history; each call also asked for whole (a new
    conversation: the same messages), to compare."""
    c = client(base)
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "The tests in main.py fail. Fix the bug."},
    ]
    args = dict(model=MODEL, tools=AGENT_TOOLS, max_tokens=128, temperature=0)
    steps = []
    for step in range(3):
        calls, content, finish, usage, fragments = {}, "", None, None, 0
        stream = c.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True},
            tool_choice="required", **args)
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = tc.id or call["id"]
                    if tc.function and tc.function.name:
                        call["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        call["arguments"] += tc.function.arguments
                        fragments += 1
                finish = choice.finish_reason or finish
        whole = c.chat.completions.create(messages=messages, tool_choice="required", **args)
        w = whole.choices[0].message.tool_calls[0]
        made = [calls[i] for i in sorted(calls)]
        details = usage.prompt_tokens_details
        steps.append({
            "calls": made, "content": content, "finish_reason": finish, "fragments": fragments,
            "whole": {"name": w.function.name, "arguments": w.function.arguments,
                      "finish_reason": whole.choices[0].finish_reason},
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details else None,
        })
        first = made[0]
        messages.append({"role": "assistant", "content": content or None, "tool_calls": [
            {"id": first["id"], "type": "function",
             "function": {"name": first["name"], "arguments": first["arguments"]}}]})
        messages.append({"role": "tool", "tool_call_id": first["id"],
                         "content": f"result {step}: def add(a, b): return a - b"})
    # A reflection step, as AutoGen makes one: the same tools with tool_choice "none".
    messages.append({"role": "user", "content": "Now say in one line what you changed."})
    reflected = c.chat.completions.create(messages=messages, tool_choice="none", **args)
    details = reflected.usage.prompt_tokens_details
    return {"steps": steps, "reflection": {
        "content": reflected.choices[0].message.content,
        "tool_calls": reflected.choices[0].message.tool_calls,
        "finish_reason": reflected.choices[0].finish_reason,
        "prompt_tokens": reflected.usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details else None}}


def response_usage(r):
    return {"input": r.usage.input_tokens, "output": r.usage.output_tokens,
            "cached": r.usage.input_tokens_details.cached_tokens,
            "reasoning": r.usage.output_tokens_details.reasoning_tokens}


def response_calls(r):
    return [{"call_id": o.call_id, "name": o.name, "arguments": o.arguments}
            for o in r.output if o.type == "function_call"]


def responses_agent(base):
    """A coding agent's loop on the Responses API: each turn streamed and made to call a tool,
    the next sending only the call's output and naming the response before; each turn also
    asked whole (the same request, not stored) to compare; the last response retrieved."""
    c = client(base)
    tools = [{"type": "function", **t["function"]} for t in AGENT_TOOLS]
    args = dict(model=MODEL, tools=tools, tool_choice="required", max_output_tokens=128,
                temperature=0)
    request = dict(instructions="You are a coding agent. Use the tools.",
                   input="The tests in main.py fail. Fix the bug.")
    steps, completed = [], None
    for step in range(3):
        events, fragments, arguments = [], 0, ""
        for event in c.responses.create(stream=True, **request, **args):
            events.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                fragments += 1
                arguments += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                completed = event.response
        whole = c.responses.create(store=False, **request, **args)
        calls = response_calls(completed)
        steps.append({"events": events, "fragments": fragments, "arguments": arguments,
                      "calls": calls, "whole": response_calls(whole),
                      "usage": response_usage(completed)})
        request = dict(previous_response_id=completed.id, input=[
            {"type": "function_call_output", "call_id": calls[0]["call_id"],
             "output": f"result {step}: def add(a, b): return a - b"}])
    return {"steps": steps, "retrieved": response_calls(c.responses.retrieve(completed.id))}


# A tool's result long enough that the rounds after it are mostly history.
LISTING = "\n".join(f"def f{i}(a, b):\n    return a + b + {i}" for i in range(24))


def responses_compaction(base):
    """Compaction on an agent's stored loop: three tool rounds, then `responses.compact` of the
    last response, and a turn on the compacted window given back as input (as the SDK's
    guide has it); then the server compacting by itself past `context_management`'s
    threshold, whole and streamed, and continued by `previous_response_id`; a compaction item
    not made here refused."""
    c = client(base)
    tools = [{"type": "function", **t["function"]} for t in AGENT_TOOLS]
    instructions = "You are a coding agent. Use the tools."
    args = dict(model=MODEL, tools=tools, max_output_tokens=48, temperature=0,
                instructions=instructions)
    request = dict(input="The tests in main.py fail. Fix the bug.")
    last = None
    for step in range(3):
        last = c.responses.create(tool_choice="required", **request, **args)
        call = response_calls(last)[0]
        request = dict(previous_response_id=last.id, input=[
            {"type": "function_call_output", "call_id": call["call_id"],
             "output": f"result {step}:\n{LISTING}"}])
    # The loop's history with the last round's results, then compacted.
    before = c.responses.create(tool_choice="none", **request, **args)
    compacted = c.responses.compact(model=MODEL, previous_response_id=before.id,
                                    instructions=instructions)
    window = [o.model_dump(exclude_none=True) for o in compacted.output]
    new = {"role": "user", "content": "Now run the tests."}
    after = c.responses.create(input=window + [new], store=False, tool_choice="none", **args)
    recomputed = c.responses.create(input=window + [new], store=False, tool_choice="none",
                                    **{**args, "instructions": instructions + " "})
    # A compaction asked of a create (a last `compaction_trigger` item): its response is the
    # compaction item, and the response after it continues the compacted context.
    triggered = c.responses.create(previous_response_id=before.id,
                                   input=[{"type": "compaction_trigger"}], tool_choice="none",
                                   **args)
    after_trigger = c.responses.create(previous_response_id=triggered.id,
                                       input="Now run the tests.", tool_choice="none", **args)
    # The server compacts by itself past the threshold; the response continues as any.
    managed_args = dict(context_management=[{"type": "compaction", "compact_threshold": 300}],
                        tool_choice="none", **args)
    managed = c.responses.create(previous_response_id=before.id, input="Summarize your work.",
                                 **managed_args)
    continued = c.responses.create(previous_response_id=managed.id, input="Thanks.",
                                   tool_choice="none", **args)
    events = [e.type for e in c.responses.create(
        previous_response_id=before.id, input="Summarize your work.", stream=True,
        **managed_args)]
    try:
        c.responses.create(input=[{"type": "compaction", "encrypted_content": "gAAAAB-foreign"},
                                  new], **args)
        foreign = None
    except openai.BadRequestError as e:
        foreign = str(e)
    return {"before": response_usage(before),
            "compacted": {"object": compacted.object,
                          "types": [o.type for o in compacted.output],
                          "roles": [getattr(o, "role", None) for o in compacted.output],
                          "content": window[-1].get("encrypted_content", ""),
                          "usage": {"input": compacted.usage.input_tokens,
                                    "cached": compacted.usage.input_tokens_details.cached_tokens,
                                    "output": compacted.usage.output_tokens}},
            "after": response_usage(after), "after_text": after.output_text,
            "recomputed": response_usage(recomputed),
            "triggered": [o.type for o in triggered.output],
            "after_trigger": response_usage(after_trigger),
            "managed": {"types": [o.type for o in managed.output],
                        "text": managed.output_text},
            "continued": response_usage(continued), "events": events, "foreign": foreign}


def responses_socket(base, rounds="4"):
    """An agent's tool loop over the Responses API's WebSocket mode, as the SDK's
    `responses.connect()` runs it: each turn sends only the call's output and the previous
    response's id, not stored (`store: false`, continued for the socket's life); the same loop
    over HTTP (stored), timed beside it; two lanes (`stream_id`) in flight on one socket; a
    refused event. After the socket closes, its responses are gone."""
    c = client(base)
    tools = [{"type": "function", **t["function"]} for t in AGENT_TOOLS]
    args = dict(model=MODEL, tools=tools, tool_choice="required", max_output_tokens=64,
                temperature=0, instructions="You are a coding agent. Use the tools.")
    task = "The tests in main.py fail. Fix the bug."

    def result(step, r):
        call = response_calls(r)[0]
        return [{"type": "function_call_output", "call_id": call["call_id"],
                 "output": f"result {step}: def add(a, b): return a - b"}]

    def over_socket(conn):
        steps, prev, given = [], None, task
        for step in range(int(rounds)):
            conn.response.create(input=given, previous_response_id=prev, store=False, **args)
            kinds = []
            for event in conn:
                kinds.append(event.type)
                if event.type == "error":
                    raise RuntimeError(f"error event: {event}")
                if event.type in ("response.completed", "response.incomplete"):
                    r = event.response
                    break
            steps.append({"usage": response_usage(r), "calls": response_calls(r),
                          "events": kinds, "id": r.id})
            prev, given = r.id, result(step, r)
        return steps

    began = time.monotonic()
    with c.responses.connect() as conn:
        socket_steps = over_socket(conn)
        socket_s = time.monotonic() - began
        # Two lanes at once: each create names its lane, and its events carry it back.
        for lane in ("a", "b"):
            conn.response.create(input=f"Lane {lane}: fix main.py.", stream_id=lane, **args)
        lanes, done = {}, set()
        for event in conn:
            lanes.setdefault(getattr(event, "stream_id", None), []).append(event.type)
            if event.type in ("response.completed", "response.incomplete", "error"):
                done.add(getattr(event, "stream_id", None))
            if done >= {"a", "b"}:
                break
        conn.send({"type": "response.steer", "previous_response_id": socket_steps[-1]["id"],
                   "input": "faster"})
        refused = conn.recv()
    began = time.monotonic()
    http_steps, prev, given = [], None, task
    for step in range(int(rounds)):
        r = c.responses.create(input=given, previous_response_id=prev, **args)
        http_steps.append({"usage": response_usage(r), "calls": response_calls(r)})
        prev, given = r.id, result(step, r)
    http_s = time.monotonic() - began
    try:
        c.responses.retrieve(socket_steps[-1]["id"])
        gone = False
    except openai.NotFoundError:
        gone = True
    return {"socket": socket_steps, "socket_s": socket_s, "http": http_steps, "http_s": http_s,
            "lanes": lanes, "refused": {"type": refused.type,
                                        "message": refused.error.message},
            "gone_after_close": gone}


def responses_reasoning(base):
    """A thinking model's responses (forced into shape by a regex): the thought as a reasoning
    item, whole and streamed; then the next response naming the first, and the same history
    sent whole with the answer only (not stored), as clients that keep it do."""
    c = client(base)
    shape = r"<think>\n[a-z ]{6,20}\n</think>\n\n[A-Za-z ]{4,20}"
    args = dict(model=MODEL, temperature=0, max_output_tokens=80,
                extra_body={"guided_regex": shape})
    # Instructions long enough that the first turn's prompt fills whole KV blocks, which a
    # response continuing it shares by content.
    system = ("You are a friendly assistant. Think about what the user wants first, then "
              "answer in a few plain words, without lists, code or quotes.")
    args["instructions"] = system
    first = c.responses.create(input="Say hello.", **args)
    thought = "".join(part.text for o in first.output if o.type == "reasoning"
                      for part in o.content or [])
    streamed = {"reasoning": "", "content": "", "order_ok": True}
    for event in c.responses.create(input="Say hello.", stream=True, **args):
        if event.type == "response.reasoning_text.delta":
            streamed["order_ok"] &= not streamed["content"]
            streamed["reasoning"] += event.delta
        if event.type == "response.output_text.delta":
            streamed["content"] += event.delta
    after = c.responses.create(input="And goodbye?", previous_response_id=first.id, **args)
    resent = c.responses.create(store=False, input=[
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And goodbye?"},
    ], **args)
    return {
        "first": {"reasoning": thought, "content": first.output_text,
                  "kinds": [o.type for o in first.output], "usage": response_usage(first)},
        "streamed": streamed,
        "next": {"content": after.output_text, "usage": response_usage(after)},
        "resent": {"content": resent.output_text, "usage": response_usage(resent)},
    }


def responses(base, fleet_base):
    """The Responses API: a response, the next naming it and sending only its new input, one
    streamed, one retrieved, the same history sent whole (stateless, not stored), a
    continuation on a second server of a fleet, and a deleted response no longer found."""
    c = client(base)
    args = dict(model=MODEL, max_output_tokens=16, temperature=0)

    def usage(r):
        return {"input": r.usage.input_tokens, "output": r.usage.output_tokens,
                "cached": r.usage.input_tokens_details.cached_tokens}

    first = c.responses.create(
        input="What is the capital of France?", instructions="Answer briefly.", **args)
    second = c.responses.create(input="And of Italy?", previous_response_id=first.id, **args)
    events, text, completed = [], "", None
    for event in c.responses.create(
            input="And of Spain?", previous_response_id=second.id, stream=True, **args):
        events.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    # Cut short by max_output_tokens: the stream ends with `response.incomplete`.
    cut_events, cut = [], None
    for event in c.responses.create(input="Count to fifty.", store=False, stream=True,
                                    **{**args, "max_output_tokens": 3}):
        cut_events.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            cut = event.response
    stateless = c.responses.create(store=False, input=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ], **args)
    fleet = client(fleet_base).responses.create(
        input="And of Germany?", previous_response_id=second.id, **args)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    structured = c.responses.create(input="Pick a number.", store=False, text={"format": {
        "type": "json_schema", "name": "pick", "schema": schema, "strict": True}}, **args)
    retrieved = c.responses.retrieve(second.id)
    # Stored and cut short: retrieved as it ended, made when it was, from the fleet's other
    # server too (what it kept travels with its conversation).
    short = c.responses.create(input="Count to fifty.", **{**args, "max_output_tokens": 3})
    again = [c.responses.retrieve(short.id), client(fleet_base).responses.retrieve(short.id)]
    kept = {"short": {"status": short.status, "created_at": short.created_at,
                      "usage": usage(short)},
            "again": [{"status": r.status, "created_at": r.created_at,
                       "reason": r.incomplete_details.reason if r.incomplete_details else None,
                       "usage": usage(r) if r.usage else None} for r in again],
            "second": {"status": second.status, "created_at": second.created_at,
                       "usage": usage(second)},
            "retrieved": {"status": retrieved.status, "created_at": retrieved.created_at,
                          "usage": usage(retrieved) if retrieved.usage else None}}
    deleted = c.responses.delete(first.id)
    try:
        c.responses.create(input="Hm?", previous_response_id=first.id, **args)
        gone = False
    except openai.NotFoundError:
        gone = True
    return {
        "first": {"id": first.id, "text": first.output_text, "usage": usage(first),
                  "status": first.status},
        "second": {"id": second.id, "text": second.output_text, "usage": usage(second),
                   "previous": second.previous_response_id},
        "streamed": {"text": text, "events": events,
                     "completed": completed.output_text if completed else None,
                     "usage": usage(completed) if completed else None},
        "cut": {"last": cut_events[-1] if cut_events else None,
                "status": cut.status if cut else None,
                "reason": cut.incomplete_details.reason
                if cut and cut.incomplete_details else None},
        "stateless": {"text": stateless.output_text, "usage": usage(stateless)},
        "fleet": {"text": fleet.output_text, "usage": usage(fleet)},
        "retrieved": retrieved.output_text,
        "kept": kept,
        "structured": structured.output_text,
        "structured_format": structured.text.format.type,
        "deleted": deleted is None or getattr(deleted, "deleted", True),
        "gone": gone,
    }


def responses_logprobs(base):
    """The answer's log-probabilities on a response, whole and streamed, beside the chat
    endpoint's for the same question."""
    c = client(base)
    question = "Name three colours."
    args = dict(model=MODEL, temperature=0, store=False, top_logprobs=2,
                include=["message.output_text.logprobs"])
    whole = c.responses.create(input=question, max_output_tokens=12, **args)
    part = whole.output[0].content[0]
    entries = [(e.token, e.logprob, [t.logprob for t in e.top_logprobs])
               for e in part.logprobs or []]
    streamed, done = [], None
    for event in c.responses.create(input=question, max_output_tokens=12, stream=True, **args):
        if event.type == "response.output_text.delta":
            streamed += [(e.token, e.logprob) for e in event.logprobs or []]
        if event.type == "response.output_text.done":
            done = [(e.token, e.logprob) for e in event.logprobs or []]
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=12, logprobs=True, top_logprobs=2)
    plain = c.responses.create(input=question, max_output_tokens=12, model=MODEL,
                               temperature=0, store=False)
    return {"text": whole.output_text, "entries": entries, "streamed": streamed, "done": done,
            "chat": logprob_entries("chat", chat.choices[0].logprobs),
            "chat_text": chat.choices[0].message.content,
            "plain": [c.model_dump().get("logprobs") for c in plain.output[0].content]}


def errors(base):
    """Requests the server refuses, as the client raises them: its class, status and `code`."""
    c = client(base)
    cases = {
        "model": lambda: c.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=1),
        "window": lambda: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 60000}], max_tokens=1),
        "field": lambda: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"temprature": 1}),
        "responses_window": lambda: c.responses.create(
            model=MODEL, input="word " * 60000, max_output_tokens=16),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except openai.APIStatusError as e:
            out[name] = {"class": type(e).__name__, "status": e.status_code, "code": e.code,
                         "param": e.param}
    return out


def main():
    base, cmd, *rest = sys.argv[1:]
    commands = {
        "resend": resend,
        "stream": stream,
        "concurrent": concurrent,
        "reasoning": reasoning,
        "agent": agent,
        "responses": responses,
        "responses_agent": responses_agent,
        "responses_socket": responses_socket,
        "responses_compaction": responses_compaction,
        "responses_reasoning": responses_reasoning,
        "errors": errors,
        "responses_logprobs": responses_logprobs,
    }
    result = commands[cmd](base, *rest)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
