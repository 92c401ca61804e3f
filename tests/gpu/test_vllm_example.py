"""examples/vllm_api.py end to end: ``mpirun -np 2 python examples/vllm_api.py`` exits 0 and
says PASS, with every rank's line. (Its ``run()`` also runs inside the MPI job of
tests/mpi/test_vllm.py at every world size; this test checks the script as a user starts it.)

Run as ONE process (not under mpirun)::

    python -m pytest tests/gpu/test_vllm_example.py -p no:cacheprovider

Ranks may share a GPU (the example uses a gloo group, which works there); under an MPS daemon
its variables are passed on to the ranks. The multicast-disabling variables are passed on as
they are.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "vllm_api.py"
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_")
KEEP_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")
WAIT_S = 240


def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return 0


NUM_GPUS = _gpu_count()
pytestmark = pytest.mark.skipif(NUM_GPUS < 1, reason="no CUDA GPU visible here")


def _mpirun():
    exe = os.environ.get("DCPKIT_MPIRUN") or shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpirun / mpiexec found (set DCPKIT_MPIRUN)")
    if any(k.startswith(("OMPI_COMM_WORLD", "PMI_RANK", "PMIX_RANK")) for k in os.environ):
        pytest.skip("this test launches its own MPI jobs: run pytest as one process, not under "
                    "mpirun")
    text = subprocess.run([exe, "--version"], capture_output=True, text=True,
                          timeout=30).stdout.lower()
    flags = []
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        flags = ["--oversubscribe", "-x", "PYTHONPATH"]
        flags += [a for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
                  if k in os.environ for a in ("-x", k)]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return exe, flags


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) or k.startswith(KEEP_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.mark.timeout(WAIT_S + 60)
@pytest.mark.parametrize("np_, backend", [(2, "a2a")])
def test_example_passes(np_, backend):
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    exe, flags = _mpirun()
    cmd = [exe, *flags, "-np", str(np_), sys.executable, str(EXAMPLE), "--comm-backend",
           backend]
    p = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {WAIT_S} s (hang)\n{out}\n{err}")
    detail = f"{' '.join(cmd)}: exit {p.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert p.returncode == 0, detail
    assert "verdict    PASS" in out, detail
    assert out.count("decode step: max abs error") == np_, detail
