"""The whole cumem setup of SymmetricHeap (and of MulticastObject) on the CPU, against a fake
driver (tests/unit/_fake_cuda.py) that keeps a real driver's books.

Ranks are threads with real Communicators; descriptors really travel over abstract Unix sockets
between them. Shown here: every rank maps every peer's allocation at the right place; fault
injection after every setup step, and driver failures on one rank, unwind everything on every
rank (no handle, range, mapping or descriptor left); the fabric attempt and its fallback; P2P
refusal; close() leaves nothing. The multicast path runs only against the fake driver, with the
guard reading a copy of the environment (the process's own variables are never touched), and
is skipped wherever a GPU is visible or a disabling variable is set.
"""

import os
import sys
import threading

import pytest

import dcpkit._cuda
import dcpkit._setup as setup
import dcpkit.multicast as mcmod
import dcpkit.symmetric as sym
from dcpkit.errors import InvalidArgument, PeerError
from dcpkit.symmetric import SymmetricHeap

from _fake_cuda import GRAN, FakeCupy, FakeDriver
from _threadgroup import run_group

W = 3
STEPS = [
    "context",
    "p2p_check",
    "granularity",
    "create",
    "export",
    "exchange",
    "import",
    "reserve",
    "map",
    "access",
    "zero",
]


def _gpu_visible():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture
def fake(monkeypatch):
    """Install a fake CuPy and a fake driver for W=3 devices; yields a factory to configure."""
    cupy = FakeCupy(W)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    holder = {}

    def make(**kwargs):
        drv = FakeDriver(cupy, **kwargs)
        holder["drv"] = drv
        monkeypatch.setattr(dcpkit._cuda, "driver", lambda: drv)
        return drv

    make()
    yield make
    monkeypatch.setattr(setup, "FAULT_POINT", None)


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _assert_nothing_left(drv, fds_before):
    assert drv.live() == {"handles": 0, "reserved": 0, "maps": 0, "bound": 0}, drv.live()
    assert _fds() == fds_before, "descriptors leaked"


def _device_body(fn):
    """Run fn(comm) with the thread's fake device current (as the mpi fixture does)."""

    def body(comm):
        sys.modules["cupy"].cuda.Device(comm.rank).use()
        return fn(comm)

    return body


def test_every_rank_maps_every_peer_at_its_slot(fake):
    drv = fake()
    fds0 = _fds()

    def fn(comm):
        heap = SymmetricHeap(comm, (1 << 20) + 3)
        got = dict(
            nbytes=heap.nbytes,
            handle_type=heap.handle_type,
            mc=heap.mc_ptr,
            owners=[drv.owner_of(p) for p in heap.peer_ptrs],
            local_is_own=heap.local_ptr == heap.peer_ptrs[comm.rank],
            reason=heap.multicast_reason,
            refusal=heap.fabric_refusal,
        )
        heap.close()
        heap.close()  # idempotent
        return got

    res = run_group(W, _device_body(fn))
    for r, (kind, got) in enumerate(res):
        assert kind == "ok", f"rank {r}: {got!r}"
        assert got["nbytes"] == GRAN and got["handle_type"] == "posix_fd" and got["mc"] == 0
        assert got["owners"] == list(range(W)), f"rank {r} maps {got['owners']}"
        assert got["local_is_own"] and got["refusal"] is None
        assert "not opted in" in got["reason"]
    assert drv.count("cuMemCreate") == W
    assert drv.count("cuMemImportFromShareableHandle") == W * (W - 1)
    assert drv.count("cuMulticastCreate") == 0 and drv.count("cuMulticastGetGranularity") == 0
    _assert_nothing_left(drv, fds0)


class _OnRank(str):
    """A fault point that matches on one rank's thread only (the module global is shared by the
    thread ranks)."""

    tls = threading.local()

    def __new__(cls, value, rank):
        obj = super().__new__(cls, value)
        obj.rank = rank
        return obj

    def __eq__(self, other):
        return getattr(_OnRank.tls, "rank", None) == self.rank and str.__eq__(self, other)

    __hash__ = str.__hash__


@pytest.mark.parametrize("step", STEPS)
def test_fault_after_every_step_unwinds_every_rank(fake, monkeypatch, step):
    drv = fake()
    fds0 = _fds()
    monkeypatch.setattr(setup, "FAULT_POINT", _OnRank(f"after_{step}", 1))

    def fn(comm):
        _OnRank.tls.rank = comm.rank
        SymmetricHeap(comm, 1 << 20, timeout_s=10)

    res = run_group(W, _device_body(fn))
    kind, err = res[1]
    assert kind == "err" and isinstance(err, RuntimeError) and f"after_{step}" in str(err), err
    for r in (0, 2):
        kind, err = res[r]
        assert kind == "err" and isinstance(err, PeerError) and set(err.failed) == {1}, err
        assert f"setup step {step!r}" in str(err)
    _assert_nothing_left(drv, fds0)


