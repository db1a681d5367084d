"""Flows of instructor: every mode."""


from common import BASE, City, HELD, KEY, MAXTOK, MODEL, check, flow, need, run_async


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
    if mode_name in HELD:
        kw["extra_body"] = HELD[mode_name]
    r = c.create(model=MODEL, response_model=City, max_retries=1,
                 messages=[{"role": "user", "content": "Capital of France?"}], **kw)
    check(isinstance(r, City), repr(r))


for _m in ["TOOLS", "TOOLS_STRICT", "PARALLEL_TOOLS", "JSON", "JSON_SCHEMA", "MD_JSON", "JSON_O1",
           "RESPONSES_TOOLS"]:
    def _f(m=_m):
        if m == "PARALLEL_TOOLS":
            need("instructor")
            from typing import Iterable
            # The mode offers the tools with `auto`: the call is forced here, as a tiny model
            # answers in text otherwise.
            r = instr(m).create(model=MODEL, response_model=Iterable[City], max_retries=1, max_tokens=MAXTOK,
                                temperature=0, messages=[{"role": "user", "content": "Capitals of France?"}],
                                extra_body={"tool_choice": "required"})
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
        extra_body={"guided_json": {"type": "object", "required": ["tasks"], "properties": {
            "tasks": {"type": "array", "items": City.model_json_schema(), "maxItems": 1}}}},
        messages=[{"role": "user", "content": "Capitals of France?"}]))
    check(items is not None, "none")
