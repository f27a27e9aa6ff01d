"""Loading any draft: the four kinds, told apart by their checkpoint's config and tensor names.

=============  ==========================================================================
kind           what marks its directory
=============  ==========================================================================
``eagle3``     an ``...Eagle3`` architecture, ``draft_vocab_size``, or ``midlayer.*`` tensors
``eagle``      ``fc.weight`` beside ``layers.0.*`` (EAGLE-1: one layer over target features)
``mtp``        ``layers.{i}.eh_proj.weight`` (chained multi-token-prediction layers)
``standalone`` a whole causal LM: ``model.layers.*`` with its own embedding
=============  ==========================================================================
"""

from __future__ import annotations

from pathlib import Path

import torch

from phasegraph.runtime.errors import DraftMismatch
from phasegraph.runtime.models.eagle1 import Eagle1Draft
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.loading import Checkpoint, read_config
from phasegraph.runtime.models.mtp import MTPDraft
from phasegraph.runtime.models.standalone import StandaloneDraft
from phasegraph.runtime.models.target import HFTarget

DRAFT_CLASSES = {"eagle": Eagle1Draft, "eagle3": Eagle3Draft, "mtp": MTPDraft, "standalone": StandaloneDraft}
DRAFT_KIND_NAMES = {"eagle": "an EAGLE-1 head", "eagle3": "an EAGLE-3 head", "mtp": "MTP layers",
                    "standalone": "a standalone causal LM"}


def draft_kind(directory: str | Path) -> str | None:
    """The draft kind a checkpoint directory holds, from its config and tensor names; None
    where they fit no kind (the caller then needs ``SpecConfig(method=...)``)."""
    raw = read_config(directory)
    architectures = " ".join(str(a) for a in raw.get("architectures") or ())
    keys = set(Checkpoint(directory, allow_bin=True).keys())
    if "Eagle3" in architectures or "draft_vocab_size" in raw or any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if any(k.startswith("layers.") and k.endswith(".eh_proj.weight") for k in keys):
        return "mtp"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    if any(k.startswith("model.layers.") for k in keys) and "model.embed_tokens.weight" in keys:
        return "standalone"
    return None


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
    return DRAFT_CLASSES[method].from_pretrained(directory, target, dtype=dtype, device=device, **options)
