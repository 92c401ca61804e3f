"""NVSHMEM backend of :class:`~dcpkit.symmetric.SymmetricHeap`, over nvshmem4py (``nvshmem.core``).

NVSHMEM is initialised once per process, on the first ``SymmetricHeap(backend="nvshmem")``,
for the group of that heap, and stays initialised (NVSHMEM does not support a second,
different group in one process; :func:`finalize` ends it, collectively). Initialisation:

* default: a unique id made by rank 0 (``nvshmem.core.get_unique_id``) and broadcast through
  the dcpkit Communicator (MPI, torch.distributed or a single rank alike);
* ``DCPKIT_NVSHMEM_INIT=mpi``: NVSHMEM's own MPI bootstrap on the Communicator's mpi4py
  communicator (needs an NVSHMEM MPI bootstrap built for the MPI in use). The method must be
  the same on every rank (ConfigMismatch on every rank otherwise, before NVSHMEM is touched).

Each heap is one ``nvshmem.core.buffer`` (``nvshmem_malloc``, collective); peer addresses come
from ``nvshmem.core.get_peer_buffer`` (``nvshmem_ptr``), the multicast address from
``nvshmem.core.get_multicast_buffer`` (``nvshmemx_mc_ptr``) only where NOTE [dcpkit multicast
guard] allows. When dcpkit does not use multicast it sets ``NVSHMEM_DISABLE_NVLS=1`` before
NVSHMEM starts, so NVSHMEM creates no multicast object of its own either.

NVSHMEM reserves its symmetric heap (``NVSHMEM_SYMMETRIC_SIZE``, 1 GiB by default) at
initialisation; a heap larger than what is left fails in ``nvshmem_malloc``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import NamedTuple

from ._setup import Transaction
from .errors import ConfigMismatch, InvalidArgument, MissingDependency
from .multicast import guard_env_or_raise, kill_switches_set

__all__ = [
    "load",
    "available",
    "init_collective",
    "allocate",
    "free",
    "local_ptr",
    "peer_ptr",
    "multicast_ptr",
    "finalize",
    "is_initialized",
    "setup_heap",
    "NvshmemHeap",
]

log = logging.getLogger("dcpkit")

_NV = None
_STATE = {"initialized": False, "rank": None, "world_size": None, "device": None}


def load():
    """The ``nvshmem.core`` module.

    Raises
    ------
    MissingDependency
        nvshmem4py (or a library it needs: cuda.core, the NVSHMEM runtime) is missing.
    """
    global _NV
    if _NV is None:
        try:
            import nvshmem.core as nvcore
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
            raise MissingDependency(
                "nvshmem4py",
                "nvshmem",
                f"{type(e).__name__}: {e}; on CUDA 13 install the 'nvshmem-cu13' extra",
            ) from None
        _NV = nvcore
    return _NV


def available() -> bool:
    """True when nvshmem4py imports."""
    try:
        load()
        return True
    except MissingDependency:
        return False


def is_initialized() -> bool:
    """True once this process initialised NVSHMEM through dcpkit (and did not finalize)."""
    return bool(_STATE["initialized"])


def _uid_nbytes() -> int:
    import nvshmem.bindings as bindings

    return int(bindings.uniqueid_dtype.itemsize)


def _uid_to_bytes(uid) -> bytes:
    return ctypes.string_at(uid.ptr, _uid_nbytes())


def _uid_from_bytes(data: bytes):
    nv = load()
    uid = nv.get_unique_id(empty=True)
    if len(data) != _uid_nbytes():
        raise InvalidArgument(
            f"nvshmem init: unique id must be {_uid_nbytes()} bytes (got {len(data)})"
        )
    ctypes.memmove(uid.ptr, data, len(data))
    return uid


def init_collective(tx, comm, device: int, allow_multicast: bool) -> None:
    """Initialise NVSHMEM for ``comm`` on ``device`` (once per process), as steps of ``tx``.

    Collective: every rank of ``comm``. If NVSHMEM is already initialised on every rank for this
    group and device, nothing happens; a different group or device raises on every rank.
    """
    nv = load()
    rank, world = comm.rank, comm.world_size
    # Each rank's init method travels with its state: ranks that differ would meet different
    # collectives (a broadcast of the unique id here, MPI's own init there) and wait forever.
    method = os.environ.get("DCPKIT_NVSHMEM_INIT", "uid").strip().lower() or "uid"
    states = comm.allgather(
        (_STATE["initialized"], _STATE["rank"], _STATE["world_size"], _STATE["device"], method)
    )

    def state_step():
        inited = [s[0] for s in states]
        if any(inited) and not all(inited):
            raise InvalidArgument(
                f"SymmetricHeap(nvshmem): NVSHMEM must be initialised on every rank or on none "
                f"(initialised on ranks {[r for r, i in enumerate(inited) if i]})"
            )
        if _STATE["initialized"] and (_STATE["rank"], _STATE["world_size"], _STATE["device"]) != (
            rank,
            world,
            device,
        ):
            raise InvalidArgument(
                f"SymmetricHeap(nvshmem): NVSHMEM is already initialised in this process as rank "
                f"{_STATE['rank']} of {_STATE['world_size']} on device {_STATE['device']}; one "
                f"group per process (got rank {rank} of {world} on device {device})"
            )

    tx.step("nvshmem_state", state_step)
    if _STATE["initialized"]:
        return

    def nvls_step():
        # dcpkit does not use multicast here: NVSHMEM must not create its own objects either.
        # Only NVSHMEM's own switch is read, inside a step: a value that is no spelling of true
        # or false raises on the rank that holds it, and every rank learns of it (outside a
        # step, that rank would raise and the others wait in NVSHMEM's init).
        name = "NVSHMEM_DISABLE_NVLS"
        if allow_multicast or kill_switches_set({k: v for k, v in os.environ.items() if k == name}):
            return
        os.environ[name] = "1"
        log.info("dcpkit nvshmem: set NVSHMEM_DISABLE_NVLS=1 (multicast not in use)")

    tx.step("nvshmem_nvls", nvls_step)

    def method_step():
        if method not in ("uid", "mpi"):
            raise InvalidArgument(
                f"SymmetricHeap(nvshmem): DCPKIT_NVSHMEM_INIT must be 'uid' or "
                f"'mpi' (got {method!r})"
            )
        methods = [st[4] for st in states]
        if any(m != method for m in methods):
            raise ConfigMismatch("SymmetricHeap(nvshmem): DCPKIT_NVSHMEM_INIT", methods)
        if method == "mpi" and comm.backend != "mpi":
            raise InvalidArgument(
                f"SymmetricHeap(nvshmem): DCPKIT_NVSHMEM_INIT=mpi needs an MPI "
                f"Communicator (got backend {comm.backend!r})"
            )

    tx.step("nvshmem_method", method_step)
    from cuda.core import Device

    if method == "uid":
        box = {}

        def uid_step():
            if rank == 0:
                box["uid"] = _uid_to_bytes(nv.get_unique_id())

        tx.step("nvshmem_uid", uid_step)
        uid_bytes = comm.broadcast(box.get("uid"), root=0)

        def init_step():
            dev = Device(device)
            dev.set_current()
            nv.init(
                device=dev,
                uid=_uid_from_bytes(uid_bytes),
                rank=rank,
                nranks=world,
                initializer_method="uid",
            )
            _mark(rank, world, device)
            _check_pe(nv, rank, world)
    else:

        def init_step():
            dev = Device(device)
            dev.set_current()
            nv.init(device=dev, mpi_comm=comm.handle, initializer_method="mpi")
            _mark(rank, world, device)
            _check_pe(nv, rank, world)

    tx.step("nvshmem_init", init_step)


def _mark(rank: int, world: int, device: int) -> None:
    _STATE.update(initialized=True, rank=rank, world_size=world, device=device)


def _check_pe(nv, rank: int, world: int) -> None:
    pe, npes = int(nv.my_pe()), int(nv.n_pes())
    if (pe, npes) != (rank, world):
        raise InvalidArgument(
            f"SymmetricHeap(nvshmem): NVSHMEM PE {pe} of {npes} must equal "
            f"the Communicator's rank {rank} of {world}"
        )


def allocate(nbytes: int):
    """``nvshmem_malloc(nbytes)`` as a ``cuda.core.Buffer`` (collective)."""
    nv = load()
    return nv.buffer(int(nbytes), release=False, except_on_del=False)


def free(buf) -> None:
    """``nvshmem_free`` (collective)."""
    load().free(buf)


def local_ptr(buf) -> int:
    return int(buf.handle)


def peer_ptr(buf, pe: int) -> int:
    """``nvshmem_ptr(buf, pe)``: the address of ``pe``'s copy as mapped here (not collective)."""
    nv = load()
    pbuf = nv.get_peer_buffer(buf, pe)
    ptr = int(pbuf.handle)
    pbuf.close()  # only drops nvshmem4py's bookkeeping; the mapping belongs to NVSHMEM
    if ptr == 0:
        raise InvalidArgument(
            f"SymmetricHeap(nvshmem): PE {pe} is not reachable by load/store "
            f"(nvshmem_ptr returned NULL)"
        )
    return ptr


