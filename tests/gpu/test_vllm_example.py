"""examples/vllm_api.py runs and passes: ``mpirun -np 2 python examples/vllm_api.py``, as a user
starts it (its ``run()`` also runs inside the MPI job of tests/mpi/test_vllm.py at every world
size).

Run as ONE process (not under mpirun); the test starts its own MPI job::

    python -m pytest tests/gpu/test_vllm_example.py -p no:cacheprovider

Ranks may share a GPU (the example's gloo group works there; best under an MPS daemon, as
``scripts/gpu_suite.sh`` runs it with ``DCPKIT_SUITE_SHARED_GPU=1 DCPKIT_SUITE_MPS=1``). The job
must exit 0, print one line per rank and PASS as its last line; the multicast-disabling
variables are passed on unchanged.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "mpi" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from reliability_cases import (  # noqa: E402 - needs the path set above
    REPO_ROOT,
    Job,
    find_mpirun,
    job_env,
    mpi_flavor,
    mpirun_command,
)

EXAMPLE = REPO_ROOT / "examples" / "vllm_api.py"
NP = 2
WAIT_S = 240


def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return 0


NUM_GPUS = _gpu_count()
pytestmark = pytest.mark.skipif(NUM_GPUS < 1, reason="no CUDA GPU visible here")


@pytest.mark.timeout(WAIT_S + 60)
@pytest.mark.parametrize("backend", ["a2a"])
def test_vllm_example_passes(tmp_path, backend):
    launched = [os.environ.get(v, "") for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")]
    if any(v not in ("", "1") for v in launched):
        pytest.skip("tests/gpu launch their own MPI jobs: run pytest as one process")
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed here (pip install 'dcpkit[torch]')")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    exe = find_mpirun()
    if exe is None:
        pytest.skip("no mpirun / mpiexec found (set DCPKIT_MPIRUN)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    cmd = mpirun_command(exe, mpi_flavor(exe), NP, [str(EXAMPLE), "--comm-backend", backend])
    job = Job(cmd, env=job_env(), cwd=REPO_ROOT, log_prefix=tmp_path / "vllm_api").wait(WAIT_S)
    out = job.output(6000)
    assert not job.timed_out, f"vllm_api did not finish within {WAIT_S} s\n{out}"
    assert job.returncode == 0, f"vllm_api exited {job.returncode}\n{out}"
    lines = [line for line in job.out_path.read_text().splitlines() if line.strip()]
    assert lines and lines[-1] == "PASS", f"vllm_api: last line is not PASS\n{out}"
    assert sum("decode step: max abs error" in line for line in lines) == NP, out
    assert any("'combine': 'direct-a2a'" in line for line in lines), out
