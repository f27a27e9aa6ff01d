"""GGUF files as Hugging Face checkpoint directories, converted once and cached.

:func:`convert_gguf` reads a ``.gguf`` file through transformers' GGUF support (which
dequantizes every tensor with the ``gguf`` package, in float32) and writes ``config.json``,
``model.safetensors`` and the tokenizer files the GGUF carries (vocabulary, merges, special
tokens, chat template) into a directory the rest of the runtime loads like any other.

The default directory is ``<cache>/gguf/<key>``, where ``<cache>`` is ``$PHASEGRAPH_CACHE`` or
the user cache dir (``$XDG_CACHE_HOME/phasegraph``, ``~/.cache/phasegraph``) and ``<key>`` the
SHA-256 of the file's first 16 MiB and its size: the same file converts once, an edited one
again. A conversion writes into a temporary sibling and renames it into place when complete, so
an interrupted one leaves nothing that looks done. Nothing is fetched: ``HF_HUB_OFFLINE`` is set
while transformers reads the file.

Needs the optional extra ``phasegraph[gguf]`` (``gguf``, and ``accelerate``, which transformers'
GGUF loading imports at present).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from phasegraph.runtime.errors import GGUFConversionError
from phasegraph.statemachine.errors import one_line

GGUF_MAGIC = b"GGUF"
KEY_BYTES = 16 << 20  # the part of the file the cache key hashes
DONE_MARKER = ".phasegraph-gguf"  # written last: its presence means the directory is complete


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a ``.gguf`` file (by its suffix; the magic is checked on read)."""
    return str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted GGUF directories live: ``$PHASEGRAPH_CACHE/gguf``, else the user cache
    dir's ``phasegraph/gguf``."""
    explicit = os.environ.get("PHASEGRAPH_CACHE")
    if explicit:
        return Path(explicit) / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "phasegraph" / "gguf"


def cache_key(path: str | os.PathLike) -> str:
    """SHA-256 of the file's first :data:`KEY_BYTES` bytes and its size (reading a multi-GB
    file whole at every start would cost more than the conversion saves)."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(KEY_BYTES))
    digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()[:32]


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise GGUFConversionError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFConversionError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def _check_dependencies() -> None:
    missing = [name for name in ("gguf", "accelerate") if not _importable(name)]
    if missing:
        raise GGUFConversionError(
            f"reading GGUF files needs {', '.join(missing)}: pip install 'phasegraph[gguf]'"
        )


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


@contextlib.contextmanager
def _hf_progress(progress: bool) -> Iterator[None]:
    """transformers' own bars (dequantizing, loading weights) only with ``progress``: without
    it a conversion inside another command (the demo's first run) prints nothing."""
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    # the dequantizing loop calls tqdm directly, past transformers' own switch
    bar = getattr(gguf_utils, "tqdm", None)
    if not progress:
        hf_logging.disable_progress_bar()
        if bar is not None:
            gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if not progress:
            if was:
                hf_logging.enable_progress_bar()
            if bar is not None:
                gguf_utils.tqdm = bar


def convert_gguf(
    path: str | os.PathLike, out_dir: str | os.PathLike | None = None, *, progress: bool = False
) -> Path:
    """The Hugging Face directory of the GGUF file ``path``: ``out_dir`` if given (written
    unless it already holds a complete conversion), else the cache entry of the file
    (:func:`cache_root`, :func:`cache_key`), converted on the first call only. ``progress``
    shows a tqdm bar over the steps (reading and dequantizing is the long one)."""
    path = Path(path)
    _check_file(path)
    target = Path(out_dir) if out_dir is not None else cache_root() / cache_key(path)
    if (target / DONE_MARKER).is_file():
        return target
    if target.exists() and any(target.iterdir()):
        raise GGUFConversionError(f"{target}: exists and holds something else than a finished conversion")
    _check_dependencies()
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    steps = tqdm(total=3, desc=f"converting {path.name}", unit="step", disable=not progress)
    try:
        with _offline(), _hf_progress(progress):
            model, tokenizer = _read(path, steps)
            steps.set_postfix_str("writing safetensors")
            _write_model(model, staging)
            tokenizer.save_pretrained(str(staging))
            steps.update()
        (staging / DONE_MARKER).write_text(f"{path.name}\n{cache_key(path)}\n")
        if target.exists():
            target.rmdir()  # empty (checked above)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        steps.close()
    return target


def _write_model(model, directory: Path) -> None:
    """``config.json`` and ``model.safetensors`` of the dequantized model. transformers marks a
    GGUF-loaded model as quantized and its ``save_pretrained`` refuses it, though every weight
    is a plain float32 tensor by then: write them directly, without the quantization entry."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding, which the loader ties back
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(directory))


def _read(path: Path, steps):
    """(model, tokenizer) of the GGUF file, float32, through transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phasegraph.runtime.models.target import check_model_type

    folder, name = str(path.parent), path.name
    steps.set_postfix_str("reading and dequantizing")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers and gguf raise their own types
        raise GGUFConversionError(
            f"{path}: transformers cannot read this GGUF file ({type(exc).__name__}: {one_line(str(exc), 300)})"
        ) from exc
    check_model_type(getattr(model.config, "model_type", None), str(path))
    steps.update()
    steps.set_postfix_str("reading the tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # noqa: BLE001 - llama.cpp writes a tokenizer into every GGUF
        raise GGUFConversionError(
            f"{path}: cannot read the tokenizer ({type(exc).__name__}: {one_line(str(exc), 300)})"
        ) from exc
    steps.update()
    return model, tokenizer
