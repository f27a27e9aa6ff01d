"""The EAGLE phase graph's declaration: its phases' names, schemas and summaries, and its edges.

::

    prefill-extend -> draft-extend -> DraftState
    DraftState -> draft -> verify -> finalize-tree-path -> draft-extend -> DraftState
    DraftState -> decode -> DraftState                      (target alone, the baseline)
    DraftState -> merge | filter | retract | split -> DraftState    (scheduler operations)

Only phases that output a :class:`DraftState` lead to the scheduler operations, so a verify
result can never reach merge (SGLang #24859), and verify is always followed by finalize-tree-path,
which always leads to draft-extend (no phase is skipped when every request finishes).

This module imports no torch (nor the phases' modules), so that ``phasegraph graph`` draws the
graph at once; :mod:`phasegraph.phases.eagle` builds the checked graph from this same outline,
and refuses phases whose names or schemas differ from it.
"""

from __future__ import annotations

from phasegraph.statemachine.outline import GraphOutline, PhaseOutline

PHASES = (
    PhaseOutline("prefill-extend", "PrefillInput", "PrefillResult",
                 "Run the target over the prompts, writing their KV, and sample each request's "
                 "first new token."),
    PhaseOutline("draft-extend", "DraftExtendInput", "DraftState",
                 "Extend the draft's KV over the committed tokens and take the top-k candidates "
                 "for each request's next token."),
    PhaseOutline("draft", "DraftState", "TreeProposal",
                 "Grow each request's tree of draft tokens with the draft model, keeping the most "
                 "likely candidates."),
    PhaseOutline("verify", "TreeProposal", "VerifyResult",
                 "Run the target over every draft tree and accept the longest path it agrees with "
                 "(exactly the target's distribution when sampling)."),
    PhaseOutline("finalize-tree-path", "VerifyResult", "FinalizedPath",
                 "Keep only the accepted path: compact its tokens, features and KV to the front."),
    PhaseOutline("decode", "DraftState", "DraftState",
                 "Without a draft: commit each request's last token and sample the next one."),
    PhaseOutline("merge", "DraftState", "DraftState",
                 "Append newly prefilled requests to the running batch."),
    PhaseOutline("filter", "DraftState", "DraftState",
                 "Drop finished or aborted requests and give their KV pages back to the pool."),
    PhaseOutline("retract", "DraftState", "DraftState",
                 "Free the KV pages of requests taken out of the batch; they resume later with "
                 "the same output."),
    PhaseOutline("split", "DraftState", "DraftState",
                 "Take some rows of the batch as a group of their own, keeping their KV: each "
                 "group runs its own speculation shape, then the groups merge again."),
)

#: Phases that produce a DraftState, and the phases a DraftState may go to.
DRAFT_STATE_SOURCES = ("draft-extend", "decode", "merge", "filter", "retract", "split")
DRAFT_STATE_TARGETS = ("draft", "decode", "merge", "filter", "retract", "split")

EDGES = (
    ("prefill-extend", "draft-extend"),
    ("draft", "verify"),
    ("verify", "finalize-tree-path"),
    ("finalize-tree-path", "draft-extend"),
    *((a, b) for a in DRAFT_STATE_SOURCES for b in DRAFT_STATE_TARGETS),
)

EAGLE_OUTLINE = GraphOutline("eagle", "prefill-extend", PHASES, EDGES)
