"""Pure tensor kernels of speculative decoding: torch references and Triton kernels.

One module per kernel; conventions in ``docs/internals.md``. Every function here takes and
returns tensors only, never syncs with the device, and has shapes that depend only on
B, K, S, N, V and P. Each module keeps its torch implementation as ``<name>_reference`` (the CPU
path and the oracle) and a Triton one as ``<name>_triton``; the names exported here dispatch
(Triton on CUDA tensors, else the reference; ``PHASEGRAPH_KERNELS=reference|triton|auto``
forces one, see ``_dispatch.py``).
"""

from phasegraph.kernels._dispatch import KernelSettingError, check_kernel_settings
from phasegraph.kernels.bonus import fill_bonus_tokens, gather_accepted_tokens
from phasegraph.kernels.build_tree import TreeTensors, build_tree, select_tree_nodes
from phasegraph.kernels.cache_slots import (
    BranchReorder,
    DraftCacheLayout,
    ExtendSlots,
    SpanRows,
    assign_draft_cache_locs,
    draft_region_pages,
    extend_slots,
    reorder_branches,
    row_slots,
    span_slots,
    span_slots_and_rows,
)
from phasegraph.kernels.compact import accepted_kv_moves, compact_to_front, move_kv
from phasegraph.kernels.draft_expand import (
    DraftCandidates,
    ExpandedCandidates,
    StepCandidates,
    concat_candidates,
    expand_step,
    first_step_candidates,
)
from phasegraph.kernels.extend_positions import (
    extend_positions,
    extend_rows,
    ragged_extend_positions,
)
from phasegraph.kernels.tree_sampling import target_probs, verify_tree_sampling
from phasegraph.kernels.verify_greedy import VerifyOutcome, verify_tree_greedy

__all__ = [
    "BranchReorder",
    "DraftCacheLayout",
    "DraftCandidates",
    "ExpandedCandidates",
    "ExtendSlots",
    "KernelSettingError",
    "SpanRows",
    "StepCandidates",
    "TreeTensors",
    "VerifyOutcome",
    "accepted_kv_moves",
    "assign_draft_cache_locs",
    "build_tree",
    "check_kernel_settings",
    "compact_to_front",
    "concat_candidates",
    "draft_region_pages",
    "expand_step",
    "extend_positions",
    "extend_rows",
    "extend_slots",
    "fill_bonus_tokens",
    "first_step_candidates",
    "gather_accepted_tokens",
    "move_kv",
    "ragged_extend_positions",
    "reorder_branches",
    "row_slots",
    "select_tree_nodes",
    "span_slots",
    "span_slots_and_rows",
    "target_probs",
    "verify_tree_greedy",
    "verify_tree_sampling",
]
