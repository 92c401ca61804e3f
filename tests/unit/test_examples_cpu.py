"""The scripts in examples/ on a machine without GPU: ``mpirun -np 2 python examples/<name>.py``
ends on every rank with exit status 2 and one line from rank 0 saying why, never a traceback
or a PASS. (tests/gpu/test_examples.py runs them where there are GPUs.)"""

from __future__ import annotations

import os
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
    on_disk = sorted(p.stem for p in examples_dir.glob("*.py") if not p.stem.startswith("_"))
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


#: The extras each example needs, as its docstring must name them (``pip install`` line).
EXTRAS = {
    "cupy_decode_step": {"mpi"},
    "dcpcomm_step": {"mpi"},
    "torch_cuda_graph": {"mpi", "torch"},
    "vllm_api": {"mpi", "torch"},
}


@pytest.mark.parametrize("name", NAMES)
def test_docstring_names_the_extras_to_install(examples_dir, name):
    """A reader learns what to install from the extras, not from bare module names."""
    import ast
    import re

    doc = ast.get_docstring(ast.parse((examples_dir / f"{name}.py").read_text()))
    found = re.findall(r"pip install '(?:dcpkit|\.)\[([a-z0-9_,-]+)\]'", doc)
    assert found, f"{name}: the docstring gives no pip install line with the extras"
    extras = set(found[0].split(","))
    assert extras >= EXTRAS[name] and extras & {"cuda12", "cuda13"}, (name, extras)


@pytest.mark.parametrize("name", ["torch_cuda_graph", "vllm_api"])
def test_torch_example_without_a_cuda_torch_names_the_extra(
    examples_dir, mpi_launcher, run_cmd, name
):
    """Without torch, or with a CPU build of torch, the one line says what to install."""
    if info.collect()["gpu_count"] > 0:
        pytest.skip("this machine has a GPU: tests/gpu/test_examples.py runs the examples")
    cmd = mpi_launcher.command(2, sys.executable, str(examples_dir / f"{name}.py"))
    proc = run_cmd(cmd, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    try:
        import torch
    except ImportError:
        assert "dcpkit[torch" in proc.stdout, proc.stdout
    else:
        if torch.version.cuda is None:
            assert "CPU build" in proc.stdout and "CUDA build of torch" in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", NAMES)
def test_example_under_a_launcher_of_another_mpi_says_so_and_exits_2(
    examples_dir, run_cmd, skip_or_fail, name
):
    """A launcher that started 2 processes while mpi4py sees a 1-rank world (the launcher of
    another MPI library): one line naming the mismatch, exit status 2, no traceback."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        skip_or_fail("mpi4py is not installed: pip install 'dcpkit[mpi]'")
    proc = run_cmd(
        [sys.executable, str(examples_dir / f"{name}.py")],
        timeout=120,
        env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, (proc.stdout, proc.stderr)
    assert lines[0].startswith(f"{name}: ") and "launcher started 2 processes" in lines[0], lines


@pytest.mark.parametrize("name", ["cupy_decode_step", "dcpcomm_step"])
def test_cupy_example_without_cupy_names_the_extra(
    examples_dir, mpi_launcher, run_cmd, tmp_path, name
):
    """Without CuPy (no CUDA extra installed) the one line says what to install, no traceback."""
    from conftest import subprocess_env

    blocker = tmp_path / "no_cupy" / "cupy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError(\"No module named 'cupy'\", name='cupy')\n"
    )
    path = os.pathsep.join([str(blocker.parent), subprocess_env()["PYTHONPATH"]])
    cmd = mpi_launcher.command(2, sys.executable, str(examples_dir / f"{name}.py"))
    proc = run_cmd(cmd, timeout=120, env={"PYTHONPATH": path})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{name}: "), (proc.stdout, proc.stderr)
    assert "dcpkit[cuda12]" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
