"""SymmetricHeap checks that need no GPU: arguments are rejected before any driver call, ranks
that disagree raise on every rank, view / reserve bounds, and the setup transaction.

The CUDA driver is replaced by a stub that fails the test on first use, so a check that ran
after a driver call would show up as an AssertionError rather than the expected error.
"""

import sys

import numpy as np
import pytest

import dcpkit._cuda
import dcpkit._nvshmem
import dcpkit._setup as setup
from dcpkit.comm import Communicator
from dcpkit.errors import (
    ClosedError,
    ConfigMismatch,
    InvalidArgument,
    InvalidType,
    MissingDependency,
    PeerError,
)
from dcpkit.symmetric import SymmetricHeap

from _threadgroup import run_group


class DriverStub:
    def __init__(self):
        self.touched = []

    def __getattr__(self, name):
        self.touched.append(name)
        raise AssertionError(f"driver.{name} was called before the arguments were checked")


@pytest.fixture
def no_driver(monkeypatch):
    stub = DriverStub()
    monkeypatch.setattr(dcpkit._cuda, "driver", lambda: stub)
    yield stub
    assert stub.touched == []


BAD_ARGS = [
    (dict(nbytes=0), InvalidArgument, r"nbytes must lie in \[1, 2\*\*40\] bytes \(got 0\)"),
    (dict(nbytes=-4096), InvalidArgument, r"nbytes must lie in .*\(got -4096\)"),
    (dict(nbytes=(1 << 40) + 1), InvalidArgument, "nbytes must lie in"),
    (dict(nbytes=1.5), InvalidType, "nbytes must be an int"),
    (dict(nbytes=True), InvalidType, "nbytes must be an int"),
    (dict(nbytes="4096"), InvalidType, "nbytes must be an int"),
    (dict(nbytes=4096, device=-1), InvalidArgument, r"device index must be >= 0 \(got -1\)"),
    (dict(nbytes=4096, device=0.0), InvalidType, "device index must be an int"),
    (dict(nbytes=4096, backend="nccl"), InvalidArgument, "backend must be one of"),
    (dict(nbytes=4096, backend=None), InvalidType, "backend must be a str"),
    (dict(nbytes=4096, handle_type="dmabuf"), InvalidArgument, "handle_type must be one of"),
    (
        dict(nbytes=4096, backend="nvshmem", handle_type="fabric"),
        InvalidArgument,
        "handle_type must be one of",
    ),
    (dict(nbytes=4096, multicast="yes"), InvalidType, "multicast must be True, False or None"),
    (dict(nbytes=4096, timeout_s=0), InvalidArgument, r"timeout_s must lie in \(0, 3600\]"),
    (dict(nbytes=4096, timeout_s=1e9), InvalidArgument, "timeout_s must lie in"),
    (dict(nbytes=4096, timeout_s=True), InvalidType, "timeout_s must be a real number"),
    (dict(nbytes=4096, timeout_s="60"), InvalidType, "timeout_s must be a real number"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_ARGS)
def test_bad_arguments_raise_before_any_driver_call(no_driver, kwargs, exc, match):
    kwargs = dict(kwargs)
    nbytes = kwargs.pop("nbytes")
    with pytest.raises(exc, match=match):
        SymmetricHeap(Communicator.single(), nbytes, **kwargs)


def test_comm_must_be_a_communicator(no_driver):
    with pytest.raises(InvalidType, match="comm must be a dcpkit.Communicator"):
        SymmetricHeap(object(), 4096)


def test_nvshmem_backend_without_nvshmem4py_names_the_extra(no_driver, monkeypatch):
    monkeypatch.setattr(dcpkit._nvshmem, "_NV", None)
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(MissingDependency, match=r"nvshmem4py .*dcpkit\[nvshmem\]"):
        SymmetricHeap(Communicator.single(), 4096, backend="nvshmem")


def test_nbytes_that_differ_across_ranks_raise_config_mismatch_on_every_rank(no_driver):
    def body(comm):
        SymmetricHeap(comm, (2 << 20) if comm.rank == 2 else (1 << 20))

    res = run_group(3, body)
    for r, (kind, err) in enumerate(res):
        assert kind == "err" and isinstance(err, ConfigMismatch), f"rank {r}: {err!r}"
        assert err.ranks == [2], f"rank {r}: {err}"
        assert "nbytes" in str(err) and "rank 2: 2097152" in str(err), str(err)


def test_backend_that_differs_across_ranks_raises_config_mismatch(no_driver):
    def body(comm):
        SymmetricHeap(comm, 1 << 20, handle_type="fabric" if comm.rank == 0 else "auto")

    res = run_group(2, body)
    for r, (kind, err) in enumerate(res):
        assert kind == "err" and isinstance(err, ConfigMismatch), f"rank {r}: {err!r}"
        assert "handle_type" in str(err)


def test_one_rank_with_bad_arguments_makes_every_rank_raise(no_driver):
    """Rank 1 passes nbytes=-1: it raises InvalidArgument, ranks 0 and 2 raise PeerError naming
    rank 1 (nobody is left waiting in a later collective)."""

    def body(comm):
        SymmetricHeap(comm, -1 if comm.rank == 1 else 4096)

    res = run_group(3, body)
    kinds = [(k, type(e).__name__) for k, e in res]
    assert res[1][0] == "err" and isinstance(res[1][1], InvalidArgument), kinds
    for r in (0, 2):
        kind, err = res[r]
        assert kind == "err" and isinstance(err, PeerError), f"rank {r}: {err!r}"
        assert err.failed.keys() == {1} and "nbytes must lie" in err.failed[1], str(err)


def test_posix_fd_handles_across_hosts_are_refused(no_driver):
    def body(comm):
        comm.hosts = [f"host{r}" for r in range(comm.world_size)]  # pretend: one rank per host
        SymmetricHeap(comm, 4096, handle_type="posix_fd")

    for r, (kind, err) in enumerate(run_group(2, body)):
        assert kind == "err" and isinstance(err, InvalidArgument), f"rank {r}: {err!r}"
        assert "spans hosts" in str(err)


# ---------------------------------------------------------------------------- view / reserve
@pytest.fixture
def heap():
    h = SymmetricHeap._unbacked(1 << 20, world_size=4, rank=1)
    yield h
    h._closed = True


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((1 << 20, (1,), np.uint8), {}, InvalidArgument, r"offset \+ view bytes must be <= nbytes"),
        ((0, (1 << 18) + 1, np.float32), {}, InvalidArgument, "must be <= nbytes 1048576"),
        ((2, (4,), np.float32), {}, InvalidArgument, r"offset must be a multiple of the itemsize"),
        ((8, (4,), np.float64), {}, None, None),
        ((12, (4,), np.float64), {}, InvalidArgument, "itemsize of float64"),
        ((-4, (4,), np.float32), {}, InvalidArgument, "offset must be >= 0"),
        ((0.0, (4,), np.float32), {}, InvalidType, "offset must be an int"),
        ((0, (4, -1), np.float32), {}, InvalidArgument, "shape entry must be >= 0"),
        ((0, "4", np.float32), {}, InvalidType, "shape must be an int or a tuple"),
        ((0, (4,), "not-a-dtype"), {}, InvalidType, "dtype must be"),
        ((0, (4,), object), {}, InvalidType, "fixed-size numeric dtype"),
        ((0, (4,), np.float32), {"rank": 4}, InvalidArgument, r"rank must lie in \[0, 4\)"),
        ((0, (4,), np.float32), {"rank": -1}, InvalidArgument, "rank must be >= 0"),
    ],
)
def test_view_checks(heap, args, kwargs, exc, match):
    if exc is None:
        pytest.importorskip("cupy")
        try:
            heap.view(*args, **kwargs)
        except (InvalidArgument, InvalidType) as e:
            pytest.fail(f"valid view rejected: {e}")
        except Exception:  # noqa: BLE001 - no GPU here: building the CuPy array may fail
            pass
        return
    with pytest.raises(exc, match=match):
        heap.view(*args, **kwargs)