@pytest.mark.parametrize(
    "call",
    [
        "cuMemCreate",
        "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle",
        "cuMemAddressReserve",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemsetD8",
    ],
)
def test_driver_failure_on_one_rank_unwinds_every_rank(fake, call):
    drv = fake(fail={(call, 2): "CUDA_ERROR_OUT_OF_MEMORY"})
    fds0 = _fds()
    res = run_group(W, _device_body(lambda comm: SymmetricHeap(comm, 1 << 20, timeout_s=10)))
    kind, err = res[2]
    assert kind == "err" and call in str(err) and "CUDA_ERROR_OUT_OF_MEMORY" in str(err), err
    for r in (0, 1):
        kind, err = res[r]
        assert kind == "err" and isinstance(err, PeerError) and set(err.failed) == {2}, err
        assert call in str(err)
    _assert_nothing_left(drv, fds0)


def test_gpus_that_cannot_reach_each_other_are_named_on_every_rank(fake):
    drv = fake(p2p=lambda a, b: {a, b} != {0, 2})
    res = run_group(W, _device_body(lambda comm: SymmetricHeap(comm, 1 << 20)))
    for r, (kind, err) in enumerate(res):
        assert kind == "err" and isinstance(err, InvalidArgument), f"rank {r}: {err!r}"
        assert "rank 0 (GPU 0000:00:00.0) cannot access rank 2" in str(err)
        assert "rank 2 (GPU 0000:02:00.0) cannot access rank 0" in str(err)
    assert drv.count("cuMemCreate") == 0
    assert drv.live()["handles"] == 0


def test_fabric_refused_everywhere_falls_back_to_descriptors_together(fake):
    drv = fake(fabric="not_permitted")
    fds0 = _fds()

    def fn(comm):
        with SymmetricHeap(comm, 1 << 20, handle_type="fabric") as heap:
            return heap.handle_type, heap.fabric_refusal, [drv.owner_of(p) for p in heap.peer_ptrs]

    res = run_group(W, _device_body(fn))
    for r, (kind, got) in enumerate(res):
        assert kind == "ok", f"rank {r}: {got!r}"
        handle_type, refusal, owners = got
        assert handle_type == "posix_fd" and owners == list(range(W))
        assert refusal.count("CUDA_ERROR_NOT_PERMITTED") == W and "rank 2" in refusal, refusal
    _assert_nothing_left(drv, fds0)


def test_fabric_refused_on_one_rank_releases_the_others_fabric_allocations(fake):
    drv = fake(fabric={1})
    fds0 = _fds()

    def fn(comm):
        with SymmetricHeap(comm, 1 << 20, handle_type="fabric") as heap:
            return heap.handle_type, heap.fabric_refusal, [drv.owner_of(p) for p in heap.peer_ptrs]

    res = run_group(W, _device_body(fn))
    for r, (kind, got) in enumerate(res):
        assert kind == "ok", f"rank {r}: {got!r}"
        assert got[0] == "posix_fd" and got[1].startswith("rank 1: ") and got[2] == [0, 1, 2]
    # ranks 0 and 2 created a fabric allocation, gave it back, then created the fd one
    assert drv.count("cuMemCreate") == W + 2 + 1
    _assert_nothing_left(drv, fds0)


def test_fabric_granted_maps_peers_from_handle_bytes(fake):
    drv = fake(fabric="ok")
    fds0 = _fds()

    def fn(comm):
        with SymmetricHeap(comm, 1 << 20, handle_type="fabric") as heap:
            return heap.handle_type, heap.fabric_refusal, [drv.owner_of(p) for p in heap.peer_ptrs]

    for r, (kind, got) in enumerate(run_group(W, _device_body(fn))):
        assert kind == "ok" and got == ("fabric", None, [0, 1, 2]), f"rank {r}: {got!r}"
    _assert_nothing_left(drv, fds0)


def test_group_across_hosts_needs_fabric_and_says_so(fake):
    drv = fake(fabric="not_permitted")
    fds0 = _fds()

    def fn(comm):
        comm.hosts = [f"host{r}" for r in range(comm.world_size)]
        SymmetricHeap(comm, 1 << 20)

    for r, (kind, err) in enumerate(run_group(W, _device_body(fn))):
        assert kind == "err" and "spans hosts" in str(err) and "NOT_PERMITTED" in str(err), err
    _assert_nothing_left(drv, fds0)


# ---------------------------------------------------------------------------- multicast
_MC_SKIP = pytest.mark.skipif(
    _gpu_visible() or bool(mcmod.kill_switches_set(os.environ)),
    reason="multicast paths run only against the fake driver on machines with no GPU and no "
    "multicast-disabling variable",
)


class _EnvProxy:
    """Stands in for the ``os`` module of dcpkit.symmetric / dcpkit.multicast: the guard reads
    ``environ`` from here (a per-rank dict), never the process's environment."""

    tls = threading.local()

    def __getattr__(self, name):
        return getattr(os, name)

    @property
    def environ(self):
        return getattr(_EnvProxy.tls, "env", {})


