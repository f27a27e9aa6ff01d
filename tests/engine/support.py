"""Shared pieces of the engine tests: tiny checkpoints on disk, prompts, transformers references.

Every checkpoint is written by :mod:`phasegraph.testing.checkpoints` into a
session temporary directory, once per architecture, and reused by every test of the session.
The targets are small (hidden 32, 3 layers, vocabulary 96). The lm_head rows of a few "strong"
tokens are scaled up (``boost_rows``) in the untied targets and in the drafts that own an
lm_head, so that random drafts agree with the target often enough to accept multi-token paths
(the tied qwen2 target gets a shrunken embedding instead: a tied random model mostly repeats
its input token). Each architecture covers a different checkpoint format:

========  ======================  =============  =====================
arch      target files            tied lm_head   EAGLE-3 vocabulary
========  ======================  =============  =====================
llama     one safetensors file    no             = target (no d2t/t2d)
qwen2     3 shards + index        yes            48 (d2t + t2d)
qwen3     one safetensors file    no             40 (d2t + t2d)
mistral   2 shards + index        no             = target (no d2t/t2d)
qwen3_moe one safetensors file    no             40 (d2t + t2d)
mixtral   2 shards + index        no             = target (no d2t/t2d)
========  ======================  =============  =====================

The mixture-of-experts targets (``MOE_ARCHS``: Qwen3-MoE with a dense layer 1 among its three,
and Mixtral; two experts per token) are not in ``ARCHS``: their own tests take them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file, save_file

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing.checkpoints import (
    write_eagle1_draft,
    write_eagle3_draft,
    write_hf_target,
    write_mtp_draft,
    write_standalone_draft,
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHS = ("qwen3_moe", "mixtral")
DRAFT_KINDS = ("eagle", "eagle3", "mtp", "standalone")
VOCAB = 96
STRONG_TOKENS = (5, 17, 42, 77, 90)
BOOST = 2.0
NEW_TOKENS = 27
# the chain and the tree the engine tests speculate with
SHAPES = {"chain": dict(topk=1, num_steps=3), "tree": dict(topk=4, num_steps=3, num_draft_tokens=8)}
PROMPT_LENGTHS = (1, 9, 23, 14)

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
ARCH_FORMAT = {
    # arch: (shards, tie_word_embeddings, eagle3 draft vocabulary or None)
    "llama": (1, False, None),
    "qwen2": (3, True, 48),
    "qwen3": (1, False, 40),
    "mistral": (2, False, None),
    "qwen3_moe": (1, False, 40),
    "mixtral": (2, False, None),
}


def small_config(arch: str) -> dict:
    values = dict(SMALL)
    if arch in ("qwen3", "qwen3_moe"):
        values["head_dim"] = 16
    return values


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    return [directory / "model.safetensors"]


def boost_rows(directory: Path, key: str, rows, factor: float) -> None:
    """Scale rows ``rows`` of tensor ``key`` in a checkpoint directory (sharded or not)."""
    rows = list(rows)
    for path in _shard_files(directory):
        state = load_file(str(path))
        if key in state:
            state[key][rows] *= factor
            save_file(state, str(path), metadata={"format": "pt"})
            return
    raise KeyError(f"{key} not found in {directory}")


def eagle3_draft_rows(directory: Path, target_ids) -> list[int]:
    """Draft-vocabulary ids of ``target_ids`` (through d2t when the head has one)."""
    state = load_file(str(directory / "model.safetensors"))
    if "d2t" not in state:
        return list(target_ids)
    mapped = (torch.arange(state["d2t"].shape[0]) + state["d2t"]).tolist()
    return [i for i, t in enumerate(mapped) if t in set(target_ids)]


@attrs.frozen
class ArchBundle:
    arch: str
    target: Path
    drafts: dict  # kind -> directory
    prompts: tuple[tuple[int, ...], ...]
    reference: tuple[tuple[int, ...], ...]  # transformers' greedy continuations


def make_prompts(n_or_lengths, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = n_or_lengths
    if isinstance(n_or_lengths, int):
        lengths = torch.randint(1, 30, (n_or_lengths,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def write_arch(root: Path, arch: str) -> tuple[Path, dict]:
    shards, tied, e3_vocab = ARCH_FORMAT[arch]
    target = write_hf_target(
        root / "target", arch, shards=shards, tie_word_embeddings=tied, **small_config(arch)
    )
    if tied:
        # a tied random model mostly repeats its input token (its hidden state stays close to
        # the token's embedding, which is also its lm_head row): shrink the embedding so that
        # the layers dominate the residual stream
        boost_rows(target, "model.embed_tokens.weight", range(VOCAB), 0.25)
    else:
        boost_rows(target, "lm_head.weight", STRONG_TOKENS, BOOST)
    drafts = {
        "eagle": write_eagle1_draft(root / "eagle", target),
        "eagle3": write_eagle3_draft(root / "eagle3", target, draft_vocab_size=e3_vocab),
        "mtp": write_mtp_draft(root / "mtp", target, num_layers=2),
        "standalone": write_standalone_draft(root / "standalone", target, arch, num_hidden_layers=1),
    }
    boost_rows(drafts["eagle3"], "lm_head.weight", eagle3_draft_rows(drafts["eagle3"], STRONG_TOKENS), BOOST)
    boost_rows(drafts["standalone"], "lm_head.weight", STRONG_TOKENS, BOOST)
    drafts["self"] = target  # the target as its own standalone draft: every draft accepted
    return target, drafts


def hf_greedy(target_dir: Path, prompts, new_tokens: int, *, stop_at_eos: bool = False) -> list[list[int]]:
    """transformers' own greedy ``generate`` of the target, one prompt at a time (no padding).
    ``stop_at_eos=False`` forbids EOS (``min_new_tokens``) so every continuation is full length."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)])
        kw = {} if stop_at_eos else {"min_new_tokens": new_tokens}
        seq = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # a token equal to pad_token_id is still real
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )[0, len(p):].tolist()
        out.append(seq)
    return out


