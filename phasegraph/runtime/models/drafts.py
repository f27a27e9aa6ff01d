"""Loading any draft: the four kinds, told apart by their checkpoint's config and tensor names.

=============  ==========================================================================
kind           what marks its directory
=============  ==========================================================================
``eagle3``     an ``...Eagle3`` architecture, ``draft_vocab_size``, ``midlayer.*`` or
               ``midlayers.{i}.*`` tensors, ``layers.0.hidden_norm.weight`` (vLLM and
               speculators), or ``speculators_model_type: eagle3``
``eagle``      ``fc.weight`` beside ``layers.0.*`` (EAGLE-1: layers over target features), or
               ``speculators_model_type: eagle`` (``fusion_fc.weight``)
``mtp``        ``layers.{i}.eh_proj.weight`` (phasegraph's chained multi-token-prediction
               layers), or ``model.layers.{N}.eh_proj.weight`` with ``num_nextn_predict_layers``
               (the public next-n layer of DeepSeek-V3 / MiMo style, N = ``num_hidden_layers``)
``standalone`` a whole causal LM: ``model.layers.*`` with its own embedding
=============  ==========================================================================

A speculators config of another ``speculators_model_type`` raises
:class:`UnsupportedDraftLayout`, as does MiMo's own ``model.mtp_layers.*`` naming.
"""

from __future__ import annotations

from pathlib import Path

import torch

from phasegraph.runtime.errors import DraftMismatch, UnsupportedDraftLayout
from phasegraph.runtime.models.draft_layouts import is_speculators, speculators_kind
from phasegraph.runtime.models.eagle1 import Eagle1Draft
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.loading import Checkpoint, read_config
from phasegraph.runtime.models.mtp import MTPDraft, NextNDraft, nextn_index
from phasegraph.runtime.models.standalone import StandaloneDraft
from phasegraph.runtime.models.target import HFTarget

DRAFT_CLASSES = {"eagle": Eagle1Draft, "eagle3": Eagle3Draft, "mtp": MTPDraft, "standalone": StandaloneDraft}
DRAFT_KIND_NAMES = {"eagle": "an EAGLE-1 head", "eagle3": "an EAGLE-3 head", "mtp": "MTP layers",
                    "standalone": "a standalone causal LM"}


def draft_kind(directory: str | Path) -> str | None:
    """The draft kind a checkpoint directory holds, from its config and tensor names; None
    where they fit no kind (the caller then needs ``SpecConfig(method=...)``)."""
    where = str(directory)
    raw = read_config(directory)
    if is_speculators(raw):
        return speculators_kind(raw, where)
    architectures = " ".join(str(a) for a in raw.get("architectures") or ())
    keys = set(Checkpoint(directory, allow_bin=True).keys())
    if any(k.startswith("model.mtp_layers.") for k in keys):
        raise UnsupportedDraftLayout(
            f"{where}: MiMo's model.mtp_layers.* naming is not supported (the next-n layer loads "
            "from model.layers.{num_hidden_layers}.*, as DeepSeek-V3 names it)"
        )
    if nextn_index(raw, keys) is not None:
        return "mtp"
    if (
        "Eagle3" in architectures
        or "draft_vocab_size" in raw
        or any(k.startswith(("midlayer.", "midlayers.")) for k in keys)
        or "layers.0.hidden_norm.weight" in keys
    ):
        return "eagle3"
    if any(k.startswith("layers.") and k.endswith(".eh_proj.weight") for k in keys):
        return "mtp"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    if any(k.startswith("model.layers.") for k in keys) and "model.embed_tokens.weight" in keys:
        return "standalone"
    return None


def draft_class(directory: str | Path, method: str):
    """The adapter class that loads ``directory`` as ``method`` (the next-n layout of ``mtp``
    has its own)."""
    if method == "mtp":
        keys = Checkpoint(directory, allow_bin=True).keys()
        if nextn_index(read_config(directory), keys) is not None:
            return NextNDraft
    return DRAFT_CLASSES[method]


def load_draft(
    directory: str | Path,
    target: HFTarget,
    method: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    **options,
):
    """The draft in ``directory`` for ``target``: of kind ``method``, or of the kind the
    directory holds (:func:`draft_kind`). A directory that holds another kind than ``method``
    raises :class:`DraftMismatch` before any weight is read."""
    found = draft_kind(directory)
    if method is None:
        if found is None:
            raise DraftMismatch(
                f"{directory}: cannot tell which kind of draft this is (config and tensor names fit "
                f"none of {', '.join(DRAFT_CLASSES)}): pass SpecConfig(method=...)"
            )
        method = found
    elif found is not None and found != method:
        raise DraftMismatch(
            f"{directory} holds {DRAFT_KIND_NAMES[found]} (method {found!r}), not what method "
            f"{method!r} loads ({DRAFT_KIND_NAMES[method]})"
        )
    return draft_class(directory, method).from_pretrained(directory, target, dtype=dtype, device=device, **options)
