#!/usr/bin/env python3
"""Agent frameworks against an OpenAI-compatible server (draft).

Usage: flows_draft.py BASE_URL [MODEL] [FLOW_SUBSTRING ...]
  BASE_URL: e.g. http://127.0.0.1:8000/v1  (a trailing /v1 is added when missing)
  MODEL:    the served model name (default: $PENSIEVE_MODEL or "pensieve")
Prints one JSON line per flow: {"flow": name, "ok": bool, "error": str|null}
(plus "skipped": true when the flow's library is not installed).
Exit status: 1 when a flow that ran failed.

The flows check the protocol, not answer quality: the model is tiny, so tool calls are
forced with tool_choice wherever the library allows, schemas are one field, replies are
capped at 32 tokens and sampling is greedy (temperature 0).

Pinned sets (PyPI; no single openai version serves all of them):
  openai 3.x set: openai==3.54.0 openai-agents==0.24.0 langchain-openai==1.8.1
                  "pydantic-ai-slim[openai]==2.78.0" "smolagents[openai]==1.26.0"
  openai 2.x set: openai==2.54.0 openai-agents==0.20.0 instructor==1.17.0 langchain-openai==1.8.1
                  "pydantic-ai-slim[openai]==2.31.1" "smolagents[openai]==1.26.0"
                  llama-index-llms-openai-like==0.8.1
  (instructor 1.17 pins jiter<0.15, openai 3.x needs jiter>=0.16; llama-index-llms-openai 0.8.x
  needs openai<3; openai-agents 0.24 and pydantic-ai-slim>=2.32 need openai>=3.)
Flows of a library that is not installed are reported skipped.

Set FLOWS_MARK=1 to POST {"flow": name} to BASE/__mark before each flow (for a recording mock).
"""
import asyncio
import contextlib
import json
import os
import sys
import traceback
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
BASE = BASE.rstrip("/")
if not BASE.endswith("/v1"):
    BASE += "/v1"
ROOT = BASE[: -len("/v1")]
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("PENSIEVE_MODEL", "pensieve")
ONLY = sys.argv[3:]
KEY = "unused"
MAXTOK = 32

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
              "llama-index": "llama_index.llms.openai_like"}


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


# ============================================================ openai client
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
    with c.responses.stream(model=MODEL, input="Hi", max_output_tokens=MAXTOK, temperature=0) as s:
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
    r1 = c.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=MAXTOK, temperature=0)
    r2 = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=r1.id,
                            max_output_tokens=MAXTOK, temperature=0)
    check(r2.status == "completed", r2.status)


@flow("openai")
def openai_conversations():
    c = oa()
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                  metadata={"topic": "test"})
    r = c.responses.create(model=MODEL, input="What is my name?", conversation=conv.id,
                           max_output_tokens=MAXTOK, temperature=0)
    check(r.status == "completed", r.status)
    items = list(c.conversations.items.list(conv.id, limit=10))
    check(len(items) >= 2, f"{len(items)} items")
    c.conversations.delete(conv.id)


# ============================================================ openai-agents
def agents_setup(chat_completions=False):
    need("agents")
    from openai import AsyncOpenAI
    from agents import (ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        set_tracing_disabled)
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=BASE, api_key=KEY)
    cls = OpenAIChatCompletionsModel if chat_completions else OpenAIResponsesModel
    return client, cls(model=MODEL, openai_client=client), ModelSettings(max_tokens=MAXTOK, temperature=0)


def agent(**kw):
    from agents import Agent
    chat = kw.pop("chat_completions", False)
    client, model, settings = agents_setup(chat)
    if "model_settings" in kw:
        settings = settings.resolve(kw.pop("model_settings"))
    return client, Agent(name="assistant", instructions="Be brief.", model=model, model_settings=settings, **kw)


@flow("openai-agents")
def agents_plain():
    from agents import Runner
    _, a = agent()
    r = run_async(Runner.run(a, "Hi"))
    check(isinstance(r.final_output, str), "no text")


