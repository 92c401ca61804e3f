"""scripts/gpu_suite.sh on a machine without GPUs (and with one, faked): it must fail loudly
instead of dropping every GPU stage and exiting 0.

``nvidia-smi`` is replaced by a script of the test's own on PATH, and ``CUDA_VISIBLE_DEVICES``
is empty so that CuPy's count is 0 too; only the info stage runs (no GPU work anywhere).
"""

import os
import shutil
import stat
import sys

import pytest


def _fake_nvidia_smi(bindir, gpus: int):
    bindir.mkdir(exist_ok=True)
    lines = "".join(f"GPU {i}: Fake GPU (UUID: GPU-{i})\\n" for i in range(gpus))
    p = bindir / "nvidia-smi"
    p.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def run_suite(repo_root, run_cmd, tmp_path):
    script = repo_root / "scripts" / "gpu_suite.sh"
    if not script.is_file() or shutil.which("bash") is None:
        pytest.skip("no scripts/gpu_suite.sh in this checkout, or no bash")

    def run(gpus: int, stages: str):
        _fake_nvidia_smi(tmp_path / "bin", gpus)
        out = tmp_path / f"out{gpus}"
        env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               "CUDA_VISIBLE_DEVICES": "", "OUT": str(out), "PYTHON": sys.executable,
               "TMPDIR": str(tmp_path), "DCPKIT_SUITE_STAGES": stages}
        proc = run_cmd(["bash", str(script)], timeout=300, env=env)
        summary = (out / "summary.txt").read_text() if (out / "summary.txt").is_file() else ""
        return proc, summary

    return run


def test_no_gpu_exits_2_after_info(run_suite):
    proc, summary = run_suite(0, "info,tests,demo,bench")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{text}"
    assert "no GPU found on this machine" in text, text
    assert "stages after info not run" in text
    assert "info - 0" in summary, summary          # the info stage ran, and passed
    assert "gpus - 2 0 no GPU found" in summary, summary
    for stage in ("mpitests", "gputests", "demo", "bench"):
        assert f"{stage} N=" not in text, f"{stage} ran without a GPU:\n{text}"


def test_stages_without_a_world_size_fail(run_suite):
    """One GPU, default world sizes 2 and 4: the mpirun stages cannot run; say so, exit 1."""
    proc, summary = run_suite(1, "info,mpitests")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit {proc.returncode}\n{text}"
    assert "stage mpitests not run: no world size of '2 4' fits 1 GPU(s)" in text, text
    assert "mpitests - 1 0 not run" in summary, summary