@functools.cache
def _bundle(root: str, arch: str) -> ArchBundle:
    base = Path(root) / arch
    target, drafts = write_arch(base, arch)
    prompts = make_prompts(PROMPT_LENGTHS, seed=(*ARCHS, *MOE_ARCHS).index(arch))
    ref = hf_greedy(target, prompts, NEW_TOKENS)
    return ArchBundle(arch, target, drafts, tuple(map(tuple, prompts)), tuple(map(tuple, ref)))


def arch_bundle(tmp_root: Path, arch: str) -> ArchBundle:
    return _bundle(str(tmp_root), arch)


def engine_for(bundle: ArchBundle, method: str, *, topk: int = 1, num_steps: int = 3,
               num_draft_tokens: int | None = None, page_size: int = 1, draft: str | None = None,
               adaptive: bool | None = False, **kw) -> Engine:
    """An engine over the bundle's target (and the draft of ``method``); fixed-shape speculation
    unless ``adaptive`` says otherwise (the tests compare runs of one shape, also on a GPU)."""
    spec = SpecConfig(method="none")
    if method != "none":
        spec = SpecConfig(method=method, topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens,
                          adaptive=adaptive)
    draft_dir = None if method == "none" else bundle.drafts[draft or method]
    kw.setdefault("kv_pool_tokens", 4096)
    # the references are transformers' float32 greedy outputs; on a GPU machine the engine would
    # otherwise default to bfloat16, whose rounding picks other tokens at near-ties
    kw.setdefault("dtype", "float32")
    return Engine.from_pretrained(bundle.target, draft_dir, spec=spec, page_size=page_size, **kw)


def greedy(max_new_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


def assert_all_free(engine: Engine) -> None:
    engine.check()
    assert not engine.has_unfinished()
    assert engine.kv.num_free_pages == engine.kv.allocator.total, "KV pages leaked"
    assert engine.kv.table.rows_in_use() == [], "page-table rows leaked"


# ---------------------------------------------------------------------------------------------
# a target with a tokenizer (stop strings, text, the CLI)

CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "the quick brown fox jumps over the lazy dog. ",
    "for i in range(10):\n    print(i, i * i)\n",
    "speculative decoding drafts tokens and the target verifies them in one forward pass. ",
    "hello world! hello again, world. ",
]
EOS_TOKEN = "<eos>"


def write_tokenizer(directory: Path, vocab_size: int = 320) -> int:
    """A tiny byte-level BPE tokenizer (``tokenizers``), saved as a PreTrainedTokenizerFast in
    ``directory``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return len(fast)


@functools.cache
def _text_bundle(root: str) -> tuple[Path, dict, object]:
    base = Path(root) / "text"
    tok_dir = base / "target"
    vocab = write_tokenizer(tok_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    values = small_config("llama") | dict(vocab_size=vocab, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    target = write_hf_target(tok_dir, "llama", **values)
    # favour the merged tokens (readable ASCII from the corpus) over raw bytes, so that the
    # generated text is text a stop string can be picked from
    boost_rows(target, "lm_head.weight", range(257, vocab), 2.5)
    drafts = {
        "eagle3": write_eagle3_draft(base / "eagle3", target),
        "self": target,
    }
    return target, drafts, tokenizer


def text_bundle(tmp_root: Path):
    """(target dir with a tokenizer, drafts, the tokenizer)."""
    return _text_bundle(str(tmp_root))
