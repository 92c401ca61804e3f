"""The scripts in examples/ run and pass: ``mpirun -np 2 python examples/<name>.py``.

Run as ONE process (not under mpirun); each test starts its own MPI job::

    python -m pytest tests/gpu/test_examples.py -p no:cacheprovider

With fewer than 2 GPUs the ranks share one (set ``DCPKIT_ALLOW_SHARED_GPU=1``; best under an
MPS daemon, as ``scripts/gpu_suite.sh`` runs it with ``DCPKIT_SUITE_SHARED_GPU=1
DCPKIT_SUITE_MPS=1``). Each job must exit 0 and print PASS as its last line on rank 0; the
multicast-disabling variables are passed on unchanged.
"""

import sys
from pathlib import Path

import pytest
from _gpus import NUM_GPUS, SHARED_GPU, mpi_launcher

SCRIPTS = Path(__file__).resolve().parents[1] / "mpi" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from reliability_cases import REPO_ROOT, Job, job_env, mpirun_command  # noqa: E402 - needs the path set above

EXAMPLES = REPO_ROOT / "examples"
NP = 2
WAIT_S = 240


pytestmark = pytest.mark.skipif(
    NUM_GPUS < NP and not (SHARED_GPU and NUM_GPUS >= 1),
    reason=f"needs {NP} GPUs (have {NUM_GPUS}; DCPKIT_ALLOW_SHARED_GPU=1 lets ranks share GPUs)",
)


@pytest.fixture(scope="module")
def launcher():
    return mpi_launcher()


def _torch_with_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.timeout(WAIT_S + 60)
@pytest.mark.parametrize(
    "name", ["cupy_decode_step", "dcpcomm_step", "torch_cuda_graph", "vllm_api"]
)
def test_example_passes(tmp_path, launcher, name):
    if name in ("torch_cuda_graph", "vllm_api") and not _torch_with_cuda():
        pytest.skip(
            "torch with CUDA is not installed here (pip install 'dcpkit[torch-cu12]', or torch-cu13)"
        )
    exe, flavor = launcher
    # The README's command, mpirun -np 2 python examples/<name>.py, with the launcher's flags
    cmd = mpirun_command(exe, flavor, NP, [str(EXAMPLES / f"{name}.py")])
    job = Job(cmd, env=job_env(), cwd=REPO_ROOT, log_prefix=tmp_path / name).wait(WAIT_S)
    out = job.output(6000)
    assert not job.timed_out, f"{name} did not finish within {WAIT_S} s\n{out}"
    assert job.returncode == 0, f"{name} exited {job.returncode}\n{out}"
    lines = [line for line in job.out_path.read_text().splitlines() if line.strip()]
    assert lines and lines[-1] == "PASS", f"{name}: last line is not PASS\n{out}"
