"""Byte-level BPE tokenizer (``tokenizers`` library) trained on the corpus' train split.

One special token, ``<|endoftext|>`` (id 0): it is EOS, BOS and pad, and it separates documents
in the packed token stream. No post-processor, so encoding a prompt adds no special tokens.
Saved as ``tokenizer.json`` + ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained(dir)`` and
``PreTrainedTokenizerFast(tokenizer_file=...)`` load offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["EOS_TOKEN", "encode_stream", "load_tokenizer", "save_tokenizer", "train_tokenizer"]

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE. Deterministic for a given list of texts (the merge order breaks
    count ties by pair id, and ids come from the sorted byte alphabet)."""
    if vocab_size < 257:
        raise ValueError("vocab_size must cover the 256 byte symbols and <|endoftext|>")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise RuntimeError("expected <|endoftext|> to have id 0")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: Path) -> Tokenizer:
    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def encode_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Pack documents into one int64 stream: ``doc0 <eos> doc1 <eos> ...``."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)
