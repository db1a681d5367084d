"""Flows of langchain-openai: chat and Responses, tools, structured output."""


from common import BASE, CITY_JSON, City, KEY, MAXTOK, MODEL, check, flow, get_weather, need, run_async  # noqa: E501


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


def lc_tool_loop_on(**kw):
    """A forced call, its result sent back as a ToolMessage, and the model's answer."""
    need("langchain_core")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather_lc(city: str) -> str:
        """Get the weather in a city."""
        return get_weather(city)

    llm = lc(**kw).bind_tools([get_weather_lc], tool_choice="get_weather_lc")
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = llm.invoke(msgs)
    check(ai.tool_calls, "no tool call")
    msgs.append(ai)
    for tc in ai.tool_calls:
        msgs.append(ToolMessage(get_weather_lc.invoke(tc["args"]), tool_call_id=tc["id"]))
    final = lc(**kw).bind_tools([get_weather_lc]).invoke(msgs)
    check(final is not None, "no final")


@flow("langchain-openai")
def lc_tool_loop():
    lc_tool_loop_on()


def lc_structured(method, **kw):
    r = lc(**kw).with_structured_output(City, method=method).invoke(CITY_JSON)
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
    lc_tool_loop_on(use_responses_api=True)