@flow("openai-agents")
def agents_sync():
    need("agents")
    from agents import Runner
    _, a = agent()
    r = Runner.run_sync(a, "Hi")
    check(isinstance(r.final_output, str), "no text")


@flow("openai-agents")
def agents_stream():
    need("agents")
    from agents import Runner

    async def go():
        _, a = agent()
        r = Runner.run_streamed(a, "Hi")
        n = 0
        async for _ in r.stream_events():
            n += 1
        check(n and r.final_output is not None, "no events/output")
    run_async(go())


def agents_tool():
    from agents import function_tool

    @function_tool
    def get_weather_tool(city: str) -> str:
        """Get the weather in a city."""
        return get_weather(city)
    return get_weather_tool


@flow("openai-agents")
def agents_tool_loop():
    need("agents")
    from agents import ModelSettings, Runner
    _, a = agent(tools=[agents_tool()], model_settings=ModelSettings(tool_choice="get_weather_tool"))
    r = run_async(Runner.run(a, "What is the weather in Paris?"))
    check(any(i.type == "tool_call_output_item" for i in r.new_items), "tool not run")


@flow("openai-agents")
def agents_tool_loop_stream():
    need("agents")
    from agents import ModelSettings, Runner

    async def go():
        _, a = agent(tools=[agents_tool()], model_settings=ModelSettings(tool_choice="required"))
        r = Runner.run_streamed(a, "What is the weather in Paris?")
        async for _ in r.stream_events():
            pass
        check(any(i.type == "tool_call_output_item" for i in r.new_items), "tool not run")
    run_async(go())


@flow("openai-agents")
def agents_output_type():
    need("agents")
    from agents import Runner
    _, a = agent(output_type=City)
    r = run_async(Runner.run(a, "Capital of France?"))
    check(isinstance(r.final_output, City), repr(r.final_output))


@flow("openai-agents")
def agents_output_type_nonstrict():
    need("agents")
    from agents import AgentOutputSchema, Runner
    _, a = agent(output_type=AgentOutputSchema(City, strict_json_schema=False))
    r = run_async(Runner.run(a, "Capital of France?"))
    check(isinstance(r.final_output, City), repr(r.final_output))


@flow("openai-agents")
def agents_previous_response_id():
    need("agents")
    from agents import Runner

    async def go():
        _, a = agent()
        r1 = await Runner.run(a, "My name is Ada.")
        check(r1.last_response_id, "no last_response_id")
        r2 = await Runner.run(a, "What is my name?", previous_response_id=r1.last_response_id)
        check(r2.final_output is not None, "no output")
    run_async(go())


@flow("openai-agents")
def agents_auto_previous_response_id():
    need("agents")
    from agents import Runner
    _, a = agent(tools=[agents_tool()])
    from agents import ModelSettings
    a.model_settings = a.model_settings.resolve(ModelSettings(tool_choice="get_weather_tool"))
    r = run_async(Runner.run(a, "Weather in Paris?", auto_previous_response_id=True))
    check(r.final_output is not None, "no output")


@flow("openai-agents")
def agents_conversation_id():
    need("agents")
    from agents import Runner

    async def go():
        client, a = agent()
        conv = await client.conversations.create()
        await Runner.run(a, "My name is Ada.", conversation_id=conv.id)
        r = await Runner.run(a, "What is my name?", conversation_id=conv.id)
        check(r.final_output is not None, "no output")
    run_async(go())


@flow("openai-agents")
def agents_sqlite_session():
    need("agents")
    from agents import Runner, SQLiteSession

    async def go():
        _, a = agent()
        s = SQLiteSession("flows")
        await Runner.run(a, "My name is Ada.", session=s)
        r = await Runner.run(a, "What is my name?", session=s)
        check(len(await s.get_items()) >= 4, "session not kept")
        check(r.final_output is not None, "no output")
    run_async(go())


