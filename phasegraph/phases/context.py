"""What every phase receives besides its input schema: models, memory and per-iteration settings."""

from __future__ import annotations

import attrs

from phasegraph.phases.protocols import DraftModel, GrammarMasks, KVMemory, TargetModel


@attrs.frozen
class TreeShape:
    """The draft tree's shape: ``topk`` (K), ``num_steps`` (S), ``num_draft_tokens`` (N)."""

    topk: int
    num_steps: int
    num_draft_tokens: int

    def __attrs_post_init__(self) -> None:
        problems = check_tree_shape(self.topk, self.num_steps, self.num_draft_tokens)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def accept_width(self) -> int:
        """W = S + 1: the longest accepted path (root + S drafts)."""
        return self.num_steps + 1

    @property
    def num_candidates(self) -> int:
        """C = K + (S-1)·K²: draft candidates per request."""
        return num_tree_candidates(self.topk, self.num_steps)



def tokens_per_iteration(tree: TreeShape | None, kv_lead: int) -> int:
    """Logical KV positions behind its committed length that one request writes in one
    iteration: the tree's N nodes or the accepted path's W plus the draft's KV lead, whichever
    is more; 1 without speculation (a decode step)."""
    if tree is None:
        return 1
    return max(tree.num_draft_tokens, tree.accept_width + kv_lead)


def num_tree_candidates(topk: int, num_steps: int) -> int:
    """C = K + (S-1)·K²: the candidates a tree of ``topk`` K and ``num_steps`` S drafts per
    request (K at the first step, K² at each later one: K beams times their top-K)."""
    return topk + (num_steps - 1) * topk * topk


def check_tree_shape(topk: int, num_steps: int, num_draft_tokens: int) -> list[str]:
    """Why (topk, num_steps, num_draft_tokens) is not a legal tree ([] when it is)."""
    problems = []
    if topk < 1:
        problems.append(f"topk must be >= 1, got {topk}")
    if num_steps < 1:
        problems.append(f"num_steps must be >= 1, got {num_steps}")
    if problems:
        return problems
    most = 1 + num_tree_candidates(topk, num_steps)
    if topk == 1:
        most = 1 + num_steps
    if not 2 <= num_draft_tokens <= most:
        problems.append(
            f"num_draft_tokens must be in [2, {most}] for topk={topk}, num_steps={num_steps} "
            f"(root + at most {most - 1} drafted candidates), got {num_draft_tokens}"
        )
    return problems


@attrs.define
class SpecContext:
    """Handles the phases work through. The runtime builds one per engine and updates the
    per-iteration flags; phases only read it (and write KV through ``memory``)."""

    target: TargetModel
    memory: KVMemory
    tree: TreeShape | None  # None for the autoregressive baseline; the shape of this iteration
    draft: DraftModel | None = None
    # candidates draft-extend keeps per request where iterations change shape (the largest K
    # of the engine's shapes; a draft of a smaller K reads the first); None: tree.topk
    draft_topk: int | None = None
    greedy_only: bool = False  # every request in the batch has temperature 0
    return_logprobs: bool = False  # a request asks for its tokens' logprobs
    top_logprobs: int = 0  # the most top logprobs per generated position a request asks for
    prompt_logprobs: int | None = None  # None: no request asks for prompt logprobs; else the most top ones
    penalties: bool = False  # a request uses logit_bias or a penalty (off: no count state, no pass)
    min_p: bool = False  # a request uses min_p
    return_routed_experts: bool = False  # a request asks for the experts its tokens were routed to
    # the batch's grammar masks where a request has structured output, else None (no mask, no
    # host round trip); the iteration then runs eagerly, outside CUDA graphs
    grammar: GrammarMasks | None = None
    # Benchmark mode only: verify accepts this many drafts per step whatever they are (greedy
    # requests); outputs are then not the target's. None = real verification.
    simulate_accept_drafts: int | None = None

    @property
    def kv_lead(self) -> int:
        """The draft's KV lead (:class:`DraftModel`), 0 without speculation."""
        return 0 if self.draft is None or self.tree is None else self.draft.kv_lead

    @property
    def tokens_per_iteration(self) -> int:
        return tokens_per_iteration(self.tree, self.kv_lead)

    @property
    def commit_per_iteration(self) -> int:
        """The most tokens one iteration commits to a request: the accepted path (W), or 1."""
        return 1 if self.tree is None else self.tree.accept_width
