"""The blocking face: turns streamed and whole, the cache's reuse, forks, errors."""

import pytest

import pensieve

QUESTIONS = ["What is the capital of France?", "And of Spain?", "Which one is larger?"]


def test_a_multi_turn_chat_reuses_its_history_and_answers_as_stateless_does(engine):
    chat = engine.open(system="Be brief.")
    replies = [chat.ask(q, max_tokens=24) for q in QUESTIONS]
    for earlier, later in zip(replies, replies[1:]):
        # The later turn's history (the earlier prompt and reply) comes from the cache; only
        # its own tokens are computed.
        # (The last token generated has no KV yet: the next turn computes it.)
        assert later.stats.reused_tokens >= earlier.stats.prompt_tokens + earlier.stats.output_tokens - 1
        assert later.stats.prefilled_tokens <= later.stats.prompt_tokens + 1
    # The core property: keeping the KV changes nothing of what the model says.
    with pensieve.Engine(mode="stateless") as stateless:
        again = stateless.open(system="Be brief.")
        expected = [again.ask(q, max_tokens=24) for q in QUESTIONS]
        assert all(r.stats.reused_tokens == 0 for r in expected)
    assert [r.tokens for r in replies] == [r.tokens for r in expected]
    assert [m["role"] for m in chat.messages()] == ["system"] + ["user", "assistant"] * 3
    assert chat.messages()[-1]["content"] == replies[-1].text


@pytest.mark.parametrize("kv", ["q8", "q4"])
def test_kv_in_8_and_4_bits_is_an_option_and_keeps_the_core_property(kv):
    # The engine's options are pensieve-server's flags: `kv="q8"` is `--kv q8`.
    runs = []
    for mode in ("tiered", "stateless"):
        with pensieve.Engine(kv=kv, mode=mode) as e:
            chat = e.open(system="Be brief.")
            runs.append([chat.ask(q, max_tokens=12).tokens for q in QUESTIONS])
    assert runs[0] == runs[1]


def test_a_streamed_turn_gives_its_text_in_pieces_then_how_it_ended(engine):
    chat = engine.open()
    stream = chat.send("Name three colors.", max_tokens=12)
    assert stream.finish_reason is None
    pieces = list(stream)
    assert len(pieces) == len(stream.tokens) > 1
    assert "".join(pieces) == stream.text
    assert stream.finish_reason in ("stop", "length")
    assert stream.stats.output_tokens == len(stream.tokens)
    assert stream.message == {"role": "assistant", "content": stream.text}
    # A stream read to its end reads as ended.
    assert list(stream) == []


def test_sampling_parameters_reach_the_engine(engine):
    chat = engine.open()
    assert chat.ask("Count from one to twenty.", max_tokens=5, ignore_eos=True).stats.output_tokens == 5
    stopped = engine.open().ask("Count from one to twenty.", max_tokens=40, stop=[","])
    assert stopped.finish_reason == "stop_string" and "," not in stopped.text
    seeded = [
        engine.open().ask("Tell me a word.", temperature=1.0, top_p=0.9, seed=7, max_tokens=8).text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_a_fork_shares_the_history_and_continues_apart(engine):
    chat = engine.open(system="Be brief.")
    chat.ask(QUESTIONS[0], max_tokens=24)
    fork = chat.fork()
    assert fork.id != chat.id and fork.messages() == chat.messages()
    a, b = chat.ask(QUESTIONS[1], max_tokens=24), fork.ask(QUESTIONS[1], max_tokens=24)
    assert a.tokens == b.tokens
    assert b.stats.reused_tokens > 0
    assert len(chat.messages()) == len(fork.messages()) == 5


def test_a_cancelled_turn_leaves_the_conversation_as_it_was(engine):
    chat = engine.open()
    chat.ask("Hi!", max_tokens=8)
    before = chat.messages()
    stream = chat.send("Write a long story about a dragon.", max_tokens=200, ignore_eos=True)
    first = [next(stream) for _ in range(3)]
    stream.cancel()
    assert stream.finish_reason == "cancelled"
    assert stream.text.startswith("".join(first)) and len(stream.tokens) < 200
    assert chat.messages() == before
    # The conversation serves the next turn.
    assert chat.ask("Hi again!", max_tokens=8).stats.reused_tokens > 0


def test_a_stream_dropped_unread_cancels_its_turn(engine):
    chat = engine.open()
    stream = chat.send("Write a long story about a dragon.", max_tokens=200, ignore_eos=True)
    next(stream)
    del stream
    # The conversation is free again once the cancel lands: a turn is taken.
    assert chat.ask("Hi!", max_tokens=4).finish_reason in ("stop", "length")


def test_bad_input_raises_the_exception_of_its_kind_and_the_engine_serves_on(engine, tmp_path):
    chat = engine.open()
    with pytest.raises(pensieve.InvalidInputError, match="temperature") as e:
        chat.ask("Hi", temperature=-1)
    assert e.value.kind == "invalid_input" and isinstance(e.value, pensieve.PensieveError)
    with pytest.raises(TypeError, match="tempreature"):
        chat.ask("Hi", tempreature=1)
    with pytest.raises(TypeError, match="a str"):
        chat.ask(42)
    with pytest.raises(pensieve.InvalidInputError, match="messages"):
        chat.ask([{"content": "no role"}])
    with pytest.raises(pensieve.NotFoundError) as e:
        engine.resume("no such conversation")
    assert e.value.kind == "not_found"
    stream = chat.send("Write a long story.", max_tokens=50, ignore_eos=True)
    with pytest.raises(pensieve.ConflictError):
        chat.ask("Hi")  # a turn is running
    stream.cancel()
    closed = engine.open()
    closed.close()
    with pytest.raises(pensieve.NotFoundError):
        closed.ask("Hi")
    with pytest.raises(pensieve.InvalidInputError, match="--modle"):
        pensieve.Engine(modle="x")
    with pytest.raises(pensieve.IoError, match="/no/such/model.gguf"):
        pensieve.Engine(model="/no/such/model.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(pensieve.ModelError) as e:
        pensieve.Engine(model=str(corrupt))
    assert e.value.kind == "model"
    # Nothing of the above harmed the conversation or the engine.
    assert chat.ask("Hi", max_tokens=4).text
    assert engine.stats().turns_finished > 0


def test_wait_reads_the_rest_or_times_out_leaving_the_turn_running(engine):
    stream = engine.open().send("Write a long story.", max_tokens=120, ignore_eos=True)
    with pytest.raises(TimeoutError):
        stream.wait(timeout=0.01)
    assert stream.finish_reason is None
    text = stream.wait()
    assert text == stream.text and stream.finish_reason == "length"
    assert len(stream.tokens) == 120


def test_token_ids_are_a_raw_prompt_a_base_model_continues(engine):
    ids = engine.tokenize("The capital of France is")
    assert engine.detokenize(ids).endswith("The capital of France is")
    plain = engine.tokenize("The capital of France is", add_special=False)
    # The same text's tokens, after the begin token where the vocabulary asks for one.
    assert ids[len(ids) - len(plain):] == plain
    chat = engine.open()
    reply = chat.ask(ids, max_tokens=4)
    assert reply.stats.prompt_tokens == len(ids) and reply.stats.output_tokens == 4
    assert chat.tokens()[: len(ids)] == ids