def multicast_ptr(buf) -> int:
    """``nvshmemx_mc_ptr(TEAM_WORLD, buf)``; refuses first if a disabling variable is set."""
    guard_env_or_raise("SymmetricHeap(nvshmem) multicast")
    nv = load()
    mbuf = nv.get_multicast_buffer(nv.Teams.TEAM_WORLD, buf)
    ptr = int(mbuf.handle)
    mbuf.close()
    return ptr


def finalize(comm=None) -> bool:
    """End NVSHMEM in this process (collective; every heap of the nvshmem backend must be
    closed first). Idempotent.

    With ``comm``, the ranks first agree that NVSHMEM is initialised on every one of them, and
    finalise only then (a rank whose initialisation failed must not leave the others waiting
    in ``nvshmem_finalize``). Returns whether NVSHMEM was finalised.
    """
    if comm is not None:
        if not all(comm.allgather(bool(_STATE["initialized"]))):
            if _STATE["initialized"]:
                log.warning(
                    "dcpkit nvshmem: not finalised: NVSHMEM is not initialised on every rank"
                )
            return False
    if not _STATE["initialized"]:
        return False
    load().finalize()
    _STATE.update(initialized=False, rank=None, world_size=None, device=None)
    return True


class NvshmemHeap(NamedTuple):
    """What :func:`setup_heap` made on this rank."""

    nbytes: int  # 512-rounded size of each rank's buffer
    peer_ptrs: list[int]  # every rank's buffer, as this process addresses it
    local_ptr: int
    mc_ptr: int  # 0 without multicast
    multicast_reason: str | None  # why multicast fell back to unicast (None: it did not)
    undo: list[tuple[str, Callable[[], object]]]


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def setup_heap(comm, device: int, nbytes: int, use_mc: bool) -> NvshmemHeap:
    """The NVSHMEM side of ``SymmetricHeap(backend="nvshmem")``: initialise NVSHMEM (once), then
    one ``nvshmem_malloc`` of ``nbytes`` (rounded up to 512), its peer pointers and, where
    ``use_mc``, its multicast pointer; zeroed. A transaction (:class:`dcpkit._setup.Transaction`):
    a failure on any rank unwinds on every rank and raises on every rank.

    Collective: every rank of ``comm``.
    """
    import cupy

    rank, world = comm.rank, comm.world_size
    reason = None
    size = _round_up(nbytes, 512)
    tx = Transaction(comm, "SymmetricHeap(nvshmem)")
    box: dict = {}
    try:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.free(0)
            init_collective(tx, comm, device, use_mc)

            def alloc_step():
                box["buf"] = allocate(size)

            try:
                tx.step("nvshmem_alloc", alloc_step)
            except BaseException:
                # nvshmem_free is collective: free only if every rank holds its buffer.
                try:
                    held = comm.allgather("buf" in box)
                    if all(held):
                        free(box["buf"])
                    elif "buf" in box:
                        log.warning(
                            "dcpkit SymmetricHeap rank %d: an NVSHMEM buffer of %d "
                            "bytes stays allocated: ranks %s failed to allocate "
                            "theirs, so no collective free is possible",
                            rank,
                            size,
                            [r for r, h in enumerate(held) if not h],
                        )
                except Exception as e:  # noqa: BLE001 - the original error matters more
                    log.warning(
                        "dcpkit SymmetricHeap rank %d: freeing the NVSHMEM buffer "
                        "after a failed setup failed: %s",
                        rank,
                        e,
                    )
                raise
            buf = box["buf"]
            # Every rank allocated: the collective free is safe from here on.
            tx.add_undo("nvshmem free", functools.partial(free, buf))
            local = local_ptr(buf)

            def peers_step():
                box["peers"] = [local if p == rank else peer_ptr(buf, p) for p in range(world)]

            tx.step("nvshmem_peers", peers_step)

            mc_ptr, mc_err = 0, None
            if use_mc:
                try:
                    mc_ptr = multicast_ptr(buf)
                except Exception as e:  # noqa: BLE001 - multicast is optional
                    mc_err = f"{type(e).__name__}: {e}"
                errs = comm.allgather(mc_err)
                failed = [r for r, m in enumerate(errs) if m]
                if failed:
                    mc_ptr = 0
                    reason = (
                        f"multicast setup failed, using unicast: rank(s) {failed}: "
                        + "; ".join(str(errs[r]) for r in failed)
                    )
                    log.warning("dcpkit SymmetricHeap rank %d: %s", rank, reason)

            def zero_step():
                cupy.cuda.runtime.memset(local, 0, size)
                cupy.cuda.runtime.deviceSynchronize()

            tx.step("zero", zero_step)
    except BaseException:
        tx.rollback()
        raise
    return NvshmemHeap(size, box["peers"], local, mc_ptr, reason, tx.commit())
