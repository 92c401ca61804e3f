"""The ``"cumem"`` backend of :class:`~dcpkit.symmetric.SymmetricHeap`: one ``cuMemCreate``
allocation per rank, shared with every peer and mapped into one reserved virtual range.

Each rank creates its copy with a POSIX file-descriptor handle, exports it, and hands the
descriptor to every peer over abstract ``AF_UNIX`` sockets with ``SCM_RIGHTS``
(:mod:`dcpkit._fdpass`); groups that span hosts of one NVLink domain exchange fabric handles
(``CU_MEM_HANDLE_TYPE_FABRIC``) as bytes through the Communicator instead. Peers import, map
(``cuMemAddressReserve`` + ``cuMemMap``) and set access; the own copy is zeroed. Every step is
a step of one :class:`dcpkit._setup.Transaction`, so a failure on any rank unwinds on every
rank and raises on every rank. :mod:`dcpkit._nvshmem` is the other backend, with the same
shape of result.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from typing import NamedTuple

from . import _cuda, _fdpass
from ._setup import Transaction
from .errors import CudaError, DcpkitError, InvalidArgument
from .multicast import MulticastObject, multicast_granularity

__all__ = ["CumemHeap", "setup_heap", "attach_multicast", "round_up"]

log = logging.getLogger("dcpkit")


class CumemHeap(NamedTuple):
    """What :func:`setup_heap` made on this rank."""

    nbytes: int  # granularity-rounded size of each rank's copy
    peer_ptrs: list[int]  # every rank's copy, as this process maps it (own included)
    local_ptr: int
    mc_ptr: int  # 0 without multicast
    mc: MulticastObject | None
    handle_type: str  # "posix_fd" or "fabric": what was used
    multicast_reason: str | None  # why multicast fell back to unicast (None: it did not)
    fabric_refusal: str | None  # every rank's reason, when fabric handles were refused
    undo: list[tuple[str, Callable[[], object]]]


def round_up(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return (x + a - 1) // a * a


def _alloc_prop(drv, device: int, kind):
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device)
    prop.requestedHandleTypes = kind
    return prop


def setup_heap(
    comm, device: int, nbytes: int, handle_type: str, use_mc: bool, timeout_s: float, tag: str
) -> CumemHeap:
    """The cumem side of ``SymmetricHeap(backend="cumem")``: check the device and P2P between
    every pair, create, share, import, map and zero one allocation of ``nbytes`` (rounded up
    to the largest granularity of the group) per rank, and bind a multicast object where
    ``use_mc``.

    ``handle_type`` is ``"auto"``, ``"posix_fd"`` or ``"fabric"`` (checked by the caller);
    ``tag`` names this heap's descriptor exchange (equal on every rank, unique per heap).

    Collective: every rank of ``comm``, after the arguments were checked and agreed.
    """
    import cupy

    rank, world = comm.rank, comm.world_size
    multicast_reason = None
    fabric_refusal = None
    mc = None
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
                    multicast_reason = (
                        "multicast off: cuMulticastGetGranularity failed on rank(s) "
                        f"{failed} ({'; '.join(str(grans[r][2]) for r in failed)})"
                    )
                    log.warning("dcpkit SymmetricHeap: %s", multicast_reason)
                else:
                    gran = functools.reduce(math.lcm, (mg for _, mg, _ in grans), gran)
            size = round_up(nbytes, gran)

            used = "posix_fd"
            if want_fabric:

                def fabric_step():
                    box["refusal"] = None
                    try:
                        supported = _cuda.device_attribute("HANDLE_TYPE_FABRIC_SUPPORTED", device)
                    except CudaError as e:
                        box["refusal"] = (
                            f"CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED query failed: {e}"
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
                    fabric_refusal = detail
                    msg = (
                        "dcpkit SymmetricHeap: fabric handles refused by the driver (%s); "
                        "every rank falls back to POSIX file descriptors"
                    )
                    if rank == 0:
                        log.warning(msg, detail)
                    else:
                        log.debug(msg, detail)

            if used == "posix_fd":

                def create_step():
                    h = check(
                        drv.cuMemCreate(size, _alloc_prop(drv, device, fd_kind), 0), "cuMemCreate"
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
                            tx.add_undo(f"close(fd of rank {p})", functools.partial(os.close, f))
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
                base = int(check(drv.cuMemAddressReserve(total, gran, 0, 0), "cuMemAddressReserve"))
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
                    check(drv.cuMemSetAccess(base + p * size, size, [desc], 1), "cuMemSetAccess")

            tx.step("access", access_step)

            def zero_step():
                check(drv.cuMemsetD8(base + rank * size, 0, size), "cuMemsetD8")
                cupy.cuda.runtime.deviceSynchronize()

            # The check after this step is the barrier: no peer writes into this copy
            # before it is zeroed.
            tx.step("zero", zero_step)

            if use_mc:
                mc, multicast_reason = attach_multicast(
                    comm, tx, device, size, box["handle"], used, timeout_s
                )
    except BaseException:
        tx.rollback()
        raise
    peer_ptrs = [base + p * size for p in range(world)]
    return CumemHeap(
        nbytes=size,
        peer_ptrs=peer_ptrs,
        local_ptr=peer_ptrs[rank],
        mc_ptr=mc.mc_ptr if mc is not None else 0,
        mc=mc,
        handle_type=used,
        multicast_reason=multicast_reason,
        fabric_refusal=fabric_refusal,
        undo=tx.commit(),
    )


def attach_multicast(
    comm, tx: Transaction, device: int, size: int, mem_handle, handle_type: str, timeout_s: float
) -> tuple[MulticastObject | None, str | None]:
    """Bind a MulticastObject to the allocation ``mem_handle`` of ``size`` bytes and register
    its release with ``tx``; return it and None. A failure is raised on every rank, so every
    rank goes on with unicast together: then return None and the reason.

    Collective: every rank of ``comm``.
    """
    try:
        mc = MulticastObject(
            comm, size, device, mem_handle=mem_handle, handle_type=handle_type, timeout_s=timeout_s
        )
    except Exception as e:  # noqa: BLE001 - raised on every rank: all fall back together
        reason = f"multicast setup failed, using unicast: {e}"
        log.warning("dcpkit SymmetricHeap rank %d: %s", comm.rank, reason)
        return None, reason
    tx.add_undo("MulticastObject", mc._release_local)
    return mc, None
