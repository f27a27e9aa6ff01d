"""Hypothesis stateful test: random legal and illegal transition sequences on the EAGLE graph.

Legal transitions must pass strict validation, illegal ones must raise IllegalTransition, bad
inputs must raise SchemaViolation, and every rejection must leave the machine unchanged.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from phasegraph.phases.eagle import EDGES
from phasegraph.statemachine import IllegalTransition, Machine, SchemaViolation
from phasegraph.testing import synthetic as syn

GRAPH = syn.synthetic_eagle_graph()
ALL_PHASES = sorted(GRAPH.phases)
LEGAL = set(EDGES)


class TransitionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = Machine(GRAPH, validate="strict")
        self.ctx = syn.SyntheticContext()
        self.next_row = 100
        self.legal_taken = 0
        self.rejected = 0

    def _snapshot(self):
        return self.m.phase, self.m.state

    def _batch(self) -> int:
        s = self.m.state
        return 0 if s is None else (s.batch_size or 0)

    def _extra_for(self, name: str, data) -> dict:
        B = self._batch()
        if name == "merge":
            n = data.draw(st.integers(0, 3), label="merge size")
            self.next_row += 4
            return {"other": syn.draft_state(n, start_row=self.next_row)}
        if name in ("filter", "retract", "split"):
            chosen = sorted(data.draw(st.sets(st.integers(0, max(B - 1, 0)), max_size=B), label="rows")) if B else []
            return {"rows" if name == "retract" else "keep": syn.rows(chosen)}
        return {}

    @rule(data=st.data())
    def legal_step(self, data):
        allowed = self.m.allowed()
        name = data.draw(st.sampled_from(sorted(allowed)), label="legal phase")
        if name in ("draft",) and self._batch() == 0:
            return  # drafting an empty batch is never scheduled
        if self.m.phase is None:
            lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4), label="prompt lens")
            self.m.advance(name, self.ctx, state=syn.prefill_input(lens))
        else:
            self.m.advance(name, self.ctx, **self._extra_for(name, data))
        assert self.m.phase == name
        self.legal_taken += 1

    @rule(name=st.sampled_from(ALL_PHASES), data=st.data())
    def illegal_step(self, name, data):
        if self.m.may_advance(name):
            return
        before = self._snapshot()
        with pytest.raises(IllegalTransition) as err:
            self.m.advance(name, self.ctx, **self._extra_for(name, data))
        assert err.value.requested == name and err.value.current == before[0]
        assert err.value.allowed == GRAPH.allowed(before[0])
        assert self._snapshot() == before
        self.rejected += 1

    @precondition(lambda self: self.m.may_advance("merge"))
    @rule(data=st.data(), corruption=st.sampled_from(["dtype", "shape", "type", "device"]))
    def corrupted_merge(self, data, corruption):
        before = self._snapshot()
        other = syn.draft_state(2, start_row=900)
        if corruption == "dtype":
            other = other.replace(seq_lens=other.seq_lens.to(torch.int32))
        elif corruption == "shape":
            other = other.replace(topk_p=torch.rand(3, 2))
        elif corruption == "device":
            other = other.replace(remaining=other.remaining.to("meta"))
        else:
            other = syn.tree_proposal(other)
        with pytest.raises(SchemaViolation):
            self.m.advance("merge", self.ctx, other=other)
        assert self._snapshot() == before
        self.rejected += 1

    @invariant()
    def state_is_valid(self):
        if self.m.state is not None:
            self.m.state.validate("strict")
            assert self.m.phase in GRAPH.phases


TransitionMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_random_transition_sequences = TransitionMachine.TestCase
