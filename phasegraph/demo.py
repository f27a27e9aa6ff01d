"""The embedded model pair and its held-out prompts, as ``phasegraph demo`` runs them.

The pair (a small Llama-architecture target and its EAGLE-3 head, trained on the Python standard
library by ``python -m phasegraph.train demo-pair``; see ``phasegraph/data/demo_pair/README.md``)
ships inside the package and loads through the same public ``Engine.from_pretrained`` path as a
user's checkpoints. The command itself is :mod:`phasegraph.cli.demo`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEMO_CHAIN = {"method": "eagle3", "num_steps": 3, "topk": 1}
DEMO_TREE = {"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16}
# KV pool of each demo engine: 16 requests of the pair's whole 1024-token context, twice over
# (left to its default, an engine on a GPU takes half the free memory: ~40 GB on an H100 for
# this 7.7M-parameter pair)
DEMO_KV_TOKENS = 32768


def demo_pair_dir() -> Path:
    """Directory of the embedded pair: ``target/`` (HF format + tokenizer) and ``eagle3/``."""
    return Path(str(resources.files("phasegraph") / "data" / "demo_pair"))


def demo_prompts(count: int, max_lines: int = 24) -> list[str]:
    """Held-out stdlib files (never trained on), cut after a ``def``/``class`` header."""
    from phasegraph.train.corpus import heldout_prompts

    return [p.text for p in heldout_prompts(max_lines=max_lines, min_lines=8, max_prompts=count)]
