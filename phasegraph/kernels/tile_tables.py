"""The tuned launch tables of the matrix products, read from one data file per GPU.

Three tables, each an ordered list of rules where the first rule that matches a product's row
count and weight shape decides: ``skinny_half`` and ``skinny_float32`` for the skinny product of
1..16 rows (:mod:`~phasegraph.kernels.linear`; bfloat16 and float16 read the half table) and
``tiled_float32`` for float32 products of 17..512 rows (:mod:`~phasegraph.kernels.tiled_linear`).

Files: ``configs/<name>.json`` beside this module, ``<name>`` being
``torch.cuda.get_device_name()`` with every character that is not a letter or digit replaced by
``_`` (:func:`file_name`: ``NVIDIA_H100_80GB_HBM3.json``). A GPU without its own file, and a
device that is not a CUDA GPU, reads ``configs/generic.json``. ``PHASEGRAPH_TILE_TABLE=path.json``
makes every device read that file instead; like the kernel settings of ``_dispatch.py`` it is
read on every lookup, so a test may set it with ``monkeypatch.setenv``. A file is read once per
device and path (:func:`clear_cache` forgets them). ``benchmarks/bench_linear.py --write-table``
writes the current GPU's file.

Format: an object with the three tables, each ``{"source": "how it was measured", "rules":
[...]}``.

- A skinny rule, ``{"m_max": 4, "n": 768, "k": [1, 4096], "config": {...}, "plain": true,
  "fused": false}``, takes the products of at most ``m_max`` rows whose weight ``[n, k]`` lies in
  its ranges, where no earlier rule took them. ``config``: the :class:`SkinnyConfig` fields
  (``block_n``, ``block_k``, ``num_warps``, ``num_stages`` and ``dot``; ``swap``, ``pdl``,
  ``precision`` and ``split_k`` where not their defaults). ``plain``: the Triton product runs
  ``linear`` (else cuBLAS); ``fused``: it runs the fused prologue forms (else the norm / silu
  kernel, then the product).
- A tiled rule, ``{"m": [17, 32], "n": 1280, "k": 768, "summed": {...}, "deferred": {...}}``:
  the :class:`TileConfig` fields (``split_k`` where not 1) for a caller that needs the sum and
  for one that takes a :class:`~phasegraph.kernels.split_sum.SplitSum`; no ``deferred`` means the
  same tile as ``summed``, and ``null`` means cuBLAS keeps the product.
- A range is an integer (that value alone), ``[lo, hi]`` (inclusive; ``hi`` null: no bound) or
  ``"any"``.

A file that cannot be read, is not JSON, lacks a table or holds a bad entry raises
:class:`TileTableError`, naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

ENV_VAR = "PHASEGRAPH_TILE_TABLE"
GENERIC = "generic.json"
UNBOUNDED = 1 << 40  # the upper end of a range without one
ANY = (1, UNBOUNDED)
TABLES = ("skinny_half", "skinny_float32", "tiled_float32")


class TileTableError(ValueError):
    """A tile-table file that cannot be read, is not JSON, or holds a bad entry (the message
    names the file and the entry)."""


class SkinnyConfig(NamedTuple):
    """Launch shape of the skinny product (one program per ``block_n`` output columns)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot: bool  # tl.dot on a 16-row tile (else a broadcast multiply-sum over next_pow2(M) rows)
    swap: bool = False  # with dot: W is the left operand (acc [BLOCK_N, 16]); else x is
    pdl: bool = False  # programmatic dependent launch even where PHASEGRAPH_PDL turns it off
    # (bench_linear's PDL rows); otherwise the setting decides, as for every kernel (_dispatch)
    precision: str = "ieee"  # a float32 tl.dot: "ieee" (FMA units) or "tf32x3" (three TF32
    # tensor-core products per tile, hi*hi + hi*lo + lo*hi: float32-level error); half dtypes
    # ignore it
    split_k: int = 1  # > 1: K in that many slices, one program each (more programs in flight for
    # few output columns); the last slice of a column block to finish sums the partials in slice
    # order (deterministic); plain products and the silu prologue (elementwise, so a slice needs
    # only its own columns of gate and up), not the norm (row statistics over the whole K)


class SkinnyRule(NamedTuple):
    m_max: int  # products of at most this many rows (that no earlier rule took)
    n_range: tuple[int, int]  # [lo, hi] inclusive
    k_range: tuple[int, int]
    config: SkinnyConfig
    plain: bool  # Triton for `linear` (else cuBLAS)
    fused: bool  # Triton for the fused prologue forms (else norm/silu kernel + the product)


