"""``phasegraph generate`` as a new user meets it: its help, prompts from files, stdin and
batches, the method a draft directory names, ``--threads``, messages that name its flags, and
Ctrl-C, which keeps the text generated so far (a real process, a real SIGINT)."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from phasegraph.cli import build_parser, main
from phasegraph.cli.generate import FLAG_OF_PARAMETER
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from tests.engine.support import arch_bundle, text_bundle

PROMPT = "def fib(n):"


def _generate_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["generate"]


def test_every_generate_option_has_help_and_says_its_default(capsys):
    no_default = {"help", "prompt", "prompt_file", "prompt_ids"}  # required, or the prompt itself
    for action in _generate_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        if action.dest not in no_default:
            assert "default" in action.help, f"{action.option_strings}: {action.help}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("--max-new-tokens N new tokens per prompt at most (default: 64)",
                  "--page-size P KV cache tokens per page (default: 1)", "(default: 1.0, all)",
                  "--top-k K sample from the K likeliest tokens (default: 0, off)", "--seed S",
                  "(default: the kind of draft --draft holds, else none)", "--threads N", "--prompt-file FILE"):
        assert shown in text, shown


def _baseline(target, prompts, max_new_tokens=8):
    return Engine.from_pretrained(target).generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))


def test_a_batch_of_prompts_prints_each_completion_in_order(engine_root, capsys):
    target, _, _ = text_bundle(engine_root)
    prompts = [PROMPT, "the quick brown", "class Stack:"]
    argv = ["generate", "--target", str(target), "--max-new-tokens", "8"]
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    want = _baseline(target, prompts)
    assert out == "".join(f"--- completion {i} of 3 ---\n{w.text}\n" for i, w in enumerate(want, 1))
    lines = err.splitlines()
    for i, w in enumerate(want, 1):
        assert f"completion {i}: mean acceptance length: n/a (method none); {len(w.token_ids)} tokens, " \
               f"finish reason: {w.finish_reason}" in lines
    assert lines[-1].startswith(f"[none] 3 prompts: {sum(len(w.token_ids) for w in want)} tokens in ")


def test_a_prompt_from_a_file_or_stdin_is_taken_exactly(engine_root, tmp_path, monkeypatch, capsys):
    target, _, _ = text_bundle(engine_root)
    text = "def fib(n):\n    if n < 2:\n"  # its final newline is part of the prompt
    (want,) = _baseline(target, [text])
    assert want.text != _baseline(target, [text.rstrip()])[0].text  # so the test can tell
    path = tmp_path / "prompt.py"
    path.write_text(text)
    assert main(["generate", "--target", str(target), "--prompt-file", str(path), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["generate", "--target", str(target), "--prompt", "-", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
    assert main(["generate", "--target", str(target), "--prompt-file", str(path), "--prompt-file", str(path),
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == f"--- completion 1 of 2 ---\n{want.text}\n--- completion 2 of 2 ---\n{want.text}\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-file", "{missing}"], "--prompt-file {missing}: no such file"),
    (["--prompt-file", "{empty}"], "--prompt-file {empty} is empty"),
    (["--prompt-file", "{tmp}"], "--prompt-file {tmp}: is a directory, not a file"),
    (["--prompt-file", "{latin1}"], "--prompt-file {latin1}: is not UTF-8 text"),
    (["--prompt-file", ""], "--prompt-file needs a file name, got an empty one"),
    (["--prompt", "-", "--prompt", "-"], "--prompt - reads stdin, which holds one prompt: give it once"),
    (["--prompt", "-"], "--prompt - read an empty prompt from stdin"),
])
def test_a_prompt_that_cannot_be_read_is_one_line_exit_2(engine_root, tmp_path, monkeypatch, capsys, args, message):
    target, _, _ = text_bundle(engine_root)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    subs = {"{missing}": str(tmp_path / "missing.txt"), "{empty}": str(tmp_path / "empty.txt"),
            "{tmp}": str(tmp_path), "{latin1}": str(tmp_path / "latin1.txt")}
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    argv = ["generate", "--target", str(target), *(subs.get(a, a) for a in args)]
    assert main(argv) == 2
    for key, value in subs.items():
        message = message.replace(key, value)
    assert capsys.readouterr().err == f"phasegraph: error: {message}\n"


def test_prompt_options_of_two_kinds_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--target", "x", "--prompt", "a", "--prompt-file", "f"])
    assert info.value.code == 2
    assert "argument --prompt-file: not allowed with argument --prompt" in capsys.readouterr().err


def test_a_draft_directory_selects_its_method(engine_root, capsys):
    target, drafts, _ = text_bundle(engine_root)
    assert main(["generate", "--target", str(target), "--draft", str(drafts["eagle3"]), "--prompt", PROMPT,
                 "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    want = Engine.from_pretrained(target, drafts["eagle3"], spec=SpecConfig(method="eagle3")).generate(
        PROMPT, SamplingParams(max_new_tokens=12))[0]
    assert out == want.text + "\n"
    assert err.splitlines()[-1].startswith(f"[eagle3] mean acceptance length: {want.stats.mean_accept_length:.2f}")

    bundle = arch_bundle(engine_root, "qwen3")
    assert main(["generate", "--target", str(bundle.target), "--draft", str(bundle.drafts["mtp"]),
                 "--prompt-ids", ",".join(map(str, bundle.prompts[1])), "--max-new-tokens", "27", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(t) for t in bundle.reference[1]]
    assert err.splitlines()[-1].startswith("[mtp] mean acceptance length: ")  # after transformers' loading bar


def test_without_target_the_embedded_pair_runs_speculatively_or_its_target_alone(capsys):
    from phasegraph.demo import demo_pair_dir

    pair = demo_pair_dir()
    argv = ["generate", "--prompt", PROMPT, "--max-new-tokens", "16", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    want = Engine.from_pretrained(pair / "target", device="cpu").generate(PROMPT, SamplingParams(max_new_tokens=16))[0]
    assert out == want.text + "\n"  # speculation is lossless
    assert err.splitlines()[-1].startswith("[eagle3] mean acceptance length: ")
    assert main([*argv, "--method", "none"]) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n"
    assert err.splitlines()[-1].startswith("[none] mean acceptance length: n/a")


def test_a_draft_directory_of_no_known_kind_asks_for_method(engine_root, tmp_path, capsys):
    from safetensors.torch import save_file

    target, _, _ = text_bundle(engine_root)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 32}))
    save_file({"weird.weight": torch.zeros(2, 2)}, str(odd / "model.safetensors"))
    assert main(["generate", "--target", str(target), "--draft", str(odd), "--prompt", PROMPT]) == 2
    assert capsys.readouterr().err == (
        f"phasegraph: error: cannot tell which kind of draft --draft {odd} holds (its config and tensor names "
        "fit none of eagle, eagle3, mtp, standalone): pass --method\n")


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_default_to_the_engines_one_and_threads_sets_them(engine_root, torch_threads, capsys):
    target, _, _ = text_bundle(engine_root)
    torch.set_num_threads(2)
    argv = ["generate", "--target", str(target), "--prompt", PROMPT, "--max-new-tokens", "2", "--device", "cpu"]
    assert main(argv) == 0
    assert torch.get_num_threads() == 1  # EngineConfig's default on a CPU
    assert main([*argv, "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    capsys.readouterr()
    assert main([*argv, "--threads", "0"]) == 2
    assert capsys.readouterr().err == "phasegraph: error: --threads must be at least 1, got 0\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--top-k", "-1"], "--top-k must be an integer in [0, 2**63) (0 = off); got -1"),
    (["--seed", str(2**70)], "--seed must be a 64-bit integer"),
    (["--kv-pool-tokens", "0"], "--kv-pool-tokens must be an integer in [1, 2147483647]; got 0"),
    (["--draft", "{draft}", "--topk", "1", "--num-steps", "3", "--num-draft-tokens", "9"],
     "--num-draft-tokens must be in [2, 4] for --topk=1, --num-steps=3 (root + at most 3 drafted candidates), got 9"),
    (["--draft", "{draft}", "--num-steps", "99"], "--num-steps must be an integer in [1, 64]; got 99"),
    (["--dtype", "float8"], "--dtype must be one of"),
    (["--draft", "{draft}", "--draft-dtype", "int8"], "--draft-dtype must be one of"),
    (["--max-new-tokens", "5000", "--kv-pool-tokens", "64"], "raise --kv-pool-tokens or lower --max-new-tokens"),
])
def test_messages_name_the_flags_not_the_librarys_parameters(engine_root, capsys, args, message):
    target, drafts, _ = text_bundle(engine_root)
    argv = ["generate", "--target", str(target), "--prompt", PROMPT, "--no-progress"]
    argv += [str(drafts["eagle3"]) if a == "{draft}" else a for a in args]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("phasegraph: error: ") and err.count("\n") == 1, err
    assert message in err, err
    for name in ("SpecConfig", "None", *(n for n in FLAG_OF_PARAMETER if "_" in n)):
        assert name not in err, err


CTRL_C_PROMPT = "import os\n\n\ndef walk(top):\n"


def _read_until(stream, marker: bytes, timeout_s: float) -> bytes:
    """What ``stream`` (a pipe) gave until ``marker`` appeared in it."""
    seen = b""
    deadline = time.monotonic() + timeout_s
    while marker not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} within {timeout_s} s: {seen[-2000:]!r}"
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, f"the stream closed before {marker!r}: {seen[-2000:]!r}"
            seen += chunk
    return seen


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_prints_what_was_generated_and_exits_130():
    """Ctrl-C at 784 of 900 tokens printed nothing but ``phasegraph: interrupted``. Now the run
    stops between two steps: every token generated is printed, and the summary counts them."""
    from phasegraph.demo import demo_pair_dir

    pair = demo_pair_dir()
    argv = [sys.executable, "-m", "phasegraph.cli", "generate", "--target", str(pair / "target"),
            "--draft", str(pair / "eagle3"), "--prompt", CTRL_C_PROMPT, "--max-new-tokens", "1000",
            "--ignore-eos", "--device", "cpu"]
    # as from a terminal: a suite started as a background job passes SIGINT on ignored, and the
    # CLI rightly keeps ignoring it there
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _read_until(proc.stderr, b"generating", timeout_s=120)  # the progress bar: the run has begun
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("[eagle3] mean acceptance length: "), err
    tokens = int(summary.rsplit("interrupted after ", 1)[1].split()[0])
    assert 0 < tokens < 1000
    # exactly the first `tokens` tokens of the same run left to go on
    want = Engine.from_pretrained(pair / "target", pair / "eagle3", device="cpu").generate(
        CTRL_C_PROMPT, SamplingParams(max_new_tokens=tokens, ignore_eos=True))[0]
    assert out.decode() == want.text + "\n"
    assert f"{tokens} tokens in " in summary
