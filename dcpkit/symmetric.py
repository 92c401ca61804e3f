"""Symmetric memory: one allocation of the same size on every rank, mapped by every peer.

Usage (every rank, in the same order)::

    comm = Communicator.from_mpi()
    cupy.cuda.Device(comm.local_rank).use()
    with SymmetricHeap(comm, 64 << 20) as heap:     # collective; memory starts zeroed
        off = heap.reserve(4096)                     # same offset on every rank
        mine = heap.view(off, (1024,), cupy.float32)               # this rank's copy
        theirs = heap.view(off, (1024,), cupy.float32, rank=peer)  # a peer's copy (NVLink)
        ...                                          # kernels take heap.peer_ptrs[r] + off
    # leaving the block closes the heap on every rank (collective)

Layout. Rank ``r``'s copy is ``nbytes`` bytes at ``peer_ptrs[r]``; this process maps all
``world_size`` copies, back to back, in one reserved virtual range (``local_ptr`` is
``peer_ptrs[rank]``). A store through ``peer_ptrs[s] + off`` lands in rank ``s``'s memory.

Backends.
* ``"cumem"`` (default): the CUDA driver's virtual-memory API through cuda-python. Each rank
  ``cuMemCreate``\\s its copy with a POSIX file-descriptor handle, exports it, and hands the
  descriptor to every peer over abstract ``AF_UNIX`` sockets with ``SCM_RIGHTS``
  (:mod:`dcpkit._fdpass`); peers import, map and set access. For groups that span hosts of one
  NVLink domain, fabric handles (``CU_MEM_HANDLE_TYPE_FABRIC``) travel as bytes through the
  Communicator instead; if the driver refuses them, ranks on one host fall back to descriptors
  together (``fabric_refusal`` records why).
* ``"nvshmem"``: the same interface over nvshmem4py (:mod:`dcpkit._nvshmem`).

Setup is a transaction (:class:`dcpkit._setup.Transaction`): every step registers its undo,
and after every step all ranks check that every rank succeeded
(:func:`dcpkit._setup.share_outcome`). A failure anywhere unwinds everything everywhere, in
reverse, and every rank raises: the failing rank its own error, the others
:class:`~dcpkit.errors.PeerError` naming it. Arguments are checked before any driver call.
Allocation and release are collective and explicit; garbage collection never frees a heap (it
only warns).

Multicast (``mc_ptr``) is used only as NOTE [dcpkit multicast guard] in
:mod:`dcpkit.multicast` allows; otherwise ``mc_ptr`` is 0 and ``multicast_reason`` says why.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable

import numpy as np

from . import _cuda, _fdpass
from ._checks import check_comm, check_int, check_multicast, check_real
from ._lifecycle import Resource
from ._setup import Transaction, collective_step, run_undo
from .errors import (
    ClosedError,
    ConfigMismatch,
    CudaError,
    DcpkitError,
    InvalidArgument,
    InvalidType,
)
from .multicast import MulticastObject, agree_multicast, multicast_decision, multicast_granularity

__all__ = ["SymmetricHeap", "BACKENDS", "HANDLE_TYPES", "MAX_NBYTES"]

log = logging.getLogger("dcpkit")

BACKENDS = ("cumem", "nvshmem")
#: Accepted ``handle_type`` arguments (``"nvshmem"`` is only ever reported, never requested).
HANDLE_TYPES = ("auto", "posix_fd", "fabric")
#: Largest ``nbytes`` accepted (1 TiB): anything above is a unit mistake.
MAX_NBYTES = 1 << 40

_HEAP_COUNTER = iter(range(1 << 62))


# ---------------------------------------------------------------------------- argument checks
def _check_args(comm, nbytes, device, backend, handle_type, multicast, timeout_s):
    """Checks that need no GPU and no driver (run first, on every rank)."""
    op = "SymmetricHeap"
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise InvalidType(
            f"{op}: nbytes must be an int number of bytes (got {type(nbytes).__name__} {nbytes!r})"
        )
    if not 1 <= nbytes <= MAX_NBYTES:
        raise InvalidArgument(f"{op}: nbytes must lie in [1, 2**40] bytes (got {nbytes})")
    if device is not None:
        check_int(device, op, "device index", minimum=0)
    if not isinstance(backend, str):
        raise InvalidType(f"{op}: backend must be a str (got {type(backend).__name__})")
    if backend not in BACKENDS:
        raise InvalidArgument(f"{op}: backend must be one of {list(BACKENDS)} (got {backend!r})")
    if not isinstance(handle_type, str):
        raise InvalidType(f"{op}: handle_type must be a str (got {type(handle_type).__name__})")
    allowed = HANDLE_TYPES if backend == "cumem" else ("auto", "nvshmem")
    if handle_type not in allowed:
        raise InvalidArgument(
            f"{op}: handle_type must be one of {list(allowed)} with backend "
            f"{backend!r} (got {handle_type!r})"
        )
    if handle_type == "posix_fd" and comm.spans_hosts:
        raise InvalidArgument(
            f"{op}: handle_type 'posix_fd' must not be used when the group "
            f"spans hosts (file descriptors cannot leave a host; use 'fabric' "
            f"or 'auto') (got ranks on {len(set(comm.hosts))} hosts)"
        )
    if backend == "nvshmem" and comm.spans_hosts:
        raise InvalidArgument(
            f"{op}: backend 'nvshmem' must not be used when the group spans "
            f"hosts (dcpkit maps peers with nvshmem_ptr, which needs one "
            f"NVLink-connected host)"
        )
    check_multicast(multicast, op)
    seconds = check_real(timeout_s, op, "timeout_s", "a real number of seconds")
    if not 0 < seconds <= 3600:  # NaN fails too
        raise InvalidArgument(f"{op}: timeout_s must lie in (0, 3600] seconds (got {timeout_s!r})")
    # Dependencies last (argument errors first), still before any driver call: a missing
    # package on one rank raises there and PeerError on the others.
    _cuda.require_cupy()  # MissingDependency naming the extra
    if backend == "nvshmem":
        from . import _nvshmem

        _nvshmem.load()  # MissingDependency naming the extra
    else:
        _cuda.driver()  # cuda-bindings: MissingDependency naming the extra


def _check_device(device, nbytes: int) -> int:
    """Checks that need the CUDA runtime: a visible GPU, the device index, a usable context on
    it, and the size against its memory."""
    op = "SymmetricHeap"
    cupy = _cuda.require_cupy()
    device = _cuda.require_device(op, device)  # DcpkitError naming the missing GPU
    try:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.free(0)  # the primary context exists (the nvshmem path needs it)
        total = int(cupy.cuda.runtime.getDeviceProperties(device)["totalGlobalMem"])
    except Exception as e:  # noqa: BLE001 - a device that cannot start a context
        raise DcpkitError(
            f"{op}: device {device} is not usable ({type(e).__name__}: {e})"
        ) from None
    if nbytes > total:
        raise InvalidArgument(
            f"{op}: nbytes must be <= the memory of device {device} ({total} bytes) (got {nbytes})"
        )
    return int(device)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _alloc_prop(drv, device: int, kind):
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device)
    prop.requestedHandleTypes = kind
    return prop


# ---------------------------------------------------------------------------- the heap
class SymmetricHeap(Resource):
    """One allocation of ``nbytes`` on every rank, with every peer's copy mapped here.

    Naive equivalent: ``bufs = [cupy.zeros(nbytes, uint8) on rank r for r in ranks]`` where
    every rank can load from and store to every ``bufs[r]`` directly (NVLink P2P).

    Parameters
    ----------
    comm : Communicator
        The group; every rank constructs the heap with equal ``nbytes``, ``backend`` and
        ``handle_type``.
    nbytes : int
        Bytes of each rank's copy, in [1, 2**40]; rounded up to the allocation granularity
        (and the multicast granularity when multicast is used). ``heap.nbytes`` is the result.
    device : int, optional
        CUDA device of this rank (default: CuPy's current device).
    backend : {"cumem", "nvshmem"}
        CUDA virtual-memory API with descriptor / fabric exchange, or nvshmem4py (install the
        ``nvshmem`` extra).
    handle_type : {"auto", "posix_fd", "fabric"}
        cumem backend only. ``"auto"``: fabric handles when the group spans hosts, POSIX file
        descriptors otherwise. ``"fabric"`` on one host falls back to descriptors (on every rank)
        if the driver refuses fabric handles.
    multicast : bool or None
        Opt in (True), out (False) or follow ``DCPKIT_MULTICAST`` (None). Used only where NOTE
        [dcpkit multicast guard] allows it, on every rank.
    timeout_s : float
        Deadline of the descriptor exchange between ranks, in seconds (0, 3600]; any real
        number type.

    Attributes
    ----------
    rank, world_size : int
        This rank and the size of the heap's group (read-only: an op given ``heap=`` checks
        them against its ``comm``).
    nbytes : int
        Size of each rank's copy in bytes (granularity-rounded).
    device : int
    backend : str
    handle_type : str
        What was used: ``"posix_fd"``, ``"fabric"`` or ``"nvshmem"``.
    local_ptr : int
        Device address of this rank's copy.
    peer_ptrs : list of int, length world_size
        Device address of every rank's copy as mapped in this process (own included).
    mc_ptr : int
        Multicast address of the heap (0 without multicast).
    multicast_reason : str
        Why multicast is on or off.
    fabric_refusal : str or None
        Why the driver refused fabric handles (every rank's reason), when they were requested
        and refused; None otherwise.
    closed : bool

    Collective
    ----------
    Construction and :meth:`close`: every rank, in the same order. :meth:`view` and
    :meth:`reserve` are local.

    Stream
    ------
    Construction zeroes the memory and synchronises the device; :meth:`close` synchronises the
    device first.

    Raises
    ------
    InvalidType, InvalidArgument
        Bad arguments (before any driver call); on the rank that passed them, while the other
        ranks raise PeerError.
    ConfigMismatch
        ``nbytes``, ``backend`` or ``handle_type`` differ across ranks (every rank, naming the
        ranks).
    InvalidArgument
        GPUs of the group that cannot reach each other (every rank, naming the pairs).
    MissingDependency
        CuPy or cuda-bindings is not installed, or ``backend="nvshmem"`` without nvshmem4py
        (names the extra); on the rank that misses it, PeerError on the others.
    DcpkitError
        No CUDA GPU is visible (``"SymmetricHeap: no CUDA GPU is visible ..."``), or the
        device cannot start a context; PeerError on the other ranks.
    CudaError, FdExchangeError, PeerError
        A setup step failed on this rank or a peer; everything was unwound on every rank.

    Notes
    -----
    The same mechanism as NCCL's cuMem P2P transport and PyTorch's ``CUDASymmetricMemory``:
    ``cuMemCreate`` + shareable handles + ``cuMemMap`` into one reserved range (CUDA
    Programming Guide, "Virtual Memory Management"); descriptors pass by ``SCM_RIGHTS``
    because containers deny ``pidfd_getfd``.
    """

    _resource_name = "SymmetricHeap"
    _unclosed_hint = "call close() on every rank (its GPU memory is returned at process exit)"

    def __init__(
        self,
        comm,
        nbytes,
        *,
        device=None,
        backend="cumem",
        handle_type="auto",
        multicast=None,
        timeout_s=60.0,
    ):
        self._undo: list[tuple[str, Callable[[], object]]] = []
        self._next = 0
        self.nbytes = 0
        self.local_ptr = 0
        self.peer_ptrs: list[int] = []
        self.mc_ptr = 0
        self.multicast_reason = ""
        self.fabric_refusal: str | None = None
        self.handle_type = ""
        self._mc = None
        self.comm = check_comm(comm, "SymmetricHeap")
        self._rank = comm.rank
        self._world_size = comm.world_size
        self.backend = backend

        # 1. Arguments: no GPU, no driver. Shared so that no rank waits for a rank that raised.
        collective_step(
            comm,
            "SymmetricHeap: argument check",
            lambda: _check_args(comm, nbytes, device, backend, handle_type, multicast, timeout_s),
        )

        # 2. Settings that must match: one allgather, ConfigMismatch on every rank.
        mine = {
            "nbytes": int(nbytes),
            "backend": backend,
            "handle_type": handle_type,
            "counter": next(_HEAP_COUNTER),
        }
        everyone = comm.allgather(mine)
        for key in ("nbytes", "backend", "handle_type"):
            values = [v[key] for v in everyone]
            if any(v != values[0] for v in values):
                raise ConfigMismatch(f"SymmetricHeap: {key}", values)
        tag = f"heap{everyone[0]['counter']}"

        # 3. The device (CUDA runtime queries only).
        dev = collective_step(
            comm, "SymmetricHeap: device check", lambda: _check_device(device, int(nbytes))
        )
        self.device = dev

        # 4. Multicast: guard on every rank, then all ranks agree (NOTE [dcpkit multicast guard]).
        local = multicast_decision(
            multicast, os.environ, lambda: _cuda.device_attribute("MULTICAST_SUPPORTED", dev) == 1
        )
        use_mc, reason = agree_multicast(comm, local)
        self.multicast_reason = reason
        if multicast is not None or use_mc:
            log.info("dcpkit SymmetricHeap rank %d: %s", self.rank, reason)

        if backend == "cumem":
            self._setup_cumem(int(nbytes), handle_type, use_mc, float(timeout_s), tag)
        else:
            self._setup_nvshmem(int(nbytes), use_mc)
        self._closed = False

    # ------------------------------------------------------------------ cumem backend
    def _setup_cumem(
        self, nbytes: int, handle_type: str, use_mc: bool, timeout_s: float, tag: str
    ) -> None:
        import cupy

        comm, rank, world, device = self.comm, self.rank, self.world_size, self.device
        drv = _cuda.driver()
        check = _cuda.check
        fd_kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fabric_kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        want_fabric = handle_type == "fabric" or (handle_type == "auto" and comm.spans_hosts)
        tx = Transaction(comm, "SymmetricHeap")
        box: dict = {}

        def release(h, who):
            return (f"cuMemRelease({who})", lambda: check(drv.cuMemRelease(h), "cuMemRelease"))

        try:
            with cupy.cuda.Device(device):

                def context_step():
                    cupy.cuda.runtime.free(0)  # the primary context exists and is current
                    box["dev"] = check(drv.cuDeviceGet(device), "cuDeviceGet")
                    box["bus"] = cupy.cuda.runtime.deviceGetPCIBusId(device)
                    for attr in (
                        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                        "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                    ):
                        if attr.startswith("HANDLE") and comm.spans_hosts:
                            continue
                        if not _cuda.device_attribute(attr, device):
                            raise DcpkitError(
                                f"SymmetricHeap: device {device} of rank {rank} "
                                f"reports CU_DEVICE_ATTRIBUTE_{attr} = 0"
                            )

                tx.step("context", context_step)

                # P2P between every pair on this host, before anything is allocated.
                buses = comm.allgather((comm.host, box["bus"]))

                def p2p_step():
                    unreachable, invisible = [], []
                    for p, (host, bus) in enumerate(buses):
                        if p == rank or host != comm.host or bus == box["bus"]:
                            continue
                        try:
                            pdev = check(
                                drv.cuDeviceGetByPCIBusId(bus.encode()), "cuDeviceGetByPCIBusId"
                            )
                        except CudaError:
                            invisible.append(p)  # hidden by CUDA_VISIBLE_DEVICES: cannot check
                            continue
                        if not check(
                            drv.cuDeviceCanAccessPeer(box["dev"], pdev), "cuDeviceCanAccessPeer"
                        ):
                            unreachable.append(p)
                    box["unreachable"] = unreachable
                    if invisible:
                        log.info(
                            "dcpkit SymmetricHeap rank %d: GPUs of peer rank(s) %s are not "
                            "visible to this process; P2P access to them is not checked "
                            "before mapping",
                            rank,
                            invisible,
                        )

                tx.step("p2p_check", p2p_step)
                reach = comm.allgather(box["unreachable"])
                bad = [(r, p) for r, peers in enumerate(reach) for p in peers]
                if bad:
                    pairs = "; ".join(
                        f"rank {r} (GPU {buses[r][1]}) cannot access rank {p} (GPU {buses[p][1]})"
                        for r, p in bad
                    )
                    raise InvalidArgument(
                        f"SymmetricHeap: the GPUs of the group must reach each other over "
                        f"P2P/NVLink (cuDeviceCanAccessPeer): {pairs}"
                    )

                # Granularity: the largest over ranks (and the multicast granularity if used).
                def granularity_step():
                    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                    prop = _alloc_prop(drv, device, fd_kind)
                    box["gran"] = int(
                        check(
                            drv.cuMemGetAllocationGranularity(prop, flag),
                            "cuMemGetAllocationGranularity",
                        )
                    )
                    box["mc_gran"] = None
                    if use_mc:
                        try:
                            box["mc_gran"] = multicast_granularity(
                                world, device, "fabric" if want_fabric else "posix_fd", nbytes
                            )
                        except Exception as e:  # noqa: BLE001 - multicast is optional
                            box["mc_err"] = f"{type(e).__name__}: {e}"

                tx.step("granularity", granularity_step)
                grans = comm.allgather((box["gran"], box["mc_gran"], box.get("mc_err")))
                gran = functools.reduce(math.lcm, (g for g, _, _ in grans))
                if use_mc:
                    failed = [r for r, (_, mg, _) in enumerate(grans) if mg is None]
                    if failed:
                        use_mc = False
                        self.multicast_reason = (
                            "multicast off: cuMulticastGetGranularity failed on rank(s) "
                            f"{failed} ({'; '.join(str(grans[r][2]) for r in failed)})"
                        )
                        log.warning("dcpkit SymmetricHeap: %s", self.multicast_reason)
                    else:
                        gran = functools.reduce(math.lcm, (mg for _, mg, _ in grans), gran)
                size = _round_up(nbytes, gran)

                used = "posix_fd"
                if want_fabric:

                    def fabric_step():
                        box["refusal"] = None
                        try:
                            supported = _cuda.device_attribute(
                                "HANDLE_TYPE_FABRIC_SUPPORTED", device
                            )
                        except CudaError as e:
                            box["refusal"] = (
                                f"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED "
                                f"query failed: {e}"
                            )
                            return
                        if not supported:
                            box["refusal"] = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0"
                            return
                        prop = _alloc_prop(drv, device, fabric_kind)
                        try:
                            h = check(drv.cuMemCreate(size, prop, 0), "cuMemCreate")
                        except CudaError as e:
                            box["refusal"] = (
                                f"cuMemCreate(CU_MEM_HANDLE_TYPE_FABRIC) returned {e.result}"
                            )
                            return
                        try:
                            shared = check(
                                drv.cuMemExportToShareableHandle(h, fabric_kind, 0),
                                "cuMemExportToShareableHandle",
                            )
                        except CudaError as e:
                            check(drv.cuMemRelease(h), "cuMemRelease")
                            box["refusal"] = (
                                f"cuMemExportToShareableHandle("
                                f"CU_MEM_HANDLE_TYPE_FABRIC) returned {e.result}"
                            )
                            return
                        box["handle"] = h
                        tx.add_undo(*release(h, "own fabric allocation"))
                        box["fabric"] = bytes(shared.data)

                    tx.step("fabric_create", fabric_step)
                    refusals = comm.allgather(box["refusal"])
                    refused = [(r, m) for r, m in enumerate(refusals) if m]
                    if not refused:
                        used = "fabric"
                    else:
                        detail = "; ".join(f"rank {r}: {m}" for r, m in refused)
                        if comm.spans_hosts:
                            raise DcpkitError(
                                f"SymmetricHeap: the group spans hosts, which needs fabric "
                                f"handles (CU_MEM_HANDLE_TYPE_FABRIC), and the driver refused "
                                f"them: {detail} (is an IMEX channel / fabric manager set up?)"
                            )
                        if "handle" in box:
                            tx.undo_last()
                            del box["handle"]
                        self.fabric_refusal = detail
                        msg = (
                            "dcpkit SymmetricHeap: fabric handles refused by the driver (%s); "
                            "every rank falls back to POSIX file descriptors"
                        )
                        if rank == 0:
                            log.warning(msg, detail)
                        else:
                            log.debug(msg, detail)
                self.handle_type = used

                if used == "posix_fd":

                    def create_step():
                        h = check(
                            drv.cuMemCreate(size, _alloc_prop(drv, device, fd_kind), 0),
                            "cuMemCreate",
                        )
                        box["handle"] = h
                        tx.add_undo(*release(h, "own allocation"))

                    tx.step("create", create_step)

                    def export_step():
                        fd = int(
                            check(
                                drv.cuMemExportToShareableHandle(box["handle"], fd_kind, 0),
                                "cuMemExportToShareableHandle",
                            )
                        )
                        box["fd"] = fd
                        tx.add_undo("close(own fd)", functools.partial(os.close, fd))
                        os.set_inheritable(fd, False)  # never leaks into a child process

                    tx.step("export", export_step)
                    token = comm.job_token()

                    def exchange_step():
                        fds = _fdpass.exchange_fds(
                            token, tag, rank, world, box["fd"], timeout_s=timeout_s
                        )
                        for p, f in enumerate(fds):
                            if f is not None:
                                tx.add_undo(
                                    f"close(fd of rank {p})", functools.partial(os.close, f)
                                )
                        box["fds"] = fds

                    tx.step("exchange", exchange_step)
                else:
                    box["fabric_all"] = comm.allgather(box["fabric"])

                def import_step():
                    handles = [None] * world
                    handles[rank] = box["handle"]
                    for p in range(world):
                        if p == rank:
                            continue
                        if used == "posix_fd":
                            h = check(
                                drv.cuMemImportFromShareableHandle(box["fds"][p], fd_kind),
                                "cuMemImportFromShareableHandle",
                            )
                        else:
                            fh = drv.CUmemFabricHandle()
                            fh.data = box["fabric_all"][p]
                            h = check(
                                drv.cuMemImportFromShareableHandle(fh.getPtr(), fabric_kind),
                                "cuMemImportFromShareableHandle",
                            )
                        tx.add_undo(*release(h, f"allocation of rank {p}"))
                        handles[p] = h
                    box["handles"] = handles

                tx.step("import", import_step)
                total = size * world

                def reserve_step():
                    base = int(
                        check(drv.cuMemAddressReserve(total, gran, 0, 0), "cuMemAddressReserve")
                    )
                    tx.add_undo(
                        "cuMemAddressFree",
                        lambda: check(drv.cuMemAddressFree(base, total), "cuMemAddressFree"),
                    )
                    box["base"] = base

                tx.step("reserve", reserve_step)
                base = box["base"]

                def map_step():
                    for p in range(world):
                        va = base + p * size
                        check(drv.cuMemMap(va, size, 0, box["handles"][p], 0), "cuMemMap")
                        tx.add_undo(
                            f"cuMemUnmap(rank {p})",
                            functools.partial(
                                lambda a: check(drv.cuMemUnmap(a, size), "cuMemUnmap"), va
                            ),
                        )

                tx.step("map", map_step)

                def access_step():
                    desc = drv.CUmemAccessDesc()
                    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    desc.location.id = device
                    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    for p in range(world):  # read/write for this device, one mapping at a time
                        check(
                            drv.cuMemSetAccess(base + p * size, size, [desc], 1), "cuMemSetAccess"
                        )

                tx.step("access", access_step)

                def zero_step():
                    check(drv.cuMemsetD8(base + rank * size, 0, size), "cuMemsetD8")
                    cupy.cuda.runtime.deviceSynchronize()

                # The check after this step is the barrier: no peer writes into this copy
                # before it is zeroed.
                tx.step("zero", zero_step)

                if use_mc:
                    self._attach_multicast(tx, size, box["handle"], used, timeout_s)
        except BaseException:
            tx.rollback()
            raise
        self.nbytes = size
        self.peer_ptrs = [base + p * size for p in range(world)]
        self.local_ptr = self.peer_ptrs[rank]
        self._undo = tx.commit()

    def _attach_multicast(
        self, tx: Transaction, size: int, mem_handle, handle_type: str, timeout_s: float
    ) -> None:
        """Bind a MulticastObject to this heap; on failure (on any rank) every rank goes on
        with unicast."""
        try:
            mc = MulticastObject(
                self.comm,
                size,
                self.device,
                mem_handle=mem_handle,
                handle_type=handle_type,
                timeout_s=timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - raised on every rank: all fall back together
            self.multicast_reason = f"multicast setup failed, using unicast: {e}"
            log.warning("dcpkit SymmetricHeap rank %d: %s", self.rank, self.multicast_reason)
            return
        tx.add_undo("MulticastObject", mc._release_local)
        self._mc = mc
        self.mc_ptr = mc.mc_ptr

    # ------------------------------------------------------------------ nvshmem backend
    def _setup_nvshmem(self, nbytes: int, use_mc: bool) -> None:
        from . import _nvshmem

        got = _nvshmem.setup_heap(self.comm, self.device, nbytes, use_mc)  # collective
        if got.multicast_reason is not None:
            self.multicast_reason = got.multicast_reason
        self.handle_type = "nvshmem"
        self.nbytes = got.nbytes
        self.peer_ptrs = got.peer_ptrs
        self.local_ptr = got.local_ptr
        self.mc_ptr = got.mc_ptr
        self._undo = got.undo

    # ------------------------------------------------------------------ local use
    @property
    def rank(self) -> int:
        """This process's rank in the heap's group (read-only)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks of the heap's group (read-only)."""
        return self._world_size

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise ClosedError(f"{op}: the heap is closed")

    def view(self, offset, shape, dtype, rank=None):
        """A CuPy array over ``[offset, offset + size)`` of this rank's or a peer's copy.

        Naive equivalent: ``copies[rank][offset:offset + size].view(dtype).reshape(shape)``.

        Parameters
        ----------
        offset : int
            Byte offset into the copy, a multiple of ``dtype``'s itemsize.
        shape : int or tuple of int
            Shape of the view (C order); ``prod(shape) * itemsize`` bytes must fit.
        dtype : dtype-like
        rank : int, optional
            Whose copy: this rank's (None, default) or peer ``rank``'s, through NVLink.

        Returns
        -------
        cupy.ndarray
            A view, valid until :meth:`close` (reading or writing it afterwards is undefined).
            Writes to a peer's copy become visible to that peer after a device synchronisation
            and a host barrier (or the signalling protocol of the ops).

        Raises
        ------
        ClosedError
            The heap is closed.
        InvalidArgument, InvalidType
            Out of bounds, misaligned for ``dtype``, negative offset, bad shape or rank.
        """
        op = "SymmetricHeap.view"
        self._check_open(op)
        off = check_int(offset, op, "offset", minimum=0)
        if rank is None:
            r = self.rank
        else:
            r = check_int(rank, op, "rank", minimum=0)
            if r >= self.world_size:
                raise InvalidArgument(f"{op}: rank must lie in [0, {self.world_size}) (got {r})")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise InvalidType(f"{op}: dtype must be a NumPy/CuPy dtype (got {dtype!r})") from None
        if dt.itemsize == 0 or dt.hasobject:
            raise InvalidType(f"{op}: dtype must be a fixed-size numeric dtype (got {dt})")
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)):
            raise InvalidType(f"{op}: shape must be an int or a tuple of ints (got {shape!r})")
        shape = tuple(check_int(s, op, "shape entry", minimum=0) for s in shape)
        size = math.prod(shape) * dt.itemsize  # exact Python ints: no overflow
        if off % dt.itemsize:
            raise InvalidArgument(
                f"{op}: offset must be a multiple of the itemsize of {dt} "
                f"({dt.itemsize} bytes) (got {off})"
            )
        if off + size > self.nbytes:
            raise InvalidArgument(
                f"{op}: offset + view bytes must be <= nbytes {self.nbytes} "
                f"(got {off} + {size} = {off + size})"
            )
        import cupy

        mem = cupy.cuda.UnownedMemory(self.peer_ptrs[r] + off, size, self, self.device)
        try:
            return cupy.ndarray(shape, dt, cupy.cuda.MemoryPointer(mem, 0))
        except (TypeError, ValueError) as e:
            raise InvalidType(f"{op}: dtype must be supported by CuPy (got {dt}: {e})") from None

    def reserve(self, nbytes, align: int = 256) -> int:
        """Take ``nbytes`` from the heap; return their byte offset.

        A bump allocator: offsets depend only on the sequence of calls, so every rank that makes
        the same calls gets the same offsets (the same region in every copy). Nothing is ever
        given back before :meth:`close`.

        Parameters
        ----------
        nbytes : int
            Bytes to take (>= 1).
        align : int
            Alignment of the returned offset in bytes, a power of two (default 256).

        Returns
        -------
        int
            Offset, a multiple of ``align``; use with :meth:`view` or ``peer_ptrs[r] + offset``.

        Raises
        ------
        InvalidArgument
            Not enough room left, or a bad ``nbytes`` / ``align``.
        ClosedError
            The heap is closed.
        """
        op = "SymmetricHeap.reserve"
        self._check_open(op)
        n = check_int(nbytes, op, "nbytes", minimum=1)
        a = check_int(align, op, "align", minimum=1)
        if a & (a - 1):
            raise InvalidArgument(f"{op}: align must be a power of two (got {a})")
        off = _round_up(self._next, a)
        if off + n > self.nbytes:
            raise InvalidArgument(
                f"{op}: nbytes must fit in the heap: {max(self.nbytes - off, 0)} "
                f"bytes left after offset {off} of {self.nbytes} (got {n})"
            )
        self._next = off + n
        return off

    @property
    def reserved_bytes(self) -> int:
        """Bytes handed out by :meth:`reserve` so far (including alignment padding)."""
        return self._next

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:  # the docstring of the collective close; Resource.close runs it
        """Release the heap on every rank (collective, idempotent).

        Synchronises the device, waits for every rank, then undoes setup in reverse: multicast
        object, unmap, ``cuMemRelease`` of every handle, ``cuMemAddressFree``, close the
        descriptors (nvshmem backend: ``nvshmem_free``). A last barrier makes sure every rank has
        released every peer's memory, so the GPU memory is back when ``close`` returns. Views
        become invalid.

        Stream: synchronises the device.

        Raises
        ------
        The first error met (the rest of the teardown still runs).
        """
        super().close()

    def _close(self) -> None:
        import cupy

        errors: list[BaseException] = []
        with cupy.cuda.Device(self.device):
            try:
                cupy.cuda.runtime.deviceSynchronize()
            except Exception as e:  # noqa: BLE001 - keep tearing down
                errors.append(e)
            try:
                self.comm.barrier()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            errors += run_undo(self._undo, "SymmetricHeap.close")
        self._mc = None
        self.local_ptr = 0
        self.peer_ptrs = []
        self.mc_ptr = 0
        try:
            self.comm.barrier()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        if errors:
            raise errors[0]

    def _left_open(self) -> bool:
        return super()._left_open() and getattr(self, "comm", None) is not None

    def __repr__(self) -> str:
        state = (
            "closed"
            if self._closed
            else (
                f"nbytes={self.nbytes}, "
                f"handle_type={self.handle_type!r}, "
                f"multicast={bool(self.mc_ptr)}"
            )
        )
        return (
            f"SymmetricHeap(rank={getattr(self, 'rank', '?')}, "
            f"world_size={getattr(self, 'world_size', '?')}, "
            f"backend={getattr(self, 'backend', '?')!r}, {state})"
        )

    # ------------------------------------------------------------------ test hook
    @classmethod
    def _unbacked(cls, nbytes: int, world_size: int = 1, rank: int = 0) -> SymmetricHeap:
        """An open heap object with no memory behind it, for testing :meth:`view` and
        :meth:`reserve` argument checks on machines without a GPU. Never pass its views to a
        kernel, and do not call :meth:`close` on it (set ``_closed`` instead)."""
        self = cls.__new__(cls)
        self._undo = []
        self._next = 0
        self.nbytes = int(nbytes)
        self._rank, self._world_size = rank, world_size
        self.device = 0
        self.backend = "cumem"
        self.handle_type = "posix_fd"
        self.local_ptr = 1 << 40
        self.peer_ptrs = [(1 << 40) + r * int(nbytes) for r in range(world_size)]
        self.mc_ptr = 0
        self.multicast_reason = ""
        self.fabric_refusal = None
        self.comm = None
        self._closed = False
        return self
