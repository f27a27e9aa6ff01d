"""``phasegraph serve``: the real command in a subprocess (the demo pair, a chat template from a
file), answering the official client as the offline engine does and stopping cleanly on
Ctrl-C; its option errors as one line and exit status 2, before any model loads."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from phasegraph.cli import main
from phasegraph.demo import demo_pair_dir
from tests.serving.support import CHAT_TEMPLATE, PROMPTS, chat_ids, greedy

START_S = 120  # importing torch and loading the pair, on a busy 2-core CI machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("engine_process", [False, True])
def test_serve_answers_like_the_engine_and_stops_on_ctrl_c(engine, tmp_path, engine_process):
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    pair, port = demo_pair_dir(), _free_port()
    cmd = [sys.executable, "-m", "phasegraph.cli", "serve", "--target", str(pair / "target"),
           "--draft", str(pair / "eagle3"), "--method", "eagle3", "--num-steps", "3", "--topk", "1",
           "--device", "cpu", "--dtype", "float32", "--kv-pool-tokens", "8192", "--port", str(port),
           "--model-name", "demo", "--chat-template", str(template), "--max-queue", "8", "--log-level", "warning",
           "--engine-process" if engine_process else "--no-engine-process"]
    # the engine-process variant needs an API key, given by the environment
    key = {"PHASEGRAPH_API_KEY": "k3y"} if engine_process else {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **key})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=key.get("PHASEGRAPH_API_KEY", "unused"), max_retries=0,
                            timeout=60)
        if key:
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer unused"}).status_code == 401
        messages = [{"role": "user", "content": "Sort a list."}]
        want_chat = engine.generate([chat_ids(engine, messages)], greedy(10))[0]
        want = engine.generate([PROMPTS[0]], greedy(10))[0]
        chat = api.chat.completions.create(model="demo", messages=messages, max_tokens=10, temperature=0)
        assert chat.choices[0].message.content == want_chat.text
        text = "".join(c.choices[0].text for c in api.completions.create(
            model="demo", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True))
        assert text == want.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "serving 'demo' with eagle3 drafts on http://127.0.0.1:" in err
    assert ("API key required" in err) == engine_process
    assert "Traceback" not in err
    where = re.search(r"the engine (in this process|in engine process (\d+))", err)
    assert where and bool(where.group(2)) == engine_process, err
    if engine_process:  # Ctrl-C stopped the engine process too
        with pytest.raises(ProcessLookupError):
            os.kill(int(where.group(2)), 0)


@pytest.mark.parametrize(("extra", "words"), [
    (["--port", "0"], "--port must be in [1, 65535]"),
    (["--max-queue", "0"], "--max-queue must be at least 1"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
    (["--chat-template", ""], "--chat-template needs a file name"),
    (["--method", "none", "--topk", "2"], "--topk was given with --method none"),
    (["--method", "eagle3"], "--method eagle3 needs --draft DIR"),
    (["--host", "no.such.host.invalid"], "--host no.such.host.invalid"),
    (["--api-key", " key"], "--api-key (or PHASEGRAPH_API_KEY) must be non-empty"),
])
def test_serve_option_errors_are_one_line_before_any_load(capsys, extra, words):
    target = str(demo_pair_dir() / "target")
    assert main(["serve", "--target", target, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phasegraph: error:") and err.count("\n") == 1 and words in err, err


def test_serve_on_a_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--target", str(demo_pair_dir() / "target"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_serve_names_the_extra_it_needs(capsys, monkeypatch):
    import phasegraph.cli.serve as serve

    monkeypatch.setattr(serve, "_importable", lambda name: name != "uvicorn")
    assert main(["serve", "--target", str(demo_pair_dir() / "target")]) == 2
    err = capsys.readouterr().err
    assert "needs uvicorn" in err and "phasegraph[serve]" in err
