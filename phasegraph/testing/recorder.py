"""A trace that records every machine's transitions during a test and asserts over them."""

from __future__ import annotations

from phasegraph.statemachine.trace import Trace, Transition, add_listener, remove_listener


class PhaseTraceRecorder(Trace):
    """Records the transitions a test causes (all machines) while it is started.

    >>> from phasegraph.statemachine import Machine
    >>> from phasegraph.testing import synthetic as syn
    >>> rec = PhaseTraceRecorder().start()
    >>> m = Machine(syn.synthetic_eagle_graph())
    >>> _ = m.advance("prefill-extend", state=syn.prefill_input([3]))
    >>> for name in ("draft-extend", "draft", "verify", "finalize-tree-path"):
    ...     _ = m.advance(name)
    >>> rec.assert_followed_by("verify", "finalize-tree-path")
    >>> rec.stop()
    """

    def start(self) -> PhaseTraceRecorder:
        add_listener(self._on_transition)
        return self

    def stop(self) -> None:
        remove_listener(self._on_transition)

    def _on_transition(self, t: Transition) -> None:
        self.record(t)

    def count(self, phase: str) -> int:
        return sum(1 for t in self.transitions if t.target == phase)

    def assert_visited(self, *phases: str) -> None:
        missing = [p for p in phases if self.count(p) == 0]
        assert not missing, f"phases never ran: {missing}; ran: {sorted(set(self.phases()))}"

    def assert_not_visited(self, *phases: str) -> None:
        ran = [p for p in phases if self.count(p)]
        assert not ran, f"phases ran but should not have: {ran}"

    def assert_followed_by(self, phase: str, successor: str) -> None:
        """Every run of ``phase`` (per machine) was directly followed by ``successor``."""
        assert self.count(phase), f"phase {phase!r} never ran"
        last: dict[str, str] = {}
        for t in self.transitions:
            prev = last.get(t.machine)
            assert not (prev == phase and t.target != successor), (
                f"machine {t.machine!r}: {phase!r} was followed by {t.target!r}, not {successor!r}"
            )
            last[t.machine] = t.target
        dangling = [m for m, p in last.items() if p == phase]
        assert not dangling, f"machines {dangling} ended in {phase!r} before {successor!r} ran"
