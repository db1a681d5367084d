"""Conversations kept in a store outlive the process: a second process resumes one by name
and continues it from the stored KV."""

import json
import subprocess
import sys
import textwrap

import pensieve

RESUME = textwrap.dedent(
    """
    import json, sys
    import pensieve
    with pensieve.Engine(store=sys.argv[1]) as engine:
        stored = engine.stored_conversations()
        chat = engine.resume("trip")
        reply = chat.ask("And of Spain?", max_tokens=24)
        print(json.dumps({"stored": stored, "messages": chat.messages(),
                          "store_tokens": reply.stats.reused_from_store_tokens,
                          "tokens": reply.tokens}))
    """
)


def test_a_stored_conversation_is_resumed_by_a_second_process(tmp_path):
    store = tmp_path / "store"
    with pensieve.Engine(store=str(store)) as engine:
        chat = engine.open(system="Be brief.", name="trip")
        first = chat.ask("What is the capital of France?", max_tokens=24)
        second = chat.ask("What is it famous for?", max_tokens=48)
        history = len(chat.tokens())
        assert engine.stored_conversations() == ["trip"]
    done = subprocess.run(
        [sys.executable, "-c", RESUME, str(store)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    resumed = json.loads(done.stdout)
    assert resumed["stored"] == ["trip"]
    assert resumed["messages"][2] == {"role": "assistant", "content": first.text}
    assert resumed["messages"][4] == {"role": "assistant", "content": second.text}
    # The history came from the store, not recomputed: all of it but the last partial chunk
    # of 32 tokens, which the store does not keep.
    assert history > 64 and resumed["store_tokens"] >= history - 32
    # And the turn says what it would have said in one process without a store.
    with pensieve.Engine(mode="stateless") as stateless:
        again = stateless.open(system="Be brief.")
        again.ask("What is the capital of France?", max_tokens=24)
        again.ask("What is it famous for?", max_tokens=48)
        assert again.ask("And of Spain?", max_tokens=24).tokens == resumed["tokens"]
