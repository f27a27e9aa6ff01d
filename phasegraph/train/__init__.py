"""Training recipe for the shipped demo pair (and larger benchmark pairs).

``python -m phasegraph.train {demo-pair,bench-pair,tiny} --out DIR`` trains a byte-level BPE
tokenizer, a small Llama target and an EAGLE-3 head on the Python standard library's sources
(plus, for ``bench-pair``, a standalone draft model) and writes them in the formats the Engine
loads. See :mod:`phasegraph.train.recipe`.
"""

from phasegraph.train.corpus import heldout_files, heldout_prompts
from phasegraph.train.presets import PRESETS, Preset, apply_overrides

__all__ = ["PRESETS", "Preset", "apply_overrides", "heldout_files", "heldout_prompts", "run_recipe"]


def __getattr__(name: str):
    if name == "run_recipe":  # keeps `import phasegraph.train` free of transformers
        from phasegraph.train.recipe import run_recipe

        return run_recipe
    raise AttributeError(name)
