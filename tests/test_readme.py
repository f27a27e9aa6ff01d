"""The README as a new user reads it: its "Using it" snippet runs as written (on this machine's
CPU, against the embedded pair), it starts with the two commands for a fresh machine, it stays
short, and every page it links to exists in a clone."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MOST_LINES = 150  # details live in docs/


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_the_using_it_snippet_runs_as_written(capsys):
    (code,) = re.findall(r"```python\n(.*?)```", _section(README.read_text(), "Using it"), re.S)
    exec(compile(code, f"{README}:Using it", "exec"), {"__name__": "readme"})
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("r1 ") for line in lines)
    assert any(line.startswith("r2 ") and line.endswith(" abort") for line in lines), "r2 was not aborted while it ran"
    assert not any(line.startswith("r2 ") and line.endswith(" length") for line in lines)


def test_the_readme_starts_with_the_two_commands_and_stays_short():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)[1]
    commands = [line for line in first_block.splitlines() if not line.startswith("#")]
    assert commands == ["scripts/install.sh && .venv/bin/phasegraph demo",
                        "scripts/install.sh test && .venv/bin/python -m pytest -q -n auto"]
    assert text.index("```bash") < text.index("\n## ")
    assert len(text.splitlines()) <= MOST_LINES


def test_every_page_the_docs_link_to_is_in_the_repository():
    for page in (README, *sorted((REPO / "docs").glob("*.md"))):
        text = page.read_text()
        assert "../shared/" not in text, f"{page.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
    text = README.read_text()
    for needed in ("docs/performance.md", "docs/validation.md", "docs/usage.md", "docs/models.md"):
        assert f"]({needed})" in text, needed
