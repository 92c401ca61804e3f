"""The NVSHMEM backend's init method (``DCPKIT_NVSHMEM_INIT``) must be the same on every rank:
ranks that differ would meet different collectives (the unique id's broadcast on one, MPI's
own init on another) and wait forever. Every rank raises ConfigMismatch naming it instead,
before any NVSHMEM call. CPU only: nvshmem4py is replaced by a stand-in that fails the test if
NVSHMEM is touched."""

import threading
import types

import pytest

from dcpkit import _nvshmem
from dcpkit._setup import Transaction
from dcpkit.errors import ConfigMismatch

from _threadgroup import run_group


class _PerRankEnv(dict):
    """os.environ as each rank thread sees it: DCPKIT_NVSHMEM_INIT from the thread's rank."""

    def __init__(self, methods):
        super().__init__()
        self.methods = methods
        self.ranks = {}

    def get(self, key, default=None):
        if key == "DCPKIT_NVSHMEM_INIT":
            return self.methods[self.ranks[threading.get_ident()]]
        return super().get(key, default)


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"NVSHMEM was called ({name}) although the ranks disagree")


@pytest.mark.parametrize(
    "methods, odd",
    [(["uid", "mpi"], [1]), (["mpi", "uid", "uid"], [0]), (["uid", " ", "MPI"], [2])],
)
def test_differing_init_methods_raise_config_mismatch_on_every_rank(monkeypatch, methods, odd):
    env = _PerRankEnv(methods)
    monkeypatch.setattr(_nvshmem, "os", types.SimpleNamespace(environ=env))
    monkeypatch.setattr(_nvshmem, "load", lambda: _Untouchable())

    def body(comm):
        env.ranks[threading.get_ident()] = comm.rank
        comm.barrier()
        try:
            _nvshmem.init_collective(Transaction(comm, "test"), comm, 0, allow_multicast=True)
        except ConfigMismatch as e:
            return str(e), e.ranks
        return None

    out = run_group(len(methods), body)
    for r, (status, res) in enumerate(out):
        assert status == "ok", f"rank {r}: {res!r}"
        assert res is not None, f"rank {r}: no ConfigMismatch"
        msg, ranks = res
        assert msg.startswith("SymmetricHeap(nvshmem): DCPKIT_NVSHMEM_INIT must be equal"), msg
        assert ranks == odd, (ranks, msg)