def test_reserve_is_deterministic_and_aligned(heap):
    offs = [
        heap.reserve(100),
        heap.reserve(1),
        heap.reserve(4096, align=4096),
        heap.reserve(8, align=8),
    ]
    assert offs == [0, 256, 4096, 8192]
    other = SymmetricHeap._unbacked(1 << 20, world_size=4, rank=3)
    try:
        assert [
            other.reserve(100),
            other.reserve(1),
            other.reserve(4096, align=4096),
            other.reserve(8, align=8),
        ] == offs
    finally:
        other._closed = True
    assert heap.reserved_bytes == 8200


def test_reserve_beyond_capacity(heap):
    heap.reserve((1 << 20) - 512)
    with pytest.raises(InvalidArgument, match=r"nbytes must fit in the heap: 512 bytes left"):
        heap.reserve(1024)
    assert heap.reserve(512) == (1 << 20) - 512
    with pytest.raises(InvalidArgument, match="0 bytes left"):
        heap.reserve(1)


@pytest.mark.parametrize(
    "nbytes,align,exc,match",
    [
        (0, 256, InvalidArgument, "nbytes must be >= 1"),
        (16, 3, InvalidArgument, "align must be a power of two"),
        (16, 0, InvalidArgument, "align must be >= 1"),
        (16.0, 256, InvalidType, "nbytes must be an int"),
    ],
)
def test_reserve_bad_arguments(heap, nbytes, align, exc, match):
    with pytest.raises(exc, match=match):
        heap.reserve(nbytes, align=align)


