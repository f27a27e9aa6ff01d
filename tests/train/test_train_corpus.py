"""The stdlib corpus: file selection, the stable held-out split, held-out prompts."""

from __future__ import annotations

import re

import pytest

from phasegraph.train import corpus
from phasegraph.train.corpus import (
    bucket_of,
    heldout_files,
    heldout_prompts,
    list_files,
    split_files,
    split_of,
)


def test_bucket_is_a_fixed_function_of_the_path():
    # SHA-1 of the relative path, first 8 bytes big-endian, mod 20: the same on every machine.
    assert bucket_of("os.py") == 9
    assert bucket_of("typing.py") == 2
    assert bucket_of("json/__init__.py") == 12
    assert split_of("asyncio/taskgroups.py") == "heldout"
    assert split_of("os.py") == "train"


def test_splits_are_disjoint_and_cover_every_file():
    files = list_files()
    splits = split_files()
    names = {k: {f.relpath for f in v} for k, v in splits.items()}
    assert not names["train"] & names["heldout"]
    assert not names["train"] & names["valid"]
    assert not names["valid"] & names["heldout"]
    assert names["train"] | names["valid"] | names["heldout"] == {f.relpath for f in files}
    assert [f.relpath for f in heldout_files()] == sorted(names["heldout"])
    share = len(names["heldout"]) / len(files)
    assert 0.02 < share < 0.09  # bucket 0 of 20
    for f in splits["heldout"]:
        assert bucket_of(f.relpath) == 0


def test_stdlib_selection_excludes_tests_site_packages_and_big_files():
    files = list_files()
    assert files, "the stdlib has Python sources"
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    for f in files:
        parts = f.relpath.split("/")[:-1]
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts)
        assert f.size <= corpus.MAX_FILE_BYTES
        assert f.relpath.endswith(".py")
    assert any(f.relpath == "os.py" for f in files)


def test_selection_rules_on_a_fake_tree(tmp_path):
    def put(rel: str, size: int = 10) -> None:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x" * size)

    put("a.py")
    put("pkg/b.py")
    put("pkg/notes.txt")
    put("test/test_a.py")
    put("idlelib/idle_test/t.py")
    put("lib2to3/tests/data/f.py")
    put("ctypes/test/t.py")
    put("site-packages/x/y.py")
    put("pkg/test_helpers/z.py")
    put("big.py", corpus.MAX_FILE_BYTES + 1)
    assert [f.relpath for f in list_files(tmp_path)] == ["a.py", "pkg/b.py"]


def test_split_caps_are_deterministic_and_respected():
    caps = {"train": 300_000, "heldout": 50_000}
    a = split_files(max_bytes=caps)
    b = split_files(max_bytes=caps)
    assert [f.relpath for f in a["train"]] == [f.relpath for f in b["train"]]
    assert sum(f.size for f in a["train"]) <= 300_000
    assert sum(f.size for f in a["heldout"]) <= 50_000
    assert a["valid"] == split_files()["valid"]  # uncapped split untouched


_HEADER = re.compile(r"^\s*(async\s+def|def|class)\s+\w+.*:\s*(#.*)?$")


@pytest.mark.parametrize("max_lines", [20, 40])
def test_heldout_prompts_end_at_a_definition_header(max_lines):
    prompts = heldout_prompts(max_lines=max_lines)
    held = [f.relpath for f in heldout_files()]
    assert prompts and [p.relpath for p in prompts] == [r for r in held if r in
                                                        {p.relpath for p in prompts}]
    assert heldout_prompts(max_lines=max_lines) == prompts  # deterministic
    n_header = 0
    for p in prompts:
        lines = p.text.splitlines()
        assert p.text.strip()
        if _HEADER.match(lines[-1]):
            n_header += 1
            assert len(lines) <= 3 * max_lines
        else:
            assert len(lines) <= max_lines
    assert n_header >= len(prompts) // 2
    assert len(heldout_prompts(max_lines=max_lines, max_prompts=3)) == 3