@flow("openai-agents")
def agents_openai_conversations_session():
    need("agents")
    from agents import OpenAIConversationsSession, Runner

    async def go():
        client, a = agent()
        s = OpenAIConversationsSession(openai_client=client)
        await Runner.run(a, "My name is Ada.", session=s)
        r = await Runner.run(a, "What is my name?", session=s)
        check(r.final_output is not None, "no output")
        items = await s.get_items()
        check(len(items) >= 4, f"{len(items)} items")
        await s.pop_item()
        await s.clear_session()
    run_async(go())


@flow("openai-agents")
def agents_chat_completions_model():
    need("agents")
    from agents import ModelSettings, Runner
    _, a = agent(chat_completions=True, tools=[agents_tool()],
                 model_settings=ModelSettings(tool_choice="get_weather_tool"))
    r = run_async(Runner.run(a, "Weather in Paris?"))
    check(r.final_output is not None, "no output")


@flow("openai-agents")
def agents_chat_completions_stream_output_type():
    need("agents")
    from agents import Runner

    async def go():
        _, a = agent(chat_completions=True, output_type=City)
        r = Runner.run_streamed(a, "Capital of France?")
        async for _ in r.stream_events():
            pass
        check(isinstance(r.final_output, City), repr(r.final_output))
    run_async(go())


# ============================================================ langchain-openai
def lc(**kw):
    need("langchain_openai")
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=MODEL, base_url=BASE, api_key=KEY, max_tokens=MAXTOK, temperature=0, **kw)


@flow("langchain-openai")
def lc_invoke():
    check(isinstance(lc().invoke("Hi").content, str), "no content")


@flow("langchain-openai")
def lc_stream():
    n = sum(1 for _ in lc().stream("Hi"))
    check(n, "no chunks")


@flow("langchain-openai")
def lc_async():
    async def go():
        m = await lc().ainvoke("Hi")
        n = 0
        async for _ in lc().astream("Hi"):
            n += 1
        check(n and m.content is not None, "no output")
    run_async(go())


@flow("langchain-openai")
def lc_tool_loop():
    need("langchain_core")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather_lc(city: str) -> str:
        """Get the weather in a city."""
        return get_weather(city)

    llm = lc().bind_tools([get_weather_lc], tool_choice="get_weather_lc")
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = llm.invoke(msgs)
    check(ai.tool_calls, "no tool call")
    msgs.append(ai)
    for tc in ai.tool_calls:
        msgs.append(ToolMessage(get_weather_lc.invoke(tc["args"]), tool_call_id=tc["id"]))
    final = lc().bind_tools([get_weather_lc]).invoke(msgs)
    check(final is not None, "no final")


def lc_structured(method, **kw):
    r = lc(**kw).with_structured_output(City, method=method).invoke("Capital of France? Answer in JSON.")
    check(isinstance(r, City), repr(r))


@flow("langchain-openai")
def lc_structured_function_calling():
    lc_structured("function_calling")


@flow("langchain-openai")
def lc_structured_json_schema():
    lc_structured("json_schema")


@flow("langchain-openai")
def lc_structured_json_mode():
    lc_structured("json_mode")


@flow("langchain-openai")
def lc_responses_invoke():
    m = lc(use_responses_api=True).invoke("Hi")
    check(m.content is not None, "no content")


@flow("langchain-openai")
def lc_responses_stream():
    n = sum(1 for _ in lc(use_responses_api=True).stream("Hi"))
    check(n, "no chunks")


@flow("langchain-openai")
def lc_responses_structured_json_schema():
    lc_structured("json_schema", use_responses_api=True)


