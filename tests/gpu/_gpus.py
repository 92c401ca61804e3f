"""What the GPU tests ask of this machine before they run: the number of GPUs visible
(:data:`NUM_GPUS`) and whether ranks may share one (:data:`SHARED_GPU`)."""

from __future__ import annotations

import os


def gpu_count() -> int:
    """The number of CUDA GPUs visible here (0 without CuPy, a driver or a device)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return 0


NUM_GPUS = gpu_count()
#: DCPKIT_ALLOW_SHARED_GPU=1: several ranks of a job may share one GPU.
SHARED_GPU = os.environ.get("DCPKIT_ALLOW_SHARED_GPU", "") not in ("", "0")


def mpi_launcher() -> tuple[str, str]:
    """``(mpirun, flavour)`` for the MPI jobs these tests start themselves
    (tests/mpi/scripts/reliability_cases.py: ``find_mpirun``, ``mpi_flavor``). Skips the test
    when pytest itself runs under mpirun (these tests must run as one process), when no launcher
    is found, or without mpi4py."""
    import importlib.util
    import sys
    from pathlib import Path

    import pytest

    launched = [os.environ.get(v, "") for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")]
    if any(v not in ("", "1") for v in launched):
        pytest.skip(
            "tests/gpu launch their own MPI jobs: run pytest as one process, not under mpirun"
        )
    scripts = str(Path(__file__).resolve().parents[1] / "mpi" / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from reliability_cases import find_mpirun, mpi_flavor

    exe = find_mpirun()
    if exe is None:
        pytest.skip("no mpirun / mpiexec found (set DCPKIT_MPIRUN)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    return exe, mpi_flavor(exe)
