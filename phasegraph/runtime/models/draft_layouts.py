"""Reading the config switches of the public draft-head layouts, strictly.

Every switch a head's ``config.json`` may carry is read here with its type checked: a value the
runtime does not implement raises :class:`UnsupportedDraftLayout` naming the key and value, so a
head never loads and silently computes something else than its reference code.

The vllm-project/speculators format nests the decoder settings under ``transformer_layer_config``
and the speculation settings under ``speculators_config``; :func:`flat_config` lifts it into the
flat layout the other trainers write (Llama keys plus the head's switches at the top level).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from phasegraph.runtime.errors import UnsupportedDraftLayout

SPECULATORS_KINDS = ("eagle3", "eagle")  # speculators_model_type values this runtime loads
# top-level keys of a speculators config that carry over into the flat config
SPECULATORS_SWITCHES = (
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "layernorms",
    "fusion_bias",
    "eagle_aux_hidden_state_layer_ids",
)


def is_speculators(raw: dict) -> bool:
    return "speculators_model_type" in raw or "transformer_layer_config" in raw


def speculators_kind(raw: dict, where: str) -> str:
    """``speculators_model_type`` of a speculators config, checked against the kinds loaded."""
    kind = raw.get("speculators_model_type")
    if kind not in SPECULATORS_KINDS:
        raise UnsupportedDraftLayout(
            f"{where}: speculators_model_type {kind!r} is not supported (supported: "
            f"{', '.join(SPECULATORS_KINDS)})"
        )
    return kind


def flat_config(raw: dict, where: str) -> dict:
    """``raw`` itself, or a speculators config lifted to the flat layout: the decoder keys of
    ``transformer_layer_config``, the head's switches, and the speculators metadata dropped.
    ``eagle_aux_hidden_state_layer_ids`` of speculators (the target layers whose *input* is
    captured, as vLLM reads it) becomes phasegraph's ``eagle_aux_layers``."""
    if not is_speculators(raw):
        return raw
    speculators_kind(raw, where)
    layer_config = raw.get("transformer_layer_config")
    if not isinstance(layer_config, dict):
        raise UnsupportedDraftLayout(
            f"{where}: a speculators config needs transformer_layer_config as an object; got "
            f"{type(layer_config).__name__}"
        )
    flat = dict(layer_config)
    for key in SPECULATORS_SWITCHES:
        if raw.get(key) is not None:
            flat[key] = raw[key]
    if "eagle_aux_hidden_state_layer_ids" in flat:
        flat["eagle_aux_layers"] = flat.pop("eagle_aux_hidden_state_layer_ids")
    flat["speculators_model_type"] = raw["speculators_model_type"]
    if raw["speculators_model_type"] == "eagle":
        # speculators' EAGLE-1 builds one ``transformer`` layer whatever the layer config says
        flat["num_hidden_layers"] = 1
    return flat


def switch(raw: dict, key: str, default: bool, where: str, *, supported: Iterable[bool] = (False, True)) -> bool:
    """A boolean switch of the config: ``default`` when absent (or null); a value that is not a
    boolean, or one outside ``supported``, raises :class:`UnsupportedDraftLayout` naming it."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UnsupportedDraftLayout(f"{where}: {key} must be true or false; got {value!r}")
    if value not in tuple(supported):
        raise UnsupportedDraftLayout(f"{where}: {key}: {str(value).lower()} is not supported")
    return value


def layer_indices(keys: Iterable[str], prefix: str) -> list[int]:
    """The sorted ``i`` of every ``{prefix}.{i}.`` tensor name."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


def require_layers(found: list[int], declared: int, prefix: str, where: str) -> None:
    """The checkpoint holds layers ``0..declared-1`` under ``prefix``, no more and no fewer."""
    if found != list(range(declared)):
        raise UnsupportedDraftLayout(
            f"{where}: config num_hidden_layers is {declared}, but the checkpoint holds layers "
            f"{found} under {prefix!r}: a head must not run another number of layers than it "
            "was trained with"
        )
