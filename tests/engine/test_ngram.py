"""The n-gram (prompt-lookup) drafter and drafting methods registered by name.

- ``ngram_propose`` on hand-made histories: the latest earlier occurrence, the longest n-gram
  first, never the suffix itself, the continuation cut at the history's end, nothing found.
- Through the engine (its lossless matrix is in tests/phases/test_lossless.py): a prompt that
  repeats its context is drafted from it (long accepted runs), with adaptive chains, after a
  retraction and with the prefix cache; the settings it cannot run are refused by name.
- A method written in a test, the way docs/custom-drafter.md describes: its own draft phase, a
  graph from the EAGLE outline, ``register_method``; lossless, and shown in the trace.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.drafters.ngram import NgramDraft, ngram_propose
from phasegraph.phases.context import SpecContext
from phasegraph.phases.eagle import FUNCTIONS
from phasegraph.phases.outline import EAGLE_OUTLINE
from phasegraph.phases.schemas import DraftState, TreeProposal
from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.runtime.methods import DraftMethod, method_names, register_method
from phasegraph.statemachine import PhaseGraph, phase
from tests.engine.support import assert_all_free
from tests.phases.lossless_support import NEW_TOKENS, VOCAB, prompts, reference, tiny_target


def _propose(seqs, count, max_ngram=3, min_ngram=1, width=16):
    hist = torch.full((len(seqs), width), 99, dtype=torch.int64)
    for i, s in enumerate(seqs):
        hist[i, : len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs])
    out, found = ngram_propose(hist, lens, count, max_ngram, min_ngram)
    return out.tolist(), found.tolist()


def test_the_latest_and_longest_earlier_occurrence():
    # "1 2 3" occurred twice before the end; the latest is followed by 7 8
    out, found = _propose([[1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3]], 3)
    assert out == [[7, 8, 9]] and found == [True]
    # the 3-gram "5 1 2" never occurred; the 2-gram "1 2" did (followed by 6), the 1-gram "2" later
    out, _ = _propose([[1, 2, 6, 2, 4, 5, 1, 2]], 2)
    assert out == [[6, 2]]


def test_never_the_suffix_itself_and_cut_at_the_end():
    out, found = _propose([[4, 5, 6]], 2)  # nothing repeats
    assert found == [False]
    out, found = _propose([[9, 3, 9]], 3)  # "9" occurred at 0, followed by 3 9: the history's end
    assert found == [True] and out == [[3, 9, 9]]
    out, found = _propose([[7]], 2, min_ngram=1)
    assert found == [False]


def test_rows_are_independent():
    out, found = _propose([[1, 2, 1], [5, 6, 7, 5]], 2)
    assert out == [[2, 1], [6, 7]] and found == [True, True]


def _engine(**kw):
    kw.setdefault("spec", SpecConfig(method="ngram", num_steps=4))
    return Engine(tiny_target(), max_batch_size=4, kv_pool_tokens=8192, check_every_step=True, **kw)


def test_a_prompt_that_repeats_its_context_is_drafted_from_it():
    """A prompt of a phrase said twice: once the output starts repeating it, whole chains are
    accepted; outputs equal the target's."""
    phrase = prompts(1, seed=9)[0]
    base = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=1, kv_pool_tokens=8192)
    prompt = phrase + phrase
    want = base.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0].token_ids
    out = _engine().generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == want
    assert out.stats.mean_accept_length > 2.0, out.stats.accept_lengths


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_ngram_adapts_over_chains(cuda_graphs):
    shapes = (OFF, SpecShape.chain(1), SpecShape.chain(3))
    table = CostTable(shapes, (1, 4), ((1.0, 1.1), (1.05, 1.2), (1.1, 1.3)))
    engine = _engine(spec=SpecConfig(method="ngram", num_steps=3, adaptive=True), spec_costs=table,
                     cuda_graphs=cuda_graphs)
    outs = engine.generate(prompts(4), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == list(reference(4))
    assert engine.trace.notes("draft")
    assert_all_free(engine)


def test_ngram_survives_retraction_and_reads_cached_prefixes():
    engine = _engine(prefix_cache=True)
    ps = prompts(4)
    shared = ps[0][:8]
    ps = [shared + p for p in ps]
    base = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=4, kv_pool_tokens=8192)
    want = [o.token_ids for o in base.generate(ps, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    got, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        if steps == 3:
            assert engine.retract("r1")
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert [got[f"r{i}"] for i in range(4)] == want
    assert engine.num_retractions == 1


@pytest.mark.parametrize(("kw", "why"), [
    (dict(spec=SpecConfig(method="ngram", topk=2, num_steps=3, num_draft_tokens=5)), "topk must be 1"),
    (dict(spec=SpecConfig(method="ngram", num_steps=3, adaptive=True),
          spec_costs=CostTable((OFF, SpecShape(2, 2, 3)), (1,), ((1.0,), (1.0,)))), "builds trees of topk <= 1"),
])
def test_what_ngram_cannot_run_is_refused(kw, why):
    with pytest.raises(InvalidConfig, match=why):
        _engine(**kw)


def test_ngram_needs_no_draft_directory(tmp_path):
    with pytest.raises(InvalidConfig, match="needs no draft_dir"):
        Engine.from_pretrained(tmp_path, tmp_path, spec=SpecConfig(method="ngram"))
    with pytest.raises(InvalidConfig, match="min_ngram <= max_ngram"):
        NgramDraft(max_ngram=0)


# ------------------------------------------------------------------ a method of one's own


@phase("draft")
def echo_draft(state: DraftState, ctx: SpecContext) -> TreeProposal:
    """Draft the bonus token again, N - 1 times (right wherever the target repeats a token)."""
    from phasegraph.kernels.build_tree import build_tree

    S, N = ctx.tree.num_steps, ctx.tree.num_draft_tokens
    B = state.seq_lens.shape[0]
    parents = (torch.arange(N) - 1).repeat(B, 1)
    built = build_tree(state.bonus_tokens, state.bonus_tokens[:, None].repeat(1, N - 1), parents, state.seq_lens)
    base = state.seq_lens + ctx.kv_lead
    return TreeProposal(
        draft=state, num_steps=S, draft_lead=ctx.kv_lead, draft_tokens=built.draft_tokens,
        positions=built.positions, parents=parents, depth=built.depth, tree_mask=built.tree_mask,
        retrieve_index=built.retrieve_index, retrieve_next_token=built.retrieve_next_token,
        retrieve_next_sibling=built.retrieve_next_sibling,
        draft_positions=(base[:, None] + torch.arange(S - 1))[:, :, None],
        draft_finite=torch.ones(B, dtype=torch.bool),
    )


def test_a_registered_method_of_ones_own_runs_losslessly():
    graph = PhaseGraph.from_outline(EAGLE_OUTLINE, [echo_draft if f.name == "draft" else f for f in FUNCTIONS])
    register_method(DraftMethod("echo", graph, make_draft=lambda target, spec: NgramDraft(), max_topk=1))
    assert "echo" in method_names()
    engine = _engine(spec=SpecConfig(method="echo", num_steps=2))
    outs = engine.generate(prompts(3), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == list(reference(3))
    assert engine.trace.always_followed_by("draft", "verify")
    assert_all_free(engine)


@pytest.mark.parametrize(("method", "why"), [
    ("not a method", "register_method takes a DraftMethod"),
    (DraftMethod("eagle3", PhaseGraph.from_outline(EAGLE_OUTLINE, FUNCTIONS)), "'eagle3' is a built-in method"),
])
def test_bad_registrations_are_refused(method, why):
    with pytest.raises(InvalidConfig, match=why):
        register_method(method)


def test_unknown_methods_are_refused_by_name():
    with pytest.raises(InvalidConfig, match="SpecConfig.method must be one of none, eagle, eagle3, mtp, standalone, ngram"):
        SpecConfig(method="lookahead")
    assert VOCAB < (1 << 24)


def test_the_command_runs_ngram_without_a_draft_and_notes_its_shape(tmp_path, capsys):
    from phasegraph.cli import main

    trace = tmp_path / "t.json"
    rc = main(["generate", "--method", "ngram", "--num-steps", "3", "--adaptive", "off", "--prompt-ids",
               ",".join(map(str, prompts(1)[0] * 2)), "--max-new-tokens", "12", "--no-progress",
               "--trace", str(trace)])
    assert rc == 0
    assert "[ngram] mean acceptance length" in capsys.readouterr().err
    assert main(["graph", "--trace", str(trace)]) == 0
    assert "draft: chain S=3 ×" in capsys.readouterr().out
