"""What the draft phases record is what the draft model was given and gave, for every draft kind.

- SGLang #26358: ``DraftState.topk_p`` is the full softmax's top k of the draft's logits, also for a
  chain (k = 1), where SGLang's shortcut put 1.0 without a softmax; the ids are mapped into the
  target vocabulary (an EAGLE-3 head's ``d2t`` offsets, else ``to_target_ids``);
- SGLang #25015: ``TreeProposal.draft_positions``, which strict mode checks against seq_len + lead +
  i, holds the very positions each draft forward received, beam by beam.

The models run on the qwen3 checkpoints, whose EAGLE-3 head has its own 40-token vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.statemachine import Machine
from tests.engine.support import DRAFT_KINDS, SHAPES, arch_bundle, engine_for, greedy


def _record(monkeypatch, engine):
    """Every draft forward (from_target, positions, logits) and every phase output, with the
    forwards that phase made."""
    forwards, phases = [], []
    forward = engine.draft.forward

    def draft_forward(input_ids, hidden, positions, attn, **kw):
        out = forward(input_ids, hidden, positions, attn, **kw)
        forwards.append((kw["from_target"], positions.clone(), out.logits.detach().clone()))
        return out

    monkeypatch.setattr(engine.draft, "forward", draft_forward)
    advance = Machine.advance

    def recorded_advance(self, name, *args, **kw):
        first = len(forwards)
        out = advance(self, name, *args, **kw)
        phases.append((name, out, forwards[first:]))
        return out

    monkeypatch.setattr(Machine, "advance", recorded_advance)
    return phases


def _want_topk(draft, logits, k):
    """softmax + topk of the draft's logits, ids in the target vocabulary."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    offsets = getattr(draft, "target_id_offsets", None)
    return probs, (ids + offsets[ids] if offsets is not None else draft.to_target_ids(ids))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_draft_phases_record_what_the_draft_model_got_and_gave(engine_root, monkeypatch, kind, shape):
    bundle = arch_bundle(engine_root, "qwen3")
    engine = engine_for(bundle, kind, **SHAPES[shape])
    K, lead = SHAPES[shape]["topk"], int(getattr(engine.draft, "kv_lead", 0))
    phases = _record(monkeypatch, engine)
    outs = engine.generate([list(p) for p in bundle.prompts], greedy())
    assert [tuple(o.token_ids) for o in outs] == list(bundle.reference)

    extends = [(out, calls) for name, out, calls in phases if name == "draft-extend"]
    drafts = [(out, calls) for name, out, calls in phases if name == "draft"]
    assert extends and drafts
    if kind == "eagle3":
        assert getattr(engine.draft, "target_id_offsets", None) is not None  # the d2t path
    lowest = 1.0
    for state, calls in extends:
        [(from_target, _, logits)] = calls
        assert from_target
        want_p, want_ids = _want_topk(engine.draft, logits, K)
        torch.testing.assert_close(state.topk_p, want_p, rtol=1e-6, atol=1e-7)
        assert torch.equal(state.topk_index, want_ids)
        lowest = min(lowest, float(state.topk_p[:, 0].min()))
    # the drafts are far from certain, so a top-1 "probability" of 1.0 would not pass above
    assert lowest < 0.9

    for proposal, calls in drafts:
        steps = [positions for from_target, positions, _ in calls if not from_target]
        B = proposal.draft.seq_lens.shape[0]
        assert len(steps) == proposal.num_steps - 1 == proposal.draft_positions.shape[1]
        for i, positions in enumerate(steps):  # [B*K], every beam of request b at base[b] + i
            assert torch.equal(proposal.draft_positions[:, i, :].reshape(-1), positions)
            assert torch.equal(positions.view(B, K), (proposal.draft.seq_lens + lead + i)[:, None].expand(B, K))
