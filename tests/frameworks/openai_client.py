"""Flows of openai client: chat, completions, responses, conversations."""

import json

from common import BASE, City, KEY, MAXTOK, MODEL, RESP_WEATHER_TOOL, SHORT, WEATHER_TOOL, check, flow, get_weather, need, run_async  # noqa: E501


def oa():
    need("openai")
    from openai import OpenAI
    return OpenAI(base_url=BASE, api_key=KEY)


def aoa():
    need("openai")
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=BASE, api_key=KEY)


@flow("openai")
def openai_models_list():
    ids = [m.id for m in oa().models.list()]
    check(ids, "no models")


@flow("openai")
def openai_chat_plain():
    r = oa().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=MAXTOK, temperature=0)
    check(r.choices[0].message.content is not None, "no content")


@flow("openai")
def openai_chat_stream():
    s = oa().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=MAXTOK, temperature=0, stream=True,
                                     stream_options={"include_usage": True})
    text, usage = "", None
    for c in s:
        if c.choices and c.choices[0].delta.content:
            text += c.choices[0].delta.content
        usage = c.usage or usage
    check(usage is not None, "no usage chunk")


@flow("openai")
def openai_chat_tool_loop():
    c = oa()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=MAXTOK,
                                  temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    check(m.tool_calls, "no tool call")
    msgs.append(m.model_dump(exclude_none=True))
    for tc in m.tool_calls:
        args = json.loads(tc.function.arguments)
        msgs.append({"role": "tool", "tool_call_id": tc.id, "content": get_weather(**args)})
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=MAXTOK,
                                  temperature=0)
    check(r.choices, "no second reply")


@flow("openai")
def openai_chat_tool_stream():
    s = oa().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     tools=[WEATHER_TOOL], tool_choice="required", max_tokens=MAXTOK,
                                     temperature=0, stream=True, parallel_tool_calls=False)
    args, name = "", None
    for c in s:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name = name or (tc.function and tc.function.name)
            args += (tc.function and tc.function.arguments) or ""
    check(name == "get_weather", f"tool name {name!r}")
    json.loads(args)


@flow("openai")
def openai_chat_parse():
    r = oa().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                    response_format=City, max_tokens=MAXTOK, temperature=0)
    check(r.choices[0].message.parsed is not None, "not parsed")


@flow("openai")
def openai_chat_json_object():
    r = oa().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
                                     response_format={"type": "json_object"}, max_tokens=MAXTOK, temperature=0)
    check(r.choices[0].message.content is not None, "no content")


@flow("openai")
def openai_chat_async_stream():
    async def go():
        s = await aoa().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=MAXTOK, temperature=0, stream=True)
        n = 0
        async for _ in s:
            n += 1
        check(n, "no chunks")
    run_async(go())


@flow("openai")
def openai_responses_plain():
    r = oa().responses.create(model=MODEL, input="Hi", max_output_tokens=MAXTOK, temperature=0)
    check(isinstance(r.output_text, str), "no output_text")


@flow("openai")
def openai_responses_stream():
    c = oa()
    done = None
    with c.responses.stream(model=MODEL, input="Say hello in one word.", max_output_tokens=MAXTOK,
                            temperature=0) as s:
        for ev in s:
            pass
        done = s.get_final_response()
    check(done.status == "completed", done.status)


@flow("openai")
def openai_responses_tool_loop():
    c = oa()
    r = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[RESP_WEATHER_TOOL],
                           tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=MAXTOK, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    check(calls, "no function_call")
    outs = [{"type": "function_call_output", "call_id": fc.call_id,
             "output": get_weather(**json.loads(fc.arguments))} for fc in calls]
    r2 = c.responses.create(model=MODEL, previous_response_id=r.id, input=outs, tools=[RESP_WEATHER_TOOL],
                            max_output_tokens=MAXTOK, temperature=0)
    check(r2.status == "completed", r2.status)


@flow("openai")
def openai_responses_parse():
    r = oa().responses.parse(model=MODEL, input="Capital of France?", text_format=City,
                             max_output_tokens=MAXTOK, temperature=0)
    check(r.output_parsed is not None, "not parsed")


@flow("openai")
def openai_responses_previous_response_id():
    c = oa()
    r1 = c.responses.create(model=MODEL, input="My name is Ada.", instructions=SHORT,
                            max_output_tokens=MAXTOK, temperature=0)
    r2 = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=r1.id,
                            instructions=SHORT, max_output_tokens=MAXTOK, temperature=0)
    check(r2.status == "completed", r2.status)


@flow("openai")
def openai_conversations():
    c = oa()
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                  metadata={"topic": "test"})
    r = c.responses.create(model=MODEL, input="What is my name?", conversation=conv.id,
                           instructions=SHORT, max_output_tokens=MAXTOK, temperature=0)
    check(r.status == "completed", r.status)
    items = list(c.conversations.items.list(conv.id, limit=10))
    check(len(items) >= 2, f"{len(items)} items")
    c.conversations.delete(conv.id)
