"""What every example in this folder does around dcpkit: connect to the ``mpirun`` world, print
from rank 0, and say in one line what is missing. Not an example itself; the examples import it
(Python puts a script's own folder first on ``sys.path``)."""

from __future__ import annotations

import dcpkit


def say(comm, *args) -> None:
    """Print on rank 0 only."""
    if comm.rank == 0:
        print(*args, flush=True)


def connect(name: str):
    """The ``mpirun`` world, or None after one line saying why it cannot be had (no mpi4py, or
    the launcher of another MPI library: it started several processes but MPI sees one)."""
    try:
        return dcpkit.Communicator.from_mpi()
    except dcpkit.DcpkitError as e:
        print(f"{name}: {' '.join(str(e).split())}", flush=True)
        return None


def gpu_count() -> int:
    """CUDA GPUs CuPy sees (0 without a driver)."""
    import cupy

    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


def gpus_on_every_rank(comm, name: str) -> int:
    """The CUDA GPUs this rank sees, or 0 after rank 0 said in one line why a rank has none
    (CuPy not installed, no driver, no device). Collective."""
    try:
        n = gpu_count()
        why = "" if n > 0 else "a rank sees no CUDA GPU (`dcpkit info` says why)"
    except ImportError as e:
        n, why = 0, missing(e)
    problems = [w for w in comm.allgather(why) if w]
    if problems:
        say(comm, f"{name}: {problems[0]}")
        return 0
    return n


def torch_problem(torch) -> str:
    """What keeps an example from running torch on a GPU here ("" when nothing does)."""
    if torch is None:
        return "torch is not installed: install it with pip install 'dcpkit[torch]'"
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU build: install a CUDA build of torch "
            f"(matching the cuda12 / cuda13 extra)"
        )
    return "" if torch.cuda.is_available() else "torch sees no CUDA GPU"


def missing(e: ImportError) -> str:
    """The one line for a missing module, naming the extra that brings it."""
    top = (e.name or "").split(".")[0]
    if top == "torch":
        return torch_problem(None)
    if top == "cupy":
        return "CuPy is not installed: install it with pip install 'dcpkit[cuda12]' (or cuda13)"
    return f"a module is missing ({e})"
