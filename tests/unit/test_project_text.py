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


def test_the_readme_virtual_environments_are_ignored_by_git(repo_root):
    """The Quick start makes its environments inside the checkout: git must not list them."""
    import shutil
    import subprocess

    readme = repo_root / "README.md"
    if not readme.is_file() or not (repo_root / ".git").exists() or not shutil.which("git"):
        pytest.skip("no git checkout with its README here")
    venvs = sorted(set(re.findall(r"python3? -m venv (\S+)", readme.read_text())))
    assert venvs, "the README creates no virtual environment"
    for venv in venvs:
        probe = f"{venv.rstrip('/')}/bin/python"
        proc = subprocess.run(
            ["git", "-C", str(repo_root), "check-ignore", "-q", "--no-index", probe],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, f"{venv} is not in .gitignore ({proc.stderr.strip()})"


#: Wording that only makes sense in the history of a change, not to a reader of a release.
COMMIT_RELATIVE = re.compile(
    r"\b(?:the|this|a|our) (?:next|previous|last|following) commit\b|\bthis commit\b", re.IGNORECASE
)


def test_the_readme_does_not_speak_of_commits_relative_to_itself(repo_root):
    readme = repo_root / "README.md"
    if not readme.is_file():
        pytest.skip(f"no README at {repo_root} (tests run from an installed copy)")
    hits = [
        f"README.md:{n}: {line.strip()}"
        for n, line in enumerate(readme.read_text().splitlines(), 1)
        if COMMIT_RELATIVE.search(line)
    ]
    assert not hits, "\n".join(hits)
