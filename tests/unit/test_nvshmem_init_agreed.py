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


class _PerRankNvls(dict):
    """os.environ as each rank thread sees it: NVSHMEM_DISABLE_NVLS from the thread's rank
    (None: unset); writes go to that rank's own copy."""

    def __init__(self, values):
        super().__init__()
        self.values = values
        self.ranks = {}
        self.own = [({} if v is None else {"NVSHMEM_DISABLE_NVLS": v}) for v in values]

    def _mine(self):
        return self.own[self.ranks[threading.get_ident()]]

    def get(self, key, default=None):
        return self._mine().get(key, default)

    def __getitem__(self, key):
        return self._mine()[key]

    def __setitem__(self, key, value):
        self._mine()[key] = value

    def __contains__(self, key):
        return key in self._mine()

    def items(self):
        return self._mine().items()


@pytest.mark.parametrize("values, odd", [(["1", "maybe"], 1), (["sure", None, "0"], 0)])
def test_an_unreadable_nvls_switch_on_one_rank_raises_on_every_rank(monkeypatch, values, odd):
    """NVSHMEM_DISABLE_NVLS with a value that is no spelling of true or false on one rank: that
    rank raises InvalidArgument naming it, the others PeerError, and none reaches NVSHMEM (the
    check used to run outside a collective step: the others would wait in NVSHMEM's init)."""
    from dcpkit.errors import InvalidArgument, PeerError

    env = _PerRankNvls(values)
    monkeypatch.setattr(_nvshmem, "os", types.SimpleNamespace(environ=env))
    monkeypatch.setattr(_nvshmem, "load", lambda: _Untouchable())

    def body(comm):
        env.ranks[threading.get_ident()] = comm.rank
        comm.barrier()
        _nvshmem.init_collective(Transaction(comm, "test"), comm, 0, allow_multicast=False)

    out = run_group(len(values), body)
    for r, (status, err) in enumerate(out):
        assert status == "err", f"rank {r} went on: {err!r}"
        if r == odd:
            assert isinstance(err, InvalidArgument), f"rank {r}: {err!r}"
            assert "NVSHMEM_DISABLE_NVLS" in str(err) and repr(values[odd]) in str(err), err
        else:
            assert isinstance(err, PeerError), f"rank {r}: {err!r}"
    # A rank that read no switch set NVSHMEM's own to 1; a set one was left as it was.
    for r, v in enumerate(values):
        if r != odd:
            assert env.own[r]["NVSHMEM_DISABLE_NVLS"] == ("1" if v in (None, "0") else v)
