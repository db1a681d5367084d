"""Flows of pydantic-ai: tool, native and prompted output, chat and Responses."""


from common import BASE, CITY_JSON, City, HELD, KEY, MAXTOK, MODEL, check, flow, get_weather, need, run_async  # noqa: E501


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
    r = pai_agent(output_type=PromptedOutput(City),
                  settings={"extra_body": HELD["JSON"]}).run_sync(CITY_JSON)
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
    r = pai_agent(responses=True, output_type=PromptedOutput(City),
                  settings={"extra_body": HELD["JSON"]}).run_sync(CITY_JSON)
    check(isinstance(r.output, City), repr(r.output))
