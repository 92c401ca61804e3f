"""Fixtures of the multi-GPU tests. Launch with

    mpirun -np N python -m pytest tests/mpi -p no:cacheprovider

Every rank runs the same tests in the same order. A test must make every collective call on
every rank before it asserts (assert after the collectives, or agree on failure with
``comm.allgather``), so that a failing rank never leaves its peers waiting.

Where there is no GPU, or fewer ranks than two, every test here is skipped with the reason.

NCCL needs one GPU per rank. Where ranks of a host share a GPU (a functional run with more ranks
than GPUs), a test that needs NCCL takes the ``nccl_usable`` fixture and is skipped with the
reason; a test that checks the NCCL path only in part asks ``nccl_expected`` (True where every
rank has a GPU of its own: there the NCCL part must run and pass). Tests of the direct path run
either way.
"""

import os

import numpy as np
import pytest


def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "no GPU"
        return 0


NUM_GPUS = _gpu_count()


def pytest_collection_modifyitems(config, items):
    if NUM_GPUS == 0:
        skip = pytest.mark.skip(reason="no CUDA GPU visible here (tests/mpi need GPUs)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def comm():
    """The MPI world as a dcpkit Communicator, with this rank's GPU selected (local_rank)."""
    import cupy

    from dcpkit.comm import Communicator

    c = Communicator.from_mpi()
    if c.world_size < 2:
        pytest.skip("tests/mpi need at least 2 ranks: run under mpirun -np N (N >= 2)")
    cupy.cuda.Device(c.local_rank % NUM_GPUS).use()
    return c


@pytest.fixture(scope="session")
def seed(comm):
    """A fresh random seed for this run, equal on every rank (set DCPKIT_TEST_SEED to replay)."""
    s = os.environ.get("DCPKIT_TEST_SEED")
    s = int(s) if s else int(np.random.SeedSequence().entropy % (2**31))
    s = comm.broadcast(s, root=0)
    if comm.rank == 0:
        print(f"\n[dcpkit tests] seed = {s} (replay with DCPKIT_TEST_SEED={s})")
    return s


def all_ranks_ok(comm, ok, what=""):
    """Agree across ranks: True only if ``ok`` holds on every rank (use before asserting)."""
    oks = comm.allgather(bool(ok))
    bad = [r for r, v in enumerate(oks) if not v]
    return (not bad), f"{what} failed on ranks {bad}"


def gpu_sharing(comm):
    """Collective (one allgather): ``[(pci_bus_id, [ranks])]`` for every GPU that two or more
    ranks of one host use (empty when every rank has a GPU of its own). Compares what NCCL
    compares in ``ncclCommInitRank``: the host and the PCI bus id of the current device."""
    import cupy

    bus = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id)
    ranks_of = {}
    for r, key in enumerate(comm.allgather((comm.host, str(bus)))):
        ranks_of.setdefault(tuple(key), []).append(r)
    return [(b, ranks) for (_, b), ranks in ranks_of.items() if len(ranks) > 1]


def ranks_share_gpu(comm) -> bool:
    """Collective: True when two ranks of one host use the same GPU (NCCL refuses them)."""
    return bool(gpu_sharing(comm))


@pytest.fixture(scope="session")
def nccl_usable(comm):
    """True where every rank of each host has a GPU of its own; otherwise the test is skipped
    (on every rank: the decision comes from one allgather): NCCL refuses two ranks on one GPU
    (``ncclInvalidUsage``), a documented limit of NCCL, not a dcpkit failure."""
    shared = gpu_sharing(comm)
    if shared:
        detail = "; ".join(f"ranks {ranks} share GPU {bus}" for bus, ranks in shared)
        pytest.skip(f"NCCL needs one GPU per rank: {detail} (ranks share GPUs in this run)")
    return True


@pytest.fixture(scope="session")
def nccl_expected(comm):
    """True where NCCL must work (every rank has a GPU of its own): tests that check the NCCL
    path in part run that part, and assert it, only then."""
    return not ranks_share_gpu(comm)
