"""``python -m pytest tests`` collects every tier in one run.

pytest's default import mode imports a test module by its basename, so two files of the same
name in ``tests/unit`` and ``tests/mpi`` stop the whole collection ("import file mismatch").
The same holds for the helper modules the tiers put on ``sys.path`` (``_threadgroup``,
``reliability_cases``, ...). Without a GPU the ``tests/mpi`` and ``tests/gpu`` tests are skipped,
but they must still collect.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest


@pytest.fixture(scope="module")
def tests_dir(repo_root):
    d = repo_root / "tests"
    if not (d / "unit").is_dir():
        pytest.skip(f"no test tree at {d}")
    return d


def test_no_two_test_tree_modules_share_a_basename(tests_dir):
    seen = defaultdict(list)
    for p in sorted(tests_dir.rglob("*.py")):
        if p.name in ("conftest.py", "__init__.py") or "__pycache__" in p.parts:
            continue
        seen[p.name].append(str(p.relative_to(tests_dir)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, (
        f"modules of the same basename under tests/ (pytest imports them by "
        f"basename, so collection fails): {clashes}"
    )


def test_pytest_collects_the_whole_test_tree(tests_dir, run_cmd):
    # From a scratch folder (run_cmd's cwd), so that the dcpkit under test is the one imported.
    proc = run_cmd(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", str(tests_dir)],
        timeout=300,
        # not this session's options (CI's --junitxml would be written by the child too)
        env={"PYTEST_ADDOPTS": "-p no:cacheprovider"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"pytest --collect-only tests exited {proc.returncode}:\n{out[-4000:]}"
    )
    for tier in ("unit", "mpi", "gpu"):
        assert f"tests/{tier}/test_" in proc.stdout, (
            f"no test of tests/{tier} was collected:\n{out[-2000:]}"
        )
