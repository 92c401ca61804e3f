"""SymmetricHeap on GPUs (issue 3): both backends, leak cycles, fault injection, mismatches.

Run with N = 2 and 4::

    mpirun -np N python -m pytest tests/mpi/test_symmetric.py -p no:cacheprovider -s

The nvshmem tests need nvshmem4py (the ``nvshmem`` extra on CUDA 12, ``nvshmem-cu13`` on
CUDA 13); without it they are skipped with that reason. Multicast is never created here:
every test runs with ``DCPKIT_DISABLE_MULTICAST=1`` added to the environment (the machine's own
disabling variables stay as they are), and multicast tests only check that it stays off.

Every test makes all its collective calls on every rank before asserting; failures name the
rank, the copy, the writer and the first mismatching word.
"""

import os
import time

import numpy as np
import pytest

import dcpkit._nvshmem as nvs
import dcpkit._setup as setup
from dcpkit.errors import ClosedError, ConfigMismatch, InvalidArgument, PeerError
from dcpkit.multicast import kill_switches_set
from dcpkit.symmetric import SymmetricHeap

from _heap_checks import agree, free_bytes, open_fds, pattern_errors, run_checked

NVSHMEM_SKIP = pytest.mark.skipif(
    not nvs.available(),
    reason="nvshmem4py is not importable here: install the 'nvshmem' extra (CUDA 12) or "
    "'nvshmem-cu13' (CUDA 13)",
)

CYCLES = 200
CYCLE_BYTES = 64 << 20


@pytest.fixture(autouse=True)
def _never_multicast(monkeypatch):
    """Add a disabling variable for these tests (never clears the machine's own)."""
    monkeypatch.setenv("DCPKIT_DISABLE_MULTICAST", "1")
    assert kill_switches_set(os.environ)


@pytest.fixture(scope="module", autouse=True)
def _finalize_nvshmem_at_the_end(comm):
    """NVSHMEM stays initialised across the nvshmem tests; end it with this module (only if
    every rank has it, so no rank waits alone in nvshmem_finalize)."""
    yield
    nvs.finalize(comm)


@pytest.fixture(autouse=True)
def _no_fault_point():
    setup.FAULT_POINT = None
    yield
    setup.FAULT_POINT = None


def _assert_all(comm, errors, what):
    ok, msg = agree(comm, errors)
    assert ok, f"{what} (world_size {comm.world_size}) failed:\n{msg}"


# ---------------------------------------------------------------------------- cumem backend
@pytest.mark.parametrize("nbytes", [4096, (3 << 20) + 5])
def test_every_rank_reads_what_every_peer_wrote_cumem(comm, seed, nbytes):
    errors = []
    heap = None
    try:
        heap = SymmetricHeap(comm, nbytes)
        W = comm.world_size
        if heap.handle_type != "posix_fd":
            errors.append(f"handle_type {heap.handle_type!r}, expected 'posix_fd' on one host")
        if heap.nbytes < nbytes or heap.nbytes % 4096:
            errors.append(f"nbytes {heap.nbytes} not a granularity-rounded size >= {nbytes}")
        if len(heap.peer_ptrs) != W or heap.local_ptr != heap.peer_ptrs[comm.rank]:
            errors.append(f"peer_ptrs {heap.peer_ptrs} / local_ptr {heap.local_ptr} inconsistent")
        if heap.mc_ptr != 0:
            errors.append(f"mc_ptr {heap.mc_ptr:#x} with multicast disabled")
        errors += pattern_errors(comm, heap, seed)
    except Exception as e:  # noqa: BLE001 - reported below, after every rank got here
        errors.append(f"raised {type(e).__name__}: {e}")
    finally:
        if heap is not None:
            heap.close()
    _assert_all(comm, errors, f"peer pattern, cumem backend, nbytes={nbytes}")


