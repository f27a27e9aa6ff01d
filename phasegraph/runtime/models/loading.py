"""Reading checkpoint directories strictly.

A directory holds ``config.json`` plus ``model.safetensors``, or shards listed by
``model.safetensors.index.json``, or (draft heads only) ``pytorch_model.bin``. Every tensor the
model expects must be present with the right shape, and nothing unexpected may be present: the
reference EAGLE loader uses ``strict=False`` and silently leaves missing keys random, which is
the failure this module exists to make loud (:class:`CheckpointMismatch`). Unreadable files raise
:class:`CheckpointFileError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from phasegraph.runtime.errors import (
    CheckpointFileError,
    CheckpointMismatch,
    PhasegraphRuntimeError,
)
from phasegraph.statemachine.errors import one_line

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN_FILE = "pytorch_model.bin"

# Keys some public checkpoints carry that no model needs (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# config.json fields read as sizes: each present one must be an integer >= 1 (transformers
# builds a model from a zero or negative size, or fails deep inside torch)
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "draft_vocab_size",
    "target_hidden_size",
)


EPSILON_FIELDS = ("rms_norm_eps",)


def read_json_object(path: Path) -> dict:
    """A checkpoint directory's JSON file (``config.json``, ``generation_config.json``) as a
    dict; unreadable or not an object: :class:`CheckpointFileError` naming the file."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFileError(f"{path}: cannot parse {path.name} ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointFileError(f"{path}: {path.name} must hold a JSON object; got a {type(raw).__name__}")
    return raw


def read_config(directory: str | Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict, its size fields checked."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        why = (
            "the directory does not exist" if not directory.exists()
            else "it is a file, not a checkpoint directory" if not directory.is_dir()
            else "the directory holds no config.json"
        )
        raise CheckpointFileError(f"{path}: config.json not found ({directory}: {why})")
    raw = read_json_object(path)
    for name in SIZE_FIELDS:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointFileError(f"{path}: {name} must be an integer >= 1; got {value!r}")
    for name in EPSILON_FIELDS:  # a zero or negative epsilon turns every norm into NaN
        value = raw.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise CheckpointFileError(f"{path}: {name} must be a number > 0; got {value!r}")
    return raw


def _config_file(directory: str | Path | None) -> Path | str:
    """What an error about a config names: its ``config.json``, or "config" for one built in code."""
    return Path(directory) / "config.json" if directory is not None else "config"


@contextlib.contextmanager
def config_errors(directory: str | Path | None) -> Iterator[None]:
    """Turn transformers' rejection of a config (its own validators, a RoPE type it does not
    know, sizes that do not divide) into :class:`CheckpointFileError` naming the file."""
    try:
        yield
    except PhasegraphRuntimeError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers/huggingface_hub raise their own types
        where = _config_file(directory)
        raise CheckpointFileError(
            f"{where}: transformers cannot build a model from this config "
            f"({type(exc).__name__}: {one_line(str(exc), 300)})"
        ) from exc


def check_model_parts(config, directory: str | Path | None) -> None:
    """Build the config's rotary embedding on the meta device (no memory, no compute) and look
    up its activation: a RoPE type or parameters, or a ``hidden_act``, that transformers rejects
    fail here, as :class:`CheckpointFileError`, rather than as a ``KeyError`` from deep inside
    the model's construction."""
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with config_errors(directory), torch.device("meta"):
        LlamaRotaryEmbedding(config=config)
    activation = getattr(config, "hidden_act", None)
    if activation is not None and (not isinstance(activation, str) or activation not in ACT2FN):
        raise CheckpointFileError(
            f"{_config_file(directory)}: hidden_act {activation!r} is not an activation transformers knows"
        )


class Checkpoint:
    """Lazy read access to the tensors of one checkpoint directory."""

    def __init__(self, directory: str | Path, *, allow_bin: bool = False) -> None:
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}  # key -> file
        self._bin: dict[str, torch.Tensor] | None = None
        single = self.directory / SAFETENSORS_FILE
        index = self.directory / SAFETENSORS_INDEX
        binary = self.directory / TORCH_BIN_FILE
        if single.is_file():
            self._add_safetensors(single)
        elif index.is_file():
            self._add_index(index)
        elif allow_bin and binary.is_file():
            self._add_bin(binary)
        else:
            looked = [SAFETENSORS_FILE, SAFETENSORS_INDEX] + (
                [TORCH_BIN_FILE] if allow_bin else []
            )
            raise CheckpointFileError(
                f"{self.directory}: no checkpoint file found (looked for {', '.join(looked)})"
            )
        self.shapes: dict[str, tuple[int, ...]] = {k: self._shape(k) for k in self._where}

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def files_of(self, key: str) -> Path:
        """The file that holds tensor ``key``."""
        return self._where[key]

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, key: str) -> torch.Tensor:
        """One tensor, on the CPU, in its stored dtype."""
        path = self._where[key]
        if self._bin is not None:
            return self._bin[key]
        try:
            return self._handles[path].get_tensor(key)
        except Exception as exc:  # safetensors raises its own exception types
            raise CheckpointFileError(f"{path}: cannot read tensor {key!r} ({exc})") from exc

    # -- opening ------------------------------------------------------------------------------

    def _open(self, path: Path) -> object:
        if not path.is_file():
            raise CheckpointFileError(f"{path}: file not found")
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError (truncated, corrupt header), OSError
            raise CheckpointFileError(
                f"{path}: not a readable safetensors file, truncated or corrupt ({exc})"
            ) from exc
        self._handles[path] = handle
        return handle

    def _add_safetensors(self, path: Path) -> None:
        handle = self._open(path)
        for key in handle.keys():
            self._where[key] = path

    def _add_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointFileError(f"{index}: cannot parse the shard index ({exc})") from exc
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointFileError(
                f"{index}: cannot parse the shard index (weight_map must map tensor names to shard "
                f"file names; got {one_line(repr(weight_map), 120)})"
            )
        for shard in sorted(set(weight_map.values())):
            path = self.directory / shard
            handle = self._open(path)
            for key in handle.keys():
                if key in self._where:
                    raise CheckpointFileError(
                        f"{path}: tensor {key!r} also appears in {self._where[key]}"
                    )
                self._where[key] = path
        for key, shard in weight_map.items():
            if self._where.get(key) != self.directory / shard:
                raise CheckpointFileError(
                    f"{index}: lists {key!r} in {shard}, but that shard does not hold it"
                )

    def _add_bin(self, path: Path) -> None:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointFileError(
                f"{path}: not a readable torch checkpoint, truncated or corrupt ({exc})"
            ) from exc
        if not isinstance(state, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in state.values()
        ):
            raise CheckpointFileError(f"{path}: expected a flat state dict of tensors")
        self._bin = dict(state)
        for key in self._bin:
            self._where[key] = path

    def _shape(self, key: str) -> tuple[int, ...]:
        if self._bin is not None:
            return tuple(self._bin[key].shape)
        path = self._where[key]
        try:
            return tuple(self._handles[path].get_slice(key).get_shape())
        except Exception as exc:
            raise CheckpointFileError(
                f"{path}: cannot read the header of {key!r} ({exc})"
            ) from exc


