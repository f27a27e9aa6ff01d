"""SamplingParams' structured-output fields: a spec that does not compile is refused by name at
construction, before any request is queued (issue 61, part 3)."""

import json

import pytest

pytest.importorskip("xgrammar")

from phasegraph import SamplingParams  # noqa: E402
from phasegraph.runtime.errors import InvalidRequest  # noqa: E402
from phasegraph.runtime.grammar import InvalidGrammar  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_schema_is_kept_as_canonical_json_text():
    a = SamplingParams(json_schema=SCHEMA)
    b = SamplingParams(json_schema=json.dumps(SCHEMA, indent=2))
    assert a.json_schema == b.json_schema and json.loads(a.json_schema) == SCHEMA
    assert a == b and hash(a) == hash(b)
    assert a.structured_output == ("json_schema", a.json_schema)
    assert SamplingParams().structured_output is None
    assert SamplingParams(regex="[0-9]+").structured_output == ("regex", "[0-9]+")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json_schema": {"type": "objekt"}}, "json_schema does not compile: .*objekt"),
        ({"json_schema": "{nope"}, "json_schema is not valid JSON"),
        ({"json_schema": [1, 2]}, "json_schema must be a JSON object"),
        ({"regex": "a(b"}, "regex does not compile: .*parenthesis"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"grammar": "root ::= foo"}, "grammar does not compile: .*foo"),
        ({"regex": "a", "json_schema": SCHEMA}, "at most one of json_schema, regex and grammar; got json_schema, regex"),
    ],
)
def test_bad_specs_raise_invalid_grammar(kwargs, message):
    with pytest.raises(InvalidGrammar, match=message) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, InvalidRequest)  # the engine's and the server's handling of bad requests applies


def test_engine_runs_a_grammar_request_beside_a_free_one():
    from phasegraph import Engine
    from phasegraph.demo import demo_pair_dir

    engine = Engine.from_pretrained(demo_pair_dir() / "target")
    engine.add_request("ok", "def f():", SamplingParams(max_new_tokens=4))
    engine.add_request("json", "{", SamplingParams(max_new_tokens=32, json_schema=SCHEMA))
    done, text = {}, {"ok": "", "json": ""}
    while engine.has_unfinished():
        for d in engine.step():
            text[d.request_id] += d.new_text
            if d.finish_reason is not None:
                done[d.request_id] = d.finish_reason
    assert done == {"ok": "length", "json": "stop"}, text
    assert isinstance(json.loads(text["json"])["n"], int)  # complete, and what the schema says


def test_an_engine_that_cannot_end_or_read_a_grammar_refuses_it_by_name():
    from phasegraph import Engine
    from phasegraph.demo import demo_pair_dir
    from tests.phases.lossless_support import tiny_target

    bare = Engine(tiny_target(), max_batch_size=2, kv_pool_tokens=1024)  # no tokenizer
    with pytest.raises(InvalidRequest, match="needs the target's tokenizer"):
        bare.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=4, regex="[0-9]+"))
    no_eos = Engine.from_pretrained(demo_pair_dir() / "target", eos_token_ids=())
    with pytest.raises(InvalidRequest, match="end-of-sequence token"):
        no_eos.add_request("b", "x", SamplingParams(max_new_tokens=4, regex="[0-9]+"))
    assert not bare.has_unfinished() and not no_eos.has_unfinished()
    simulated = Engine.from_pretrained(demo_pair_dir() / "target", demo_pair_dir() / "eagle3", simulate_accept_length=3)
    with pytest.raises(InvalidRequest, match="simulate_accept_length"):
        simulated.add_request("c", "x", SamplingParams(max_new_tokens=4, regex="[0-9]+"))