def test_use_after_close_raises_closed_error(heap):
    heap._closed = True
    with pytest.raises(ClosedError, match="SymmetricHeap.view: the heap is closed"):
        heap.view(0, (4,), np.float32)
    with pytest.raises(ClosedError, match="SymmetricHeap.reserve: the heap is closed"):
        heap.reserve(16)


# ---------------------------------------------------------------------------- the transaction
def test_transaction_unwinds_every_rank_in_reverse_when_one_rank_fails():
    logs = {r: [] for r in range(3)}

    def body(comm):
        tx = setup.Transaction(comm, "test")
        log = logs[comm.rank]
        for step in ("a", "b", "c"):

            def fn(step=step):
                if step == "c" and comm.rank == 1:
                    raise ValueError("rank 1 breaks at c")
                tx.add_undo(step, lambda: log.append(f"undo {step}"))
                log.append(f"do {step}")

            tx.step(step, fn)
        return tx.commit()

    res = run_group(3, body)
    assert isinstance(res[1][1], ValueError), res
    for r in (0, 2):
        assert isinstance(res[r][1], PeerError) and res[r][1].failed.keys() == {1}, res[r]
        assert logs[r] == ["do a", "do b", "do c", "undo c", "undo b", "undo a"], logs[r]
    assert logs[1] == ["do a", "do b", "undo b", "undo a"], logs[1]


def test_transaction_keeps_unwinding_past_a_failing_undo():
    done = []
    tx = setup.Transaction(Communicator.single(), "test")
    tx.add_undo("first", lambda: done.append("first"))
    tx.add_undo("broken", lambda: 1 / 0)
    tx.add_undo("last", lambda: done.append("last"))
    with pytest.raises(RuntimeError, match="boom"):
        tx.step("x", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert done == ["last", "first"]


def test_fault_point_injects_after_the_named_step(monkeypatch):
    monkeypatch.setattr(setup, "FAULT_POINT", "after_export")
    undone = []
    tx = setup.Transaction(Communicator.single(), "test")
    tx.step("create", lambda: tx.add_undo("create", lambda: undone.append("create")))
    with pytest.raises(RuntimeError, match="injected fault at after_export"):
        tx.step("export", lambda: tx.add_undo("export", lambda: undone.append("export")))
    assert undone == ["export", "create"]