class TileConfig(NamedTuple):
    """Launch shape of the tiled product."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # K in that many slices, one program each, partials summed in slice order


class TileRule(NamedTuple):
    m_range: tuple[int, int]  # rows, [lo, hi] inclusive
    n_range: tuple[int, int]
    k_range: tuple[int, int]
    summed: TileConfig | None  # for a caller that needs the sum (None: cuBLAS keeps it)
    deferred: TileConfig | None  # for a caller that takes a SplitSum (``defer``)


@dataclasses.dataclass(frozen=True)
class TileTables:
    """The three tables of one file, and the ``source`` line of each."""

    skinny_half: tuple[SkinnyRule, ...]
    skinny_float32: tuple[SkinnyRule, ...]
    tiled_float32: tuple[TileRule, ...]
    sources: Mapping[str, str]
    path: str = dataclasses.field(default="", compare=False)  # the file it was read from

    def skinny(self, dtype: torch.dtype) -> tuple[SkinnyRule, ...]:
        """The skinny product's rules for ``dtype``."""
        return self.skinny_float32 if dtype == torch.float32 else self.skinny_half


def match_skinny(rules: Sequence[SkinnyRule], m: int, n: int, k: int) -> SkinnyRule | None:
    """The first rule that takes ``m`` rows of an ``[n, k]`` weight, or None."""
    for rule in rules:
        if m <= rule.m_max and rule.n_range[0] <= n <= rule.n_range[1] \
                and rule.k_range[0] <= k <= rule.k_range[1]:
            return rule
    return None


def match_tile(rules: Sequence[TileRule], m: int, n: int, k: int) -> TileRule | None:
    """The first rule that takes ``m`` rows of an ``[n, k]`` weight, or None."""
    for rule in rules:
        if rule.m_range[0] <= m <= rule.m_range[1] and rule.n_range[0] <= n <= rule.n_range[1] \
                and rule.k_range[0] <= k <= rule.k_range[1]:
            return rule
    return None


# --------------------------------------------------------------------------------------------
# Which file a device reads


def file_name(gpu_name: str) -> str:
    """The table file of the GPU that ``torch.cuda.get_device_name()`` calls ``gpu_name``."""
    return re.sub(r"[^A-Za-z0-9]", "_", gpu_name) + ".json"


def shipped_file(name: str) -> Traversable:
    """``configs/<name>`` of the installed package (a path on a plain install)."""
    return resources.files(__package__).joinpath("configs", name)


def _device_index(device: torch.device | None) -> int | None:
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _device_file(index: int | None) -> Traversable:
    if index is not None:
        own = shipped_file(file_name(torch.cuda.get_device_name(index)))
        if own.is_file():
            return own
    return shipped_file(GENERIC)


def table_file(device: torch.device | None = None) -> Traversable | Path:
    """The file ``device`` reads (``None``: the current CUDA device, if any):
    ``$PHASEGRAPH_TILE_TABLE``, else the GPU's own, else ``generic.json``."""
    override = os.environ.get(ENV_VAR, "").strip()
    return Path(override) if override else _device_file(_device_index(device))


def tables_for(device: torch.device | None = None) -> TileTables:
    """The tables ``device`` reads (``None``: the current CUDA device, if any); a dictionary
    lookup after the first call per device and file."""
    return _tables(os.environ.get(ENV_VAR, "").strip(), _device_index(device))


@functools.cache
def _tables(override: str, index: int | None) -> TileTables:
    return read_tables(Path(override) if override else _device_file(index))


def clear_cache() -> None:
    """Forget the files read and the GPU names looked up (after a file changed)."""
    _tables.cache_clear()
    _device_file.cache_clear()


# --------------------------------------------------------------------------------------------
# Reading and validating


def read_tables(path: Traversable | str | os.PathLike) -> TileTables:
    """The tables of the file at ``path``, validated."""
    path = Path(path) if isinstance(path, (str, os.PathLike)) else path
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TileTableError(f"{path}: cannot read the tile table ({exc.strerror or exc})") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TileTableError(f"{path}: not a JSON tile table ({exc})") from None
    return parse_tables(data, str(path))


def parse_tables(data: Any, where: str) -> TileTables:
    """The tables of a decoded file (``where`` names it in errors)."""
    _fields(data, where, set(TABLES), set())
    tables, sources = {}, {}
    for name in TABLES:
        at = f"{where}: {name}"
        table = data[name]
        _fields(table, at, {"source", "rules"}, set())
        if not isinstance(table["source"], str):
            raise TileTableError(f"{at}: source: expected a string, got {table['source']!r}")
        if not isinstance(table["rules"], list):
            raise TileTableError(f"{at}: rules: expected a list, got {table['rules']!r}")
        parse = _tile_rule if name == "tiled_float32" else _skinny_rule
        tables[name] = tuple(parse(rule, f"{at} rule {i}")
                             for i, rule in enumerate(table["rules"]))
        sources[name] = table["source"]
    return TileTables(**tables, sources=sources, path=where)


def _fields(entry: Any, at: str, required: set[str], optional: set[str]) -> None:
    if not isinstance(entry, dict):
        raise TileTableError(f"{at}: expected an object with {', '.join(sorted(required))}, "
                             f"got {entry!r}")
    missing, unknown = required - entry.keys(), entry.keys() - required - optional
    if missing:
        raise TileTableError(f"{at}: missing {', '.join(sorted(missing))} in {entry!r}")
    if unknown:
        raise TileTableError(f"{at}: unknown {', '.join(sorted(unknown))} in {entry!r}")


