"""The training corpus: the Python sources of the installed standard library.

Every machine has one, so the recipe needs no download. Files are listed by their path relative
to ``sysconfig.get_paths()["stdlib"]`` (POSIX separators), sorted, and split by a stable hash of
that relative path, so a given file lands in the same split on every machine and every Python
version (files that exist only in some versions simply join their bucket there):

- ``heldout``: SHA-1 bucket 0 of 20 (5%). Never trained on; the report's held-out figures and the
  prompts of the demo and the benchmarks come from it.
- ``valid``: bucket 1 of 20 (5%). Used only to pick the best checkpoint during training.
- ``train``: the other 18 buckets.

Excluded: anything under ``site-packages``/``dist-packages``/``__pycache__``, test directories
(``test``, ``tests``, ``idle_test``, ``*_test``, ``*_tests``, ``test_*``) and files over 200 KB.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_FILE_BYTES",
    "NUM_BUCKETS",
    "Prompt",
    "SourceFile",
    "heldout_files",
    "heldout_prompts",
    "list_files",
    "read_texts",
    "split_files",
    "split_of",
    "stdlib_root",
]

NUM_BUCKETS = 20
HELDOUT_BUCKET = 0
VALID_BUCKET = 1
MAX_FILE_BYTES = 200_000
SPLITS = ("train", "valid", "heldout")

_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path relative to the stdlib root
    path: Path
    size: int  # bytes on disk


@dataclass(frozen=True)
class Prompt:
    relpath: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(part: str) -> bool:
    return (
        part in _EXCLUDED_DIRS
        or part.startswith("test_")
        or part.endswith(("_test", "_tests"))
    )


def bucket_of(relpath: str) -> int:
    """Stable bucket in ``[0, NUM_BUCKETS)`` of a relative path (SHA-1 of its UTF-8 bytes)."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % NUM_BUCKETS


def split_of(relpath: str) -> str:
    bucket = bucket_of(relpath)
    if bucket == HELDOUT_BUCKET:
        return "heldout"
    if bucket == VALID_BUCKET:
        return "valid"
    return "train"


def list_files(root: Path | None = None) -> list[SourceFile]:
    """Every corpus file under ``root`` (default: the stdlib), sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]  # prune while walking
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            if not path.is_file():
                continue
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                continue
            files.append(SourceFile(path.relative_to(root).as_posix(), path, size))
    files.sort(key=lambda f: f.relpath)
    return files


def split_files(
    root: Path | None = None, max_bytes: dict[str, int | None] | None = None
) -> dict[str, list[SourceFile]]:
    """Files of each split, sorted by relative path.

    ``max_bytes[split]`` caps a split: files are taken in the order of their full SHA-1 (a
    deterministic, directory-independent sample) until the cap would be passed, then re-sorted.
    """
    out: dict[str, list[SourceFile]] = {s: [] for s in SPLITS}
    for f in list_files(root):
        out[split_of(f.relpath)].append(f)
    for split, cap in (max_bytes or {}).items():
        if cap is None:
            continue
        chosen, total = [], 0
        for f in sorted(out[split], key=lambda f: hashlib.sha1(f.relpath.encode()).hexdigest()):
            if total + f.size > cap:
                continue
            chosen.append(f)
            total += f.size
        out[split] = sorted(chosen, key=lambda f: f.relpath)
    return out


def heldout_files(root: Path | None = None) -> list[SourceFile]:
    """The held-out files (bucket 0 of 20), sorted by relative path."""
    return split_files(root)["heldout"]


def read_text(f: SourceFile) -> str:
    return f.path.read_bytes().decode("utf-8", errors="replace")


def read_texts(files: Iterable[SourceFile]) -> list[str]:
    return [read_text(f) for f in files]


_HEADER = re.compile(r"^\s*(async\s+def|def|class)\s+\w+.*:\s*(#.*)?$")


def _prompt_cut(lines: list[str], min_lines: int, max_lines: int) -> int:
    """Number of lines to keep: through the last one-line ``def``/``class`` header that ends at
    or before ``max_lines`` (and at or after ``min_lines``); else the first such header up to
    ``3 * max_lines``; else ``max_lines``."""
    best = None
    for i, line in enumerate(lines[: 3 * max_lines]):
        if i + 1 < min_lines or not _HEADER.match(line.rstrip("\n")):
            continue
        if i + 1 <= max_lines:
            best = i + 1
        elif best is None:
            return i + 1
        else:
            break
    return best if best is not None else min(max_lines, len(lines))


def heldout_prompts(
    max_lines: int = 40,
    min_lines: int = 8,
    max_prompts: int | None = None,
    root: Path | None = None,
    files: list[SourceFile] | None = None,
) -> list[Prompt]:
    """One prompt per held-out file: its first lines, cut right after a function/class header.

    The prompt ends with the header line (``def name(...):`` or ``class Name(...):``) so the
    continuation is that definition's body. Files shorter than ``min_lines`` lines are skipped.
    Deterministic: files in relative-path order, the first ``max_prompts`` kept.
    """
    files = files if files is not None else heldout_files(root)
    prompts = []
    for f in files:
        lines = read_text(f).splitlines(keepends=True)
        if len(lines) < min_lines:
            continue
        cut = _prompt_cut(lines, min_lines, max_lines)
        text = "".join(lines[:cut])
        if not text.strip():
            continue
        prompts.append(Prompt(f.relpath, text))
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
    return prompts
