"""What every example in this folder does around dcpkit: parse its command line (``--help``
prints the example's docstring: what it does, what it needs, how to launch it), connect to the
``mpirun`` world, print from rank 0, and say in one line what is missing. Not an example itself;
the examples import it (Python puts a script's own folder first on ``sys.path``)."""

from __future__ import annotations

import argparse
import os
import re

import dcpkit
from dcpkit.cli import CommandParser, job_leader


def parser(script: str, doc: str) -> CommandParser:
    """The command line of the example ``script`` (its ``__file__``): ``--help`` prints ``doc``
    (the example's docstring) without the reST markup, and the options; a bad value, or a bad
    ``DCPKIT_TIMEOUT_MS``, is one line and exit status 2 (:func:`parse_args`). Under mpirun only
    the launcher's rank 0 prints."""
    text = re.sub(r"``([^`]+)``", r"\1", doc.strip())
    text = re.sub(r":(?:class|func|meth):`~?([^`]+)`", r"\1", text).replace("::\n", ":\n")
    base = os.path.basename(script)
    return CommandParser(
        prog=os.path.splitext(base)[0],  # the prefix of the example's other one-line messages
        usage=f"mpirun -np N python examples/{base} [options]",
        help_command=f"python examples/{base}",
        description=text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse_args(p: CommandParser, argv=None) -> argparse.Namespace:
    """``p.parse_args(argv)``, then ``DCPKIT_TIMEOUT_MS`` checked: the ops read it, and a bad
    value is better refused here than on the GPU, inside the first collective."""
    args = p.parse_args(argv)
    p.timeout_from_env()
    return args


def integer(minimum: int, maximum: int | None = None):
    """An argparse ``type=`` for an integer in ``[minimum, maximum]``."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bounds} (got {text!r})")
        return value

    return parse


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
        if job_leader():  # no shared world to agree in: the launcher's rank 0 says it
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
        from dcpkit._cuda import torch_extra

        return f"torch is not installed: install it with pip install 'dcpkit[{torch_extra()}]'"
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
