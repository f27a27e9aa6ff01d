"""Structured output under speculation: the grammar's masks make the target's
constrained distribution, and speculation keeps it exactly.

- Greedy: the constrained tokens are identical under the target alone (decode), chains and
  trees of an EAGLE-3 head, the target as its own standalone draft and n-gram drafts, with CUDA
  graphs emulated too; regex and EBNF requests likewise.
- 200 sampled objects over 10 JSON schemas are complete (the grammar ended them) and valid
  (``jsonschema``).
- Free requests in a batch with grammar requests emit what they emit without them.
- Drafts are masked: no node verify may try holds a token the grammar forbids (EAGLE drafts
  are proposed among the allowed tokens, n-gram chains are cut before a forbidden one).
- Sampling stays lossless: 3000 seeded requests of a small regex, sampled under a tree and by
  the target alone (decode), share one distribution of outputs (two-sample chi-square p > 1e-4,
  total variation < 0.06, as tests/engine/test_sampling_distribution.py). Verify masks that
  ignore the drafted ancestry (every node masked as the root) fail it.
- SamplingParams' json_schema / regex / grammar: a spec that does not compile is refused by name
  at construction, before any request is queued; an engine that cannot end or read a grammar
  refuses the request by name.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from phasegraph.runtime.config import SamplingParams, SpecConfig  # noqa: E402
from phasegraph.runtime.engine import Engine  # noqa: E402
from phasegraph.runtime.errors import InvalidRequest, RequestFailed  # noqa: E402
from phasegraph.runtime.grammar import InvalidGrammar  # noqa: E402
from tests.engine.support import assert_all_free, text_bundle  # noqa: E402
from tests.engine.test_sampling_distribution import P_THRESHOLD, REQUESTS, two_sample_pvalue  # noqa: E402

PROMPTS = ["hello", "def f", "the quick", "for i in", "world. "]


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props),
            "additionalProperties": False}


SCHEMAS = [
    _obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"c": {"enum": ["red", "green", "blue"]}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "minItems": 1, "maxItems": 3},
    _obj({"s": {"type": "string", "pattern": "^[ab]{1,3}$"}}),
    _obj({"x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "boolean"}}),
    _obj({"k": {"const": "v"}}),
    _obj({"n": {"type": "null"}, "t": {"enum": [True, False]}}),
    _obj({"id": {"enum": ["a1", "b2"]}, "v": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}),
    _obj({"p": {"enum": [1, 2, 3]}, "q": {"enum": ["hi", "yo"]}}),
]

# (method, draft key in the bundle, topk, num_steps, num_draft_tokens)
SPECS = {
    "eagle3-chain": ("eagle3", "eagle3", 1, 3, 4),
    "eagle3-tree": ("eagle3", "eagle3", 2, 3, 6),
    "standalone-tree": ("standalone", "self", 2, 3, 6),
    "ngram-chain": ("ngram", None, 1, 3, 4),
}


def _engine(root, name: str = "none", **kw) -> Engine:
    target, drafts, _ = text_bundle(root)
    kw.setdefault("kv_pool_tokens", 8192)
    kw.setdefault("max_batch_size", 32)
    if name == "none":
        return Engine.from_pretrained(target, spec=SpecConfig(method="none"), dtype="float32", **kw)
    method, draft, topk, steps, nodes = SPECS[name]
    spec = SpecConfig(method=method, topk=topk, num_steps=steps, num_draft_tokens=nodes, adaptive=False)
    return Engine.from_pretrained(target, None if draft is None else drafts[draft], spec=spec, dtype="float32", **kw)


def _check_json(out, schema: dict) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)  # complete: the grammar ended it
    jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("structured")


@pytest.fixture(scope="module")
def greedy_reference(root):
    """The target alone (decode), greedy, constrained by SCHEMAS[i % 10] for prompt i."""
    engine = _engine(root)
    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]) for i in range(len(SCHEMAS))]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params)
    for out, schema in zip(outs, SCHEMAS, strict=True):
        _check_json(out, schema)
    assert_all_free(engine)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_output_is_the_target_alones(root, greedy_reference, name):
    engine = _engine(root, name, check_every_step=True)
    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]) for i in range(len(SCHEMAS))]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params)
    assert [o.token_ids for o in outs] == greedy_reference
    for out, schema in zip(outs, SCHEMAS, strict=True):
        _check_json(out, schema)
    assert_all_free(engine)


# the grammar calls a graph of each kind is cut at (decode alone asks before its forward only)
CUT_AT = {
    "none": {"next_token_bitmask"},
    "eagle3-chain": {"beam_bitmask", "tree_bitmask", "next_token_bitmask_after"},
    "eagle3-tree": {"beam_bitmask", "tree_bitmask", "next_token_bitmask_after"},
    "ngram-chain": {"tree_bitmask", "next_token_bitmask_after"},
}


@pytest.mark.parametrize(("name", "scope"), [("none", "iteration"), ("eagle3-chain", "iteration"),
                                             ("eagle3-tree", "iteration"), ("eagle3-tree", "phase"),
                                             ("ngram-chain", "iteration")])
def test_grammar_iterations_replay_emulated_graphs_cut_at_their_masks(root, greedy_reference, name, scope):
    from phasegraph.runtime.cuda_graphs import SegmentedGraph

    engine = _engine(root, name, cuda_graphs="emulate", graph_scope=scope)
    runner = engine.graph_runner
    free = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True))  # plain graphs
    captured = [c for p in runner.phases.values() for c in p.graphs.values()]
    if runner.iteration is not None:
        captured += list(runner.iteration.graphs.values())
    assert captured and not any(isinstance(c.graph, SegmentedGraph) for c in captured)
    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]) for i in range(len(SCHEMAS))]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params)
    assert [o.token_ids for o in outs] == greedy_reference
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True))] \
        == [o.token_ids for o in free]
    stats = runner.stats()
    assert not any(s.get("eager_reasons", {}).get("structured output") for s in stats.values()), stats
    graphed = [c for p in runner.phases.values() for c in p.graphs.values()]
    if runner.iteration is not None:
        graphed += list(runner.iteration.graphs.values())
    cut = [c.graph for c in graphed if isinstance(c.graph, SegmentedGraph)]
    assert cut, stats  # the grammar batches ran from graphs of their own
    assert {call.name for g in cut for call in g.calls} == CUT_AT[name]
    served = stats["decode"]["replays"] if name == "none" else (
        stats["iteration"]["replays"] if scope == "iteration" else stats["verify"]["replays"])
    assert served > len(outs)  # replayed, not only captured


def test_200_sampled_objects_over_10_schemas_are_complete_and_valid(root):
    engine = _engine(root, "eagle3-tree")
    prompts, params, schemas = [], [], []
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(max_new_tokens=48, temperature=1.0, seed=i, json_schema=schema))
        schemas.append(schema)
    outs = engine.generate(prompts, params)
    for out, schema in zip(outs, schemas, strict=True):
        _check_json(out, schema)
    assert len({o.text for o in outs}) > 30  # sampled: many distinct objects, not one per schema
    assert_all_free(engine)


@pytest.mark.parametrize(
    ("kind", "spec", "check"),
    [
        ("regex", "(ab|ac|b)c?", lambda t: re.fullmatch("(ab|ac|b)c?", t)),
        ("regex", "[0-9]{2,4}-[a-f]{1,3}", lambda t: re.fullmatch("[0-9]{2,4}-[a-f]{1,3}", t)),
        ("grammar", 'root ::= "yes" | "no" | "maybe " num\nnum ::= [0-9] | [0-9] num', lambda t: re.fullmatch("yes|no|maybe [0-9]+", t)),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_ebnf(root, kind, spec, check, temperature):
    params = [SamplingParams(max_new_tokens=24, temperature=temperature, seed=i, **{kind: spec}) for i in range(10)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(10)]
    alone = _engine(root).generate(prompts, params)
    speculated = _engine(root, "standalone-tree").generate(prompts, params)
    for out in (*alone, *speculated):
        assert out.finish_reason == "stop" and check(out.text), (out.finish_reason, out.text)
    if temperature == 0.0:
        assert [o.token_ids for o in speculated] == [o.token_ids for o in alone]


@pytest.mark.parametrize("name", ["none", "eagle3-tree", "ngram-chain"])
def test_free_requests_beside_grammar_requests_are_unchanged(root, name):
    free = [SamplingParams(max_new_tokens=20, ignore_eos=True),
            SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, ignore_eos=True)]
    alone = _engine(root, name).generate(PROMPTS[:2], free)
    engine = _engine(root, name)
    mixed = engine.generate(PROMPTS[:2] + PROMPTS[2:4],
                            free + [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[2]),
                                    SamplingParams(max_new_tokens=48, regex="(ab|ac|b)c?")])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    _check_json(mixed[2], SCHEMAS[2])
    assert mixed[3].finish_reason == "stop" and re.fullmatch("(ab|ac|b)c?", mixed[3].text)
    assert_all_free(engine)


def _tried_nodes(next_token: list[int], next_sibling: list[int]) -> list[int]:
    """The nodes verify may try: reached from the root through first-child and sibling links."""
    tried, stack = [], [0]
    while stack:
        c = next_token[stack.pop()]
        while c >= 0:
            tried.append(c)
            stack.append(c)
            c = next_sibling[c]
    return tried


def _refused_nodes(grammar, tree) -> int:
    """Nodes verify may try whose token the grammar forbids after their parent's path (the path
    accepted and not ended: the tokens after an end are cut by the stop anyway)."""
    B, N = tree.parents.shape
    tokens, par = tree.draft_tokens.view(B, N).tolist(), tree.parents.tolist()
    nxt, sib = tree.retrieve_next_token.tolist(), tree.retrieve_next_sibling.tolist()
    refused = 0
    for b, m in enumerate(grammar.matchers):
        if m is None:
            continue
        for j in _tried_nodes(nxt[b], sib[b]):
            path, p = [], par[b][j]
            while p > 0:
                path.append(tokens[b][p])
                p = par[b][p]
            taken = 0
            for t in reversed(path):
                if m.is_terminated() or not m.accept_token(t):
                    break
                taken += 1
            if taken == len(path) and not m.is_terminated():
                if m.accept_token(tokens[b][j]):
                    m.rollback(1)
                else:
                    refused += 1
            if taken:
                m.rollback(taken)
    return refused


@pytest.mark.parametrize("name", ["eagle3-chain", "eagle3-tree", "standalone-tree", "ngram-chain"])
def test_drafts_are_masked_so_verify_sees_no_forbidden_token(root, greedy_reference, monkeypatch, name):
    from phasegraph.drafters import ngram
    from phasegraph.phases import _common
    from phasegraph.runtime.scheduler import Scheduler

    refused, trees = [], []
    run = Scheduler._run

    def hooked(self, machine, phase, reqs, note="", **kw):  # every tree handed to verify
        out = run(self, machine, phase, reqs, note, **kw)
        if phase == "draft" and self.ctx.grammar is not None:
            refused.append(_refused_nodes(self.ctx.grammar, out))
            trees.append(out)
        return out

    monkeypatch.setattr(Scheduler, "_run", hooked)
    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]) for i in range(len(SCHEMAS))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    outs = _engine(root, name).generate(prompts, params)
    assert [o.token_ids for o in outs] == greedy_reference
    assert trees and all(t.token_bitmask is not None for t in trees)
    assert sum(refused) == 0, refused

    # the same run with the drafts unmasked: the check above is not vacuous
    refused.clear()
    monkeypatch.setattr(_common, "_grammar_masked_draft_logits", lambda model, logits, *a: logits)
    monkeypatch.setattr(ngram, "_cut_at_forbidden", lambda bitmask, tokens, parents, next_token: next_token)
    outs = _engine(root, name).generate(prompts, params)
    assert [o.token_ids for o in outs] == greedy_reference
    assert sum(refused) > 0


SAMPLED_REGEX = "(ab|ac|b)c?"


def _sampled_outputs(root, name: str) -> list:
    """The outputs of REQUESTS seeded requests of SAMPLED_REGEX at temperature 1 (failed ones
    included: a token the grammar refused is an outcome of its own in the distributions)."""
    from phasegraph.runtime.errors import RequestFailed

    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s, regex=SAMPLED_REGEX) for s in range(REQUESTS)]
    try:
        return _engine(root, name, max_batch_size=64).generate(["hello"] * REQUESTS, params)
    except RequestFailed as e:
        return e.outputs


def _outcome(out) -> tuple:
    return ("error",) if out.finish_reason == "error" else tuple(out.token_ids)


def _same_distribution(a: list, b: list) -> tuple[float, float]:
    """(two-sample chi-square p-value, total variation) of two samples of whole outputs."""
    import torch

    a, b = list(map(_outcome, a)), list(map(_outcome, b))
    bins = {seq: i for i, seq in enumerate(sorted(set(a) | set(b), key=str))}
    ia = torch.tensor([bins[s] for s in a])
    ib = torch.tensor([bins[s] for s in b])
    pa = torch.bincount(ia, minlength=len(bins)).double() / len(a)
    pb = torch.bincount(ib, minlength=len(bins)).double() / len(b)
    return two_sample_pvalue(ia, ib, len(bins)), float((pa - pb).abs().sum() / 2)


@pytest.fixture(scope="module")
def sampled_alone(root):
    outs = _sampled_outputs(root, "none")
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(SAMPLED_REGEX, out.text), (out.finish_reason, out.text)
    assert len({o.text for o in outs}) >= 4  # the grammar leaves the target several outputs
    return outs


def _check_sampled_tree(root, sampled_alone) -> None:
    tree = _sampled_outputs(root, "standalone-tree")
    assert [o.token_ids for o in tree] != [o.token_ids for o in sampled_alone]  # other coins: a real comparison
    p, tv = _same_distribution(sampled_alone, tree)
    assert p > P_THRESHOLD and tv < 0.06, (p, tv)
    for out in tree:
        assert out.finish_reason == "stop" and re.fullmatch(SAMPLED_REGEX, out.text), (out.finish_reason, out.text)


def test_sampled_constrained_outputs_have_the_target_alones_distribution(root, sampled_alone):
    _check_sampled_tree(root, sampled_alone)


def test_masks_that_ignore_the_drafted_ancestry_are_caught(root, sampled_alone, monkeypatch):
    """The planted mutant: every node of the tree masked by the grammar at the root, as if its
    drafted ancestors had not been emitted. The distribution check above fails on it."""
    from phasegraph.runtime.grammar import BatchGrammar

    def root_only(self, draft_tokens, parents):
        return self.next_token_bitmask().repeat_interleave(parents.shape[1], dim=0)  # [B*N, Vw]

    monkeypatch.setattr(BatchGrammar, "tree_bitmask", root_only)
    with pytest.raises(AssertionError, match=r"^\(") as caught:  # the (p, tv) assertion
        _check_sampled_tree(root, sampled_alone)
    p, tv = map(float, re.findall(r"[-+0-9.e]+", str(caught.value).splitlines()[0]))
    assert p < 1e-12 and tv > 0.1, (p, tv)


@pytest.mark.parametrize("name", ["none", "eagle3-tree"])
def test_overlap_retraction_and_strict_validation_keep_the_output(root, greedy_reference, name):
    """Overlap scheduling (a grammar batch is collected before the next iteration is issued),
    requests retracted mid-run (they resume with the matcher at their tokens) and strict phase
    validation (every schema and invariant, inputs never mutated) change no token."""
    engine = _engine(root, name, overlap=True, validate="strict")
    ids = [f"r{i}" for i in range(len(SCHEMAS))]
    for i, rid in enumerate(ids):
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]))
    tokens = {rid: [] for rid in ids}
    retracted = set()
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.new_token_ids
        steps += 1
        if steps in (3, 5):  # two requests out of the batch, and back
            for rid in ids[steps - 3 :: 4]:
                if engine.retract(rid):
                    retracted.add(rid)
    assert len(retracted) >= 2
    assert [tokens[rid] for rid in ids] == greedy_reference
    assert_all_free(engine)


def test_a_grammar_batch_split_in_two_groups_keeps_the_output(root, greedy_reference):
    """Adaptive speculation runs requests that do not speculate as a group of their own (decode)
    beside the others (chains): each group's masks are its own rows'."""
    from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape

    chain = SpecShape.chain(3)
    batches = (1, 2, 4, 8, 16)
    table = CostTable((OFF, chain), batches, [[0.01 + 0.1 * b for b in batches], [0.01 + 0.2 * b for b in batches]], 0.005)
    target, drafts, _ = text_bundle(root)
    spec = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4, adaptive=True)
    engine = Engine.from_pretrained(target, drafts["eagle3"], spec=spec, dtype="float32", kv_pool_tokens=8192,
                                    max_batch_size=16, spec_costs=table, trace=True, check_every_step=True)
    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i], speculate=i % 2 == 0) for i in range(len(SCHEMAS))]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params)
    assert [o.token_ids for o in outs] == greedy_reference
    assert engine.trace.notes("split"), "the batch never ran as two groups"
    assert_all_free(engine)


def test_grammar_masks_apply_after_bias_and_penalties(root):
    """A bias toward a token the grammar forbids moves nothing past the mask; penalties change
    the constrained choice the same way alone and under speculation."""
    _, _, tokenizer = text_bundle(root)
    brace = tokenizer.convert_tokens_to_ids("}")
    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i], repetition_penalty=1.5,
                             logit_bias={brace: 50.0, tokenizer.eos_token_id: 20.0}) for i in range(len(SCHEMAS))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    alone = _engine(root).generate(prompts, params)
    for out, schema in zip(alone, SCHEMAS, strict=True):
        _check_json(out, schema)
    for name in ("eagle3-tree", "ngram-chain"):
        assert [o.token_ids for o in _engine(root, name).generate(prompts, params)] == [o.token_ids for o in alone]


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
    from phasegraph.demo import demo_pair_dir
    from tests.phases.lossless_support import tiny_target

    bare = Engine(tiny_target(), max_batch_size=2, kv_pool_tokens=1024)  # no tokenizer
    with pytest.raises(InvalidRequest, match="needs the target's tokenizer"):
        bare.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=4, regex="[0-9]+"))
    no_eos = Engine.from_pretrained(demo_pair_dir() / "target", eos_token_ids=())
    with pytest.raises(InvalidRequest, match="end-of-sequence token"):
        no_eos.add_request("b", "x", SamplingParams(max_new_tokens=4, regex="[0-9]+"))
    assert not bare.has_unfinished() and not no_eos.has_unfinished()


@pytest.mark.parametrize("name", ["eagle3-chain", "eagle3-tree"])
def test_simulated_acceptance_takes_only_drafts_the_grammar_allows(root, monkeypatch, name):
    """Benchmark mode accepts drafts whatever they are, so a draft the grammar forbids (a draft
    row the grammar leaves nothing in keeps its logits) must end the accepted path: with the
    drafts unmasked every object is still complete and valid, and without the cut it is not."""
    from phasegraph.phases import _common, verify

    params = [SamplingParams(max_new_tokens=48, json_schema=SCHEMAS[i]) for i in range(len(SCHEMAS))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]

    def run():
        engine = _engine(root, name, simulate_accept_length=3)
        outs = engine.generate(prompts, params)
        assert_all_free(engine)
        return outs

    for out, schema in zip(run(), SCHEMAS, strict=True):
        _check_json(out, schema)
        assert max(out.stats.accept_lengths) == 3  # the simulated length, where the grammar let it
    monkeypatch.setattr(_common, "_grammar_masked_draft_logits", lambda model, logits, *a: logits)
    outs = run()
    for out, schema in zip(outs, SCHEMAS, strict=True):
        _check_json(out, schema)
    monkeypatch.setattr(verify, "_links_the_grammar_allows", lambda bitmask, tokens, next_token: next_token)
    with pytest.raises(RequestFailed, match="the grammar refused emitted token"):
        run()


def test_a_cut_graph_refuses_host_arguments_and_calls_out_of_order():
    """Emulated: a grammar call with a host list cannot be replayed from a graph (named error at
    capture), and a replay that asks other calls than the capture did is refused by name."""
    from types import SimpleNamespace

    import torch

    from phasegraph.runtime.cuda_graphs import GrammarCallError, SegmentedGraph

    class Masks:
        words = 2

        def beam_bitmask(self, beam_tokens, beam_parent=None):
            return torch.full((beam_tokens.numel(), 2), -1, dtype=torch.int32)

        def tree_bitmask(self, draft_tokens, parents):
            return torch.zeros((draft_tokens.numel(), 2), dtype=torch.int32)

    ctx = SimpleNamespace(grammar=Masks())
    with pytest.raises(GrammarCallError, match="device tensors or row counts; got list"):
        SegmentedGraph(ctx, lambda: ctx.grammar.beam_bitmask([[1, 2]]), emulate=True).capture()
    assert isinstance(ctx.grammar, Masks)  # the stand-in is gone after the error

    order = ["beam_bitmask"]

    def run() -> list:  # an iteration of no phase outputs: only its grammar call
        getattr(ctx.grammar, order[0])(torch.tensor([[3, 4]]), torch.zeros(1, 2, dtype=torch.int64))
        return []

    graph = SegmentedGraph(ctx, run, emulate=True)
    graph.capture()
    (call,) = graph.calls
    assert call.name == "beam_bitmask" and call.out.tolist() == [[-1, -1], [-1, -1]]
    graph.replay()
    order[0] = "tree_bitmask"
    with pytest.raises(GrammarCallError, match="grammar call tree_bitmask where the capture made beam_bitmask"):
        graph.replay()