def _positive(value: Any, at: str, power_of_two: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 \
            or (power_of_two and value & (value - 1)):
        kind = "a power of two" if power_of_two else "a positive integer"
        raise TileTableError(f"{at}: expected {kind}, got {value!r}")
    return value


def _flag(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise TileTableError(f"{at}: expected true or false, got {value!r}")
    return value


def _range(value: Any, at: str) -> tuple[int, int]:
    if value == "any":
        return ANY
    if isinstance(value, int) and not isinstance(value, bool):
        return _positive(value, at), value
    if isinstance(value, list) and len(value) == 2:
        lo = _positive(value[0], f"{at}[0]")
        hi = UNBOUNDED if value[1] is None else _positive(value[1], f"{at}[1]")
        if lo <= hi:
            return lo, hi
    raise TileTableError(f'{at}: expected an integer, [lo, hi] with lo <= hi, or "any"; '
                         f"got {value!r}")


_POWERS_OF_TWO = {"block_m", "block_n", "block_k", "num_warps"}  # Triton block shapes and warps
_PRECISIONS = ("ieee", "tf32x3")


def _config(cls: type, entry: Any, at: str) -> Any:
    defaults = cls._field_defaults
    _fields(entry, at, set(cls._fields) - defaults.keys(), set(defaults))
    values = {}
    for field in cls._fields:
        value = entry.get(field, defaults.get(field))
        if field in ("dot", "swap", "pdl"):
            values[field] = _flag(value, f"{at}.{field}")
        elif field == "precision":
            if value not in _PRECISIONS:
                raise TileTableError(f"{at}.precision: expected one of {', '.join(_PRECISIONS)}, "
                                     f"got {value!r}")
            values[field] = value
        else:
            values[field] = _positive(value, f"{at}.{field}", field in _POWERS_OF_TWO)
    return cls(**values)


def _skinny_rule(entry: Any, at: str) -> SkinnyRule:
    _fields(entry, at, {"m_max", "n", "k", "config", "plain", "fused"}, set())
    rule = SkinnyRule(
        _positive(entry["m_max"], f"{at}: m_max"), _range(entry["n"], f"{at}: n"),
        _range(entry["k"], f"{at}: k"), _config(SkinnyConfig, entry["config"], f"{at}: config"),
        _flag(entry["plain"], f"{at}: plain"), _flag(entry["fused"], f"{at}: fused"),
    )
    if rule.fused and rule.config.split_k > 1:  # the norm prologue needs the whole K
        raise TileTableError(f"{at}: a split-K config (split_k {rule.config.split_k}) takes no "
                             "fused prologue; set fused to false")
    return rule


def _tile_rule(entry: Any, at: str) -> TileRule:
    _fields(entry, at, {"m", "n", "k", "summed"}, {"deferred"})
    summed = deferred = None
    if entry["summed"] is not None:
        summed = deferred = _config(TileConfig, entry["summed"], f"{at}: summed")
    if entry.get("deferred") is not None:
        deferred = _config(TileConfig, entry["deferred"], f"{at}: deferred")
    return TileRule(_range(entry["m"], f"{at}: m"), _range(entry["n"], f"{at}: n"),
                    _range(entry["k"], f"{at}: k"), summed, deferred)


# --------------------------------------------------------------------------------------------
# Writing (the tuner)


def _range_json(span: tuple[int, int]) -> Any:
    lo, hi = span
    if span == ANY:
        return "any"
    return lo if lo == hi else [lo, None if hi == UNBOUNDED else hi]


def _config_json(config: NamedTuple) -> dict:
    defaults = type(config)._field_defaults
    return {f: v for f, v in config._asdict().items() if f not in defaults or v != defaults[f]}


def _rule_json(rule: SkinnyRule | TileRule) -> dict:
    if isinstance(rule, SkinnyRule):
        return {"m_max": rule.m_max, "n": _range_json(rule.n_range),
                "k": _range_json(rule.k_range), "config": _config_json(rule.config),
                "plain": rule.plain, "fused": rule.fused}
    out = {"m": _range_json(rule.m_range), "n": _range_json(rule.n_range),
           "k": _range_json(rule.k_range),
           "summed": None if rule.summed is None else _config_json(rule.summed)}
    if rule.deferred != rule.summed:  # left out: the same tile
        out["deferred"] = None if rule.deferred is None else _config_json(rule.deferred)
    return out


def format_tables(tables: TileTables) -> str:
    """The file text of ``tables``: one rule per line, in order."""
    parts = []
    for name in TABLES:
        rules = [f"      {json.dumps(_rule_json(rule))}" for rule in getattr(tables, name)]
        listed = "[\n" + ",\n".join(rules) + "\n    ]" if rules else "[]"
        parts.append(f'  "{name}": {{\n    "source": {json.dumps(tables.sources[name])},\n'
                     f'    "rules": {listed}\n  }}')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_tables(path: str | os.PathLike, tables: TileTables) -> None:
    """Write ``tables`` to ``path`` in the file format (validated first, as a reader would)."""
    text = format_tables(tables)
    parse_tables(json.loads(text), str(path))
    Path(path).write_text(text, encoding="utf-8")
