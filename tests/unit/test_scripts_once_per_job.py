"""The scripts' lines before they run: ``scripts/host_overhead.py`` without a GPU says so once
per MPI job (every rank exits 2), and every line a script writes to stderr starts with one
prefix, its path (``scripts/soak.py: ...``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from _scripts import ROOT, load_file


def _id(v):
    return (" ".join(v) or "(none)") if isinstance(v, list) else str(v)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _script(repo_root: Path, name: str) -> Path:
    path = repo_root / "scripts" / name
    if not path.is_file():
        pytest.skip(f"no {path} (tests run from an installed copy without the checkout)")
    return path


def _no_gpu():
    from dcpkit import info

    if info.collect()["gpu_count"] > 0:
        pytest.skip("this machine has a GPU: the no-GPU line is not printed here")


def test_host_overhead_without_a_gpu_prints_once_under_mpirun(repo_root, mpi_launcher, run_cmd):
    _no_gpu()
    script = _script(repo_root, "host_overhead.py")
    proc = run_cmd(mpi_launcher.command(2, sys.executable, str(script)), timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = _lines(proc.stdout + proc.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith("scripts/host_overhead.py: needs a CUDA GPU"), lines
    assert "rank" not in lines[0], lines


def test_host_overhead_under_another_launcher_speaks_from_its_rank_0(
    repo_root, run_python, skip_or_fail
):
    """Under the launcher of another MPI library the ranks cannot agree over MPI: the process
    the launcher calls rank 0 prints the line, every process exits with status 2."""
    if importlib.util.find_spec("mpi4py") is None:
        skip_or_fail("mpi4py is not installed: pip install 'dcpkit[mpi]'")
    _no_gpu()
    script = _script(repo_root, "host_overhead.py")
    for rank, printed in (("0", 1), ("1", 0)):
        env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": rank}
        r = run_python([str(script)], env=env)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = _lines(r.stdout + r.stderr)
        assert len(lines) == printed, (rank, lines)


def test_host_overhead_names_ranks_only_where_they_differ():
    mod = load_file(ROOT / "scripts" / "host_overhead.py", "_host_overhead")
    assert mod._no_gpu_line([None, None]) is None
    assert mod._no_gpu_line(["x", "x"]) == "x"
    assert mod._no_gpu_line([None, "x"]) == "rank 1: x"
    assert mod._no_gpu_line(["x", "y", "x"]) == "ranks 0, 2: x; rank 1: y"


@pytest.mark.parametrize("argv", [[], ["--calls", "0"], ["--bogus"]], ids=lambda v: _id(v))
def test_soak_lines_have_one_prefix(argv, repo_root, run_python):
    if not argv:
        _no_gpu()
    r = run_python([str(_script(repo_root, "soak.py")), *argv])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = _lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("scripts/soak.py: "), lines
    assert not lines[0].startswith("soak:"), lines