@flow("langchain-openai")
def lc_responses_tool_loop():
    need("langchain_core")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather_lc(city: str) -> str:
        """Get the weather in a city."""
        return get_weather(city)

    llm = lc(use_responses_api=True).bind_tools([get_weather_lc], tool_choice="get_weather_lc")
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = llm.invoke(msgs)
    check(ai.tool_calls, "no tool call")
    msgs.append(ai)
    for tc in ai.tool_calls:
        msgs.append(ToolMessage(get_weather_lc.invoke(tc["args"]), tool_call_id=tc["id"]))
    final = lc(use_responses_api=True).bind_tools([get_weather_lc]).invoke(msgs)
    check(final is not None, "no final")


# ============================================================ pydantic-ai
def pai_model(responses=False):
    need("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    provider = OpenAIProvider(base_url=BASE, api_key=KEY)
    return (OpenAIResponsesModel if responses else OpenAIChatModel)(MODEL, provider=provider)


def pai_agent(responses=False, **kw):
    from pydantic_ai import Agent
    settings = {"max_tokens": MAXTOK, "temperature": 0, **kw.pop("settings", {})}
    return Agent(pai_model(responses), model_settings=settings, **kw)


@flow("pydantic-ai")
def pai_chat_plain():
    r = pai_agent().run_sync("Hi")
    check(isinstance(r.output, str), "no text")


@flow("pydantic-ai")
def pai_chat_stream():
    async def go():
        async with pai_agent().run_stream("Hi") as r:
            async for _ in r.stream_text(delta=True):
                pass
    run_async(go())


@flow("pydantic-ai")
def pai_chat_tool_loop():
    from pydantic_ai import ToolOutput
    a = pai_agent(output_type=ToolOutput(City), tools=[get_weather])
    r = a.run_sync("What is the weather in Paris?")
    check(isinstance(r.output, City), repr(r.output))


@flow("pydantic-ai")
def pai_chat_tool_output():
    from pydantic_ai import ToolOutput
    r = pai_agent(output_type=ToolOutput(City)).run_sync("Capital of France?")
    check(isinstance(r.output, City), repr(r.output))


@flow("pydantic-ai")
def pai_chat_native_output():
    from pydantic_ai import NativeOutput
    r = pai_agent(output_type=NativeOutput(City)).run_sync("Capital of France?")
    check(isinstance(r.output, City), repr(r.output))


@flow("pydantic-ai")
def pai_chat_prompted_output():
    from pydantic_ai import PromptedOutput
    r = pai_agent(output_type=PromptedOutput(City)).run_sync("Capital of France?")
    check(isinstance(r.output, City), repr(r.output))


@flow("pydantic-ai")
def pai_chat_multi_turn():
    a = pai_agent()
    r1 = a.run_sync("My name is Ada.")
    r2 = a.run_sync("What is my name?", message_history=r1.all_messages())
    check(isinstance(r2.output, str), "no text")


@flow("pydantic-ai")
def pai_chat_stream_structured():
    async def go():
        async with pai_agent(output_type=City).run_stream("Capital of France?") as r:
            out = await r.get_output()
        check(isinstance(out, City), repr(out))
    run_async(go())


@flow("pydantic-ai")
def pai_responses_plain():
    r = pai_agent(responses=True).run_sync("Hi")
    check(isinstance(r.output, str), "no text")


@flow("pydantic-ai")
def pai_responses_stream():
    async def go():
        async with pai_agent(responses=True).run_stream("Hi") as r:
            async for _ in r.stream_text(delta=True):
                pass
    run_async(go())


@flow("pydantic-ai")
def pai_responses_tool_loop():
    from pydantic_ai import ToolOutput
    r = pai_agent(responses=True, output_type=ToolOutput(City), tools=[get_weather]).run_sync(
        "What is the weather in Paris?")
    check(isinstance(r.output, City), repr(r.output))


@flow("pydantic-ai")
def pai_responses_native_output():
    from pydantic_ai import NativeOutput
    r = pai_agent(responses=True, output_type=NativeOutput(City)).run_sync("Capital of France?")
    check(isinstance(r.output, City), repr(r.output))


@flow("pydantic-ai")
def pai_responses_prompted_output():
    from pydantic_ai import PromptedOutput
    r = pai_agent(responses=True, output_type=PromptedOutput(City)).run_sync("Capital of France?")
    check(isinstance(r.output, City), repr(r.output))


# ============================================================ instructor
def instr(mode_name, async_=False):
    need("instructor")
    import instructor
    from openai import AsyncOpenAI, OpenAI
    cls = AsyncOpenAI if async_ else OpenAI
    return instructor.from_openai(cls(base_url=BASE, api_key=KEY), mode=getattr(instructor.Mode, mode_name))


def instr_mode(mode_name):
    c = instr(mode_name)
    kw = {"max_tokens": MAXTOK, "temperature": 0}
    if mode_name.startswith("RESPONSES"):
        kw = {"max_output_tokens": MAXTOK, "temperature": 0}
    r = c.create(model=MODEL, response_model=City, max_retries=1,
                 messages=[{"role": "user", "content": "Capital of France?"}], **kw)
    check(isinstance(r, City), repr(r))


for _m in ["TOOLS", "TOOLS_STRICT", "PARALLEL_TOOLS", "JSON", "JSON_SCHEMA", "MD_JSON", "JSON_O1",
           "RESPONSES_TOOLS"]:
    def _f(m=_m):
        if m == "PARALLEL_TOOLS":
            need("instructor")
            from typing import Iterable
            r = instr(m).create(model=MODEL, response_model=Iterable[City], max_retries=1, max_tokens=MAXTOK,
                                temperature=0, messages=[{"role": "user", "content": "Capitals of France?"}])
            check(len(list(r)) >= 1, "no items")
        else:
            instr_mode(m)
    _f.__name__ = "instructor_" + _m.lower()
    flow("instructor")(_f)


@flow("instructor")
def instructor_async_tools():
    async def go():
        r = await instr("TOOLS", async_=True).create(
            model=MODEL, response_model=City, max_retries=1, max_tokens=MAXTOK, temperature=0,
            messages=[{"role": "user", "content": "Capital of France?"}])
        check(isinstance(r, City), repr(r))
    run_async(go())


@flow("instructor")
def instructor_partial_stream():
    parts = list(instr("TOOLS").create_partial(
        model=MODEL, response_model=City, max_retries=1, max_tokens=MAXTOK, temperature=0,
        messages=[{"role": "user", "content": "Capital of France?"}]))
    check(parts, "no partials")


@flow("instructor")
def instructor_iterable_stream_json():
    items = list(instr("JSON").create_iterable(
        model=MODEL, response_model=City, max_retries=1, max_tokens=MAXTOK, temperature=0,
        messages=[{"role": "user", "content": "Capitals of France?"}]))
    check(items is not None, "none")


# ============================================================ smolagents
def smol_model():
    need("smolagents")
    from smolagents import OpenAIServerModel
    return OpenAIServerModel(model_id=MODEL, api_base=BASE, api_key=KEY, max_tokens=MAXTOK, temperature=0)


@flow("smolagents")
def smol_model_generate():
    from smolagents.models import ChatMessage, MessageRole
    m = smol_model()
    r = m.generate([ChatMessage(role=MessageRole.USER, content=[{"type": "text", "text": "Hi"}])])
    check(r.content is not None, "no content")


@flow("smolagents")
def smol_model_stream():
    from smolagents.models import ChatMessage, MessageRole
    m = smol_model()
    n = sum(1 for _ in m.generate_stream([ChatMessage(role=MessageRole.USER,
                                                       content=[{"type": "text", "text": "Hi"}])]))
    check(n, "no deltas")


@flow("smolagents")
def smol_tool_calling_agent():
    from smolagents import ToolCallingAgent, tool

    @tool
    def get_weather_smol(city: str) -> str:
        """Get the weather in a city.

        Args:
            city: the city.
        """
        return get_weather(city)

    a = ToolCallingAgent(tools=[get_weather_smol], model=smol_model(), max_steps=3, verbosity_level=0)
    out = a.run("What is the weather in Paris?")
    check(out is not None, "no answer")


@flow("smolagents")
def smol_tool_calling_agent_stream():
    from smolagents import ToolCallingAgent, tool

    @tool
    def get_weather_smol(city: str) -> str:
        """Get the weather in a city.

        Args:
            city: the city.
        """
        return get_weather(city)

    a = ToolCallingAgent(tools=[get_weather_smol], model=smol_model(), max_steps=3, verbosity_level=0,
                         stream_outputs=True)
    out = a.run("What is the weather in Paris?")
    check(out is not None, "no answer")


@flow("smolagents")
def smol_model_response_format():
    from smolagents.models import ChatMessage, MessageRole
    m = smol_model()
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "strict": True,
                                                  "schema": City.model_json_schema()}}
    r = m.generate([ChatMessage(role=MessageRole.USER, content=[{"type": "text", "text": "Capital?"}])],
                   response_format=fmt)
    City.model_validate_json(r.content)


