"""The project's own text (code, scripts, tests, examples) speaks of the project: how to run
it and what it needs, not the machines it happens to be developed on."""

from __future__ import annotations

import re

import pytest

#: Phrases of that kind; each once appeared in a help text or a skip reason.
PHRASES = re.compile(r"GPU machines|machines return|\b\d+ s call\b|\blent\b", re.IGNORECASE)
FOLDERS = ("dcpkit", "scripts", "tests", "examples", "kernels")
SUFFIXES = {".py", ".sh", ".cu", ".cuh", ".h", ".toml", ".md", ".txt"}


def test_no_development_machine_words(repo_root):
    if not (repo_root / "scripts").is_dir():
        pytest.skip(f"no checkout at {repo_root} (tests run from an installed copy)")
    this = repo_root / "tests" / "unit" / "test_project_text.py"
    hits = []
    for folder in FOLDERS:
        for path in sorted((repo_root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or path == this or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if PHRASES.search(line):
                    hits.append(f"{path.relative_to(repo_root)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
