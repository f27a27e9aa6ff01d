"""``phasegraph import-gguf FILE OUT_DIR``: a GGUF file as a Hugging Face checkpoint directory
(config.json, model.safetensors, tokenizer files), which every other command loads."""

from __future__ import annotations

import argparse
import time

from phasegraph.cli.common import CliError


def run_import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from phasegraph.runtime.models.gguf import DONE_MARKER, convert_gguf

    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise CliError(f"OUT_DIR {args.out_dir!r} is a file, not a directory")
    already = (out / DONE_MARKER).is_file()
    start = time.perf_counter()
    directory = convert_gguf(args.file, out, progress=True)
    if already:
        print(f"{directory} already holds the conversion of {args.file}")
    else:
        print(f"converted {args.file} into {directory} in {time.perf_counter() - start:.1f} s")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("import-gguf", help="convert a .gguf file into a Hugging Face checkpoint directory")
    p.add_argument("file", metavar="FILE", help="the .gguf file (any quantization transformers reads)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (created; must be empty)")
    p.set_defaults(func=run_import_gguf)
