"""Flows of smolagents: OpenAIServerModel and its agents."""


from common import BASE, City, KEY, MAXTOK, MODEL, check, flow, get_weather, need


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


def smol_agent_run(**kw):
    """A ToolCallingAgent with one tool, run on a question the tool answers."""
    from smolagents import ToolCallingAgent, tool

    @tool
    def get_weather_smol(city: str) -> str:
        """Get the weather in a city.

        Args:
            city: the city.
        """
        return get_weather(city)

    a = ToolCallingAgent(tools=[get_weather_smol], model=smol_model(), max_steps=3, verbosity_level=0, **kw)
    out = a.run("What is the weather in Paris?")
    check(out is not None, "no answer")


@flow("smolagents")
def smol_tool_calling_agent():
    smol_agent_run()


@flow("smolagents")
def smol_tool_calling_agent_stream():
    smol_agent_run(stream_outputs=True)


@flow("smolagents")
def smol_model_response_format():
    from smolagents.models import ChatMessage, MessageRole
    m = smol_model()
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "strict": True,
                                                  "schema": City.model_json_schema()}}
    r = m.generate([ChatMessage(role=MessageRole.USER, content=[{"type": "text", "text": "Capital?"}])],
                   response_format=fmt)
    City.model_validate_json(r.content)
