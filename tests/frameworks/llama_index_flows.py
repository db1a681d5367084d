"""Flows of llama-index: OpenAILike."""


from common import BASE, City, KEY, MAXTOK, MODEL, check, flow, get_weather, need, run_async


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
