#!/usr/bin/env python3
"""The frameworks' Anthropic models against pensieve-server's Messages API (`/v1/messages`),
as their users' programs call them: LangChain's `ChatAnthropic`, pydantic-ai's
`AnthropicModel` and LiteLLM's `anthropic/` route (plain, streamed, async, a forced tool call
whose result goes back, structured output, multi-turn with the cache read). tests/frameworks.rs
runs this in the pinned `frameworks-anthropic` environment (scripts/fetch-assets).

Usage: anthropic_flows.py BASE_URL [MODEL] [FLOW_SUBSTRING ...]; output as flows.py's.
"""

import sys

from common import KEY, MAXTOK, MODEL, ROOT, City, check, flow, get_weather, need, run_async, run_flows

# Greedy sampling: the latest clients' own types have no `temperature` (Claude's newest models
# take none); these libraries pass it through, and the server takes it.
WEATHER = {"name": "get_weather", "description": "Get the weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}


def chat(**kw):
    need("langchain_anthropic")
    from langchain_anthropic import ChatAnthropic
    return ChatAnthropic(model=MODEL, base_url=ROOT, api_key=KEY, max_tokens=MAXTOK,
                         temperature=0, max_retries=0, **kw)


@flow("langchain-anthropic")
def lca_invoke_and_usage():
    m = chat().invoke("Hi")
    check(isinstance(m.content, str) and m.content, "no content")
    u = m.usage_metadata
    check(u and u["input_tokens"] > 0 and u["output_tokens"] > 0, f"usage {u}")


@flow("langchain-anthropic")
def lca_stream_and_async():
    n = sum(1 for _ in chat().stream("Hi"))
    check(n > 1, "no chunks")

    async def go():
        m = await chat().ainvoke("Hi")
        k = 0
        async for _ in chat().astream("Hi"):
            k += 1
        check(k > 1 and m.content, "no async output")
    run_async(go())


@flow("langchain-anthropic")
def lca_tool_loop_reads_the_cache():
    """A forced call, its result as a ToolMessage, the answer: the second request continues
    the conversation the first left (its prompt read from the cache)."""
    need("langchain_core")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather_lc(city: str) -> str:
        """Get the weather in a city."""
        return get_weather(city)

    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = chat().bind_tools([get_weather_lc], tool_choice="get_weather_lc").invoke(msgs)
    check(ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather_lc", f"calls {ai.tool_calls}")
    msgs.append(ai)
    for tc in ai.tool_calls:
        msgs.append(ToolMessage(get_weather_lc.invoke(tc["args"]), tool_call_id=tc["id"]))
    final = chat().bind_tools([get_weather_lc]).invoke(msgs)
    read = final.usage_metadata["input_token_details"].get("cache_read", 0)
    check(read >= ai.usage_metadata["input_tokens"] - 8, f"cache read {read}, {final.usage_metadata}")


@flow("langchain-anthropic")
def lca_structured_output():
    s = chat().with_structured_output(City).invoke("Which city is the capital of France?")
    check(isinstance(s, City), f"{s!r}")


@flow("langchain-anthropic")
def lca_prompt_cache_breakpoints():
    from langchain_core.messages import HumanMessage, SystemMessage
    system = SystemMessage(content=[{"type": "text", "text": "You are terse. " * 40,
                                     "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    first = chat().invoke([system, HumanMessage("Hi")])
    again = chat().invoke([system, HumanMessage("Hello")])
    # LangChain reports what was written by time-to-live where the answer splits it.
    details = first.usage_metadata["input_token_details"]
    created = sum(details.get(k, 0) for k in
                  ("cache_creation", "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"))
    read = again.usage_metadata["input_token_details"].get("cache_read", 0)
    check(created > 0 and read > 0, f"{first.usage_metadata} / {again.usage_metadata}")


def pai_agent(**kw):
    need("pydantic_ai.models.anthropic")
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    model = AnthropicModel(MODEL, provider=AnthropicProvider(base_url=ROOT, api_key=KEY))
    settings = {"max_tokens": MAXTOK, "temperature": 0, **kw.pop("settings", {})}
    return Agent(model, model_settings=settings, **kw)


@flow("pydantic-ai-anthropic")
def paia_plain_and_multi_turn():
    a = pai_agent()
    r = a.run_sync("Hi")
    check(isinstance(r.output, str), "no text")
    r2 = a.run_sync("And again?", message_history=r.all_messages())
    check(isinstance(r2.output, str), "no second text")


@flow("pydantic-ai-anthropic")
def paia_stream():
    async def go():
        async with pai_agent().run_stream("Hi") as r:
            async for _ in r.stream_text(delta=True):
                pass
    run_async(go())


@flow("pydantic-ai-anthropic")
def paia_tool_output():
    """Structured output by a tool the model must call (tool_choice any)."""
    from pydantic_ai import ToolOutput
    r = pai_agent(output_type=ToolOutput(City)).run_sync("Which city is the capital of France?")
    check(isinstance(r.output, City), f"{r.output!r}")


def litellm_call(**kw):
    need("litellm")
    import litellm
    return litellm.completion(model=f"anthropic/{MODEL}", api_base=ROOT, api_key=KEY,
                              max_tokens=MAXTOK, temperature=0, **kw)


@flow("litellm")
def litellm_plain_and_stream():
    r = litellm_call(messages=[{"role": "user", "content": "Hi"}])
    check(r.choices[0].message.content, "no content")
    chunks = list(litellm_call(messages=[{"role": "user", "content": "Hi"}], stream=True))
    check(len(chunks) > 1, "no chunks")


@flow("litellm")
def litellm_tool_loop():
    tool = {"type": "function", "function": {"name": WEATHER["name"],
            "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = litellm_call(messages=msgs, tools=[tool],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    check(calls and calls[0].function.name == "get_weather", f"{r.choices[0].message}")
    msgs.append(r.choices[0].message.model_dump())
    msgs.append({"role": "tool", "tool_call_id": calls[0].id, "content": get_weather("Paris")})
    final = litellm_call(messages=msgs, tools=[tool])
    check(final.choices[0].message is not None, "no final")


if __name__ == "__main__":
    sys.exit(run_flows())
