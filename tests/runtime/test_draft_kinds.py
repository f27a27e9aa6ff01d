"""One loader for every draft kind: the kind is told from the checkpoint, and a method that
names another kind is refused before any weight is read."""

from __future__ import annotations

import json

import pytest

from phasegraph.runtime.config import SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import DraftMismatch, InvalidConfig
from phasegraph.runtime.models.drafts import DRAFT_CLASSES, draft_kind, load_draft
from phasegraph.runtime.models.target import HFTarget

from ..engine.support import DRAFT_KINDS, arch_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return arch_bundle(tmp_path_factory.mktemp("kinds"), "llama")


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_each_kind_is_told_from_its_checkpoint_and_loads(bundle, kind):
    assert draft_kind(bundle.drafts[kind]) == kind
    target = HFTarget.from_pretrained(bundle.target, feature_mode={"eagle3": "eagle3", "standalone": "none"}.get(kind, "last"))
    assert type(load_draft(bundle.drafts[kind], target)) is DRAFT_CLASSES[kind]


def test_the_target_itself_is_a_standalone_draft(bundle):
    assert draft_kind(bundle.drafts["self"]) == "standalone"


def test_a_method_that_names_another_kind_is_refused_by_name(bundle):
    target = HFTarget.from_pretrained(bundle.target)
    with pytest.raises(DraftMismatch, match=r"holds an EAGLE-3 head \(method 'eagle3'\), not what method 'eagle' loads"):
        load_draft(bundle.drafts["eagle3"], target, "eagle")


def test_an_unknown_layout_asks_for_the_method(bundle, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden_size": 32, "vocab_size": 96}))
    import torch
    from safetensors.torch import save_file

    save_file({"weird.weight": torch.zeros(2, 2)}, str(odd / "model.safetensors"))
    assert draft_kind(odd) is None
    with pytest.raises(DraftMismatch, match="cannot tell which kind of draft"):
        load_draft(odd, HFTarget.from_pretrained(bundle.target))
    with pytest.raises(InvalidConfig, match=r"pass spec=SpecConfig\(method=\.\.\.\)"):
        Engine.from_pretrained(bundle.target, odd)


@pytest.mark.parametrize("kind", ["eagle3", "standalone"])
def test_engine_from_pretrained_picks_the_method_the_draft_holds(bundle, kind):
    draft = bundle.drafts["self" if kind == "standalone" else kind]
    engine = Engine.from_pretrained(bundle.target, draft, kv_pool_tokens=2048, dtype="float32")
    assert engine.spec == SpecConfig(method=kind)
    with pytest.raises(DraftMismatch, match="not what method 'mtp' loads"):
        Engine.from_pretrained(bundle.target, draft, spec=SpecConfig(method="mtp"), kv_pool_tokens=2048)
