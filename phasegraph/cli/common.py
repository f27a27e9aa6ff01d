"""What every command shares: the user-facing error, the argument parser that reports usage
errors in one line, and the checks of file and number options made before any work."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with usage errors as one ``phasegraph: error: ...`` line, exit status 2
    (subcommand parsers are built with this class too)."""

    def error(self, message: str):
        print(f"phasegraph: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# ``graph --out FILE``: the format a file name's suffix asks for (any other suffix: text)
FORMAT_OF_SUFFIX = {".png": "png", ".svg": "svg", ".dot": "dot", ".gv": "dot", ".mmd": "mermaid",
                    ".mermaid": "mermaid"}


def graph_format(fmt: str | None, out: str | None) -> str:
    """``--format``, else the one ``--out``'s suffix names, else text; a format that contradicts
    the suffix is a :class:`CliError` (text in a ``.png`` would be no picture)."""
    implied = FORMAT_OF_SUFFIX.get(Path(out).suffix.lower()) if out else None
    if fmt is None:
        return implied or "text"
    if implied is not None and implied != fmt:
        raise CliError(f"--out {out} names a {implied} file but --format is {fmt}: drop --format or "
                       "change the suffix")
    return fmt


def require_at_least(option: str, value: int, least: int) -> None:
    """A :class:`CliError` unless the number given to ``option`` is at least ``least``."""
    if value < least:
        raise CliError(f"{option} must be at least {least}, got {value}")


def require_name(option: str, value: str | None, kind: str) -> None:
    """A :class:`CliError` if ``option`` was given an empty ``kind`` name ("file", "directory"):
    "" would silently mean the current directory, stdout or no file at all."""
    if value is not None and not value.strip():
        raise CliError(f"{option} needs a {kind} name, got an empty one")


def writable_file(path: str, option: str) -> Path:
    """``path`` as a file a command may write, checked before any work: a :class:`CliError` if it
    names a directory, its directory is missing, or the file cannot be opened for writing (a
    read-only place; the check opens it for appending and removes it again if it was new)."""
    file = Path(path)
    if file.is_dir():
        raise CliError(f"{option} {path}: is a directory, not a writable file path")
    parent = file.resolve().parent
    if not parent.is_dir():
        where = f"{parent} is a file, not a directory" if parent.exists() else f"directory {parent} does not exist"
        raise CliError(f"{option} {path}: {where} (not a writable file path)")
    existed = file.exists()
    try:
        open(file, "ab").close()  # opened only to learn that it can be
    except OSError as exc:
        raise CliError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        file.unlink(missing_ok=True)
    return file
