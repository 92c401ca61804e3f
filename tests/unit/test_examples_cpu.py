"""The scripts in examples/ on a machine without GPU: ``mpirun -np 2 python examples/<name>.py``
ends on every rank with exit status 2 and one line from rank 0 saying why, never a traceback
or a PASS. (tests/gpu/test_examples.py runs them where there are GPUs.)"""

from __future__ import annotations

import sys

import pytest

from dcpkit import info

NAMES = ["cupy_decode_step", "dcpcomm_step", "torch_cuda_graph", "vllm_api"]


@pytest.fixture(scope="module")
def examples_dir(repo_root):
    d = repo_root / "examples"
    if not d.is_dir():
        pytest.skip(f"no {d} (tests run from an installed copy without the checkout)")
    return d


def test_every_example_is_listed_in_the_readme(examples_dir, repo_root):
    readme = (repo_root / "README.md").read_text()
    on_disk = sorted(p.stem for p in examples_dir.glob("*.py"))
    assert on_disk == sorted(NAMES)
    for name in NAMES:
        assert f"mpirun -np 2 python examples/{name}.py" in readme, name


@pytest.mark.parametrize("name", NAMES)
def test_example_without_a_gpu_says_so_and_exits_2(examples_dir, mpi_launcher, run_cmd, name):
    if info.collect()["gpu_count"] > 0:
        pytest.skip("this machine has a GPU: tests/gpu/test_examples.py runs the examples")
    cmd = mpi_launcher.command(2, sys.executable, str(examples_dir / f"{name}.py"))
    proc = run_cmd(cmd, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: "), proc.stdout
    assert "PASS" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
