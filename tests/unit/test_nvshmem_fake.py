"""The nvshmem backend of SymmetricHeap (dcpkit/_nvshmem.py) against a fake nvshmem4py, on the
CPU: the call sequence (unique id made once on rank 0 and broadcast, one init per process, a
collective buffer, peer addresses from get_peer_buffer for peers only, zeroing, collective
free), NVSHMEM_DISABLE_NVLS set when multicast is not used, and unwinding on a fault.

The fake follows nvshmem4py 0.4's ``nvshmem.core`` API as dcpkit uses it. The real backend runs
in tests/mpi/test_symmetric.py on GPUs.
"""

import ctypes
import os
import sys
import threading
import types

import pytest

import dcpkit._cuda
import dcpkit._nvshmem as nvs
import dcpkit._setup as setup
from dcpkit.errors import InvalidArgument, PeerError
from dcpkit.symmetric import SymmetricHeap

from _fake_cuda import FakeCupy
from _threadgroup import run_group

W = 3
UID_BYTES = 128
BASE = 1 << 40
SPAN = 1 << 36


class _Uid:
    def __init__(self):
        self._buf = ctypes.create_string_buffer(UID_BYTES)
        self.ptr = ctypes.addressof(self._buf)


class _Buffer:
    def __init__(self, handle, size, owner):
        self.handle, self.size, self.owner, self.closed = handle, size, owner, False

    def close(self):
        self.closed = True


class FakeNvshmem:
    """``nvshmem.core`` as dcpkit uses it; one PE per thread."""

    Teams = types.SimpleNamespace(TEAM_WORLD=0)

    def __init__(self):
        self.lock = threading.Lock()
        self.tls = threading.local()
        self.calls = []
        self.uids = {}  # pe -> uid bytes given to init
        self.live = {}  # (pe, addr) -> size
        self.peer_bufs = []  # every peer buffer handed out
        self._offsets = {}  # pe -> counter of symmetric offsets

    def _pe(self):
        return getattr(self.tls, "pe", None)

    def get_unique_id(self, empty=False):
        self.calls.append(("get_unique_id", empty, self._pe()))
        uid = _Uid()
        if not empty:
            ctypes.memmove(uid.ptr, os.urandom(UID_BYTES), UID_BYTES)
        return uid

    def init(
        self, device=None, uid=None, rank=None, nranks=None, mpi_comm=None, initializer_method=""
    ):
        assert initializer_method == "uid" and mpi_comm is None and device is not None
        assert self._pe() is None, "NVSHMEM initialised twice in one process"
        self.tls.pe, self.tls.npes = rank, nranks
        with self.lock:
            self.uids[rank] = ctypes.string_at(uid.ptr, UID_BYTES)
        self.calls.append(("init", rank, nranks))

    def my_pe(self):
        return self.tls.pe

    def n_pes(self):
        return self.tls.npes

    def buffer(self, size, release=False, except_on_del=True):
        pe = self._pe()
        assert pe is not None
        with self.lock:
            off = self._offsets.get(pe, 0)
            self._offsets[pe] = off + size
            addr = BASE + pe * SPAN + off
            self.live[(pe, addr)] = size
        self.calls.append(("buffer", pe, size))
        return _Buffer(addr, size, pe)

    def free(self, buf):
        with self.lock:
            del self.live[(buf.owner, buf.handle)]
        buf.close()
        self.calls.append(("free", buf.owner))

    def get_peer_buffer(self, buf, pe):
        assert pe != self._pe(), "own PE asked through get_peer_buffer (breaks nvshmem4py refs)"
        pb = _Buffer(buf.handle - buf.owner * SPAN + pe * SPAN + (1 << 35), buf.size, pe)
        self.peer_bufs.append(pb)
        return pb

    def get_multicast_buffer(self, team, buf):
        raise AssertionError("multicast buffer asked although multicast is off")

    def finalize(self):
        self.calls.append(("finalize", self._pe()))
        self.tls.pe = None


class _TLState:
    """``_nvshmem._STATE`` per thread: each thread-rank is its own 'process'."""

    def __init__(self):
        self.tls = threading.local()

    def _d(self):
        if not hasattr(self.tls, "d"):
            self.tls.d = {"initialized": False, "rank": None, "world_size": None, "device": None}
        return self.tls.d

    def __getitem__(self, k):
        return self._d()[k]

    def update(self, **kw):
        self._d().update(kw)


class _EnvOs:
    env = {}

    def __getattr__(self, attr):
        return getattr(os, attr)

    @property
    def environ(self):
        return _EnvOs.env


class _NoDriver:
    def __getattr__(self, name):
        raise AssertionError(f"the nvshmem backend called driver.{name}")


@pytest.fixture
def fake_nv(monkeypatch):
    cupy = FakeCupy(W)
    nv = FakeNvshmem()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "nvshmem", types.ModuleType("nvshmem"))
    monkeypatch.setitem(
        sys.modules,
        "nvshmem.bindings",
        types.SimpleNamespace(uniqueid_dtype=types.SimpleNamespace(itemsize=UID_BYTES)),
    )
    core = types.ModuleType("cuda.core")

    class Device:
        def __init__(self, d):
            self.device_id = d

        def set_current(self):
            pass

    core.Device = Device
    monkeypatch.setitem(sys.modules, "cuda.core", core)
    monkeypatch.setattr(nvs, "_NV", nv)
    monkeypatch.setattr(nvs, "_STATE", _TLState())
    _EnvOs.env = {}
    monkeypatch.setattr(nvs, "os", _EnvOs())
    monkeypatch.setattr(dcpkit._cuda, "driver", lambda: _NoDriver())
    yield nv, cupy
    monkeypatch.setattr(setup, "FAULT_POINT", None)