@pytest.fixture
def guard_env(monkeypatch):
    monkeypatch.setattr(sym, "os", _EnvProxy())
    monkeypatch.setattr(mcmod, "os", _EnvProxy())

    def set_env(env):
        _EnvProxy.tls.env = dict(env)

    return set_env


@_MC_SKIP
def test_multicast_object_binds_every_rank_and_closes_clean(fake, guard_env):
    drv = fake(mc_supported=1)
    fds0 = _fds()

    def fn(comm):
        guard_env({})
        with SymmetricHeap(comm, 1 << 20, multicast=True) as heap:
            got = (heap.mc_ptr != 0, heap.multicast_reason, heap._mc.nbytes == heap.nbytes)
            bound = {d for m in drv.mc.values() for d in m["bound"]}
            comm.barrier()
            return got + (bound,)

    res = run_group(W, _device_body(fn))
    for r, (kind, got) in enumerate(res):
        assert kind == "ok", f"rank {r}: {got!r}"
        assert got[0] and got[2] and "every rank allows" in got[1], got
        assert got[3] == set(range(W))
    assert [d for n, d in drv.calls if n == "cuMulticastCreate"] == [0]
    assert drv.count("cuMulticastAddDevice") == W and drv.count("cuMulticastUnbind") == W
    _assert_nothing_left(drv, fds0)


@_MC_SKIP
def test_multicast_failure_on_one_rank_leaves_every_rank_on_unicast(fake, guard_env):
    drv = fake(mc_supported=1, fail={("cuMulticastBindMem", 1): "CUDA_ERROR_NOT_SUPPORTED"})
    fds0 = _fds()

    def fn(comm):
        guard_env({})
        with SymmetricHeap(comm, 1 << 20, multicast=True) as heap:
            return heap.mc_ptr, heap.multicast_reason, [drv.owner_of(p) for p in heap.peer_ptrs]

    res = run_group(W, _device_body(fn))
    for r, (kind, got) in enumerate(res):
        assert kind == "ok", f"rank {r}: {got!r}"
        assert got[0] == 0 and "multicast setup failed" in got[1] and "cuMulticastBindMem" in got[1]
        assert got[2] == [0, 1, 2]
    _assert_nothing_left(drv, fds0)


@_MC_SKIP
def test_one_rank_with_a_disabling_variable_keeps_every_rank_off_multicast(fake, guard_env):
    drv = fake(mc_supported=1)

    def fn(comm):
        guard_env({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"} if comm.rank == 2 else {})
        with SymmetricHeap(comm, 1 << 20, multicast=True) as heap:
            return heap.mc_ptr, heap.multicast_reason

    for r, (kind, got) in enumerate(run_group(W, _device_body(fn))):
        assert kind == "ok" and got[0] == 0, f"rank {r}: {got!r}"
        assert "rank(s) [2]" in got[1] and "TORCH_SYMM_MEM_DISABLE_MULTICAST" in got[1]
    assert drv.count("cuMulticastCreate") == 0 and drv.count("cuMulticastGetGranularity") == 0


@_MC_SKIP
@pytest.mark.parametrize(
    "env,opt_in",
    [({"DCPKIT_MULTICAST": "maybe"}, None), ({"NCCL_NVLS_ENABLE": "1_0"}, True)],
    ids=["opt-in", "switch"],
)
def test_an_unreadable_guard_value_on_one_rank_raises_on_every_rank(fake, guard_env, env, opt_in):
    """A guard variable holding no spelling of true or false on one rank: that rank raises
    InvalidArgument naming it, every other rank PeerError (the decision runs inside the
    multicast agreement; outside it, the others waited there), and nothing is left behind."""
    from dcpkit.errors import InvalidArgument, PeerError

    drv = fake(mc_supported=1)
    fds0 = _fds()
    name = next(iter(env))

    def fn(comm):
        guard_env(env if comm.rank == 1 else {})
        SymmetricHeap(comm, 1 << 20, timeout_s=10, multicast=opt_in).close()

    for r, (kind, err) in enumerate(run_group(W, _device_body(fn))):
        assert kind == "err", f"rank {r} built its heap: {err!r}"
        want = InvalidArgument if r == 1 else PeerError
        assert isinstance(err, want), f"rank {r}: {err!r}"
        if r == 1:
            assert name in str(err) and repr(env[name]) in str(err), err
    assert drv.count("cuMulticastCreate") == 0
    _assert_nothing_left(drv, fds0)


@_MC_SKIP
def test_device_without_multicast_keeps_it_off(fake, guard_env):
    drv = fake(mc_supported=0)

    def fn(comm):
        guard_env({"DCPKIT_MULTICAST": "1"})
        with SymmetricHeap(comm, 1 << 20) as heap:
            return heap.mc_ptr, heap.multicast_reason

    for r, (kind, got) in enumerate(run_group(W, _device_body(fn))):
        assert kind == "ok" and got[0] == 0 and "MULTICAST_SUPPORTED = 0" in got[1], got
    assert drv.count("cuMulticastCreate") == 0
