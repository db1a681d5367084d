"""The OpenAI-compatible server started from Python (``python -m pensieve.server``), asked
over HTTP, and stopped by SIGTERM."""

import json
import signal
import subprocess
import sys
import urllib.request


def post(address, path, body):
    request = urllib.request.Request(
        address + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_the_server_runs_from_python_serves_chat_and_stops_on_sigterm():
    server = subprocess.Popen(
        [sys.executable, "-m", "pensieve.server", "--port", "0", "--served-model-name", "m"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("listening on "), line + server.stderr.read()
        address = line.split()[-1]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        first = post(address, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 16})
        reply = first["choices"][0]["message"]
        messages += [reply, {"role": "user", "content": "And of Spain?"}]
        second = post(address, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 16})
        # The resent history was the conversation the server kept.
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code == 0


def test_a_refused_command_line_exits_2_with_the_message():
    done = subprocess.run(
        [sys.executable, "-m", "pensieve.server", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--no-such-flag" in done.stderr