def alias_groups(module: torch.nn.Module) -> list[list[str]]:
    """State-dict keys grouped by the tensor they name (tied weights share a group)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def check_keys(
    where: str,
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    *,
    alias: Iterable[Iterable[str]] = (),
    allowed_extra: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Raise :class:`CheckpointMismatch` unless ``found`` covers ``expected`` exactly.

    ``alias`` groups expected keys naming one tensor (tied weights): one of each group suffices.
    ``allowed_extra`` keys may be present (shape-checked) and are otherwise ignored.
    """
    allowed_extra = dict(allowed_extra or {})
    groups = [list(g) for g in alias]
    grouped = {k for g in groups for k in g}
    groups += [[k] for k in expected if k not in grouped]
    missing = [g[0] for g in groups if not any(k in found for k in g)]
    unexpected = [
        k
        for k in found
        if k not in expected and k not in allowed_extra and not k.endswith(IGNORED_SUFFIXES)
    ]
    mismatched = []
    for key, shape in found.items():
        want = expected.get(key, allowed_extra.get(key))
        if want is not None and tuple(shape) != tuple(want):
            mismatched.append((key, tuple(shape), tuple(want)))
    if missing or unexpected or mismatched:
        raise CheckpointMismatch(where, missing, unexpected, mismatched)


@torch.no_grad()
def load_into_module(
    module: torch.nn.Module,
    checkpoint: Checkpoint,
    *,
    allowed_extra: Mapping[str, tuple[int, ...]] | None = None,
    progress: bool = False,
) -> None:
    """Check keys/shapes strictly, then copy every tensor into ``module`` (converting dtype);
    ``progress``: a bar over the tensors."""
    check_module_keys(module, checkpoint, allowed_extra=allowed_extra)
    load_tensors(module, checkpoint, progress=progress)


def check_module_keys(
    module: torch.nn.Module,
    checkpoint: Checkpoint,
    *,
    allowed_extra: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """:func:`check_keys` of ``module``'s state against ``checkpoint`` (a module on the meta
    device works: only shapes are read)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    check_keys(str(checkpoint.directory), expected, checkpoint.shapes, alias=alias_groups(module),
               allowed_extra=allowed_extra)


@torch.no_grad()
def load_tensors(module: torch.nn.Module, checkpoint: Checkpoint, prefix: str = "", *,
                 progress: bool = False) -> None:
    """Copy into ``module`` every tensor of its state that ``checkpoint`` holds under ``prefix``
    + its name (keys checked before); a NaN or infinite value raises :class:`CheckpointFileError`.
    ``progress``: a bar over the tensors."""
    from tqdm.auto import tqdm

    state = module.state_dict(keep_vars=True)
    bar = tqdm(state.items(), total=len(state), desc=f"loading {checkpoint.directory.name}", unit="tensor",
               disable=not progress)
    for name, tensor in bar:
        key = prefix + name
        if key not in checkpoint.shapes:  # a tied alias, loaded through the name the file uses
            continue
        tensor.copy_(checkpoint.get(key))
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointFileError(
                f"{checkpoint.files_of(key)}: tensor {key!r} holds {bad} NaN or infinite values "
                f"(as loaded in {tensor.dtype}); every output would be garbage"
            )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(directory: Path):
    """The directory's tokenizer, or None where it ships none. Unreadable tokenizer files raise
    :class:`CheckpointFileError` naming them (transformers raises whatever its parser met)."""
    present = [f for f in TOKENIZER_FILES if (directory / f).exists()]
    if not present:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001 - tokenizers/transformers/json raise their own types
        raise CheckpointFileError(
            f"{directory}: cannot load the tokenizer from {', '.join(present)} "
            f"({type(exc).__name__}: {one_line(str(exc), 200)})"
        ) from exc
