"""Flows of openai-agents: Responses and chat models, tools, output types, sessions."""


from common import (BASE, City, KEY, MAXTOK, MODEL, Skip, check, flow, get_weather, need,
                    run_async)


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


def need_attr(module, name):
    """Skips a flow where the installed version has no `name` yet (older releases)."""
    need(module)
    if not hasattr(__import__(module), name):
        raise Skip(f"{module} has no {name}")


@flow("openai-agents")
def agents_websocket_session_tool_loop():
    need_attr("agents", "responses_websocket_session")
    from agents import ModelSettings, responses_websocket_session

    async def go():
        _, a = agent(tools=[agents_tool()], model_settings=ModelSettings(tool_choice="required"))
        # A model by name: the session's provider makes it a Responses model over one socket
        # (the SDK's WebSocket mode), for both runs.
        a.model = MODEL
        async with responses_websocket_session(base_url=BASE, api_key=KEY) as ws:
            r = await ws.run(a, "What is the weather in Paris?")
            check(any(i.type == "tool_call_output_item" for i in r.new_items), "tool not run")
            r2 = await ws.run(a, "And in Rome?", previous_response_id=r.last_response_id)
            check(r2.final_output is not None, "no output")
    run_async(go())


@flow("openai-agents")
def agents_compaction_session():
    need_attr("agents", "OpenAIResponsesCompactionSession")
    from agents import OpenAIResponsesCompactionSession, Runner, SQLiteSession

    async def go():
        client, a = agent()
        s = OpenAIResponsesCompactionSession(
            "compaction", SQLiteSession("compaction"), client=client,
            should_trigger_compaction=lambda ctx: True)
        # The session accepts OpenAI's model names only; this server serves MODEL.
        s.model = MODEL
        await Runner.run(a, "My name is Ada.", session=s)
        items = await s.get_items()
        check(any(i.get("type") == "compaction" for i in items), f"not compacted: {items}")
        r = await Runner.run(a, "What is my name?", session=s)
        check(r.final_output is not None, "no output")
    run_async(go())