def test_two_heaps_at_once_are_distinct(comm, seed):
    def body(errors):
        with SymmetricHeap(comm, 1 << 20) as a, SymmetricHeap(comm, 1 << 20) as b:
            if set(a.peer_ptrs) & set(b.peer_ptrs):
                errors.append("two heaps share addresses")
            errors.extend(pattern_errors(comm, a, seed))
            errors.extend(f"second heap: {e}" for e in pattern_errors(comm, b, seed + 1))
            # the first heap still holds its own pattern after the second was written
            errors.extend(
                f"first heap after second: {e}" for e in _pattern_still_there(comm, a, seed)
            )

    _assert_all(comm, run_checked(comm, body), "two heaps at once")


def _pattern_still_there(comm, heap, seed):
    import cupy

    from _heap_checks import pattern

    W, me = comm.world_size, comm.rank
    n = min(heap.nbytes // 4 // W, 1 << 16)
    out = []
    for s in range(W):
        got = cupy.asnumpy(heap.view(s * n * 4, (n,), np.uint32))
        if not np.array_equal(got, pattern(seed, s, me, n)):
            out.append(f"region of rank {s} changed")
    comm.barrier()
    return out


def test_alloc_close_cycles_leave_memory_and_fds_where_they_were(comm):
    """200 collective allocate/close cycles of 64 MiB: free GPU memory and open descriptors
    return exactly to where they were (measured after two warm-up cycles)."""
    errors = []
    try:
        for _ in range(2):  # warm-up: lazy driver and MPI state is created once
            SymmetricHeap(comm, CYCLE_BYTES).close()
        comm.barrier()
        mem0, fds0 = free_bytes(comm), open_fds()
        t0 = time.perf_counter()
        for i in range(CYCLES):
            h = SymmetricHeap(comm, CYCLE_BYTES)
            if h.nbytes != CYCLE_BYTES:
                errors.append(f"cycle {i}: nbytes {h.nbytes}")
            h.close()
            if not h.closed:
                errors.append(f"cycle {i}: closed is False after close()")
        comm.barrier()
        mem1, fds1 = free_bytes(comm), open_fds()
        if comm.rank == 0:
            print(
                f"\n[symmetric] {CYCLES} cycles of {CYCLE_BYTES >> 20} MiB x {comm.world_size} "
                f"ranks: {(time.perf_counter() - t0) / CYCLES * 1e3:.2f} ms per cycle; free "
                f"memory {mem0} -> {mem1}, open fds {fds0} -> {fds1}"
            )
        if mem1 != mem0:
            errors.append(
                f"free GPU memory changed by {mem1 - mem0} bytes over {CYCLES} cycles "
                f"({mem0} -> {mem1})"
            )
        if fds1 != fds0:
            errors.append(f"open file descriptors changed by {fds1 - fds0} ({fds0} -> {fds1})")
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    _assert_all(comm, errors, "allocate/close cycles, cumem backend")


FAULT_POINTS = [
    "after_context",
    "after_granularity",
    "after_create",
    "after_export",
    "after_exchange",
    "after_import",
    "after_reserve",
    "after_map",
    "after_access",
    "after_zero",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_fault_injection_unwinds_everywhere(comm, point):
    """The last rank raises right after setup step `point`: it raises the injected error, every
    other rank raises PeerError naming it, and afterwards no GPU memory and no descriptor is
    left behind on any rank."""
    errors = []
    faulty = comm.world_size - 1
    SymmetricHeap(comm, 8 << 20).close()  # warm-up
    comm.barrier()
    mem0, fds0 = free_bytes(comm), open_fds()
    if comm.rank == faulty:
        setup.FAULT_POINT = point
    t0 = time.perf_counter()
    try:
        heap = SymmetricHeap(comm, 8 << 20, timeout_s=20)
    except Exception as e:  # noqa: BLE001 - the expected outcome, checked below
        err = e
    else:
        heap.close()
        err = None
    finally:
        setup.FAULT_POINT = None
    elapsed = time.perf_counter() - t0
    comm.barrier()
    if comm.rank == faulty:
        if not (isinstance(err, RuntimeError) and f"injected fault at {point}" in str(err)):
            errors.append(f"faulty rank raised {err!r}, expected the injected RuntimeError")
    else:
        if not (isinstance(err, PeerError) and set(err.failed) == {faulty}):
            errors.append(f"raised {err!r}, expected PeerError naming rank {faulty}")
    mem1, fds1 = free_bytes(comm), open_fds()
    if mem1 != mem0:
        errors.append(f"free GPU memory changed by {mem1 - mem0} bytes after the failed setup")
    if fds1 != fds0:
        errors.append(f"open descriptors changed by {fds1 - fds0}")
    if comm.rank == 0:
        print(
            f"\n[symmetric] fault {point} on rank {faulty}: every rank raised after "
            f"{elapsed * 1e3:.1f} ms"
        )
    _assert_all(comm, errors, f"fault injection at {point}")


def test_nbytes_that_differ_raise_config_mismatch_on_every_rank(comm):
    odd = comm.world_size - 1
    err = None
    try:
        SymmetricHeap(comm, (2 << 20) if comm.rank == odd else (1 << 20)).close()
    except Exception as e:  # noqa: BLE001
        err = e
    errors = []
    if not isinstance(err, ConfigMismatch):
        errors.append(f"raised {err!r}, expected ConfigMismatch")
    elif err.ranks != [odd] or f"rank {odd}: 2097152" not in str(err):
        errors.append(f"ConfigMismatch does not name rank {odd}: {err}")
    _assert_all(comm, errors, "nbytes mismatch")


def test_fabric_handles_are_tried_and_a_refusal_is_recorded(comm, seed, record_property):
    """handle_type='fabric' on one host: fabric handles if the driver grants them; otherwise
    every rank falls back to descriptors together and ``fabric_refusal`` says why (recorded,
    not a failure)."""
    errors = []
    info = None
    try:
        with SymmetricHeap(comm, 4 << 20, handle_type="fabric") as heap:
            info = (heap.handle_type, heap.fabric_refusal)
            if heap.handle_type == "posix_fd" and not heap.fabric_refusal:
                errors.append("fell back to posix_fd without a recorded refusal")
            if heap.handle_type not in ("fabric", "posix_fd"):
                errors.append(f"handle_type {heap.handle_type!r}")
            errors += pattern_errors(comm, heap, seed)
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    infos = comm.allgather(info)
    if len(set(map(repr, infos))) != 1:
        errors.append(f"ranks disagree on the handle type / refusal: {infos}")
    if comm.rank == 0:
        print(
            f"\n[symmetric] fabric attempt: handle_type={infos[0][0] if infos[0] else None} "
            f"refusal={infos[0][1] if infos[0] else None}"
        )
    record_property("fabric_result", repr(infos[0]))
    _assert_all(comm, errors, "fabric attempt")


def test_bad_input_on_the_gpu(comm):
    import cupy

    errors = []
    ndev = cupy.cuda.runtime.getDeviceCount()
    cases = [
        (
            "device out of range",
            dict(nbytes=4096, device=ndev),
            InvalidArgument,
            f"device index must lie in [0, {ndev})",
        ),
        (
            "more than the device's memory",
            dict(nbytes=1 << 40),
            InvalidArgument,
            "must be <= the memory of device",
        ),
    ]
    for what, kw, exc, text in cases:
        kw = dict(kw)
        try:
            SymmetricHeap(comm, kw.pop("nbytes"), **kw).close()
            errors.append(f"{what}: no error")
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, exc) or text not in str(e):
                errors.append(f"{what}: raised {e!r}, expected {exc.__name__} with {text!r}")
    try:
        heap = SymmetricHeap(comm, 1 << 20)
        for what, call, exc in [
            (
                "view out of bounds",
                lambda: heap.view(heap.nbytes - 4, (2,), np.float32),
                InvalidArgument,
            ),
            ("view misaligned", lambda: heap.view(2, (2,), np.float32), InvalidArgument),
            ("reserve beyond capacity", lambda: heap.reserve(heap.nbytes + 1), InvalidArgument),
        ]:
            try:
                call()
                errors.append(f"{what}: no error")
            except exc:
                pass
        heap.close()
        heap.close()  # idempotent
        try:
            heap.view(0, (4,), np.float32)
            errors.append("view after close: no error")
        except ClosedError:
            pass
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    _assert_all(comm, errors, "bad input on the GPU")


def test_multicast_stays_off_where_disabled(comm):
    """multicast=True with a disabling variable set: no multicast object, the reason names the
    variable, every rank agrees. (Skipped where nothing disables multicast: this test must never
    create one.)"""
    if not kill_switches_set(os.environ):
        pytest.skip(
            "no multicast-disabling variable set: this test would create a multicast object"
        )
    errors = []
    try:
        with SymmetricHeap(comm, 1 << 20, multicast=True) as heap:
            if heap.mc_ptr != 0:
                errors.append(f"mc_ptr {heap.mc_ptr:#x} although multicast is disabled")
            if "DCPKIT_DISABLE_MULTICAST" not in heap.multicast_reason:
                errors.append(f"reason does not name the variable: {heap.multicast_reason!r}")
            reasons = comm.allgather(heap.multicast_reason)
            if len(set(reasons)) != 1:
                errors.append(f"ranks give different reasons: {reasons}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    _assert_all(comm, errors, "multicast stays off")


# ---------------------------------------------------------------------------- nvshmem backend
# Last in this file: NVSHMEM stays initialised once started, and reserves its own heap, which
# must not fall inside the memory checks of the cumem tests above.
@NVSHMEM_SKIP
def test_every_rank_reads_what_every_peer_wrote_nvshmem(comm, seed):
    errors = []
    heap = None
    try:
        heap = SymmetricHeap(comm, (1 << 20) + 100, backend="nvshmem")
        if heap.handle_type != "nvshmem" or heap.mc_ptr != 0:
            errors.append(f"handle_type {heap.handle_type!r}, mc_ptr {heap.mc_ptr:#x}")
        if len(set(heap.peer_ptrs)) != comm.world_size:
            errors.append(f"peer_ptrs not distinct: {heap.peer_ptrs}")
        errors += pattern_errors(comm, heap, seed)
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    finally:
        if heap is not None:
            heap.close()
    _assert_all(comm, errors, "peer pattern, nvshmem backend")


@NVSHMEM_SKIP
def test_alloc_close_cycles_nvshmem_do_not_grow(comm):
    """NVSHMEM keeps its own heap reserved, so the check is: after a warm-up cycle, 200 cycles of
    64 MiB leave free GPU memory and descriptors exactly where they were."""
    errors = []
    try:
        SymmetricHeap(comm, CYCLE_BYTES, backend="nvshmem").close()
        comm.barrier()
        mem0, fds0 = free_bytes(comm), open_fds()
        for _ in range(CYCLES):
            SymmetricHeap(comm, CYCLE_BYTES, backend="nvshmem").close()
        comm.barrier()
        mem1, fds1 = free_bytes(comm), open_fds()
        if comm.rank == 0:
            print(
                f"\n[symmetric] nvshmem {CYCLES} cycles: free memory {mem0} -> {mem1}, "
                f"open fds {fds0} -> {fds1}"
            )
        if mem1 != mem0:
            errors.append(f"free GPU memory changed by {mem1 - mem0} bytes")
        if fds1 != fds0:
            errors.append(f"open descriptors changed by {fds1 - fds0}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    _assert_all(comm, errors, "allocate/close cycles, nvshmem backend")


@NVSHMEM_SKIP
def test_nvshmem_nbytes_that_differ_raise_config_mismatch(comm):
    err = None
    try:
        SymmetricHeap(comm, (2 << 20) if comm.rank == 0 else (1 << 20), backend="nvshmem").close()
    except Exception as e:  # noqa: BLE001
        err = e
    errors = [] if isinstance(err, ConfigMismatch) else [f"raised {err!r}"]
    _assert_all(comm, errors, "nvshmem nbytes mismatch")