# ============================================================ llama-index
def li(**kw):
    need("llama_index.llms.openai_like")
    from llama_index.llms.openai_like import OpenAILike
    return OpenAILike(model=MODEL, api_base=BASE, api_key=KEY, max_tokens=MAXTOK, temperature=0,
                      is_chat_model=True, is_function_calling_model=True, context_window=2048, **kw)


def li_msgs(text):
    from llama_index.core.llms import ChatMessage
    return [ChatMessage(role="user", content=text)]


@flow("llama-index")
def li_complete():
    check(li().complete("Hi").text is not None, "no text")


@flow("llama-index")
def li_chat():
    check(li().chat(li_msgs("Hi")).message is not None, "no message")


@flow("llama-index")
def li_stream_chat():
    n = sum(1 for _ in li().stream_chat(li_msgs("Hi")))
    check(n, "no deltas")


@flow("llama-index")
def li_async_chat():
    async def go():
        r = await li().achat(li_msgs("Hi"))
        check(r.message is not None, "none")
    run_async(go())


@flow("llama-index")
def li_tool_loop():
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    t = FunctionTool.from_defaults(fn=get_weather)
    llm = li()
    msgs = li_msgs("What is the weather in Paris?")
    r = llm.chat_with_tools([t], chat_history=msgs, tool_required=True)
    calls = llm.get_tool_calls_from_response(r, error_on_no_tool_call=True)
    msgs.append(r.message)
    for c in calls:
        msgs.append(ChatMessage(role="tool", content=t(**c.tool_kwargs).content,
                                additional_kwargs={"tool_call_id": c.tool_id, "name": c.tool_name}))
    r2 = llm.chat_with_tools([t], chat_history=msgs)
    check(r2.message is not None, "no final")


@flow("llama-index")
def li_structured_predict():
    from llama_index.core.prompts import PromptTemplate
    r = li().structured_predict(City, PromptTemplate("Capital of {country}?"), country="France")
    check(isinstance(r, City), repr(r))


@flow("llama-index")
def li_structured_llm():
    r = li().as_structured_llm(City).chat(li_msgs("Capital of France?"))
    check(isinstance(r.raw, City), repr(r.raw))


@flow("llama-index")
def li_structured_outputs_json_schema():
    from llama_index.core.prompts import PromptTemplate
    r = li(should_use_structured_outputs=True).structured_predict(City, PromptTemplate("Capital of France?"))
    check(isinstance(r, City), repr(r))


# ============================================================ main
def mark(name):
    if os.environ.get("FLOWS_MARK"):
        req = urllib.request.Request(ROOT + "/__mark", data=json.dumps({"flow": name}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req).read()


def main():
    failed = 0
    for lib, fn in FLOWS:
        name = fn.__name__
        if ONLY and not any(o in name for o in ONLY):
            continue
        mark(name)
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
    mark(None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
