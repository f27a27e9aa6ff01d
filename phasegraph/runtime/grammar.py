"""Structured output: a request's JSON schema, regex or EBNF grammar, through xgrammar.

xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models", 2024) is imported lazily, so the engine runs without the ``grammar`` extra
until a request asks for a grammar.
"""

from __future__ import annotations

import json

from phasegraph.runtime.errors import InvalidRequest

# the kinds a request may give, at most one per request
GRAMMAR_KINDS = ("json_schema", "regex", "grammar")


class InvalidGrammar(InvalidRequest):
    """A request's JSON schema, regex or grammar does not compile. Nothing was queued."""


def canonical_json_schema(schema: object) -> str:
    """``schema`` (a dict, or its JSON text) as JSON text, so the params stay hashable."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidGrammar(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidGrammar(f"json_schema must be a JSON object (a dict or its text); got {type(schema).__name__}")
    return json.dumps(schema, sort_keys=True)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest(
            "structured output (json_schema, regex, grammar) needs the grammar extra: pip install 'phasegraph[grammar]'"
        ) from None
    return xgrammar


def compile_grammar(kind: str, spec: str):
    """The tokenizer-free ``xgrammar.Grammar`` of ``spec``; a spec that does not parse raises
    ``InvalidGrammar`` naming the kind and the engine's reason."""
    xgr = _xgrammar()
    build = {
        "json_schema": lambda s: xgr.Grammar.from_json_schema(s),
        "regex": xgr.Grammar.from_regex,
        "grammar": lambda s: xgr.Grammar.from_ebnf(s, root_rule_name="root"),
    }[kind]
    try:
        return build(spec)
    except (RuntimeError, ValueError) as e:
        # xgrammar prefixes its C++ source location; the reason follows the last "] ... : "
        reason = str(e).strip().splitlines()[0].split("] ", 1)[-1]
        raise InvalidGrammar(f"{kind} does not compile: {reason}") from None