def _device_body(fn):
    def body(comm):
        sys.modules["cupy"].cuda.Device(comm.rank).use()
        return fn(comm)

    return body


def test_heaps_over_nvshmem(fake_nv):
    nv, cupy = fake_nv

    def fn(comm):
        out = []
        for nbytes in (1000, 4096):
            with SymmetricHeap(comm, nbytes, backend="nvshmem") as heap:
                out.append(
                    (
                        heap.handle_type,
                        heap.nbytes,
                        heap.local_ptr,
                        list(heap.peer_ptrs),
                        heap.mc_ptr,
                    )
                )
        out.append(nvs.finalize(comm))
        return out

    res = run_group(W, _device_body(fn))
    for r, (kind, got) in enumerate(res):
        assert kind == "ok", f"rank {r}: {got!r}"
        (t0, n0, l0, p0, m0), (t1, n1, l1, p1, m1), finalized = got
        assert (t0, n0, m0, t1, n1, m1, finalized) == ("nvshmem", 1024, 0, "nvshmem", 4096, 0, True)
        assert l0 == BASE + r * SPAN and p0[r] == l0
        assert p0 == [l0 if p == r else BASE + p * SPAN + (1 << 35) for p in range(W)], p0
        assert l1 == BASE + r * SPAN + 1024 and p1[r] == l1
    # one unique id, made on rank 0 only, handed to every rank's init
    made = [c for c in nv.calls if c[0] == "get_unique_id" and c[1] is False]
    assert made == [("get_unique_id", False, None)]
    assert len(set(nv.uids.values())) == 1 and sorted(nv.uids) == list(range(W))
    assert sum(1 for c in nv.calls if c[0] == "init") == W  # once per process, not per heap
    assert nv.live == {} and all(b.closed for b in nv.peer_bufs)
    assert len(nv.peer_bufs) == 2 * W * (W - 1)
    # every rank zeroed its own copy of each heap before use
    assert sorted((d, p, v, n) for d, p, v, n in cupy.memsets) == sorted(
        [(r, BASE + r * SPAN, 0, 1024) for r in range(W)]
        + [(r, BASE + r * SPAN + 1024, 0, 4096) for r in range(W)]
    )
    # NVSHMEM must not create multicast objects of its own when dcpkit does not use multicast
    assert _EnvOs.env.get("NVSHMEM_DISABLE_NVLS") == "1"


class _OnRank(str):
    tls = threading.local()

    def __new__(cls, value, rank):
        obj = super().__new__(cls, value)
        obj.rank = rank
        return obj

    def __eq__(self, other):
        return getattr(_OnRank.tls, "rank", None) == self.rank and str.__eq__(self, other)

    __hash__ = str.__hash__


@pytest.mark.parametrize("step", ["nvshmem_init", "nvshmem_alloc", "nvshmem_peers", "zero"])
def test_fault_in_nvshmem_setup_unwinds_every_rank(fake_nv, monkeypatch, step):
    nv, _ = fake_nv
    monkeypatch.setattr(setup, "FAULT_POINT", _OnRank(f"after_{step}", 2))

    def fn(comm):
        _OnRank.tls.rank = comm.rank
        SymmetricHeap(comm, 4096, backend="nvshmem")

    res = run_group(W, _device_body(fn))
    assert res[2][0] == "err" and f"after_{step}" in str(res[2][1]), res[2]
    for r in (0, 1):
        assert res[r][0] == "err" and isinstance(res[r][1], PeerError), res[r]
    assert nv.live == {}, nv.live  # every rank freed its buffer (collectively)


def test_allocation_failing_on_one_rank_never_leaves_a_rank_alone_in_free(fake_nv, monkeypatch):
    nv, _ = fake_nv
    real_buffer = nv.buffer

    def buffer(size, **kw):
        if nv.my_pe() == 1:
            raise RuntimeError("nvshmem_malloc failed (fake)")
        return real_buffer(size, **kw)

    monkeypatch.setattr(nv, "buffer", buffer)
    res = run_group(W, _device_body(lambda comm: SymmetricHeap(comm, 4096, backend="nvshmem")))
    assert "nvshmem_malloc failed" in str(res[1][1])
    assert all(kind == "err" for kind, _ in res)
    assert not any(c[0] == "free" for c in nv.calls)  # no rank entered the collective free
    assert len(nv.live) == W - 1  # left allocated, with a warning, on ranks 0 and 2


def test_second_group_in_one_process_is_refused(fake_nv):
    def fn(comm):
        SymmetricHeap(comm, 4096, backend="nvshmem").close()
        nvs._STATE.update(rank=comm.rank + 1)  # pretend NVSHMEM was started for another group
        SymmetricHeap(comm, 4096, backend="nvshmem")

    for r, (kind, err) in enumerate(run_group(2, _device_body(fn))):
        assert kind == "err" and isinstance(err, InvalidArgument), f"rank {r}: {err!r}"
        assert "one group per process" in str(err)
