"""Multicast objects over a symmetric heap, and the guard that decides whether one may exist.

A multicast object gives every rank one virtual address, ``mc_ptr``, bound to every rank's copy
of a symmetric heap: a ``multimem.st`` to ``mc_ptr + offset`` lands at ``offset`` in every copy
(NVLink SHARP on NVSwitch systems). Creating one takes NVSwitch resources; on shared machines an
operator can forbid it, and there ``cuMulticastCreate`` must never run (see README.md,
"Known limits", and NOTE [dcpkit multicast guard] below).

NOTE [dcpkit multicast guard]
Multicast is used only when all of these hold, checked in this order:

1. opt-in: ``multicast=True`` was passed, or ``multicast=None`` (the default) and
   ``DCPKIT_MULTICAST`` holds a true spelling. ``multicast=False`` is always off.
2. no disabling variable is set (every one that disables is named in the reason):

   ================================== ===========================================================
   variable                           disables multicast when its value is ...
   ================================== ===========================================================
   ``NCCL_NVLS_ENABLE``               a false spelling (``0``, ``false``, ...). Not disabling:
                                      a true spelling (``1``, ``2``, ``true``, ...).
   ``NVSHMEM_DISABLE_NVLS``           a true spelling (``1``, ``true``, ``yes``, ...). Not
   ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` disabling: a false spelling (``0``, ``false``, ...).
   ``DCPKIT_DISABLE_MULTICAST``
   ================================== ===========================================================

   The spellings, of these variables and of ``DCPKIT_MULTICAST`` (:data:`TRUE_SPELLINGS`,
   :data:`FALSE_SPELLINGS`): true is ``1``, ``true``, ``yes``, ``on``, ``y``, ``t`` or any other
   decimal integer but 0 (``2``, say); false is ``0``, ``false``, ``no``, ``off``, ``n``, ``f``
   (``00`` too). They are compared case-insensitively, after stripping ASCII blanks, and must
   be ASCII: ``1_0``, ``+1``, ``-1``, an Arabic-Indic digit one and unknown words are none of
   them. A variable that is unset, or set to the empty
   string or to blanks, has no effect. Any other value raises
   :class:`~dcpkit.errors.InvalidArgument` naming the variable and the value, wherever the
   guard reads it: a value the guard cannot read never enables multicast, and never disables it
   silently either.
3. the device reports ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` = 1.
4. every rank of the group says yes (:func:`agree_multicast`); otherwise no rank uses it, and the
   reason names the ranks that said no.

:class:`MulticastObject` checks rule 2 again from ``os.environ`` on every rank, before its first
driver call, and raises :class:`~dcpkit.errors.MulticastDisabled` on every rank if any rank is
forbidden: a caller that skipped the guard still cannot reach ``cuMulticastCreate``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from . import _cuda
from ._checks import check_comm
from ._lifecycle import Resource
from ._setup import Transaction, collective_step, run_undo
from .errors import InvalidArgument, InvalidType, MulticastDisabled, PeerError

__all__ = [
    "KILL_SWITCHES",
    "OPT_IN_VARIABLE",
    "TRUE_SPELLINGS",
    "FALSE_SPELLINGS",
    "kill_switches_set",
    "multicast_decision",
    "agree_multicast",
    "multicast_granularity",
    "guard_env_or_raise",
    "MulticastObject",
]

log = logging.getLogger("dcpkit")

#: The user's opt-in variable.
OPT_IN_VARIABLE = "DCPKIT_MULTICAST"

#: Variables that forbid multicast, with the sense of each: ``"enable"`` variables forbid it
#: when they hold a false spelling, ``"disable"`` variables when they hold a true spelling
#: (NOTE [dcpkit multicast guard]).
KILL_SWITCHES: tuple[tuple[str, str], ...] = (
    ("NCCL_NVLS_ENABLE", "enable"),
    ("NVSHMEM_DISABLE_NVLS", "disable"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "disable"),
    ("DCPKIT_DISABLE_MULTICAST", "disable"),
)

#: Disabling variables read as integers only (their owner reads them with strtoll).
_INTEGER_ONLY = frozenset({"NCCL_NVLS_ENABLE"})

#: Words that read as true in the guard's variables (besides a decimal integer other than 0).
TRUE_SPELLINGS = ("1", "true", "yes", "on", "y", "t")
#: Words that read as false in the guard's variables (besides ``0`` written with more zeros).
FALSE_SPELLINGS = ("0", "false", "no", "off", "n", "f")
_TRUE_WORDS = frozenset(TRUE_SPELLINGS)
_FALSE_WORDS = frozenset(FALSE_SPELLINGS)
_ASCII_BLANKS = " \t\n\r\f\v"
_SPELLINGS = (
    f"{', '.join(TRUE_SPELLINGS)} (or another run of ASCII digits, no sign, but 0) for true, or "
    f"{', '.join(FALSE_SPELLINGS)} for false"
)
#: The op named in the guard's messages when the caller names none.
_GUARD = "multicast guard"


def _parse_bool(name: str, value: str, op: str = _GUARD) -> bool:
    """``value`` of the variable ``name`` as True or False (NOTE [dcpkit multicast guard]).

    Raises
    ------
    InvalidArgument
        ``value`` is not one of the spellings: an unknown word, non-ASCII characters, a sign, a
        digit separator (``1_0``). The message names ``op``, ``name`` and ``value``.
    """
    v = value.strip(_ASCII_BLANKS)
    if v.isascii():  # before lower(), which maps some non-ASCII letters to ASCII ones
        v = v.lower()
        if v in _TRUE_WORDS:
            return True
        if v in _FALSE_WORDS:
            return False
        if v.isdigit():  # ASCII digits only: no sign, no separator, no other script's digits
            return v.strip("0") != ""
    raise InvalidArgument(f"{op}: {name} must be {_SPELLINGS} (got {value!r})")


def _is_set(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name)
    return value is not None and value.strip(_ASCII_BLANKS) != ""


def kill_switches_set(env: Mapping[str, str], op: str = _GUARD) -> list[tuple[str, str]]:
    """The disabling variables that forbid multicast in ``env``, as ``(name, value)`` pairs.

    Empty when multicast is not forbidden by any variable. See NOTE [dcpkit multicast guard].

    Raises
    ------
    InvalidArgument
        A disabling variable holds a value that is neither a true nor a false spelling (the
        message names ``op``, every such variable and its value).
    """
    found, unreadable, integer_only = [], [], []
    for name, sense in KILL_SWITCHES:
        if not _is_set(env, name):
            continue
        value = env[name]
        try:
            parsed = _parse_bool(name, value, op)
        except InvalidArgument:
            unreadable.append((name, value))
            continue
        if parsed and name in _INTEGER_ONLY and not value.strip(_ASCII_BLANKS).isdigit():
            # NCCL reads its own variable with strtoll: a word is 0 there (NVLS off), so
            # reading TRUE as on here would let dcpkit use multicast where NCCL does not.
            integer_only.append((name, value))
            continue
        if parsed is (sense == "disable"):
            found.append((name, value))
    msgs = []
    if unreadable:
        names = " and ".join(n for n, _ in unreadable)
        values = " and ".join(repr(v) for _, v in unreadable)
        each = " each" if len(unreadable) > 1 else ""
        msgs.append(f"{names} must{each} be {_SPELLINGS} (got {values})")
    for name, value in integer_only:
        msgs.append(
            f"{name} must be written as an integer to mean on, such as 1 (got {value!r}: NCCL "
            f"reads a word as 0, NVLS off)"
        )
    if msgs:
        raise InvalidArgument(f"{op}: " + "; ".join(msgs))
    return found


def multicast_decision(
    opt_in: bool | None, env: Mapping[str, str], device_supported: bool | Callable[[], bool]
) -> tuple[bool, str]:
    """Whether this rank may use multicast, and why (rules 1 to 3 of the guard).

    Naive equivalent::

        truthy = ("1", "true", "yes", "on", "y", "t")    # or a decimal integer other than 0
        falsy = ("0", "false", "no", "off", "n", "f", "")
        raw = env.get("DCPKIT_MULTICAST", "").strip().lower()
        if opt_in is None and raw not in truthy + falsy:
            raise InvalidArgument("DCPKIT_MULTICAST must be ... (got ...)")
        opted_in = opt_in if opt_in is not None else raw in truthy
        return opted_in and not any_kill_switch(env) and device_supported

    Parameters
    ----------
    opt_in : bool or None
        ``multicast=`` as the user passed it: True, False, or None (then ``DCPKIT_MULTICAST``
        decides).
    env : mapping of str to str
        The environment to read (``os.environ``).
    device_supported : bool or callable returning bool
        ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` of this rank's device. A callable is called
        only when rules 1 and 2 pass, so a refused rank makes no driver call; if it raises, the
        answer is no, with the error in the reason.

    Returns
    -------
    (bool, str)
        The decision and its reason; the reason names the deciding argument, variable or device
        attribute.

    Raises
    ------
    InvalidType
        ``opt_in`` is not True, False or None.
    InvalidArgument
        A variable the decision reads holds a value that is neither a true nor a false spelling
        (NOTE [dcpkit multicast guard]): ``DCPKIT_MULTICAST`` when ``opt_in`` is None, the
        disabling variables once opted in. Multicast is then not used.
    """
    if opt_in is not None and not isinstance(opt_in, bool):
        raise InvalidType(
            f"multicast_decision: opt_in must be True, False or None (got {opt_in!r})"
        )
    if opt_in is False:
        return False, "multicast=False was passed"
    if opt_in is None:
        raw = env.get(OPT_IN_VARIABLE)
        if not _is_set(env, OPT_IN_VARIABLE) or not _parse_bool(OPT_IN_VARIABLE, raw):
            shown = "unset" if raw is None else f"{raw!r}"
            return False, (
                f"not opted in: {OPT_IN_VARIABLE} is {shown} (pass multicast=True or "
                f"set {OPT_IN_VARIABLE}=1)"
            )
        how = f"{OPT_IN_VARIABLE}={raw!r}"
    else:
        how = "multicast=True"
    killed = kill_switches_set(env)
    if killed:
        names = ", ".join(f"{n}={v!r}" for n, v in killed)
        return False, f"disabled by {names} (opted in by {how})"
    try:
        supported = device_supported() if callable(device_supported) else device_supported
    except Exception as e:  # noqa: BLE001 - a failed query means no, with the reason
        return False, (
            f"could not query CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED ({type(e).__name__}: {e})"
        )
    if not supported:
        return False, "the device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"
    return True, (f"opted in by {how}, no disabling variable set, the device supports multicast")


def agree_multicast(comm, local_decision) -> tuple[bool, str]:
    """Rule 4 of the guard: multicast only if every rank allows it.

    Parameters
    ----------
    comm : Communicator
    local_decision : bool, (bool, str), or a callable that returns one of them
        This rank's :func:`multicast_decision` (or a bare bool). A callable runs inside the
        exchange, so that an error it raises on one rank (a guard variable holding a value
        that is no spelling of the guard, say) reaches every rank instead of leaving the others
        waiting: ``agree_multicast(comm, lambda: multicast_decision(opt_in, os.environ, dev))``.

    Returns
    -------
    (bool, str)
        Equal on every rank. The reason names the ranks that said no and their reasons.

    Collective
    ----------
    One allgather; every rank calls it.

    Raises
    ------
    Exception
        On a rank whose callable raised, its own error (InvalidArgument, ...).
    PeerError
        On every other rank, when a callable raised on some rank (naming it and its error).
    """
    if callable(local_decision):
        decide = local_decision
        everyone = collective_step(comm, "multicast guard", lambda: _vote(decide()), gather=True)
    else:
        everyone = comm.allgather(_vote(local_decision))
    refused = [r for r, (o, _) in enumerate(everyone) if not o]
    if not refused:
        return True, f"every rank allows multicast ({everyone[0][1]})"
    detail = "; ".join(f"rank {r}: {everyone[r][1]}" for r in refused)
    return False, f"multicast off: rank(s) {refused} do not allow it ({detail})"


def _vote(decision) -> tuple[bool, str]:
    """``(ok, reason)`` of a decision given as ``(bool, str)`` or a bare bool."""
    if isinstance(decision, tuple):
        return bool(decision[0]), str(decision[1])
    return bool(decision), ("allowed" if decision else "refused")


def guard_env_or_raise(what: str, rank: int | None = None) -> None:
    """Rule 2 of NOTE [dcpkit multicast guard], read from ``os.environ``: raise
    :class:`~dcpkit.errors.MulticastDisabled` (before any driver call) if any disabling
    variable is set, :class:`~dcpkit.errors.InvalidArgument` (also before any driver call) if
    one holds a value that is not a spelling of the guard."""
    killed = kill_switches_set(os.environ, what)
    if killed:
        names = ", ".join(f"{n}={v!r}" for n, v in killed)
        where = "" if rank is None else f" on rank {rank}"
        raise MulticastDisabled(
            f"{what}: multicast is disabled{where} by {names}; no multicast "
            f"object is created (NOTE [dcpkit multicast guard])"
        )


def _handle_type_enum(drv, handle_type: str):
    if handle_type == "posix_fd":
        return drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if handle_type == "fabric":
        return drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    raise InvalidArgument(
        f"MulticastObject: handle_type must be 'posix_fd' or 'fabric' (got {handle_type!r})"
    )


def _mc_prop(drv, world_size: int, size: int, handle_type: str):
    prop = drv.CUmulticastObjectProp()
    prop.numDevices = int(world_size)
    prop.size = int(size)
    prop.handleTypes = int(_handle_type_enum(drv, handle_type))
    prop.flags = 0
    return prop


def multicast_granularity(
    world_size: int, device: int, handle_type: str = "posix_fd", size: int = 1 << 21
) -> int:
    """The minimum multicast granularity in bytes (``cuMulticastGetGranularity``).

    A heap that will be bound to a multicast object rounds its size up to a multiple of this.
    The minimum (not the recommended, which can be hundreds of MiB) keeps small workspaces
    small; it is what binding requires. Checks the disabling variables first (NOTE [dcpkit
    multicast guard]); the query itself creates nothing.

    Raises
    ------
    MulticastDisabled
        A disabling variable is set (raised before any driver call).
    CudaError
        The driver refused the query.
    """
    guard_env_or_raise("multicast_granularity")
    drv = _cuda.driver()
    prop = _mc_prop(drv, world_size, size, handle_type)
    flag = drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM
    return int(_cuda.check(drv.cuMulticastGetGranularity(prop, flag), "cuMulticastGetGranularity"))


class MulticastObject(Resource):
    """One multicast address bound to every rank's copy of a symmetric heap.

    Naive equivalent: none in plain CUDA; with it, ``multimem.st [mc_ptr + off], v`` behaves as
    ``for r in ranks: store(peer_ptrs[r] + off, v)`` in one NVSwitch operation.

    Setup (a transaction: every step registers its undo, every rank checks after every step that
    all ranks succeeded, and a failure anywhere unwinds everywhere):

    1. the guard: disabling variables re-read from ``os.environ`` on every rank, then the device
       attribute; a refusal on any rank raises :class:`MulticastDisabled` on every rank, before
       any multicast driver call
    2. ``cuMulticastGetGranularity`` (the largest over ranks); ``heap_nbytes`` must be a multiple
    3. rank 0: ``cuMulticastCreate``, then export (POSIX fd, or fabric handle bytes)
    4. the handle goes to every peer: fd over an abstract Unix socket (``SCM_RIGHTS``), or fabric
       bytes through the Communicator; peers import it
    5. ``cuMulticastAddDevice`` on every rank; the step check is the barrier that makes every
       device join before any memory is bound
    6. ``cuMulticastBindMem`` of this rank's own physical allocation (``mem_handle``)
    7. ``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess`` of the multicast handle

    :meth:`close` undoes these in reverse (unmap, free the range, unbind, release, close fds).

    Parameters
    ----------
    comm : Communicator
    heap_nbytes : int
        Size in bytes of each rank's copy of the heap, a multiple of the multicast granularity
        (:func:`multicast_granularity`).
    device : int
        This rank's CUDA device.
    mem_handle : CUmemGenericAllocationHandle
        This rank's physical allocation of the heap (from ``cuMemCreate``), bound at offset 0.
    handle_type : {"posix_fd", "fabric"}
        How the multicast handle travels from rank 0 to its peers.
    timeout_s : float
        Deadline of the descriptor exchange, in seconds.

    Attributes
    ----------
    mc_ptr : int
        The multicast virtual address (0 after :meth:`close`).
    nbytes : int
        Bytes bound, equal to ``heap_nbytes``.

    Collective
    ----------
    Construction and :meth:`close`.

    Raises
    ------
    MulticastDisabled
        On every rank, when any rank has a disabling variable set or a device without multicast.
    PeerError
        A step failed on another rank (this rank unwound what it had created).
    CudaError, FdExchangeError, InvalidArgument
        A step failed on this rank (every rank unwound).
    """

    _resource_name = "MulticastObject"

    def __init__(
        self,
        comm,
        heap_nbytes: int,
        device: int,
        *,
        mem_handle,
        handle_type: str = "posix_fd",
        timeout_s: float = 60.0,
    ):
        self._undo: list = []
        self.mc_ptr = 0
        self.comm = check_comm(comm, "MulticastObject")
        rank, world = comm.rank, comm.world_size

        # 1. The guard, before any driver call, on every rank.
        def guard_and_arguments():
            guard_env_or_raise("MulticastObject", rank)
            for name, value in (("heap_nbytes", heap_nbytes), ("device", device)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidType(
                        f"MulticastObject: {name} must be an int "
                        f"(got {type(value).__name__} {value!r})"
                    )
            if heap_nbytes <= 0:
                raise InvalidArgument(
                    f"MulticastObject: heap_nbytes must be > 0 (got {heap_nbytes})"
                )
            if device < 0:
                raise InvalidArgument(f"MulticastObject: device must be >= 0 (got {device})")
            if handle_type not in ("posix_fd", "fabric"):
                raise InvalidArgument(
                    f"MulticastObject: handle_type must be 'posix_fd' or "
                    f"'fabric' (got {handle_type!r})"
                )
            if mem_handle is None:
                raise InvalidArgument(
                    "MulticastObject: mem_handle must be the heap's physical "
                    "allocation handle (got None)"
                )

        try:
            collective_step(
                comm, "MulticastObject: multicast guard and arguments", guard_and_arguments
            )
        except PeerError as pe:
            # A peer is forbidden: refuse here too with the same error type, still before any
            # driver call.
            if any(str(m).startswith("MulticastDisabled") for m in pe.failed.values()):
                raise MulticastDisabled(f"MulticastObject: refused on every rank: {pe}") from pe
            raise

        import cupy

        drv = _cuda.driver()
        self.device = int(device)
        self.nbytes = int(heap_nbytes)
        self.handle_type = handle_type
        hkind = _handle_type_enum(drv, handle_type)
        tx = Transaction(comm, "MulticastObject")
        box = {}

        try:
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.free(0)  # the primary context exists and is current

                def device_step():
                    supported = _cuda.device_attribute("MULTICAST_SUPPORTED", self.device)
                    if not supported:
                        raise MulticastDisabled(
                            f"MulticastObject: device {self.device} of rank {rank} reports "
                            f"CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"
                        )
                    box["dev"] = _cuda.check(drv.cuDeviceGet(self.device), "cuDeviceGet")

                tx.step("mc_device", device_step)

                def granularity_step():
                    box["gran"] = multicast_granularity(
                        world, self.device, handle_type, self.nbytes
                    )

                tx.step("mc_granularity", granularity_step)
                gran = max(comm.allgather(box["gran"]))

                def size_step():
                    if self.nbytes % gran:
                        raise InvalidArgument(
                            f"MulticastObject: heap_nbytes must be a multiple "
                            f"of the multicast granularity {gran} "
                            f"(got {self.nbytes})"
                        )

                tx.step("mc_size", size_step)
                prop = _mc_prop(drv, world, self.nbytes, handle_type)
                token = comm.job_token()

                def create_step():
                    if rank == 0:
                        guard_env_or_raise("MulticastObject", rank)  # last look before creation
                        h = _cuda.check(drv.cuMulticastCreate(prop), "cuMulticastCreate")
                        box["handle"] = h
                        tx.add_undo(
                            "cuMemRelease(multicast)",
                            lambda: _cuda.check(drv.cuMemRelease(h), "cuMemRelease"),
                        )

                tx.step("mc_create", create_step)

                def export_step():
                    if rank == 0:
                        shared = _cuda.check(
                            drv.cuMemExportToShareableHandle(box["handle"], hkind, 0),
                            "cuMemExportToShareableHandle",
                        )
                        if handle_type == "posix_fd":
                            fd = int(shared)
                            box["fd"] = fd
                            tx.add_undo("close(multicast fd)", lambda: os.close(fd))
                            os.set_inheritable(fd, False)
                        else:
                            box["fabric"] = bytes(shared.data)

                tx.step("mc_export", export_step)

                if handle_type == "posix_fd":

                    def exchange_step():
                        from . import _fdpass

                        got = _fdpass.exchange_fds(
                            token,
                            "mc",
                            rank,
                            world,
                            box.get("fd"),
                            senders=[0],
                            timeout_s=timeout_s,
                        )
                        if rank != 0:
                            fd = got[0]
                            box["fd"] = fd
                            tx.add_undo("close(multicast fd)", lambda: os.close(fd))

                    tx.step("mc_exchange", exchange_step)
                else:
                    box["fabric"] = comm.broadcast(box.get("fabric"), root=0)

                def import_step():
                    if rank == 0:
                        return
                    if handle_type == "posix_fd":
                        h = _cuda.check(
                            drv.cuMemImportFromShareableHandle(box["fd"], hkind),
                            "cuMemImportFromShareableHandle",
                        )
                    else:
                        fh = drv.CUmemFabricHandle()
                        fh.data = box["fabric"]
                        h = _cuda.check(
                            drv.cuMemImportFromShareableHandle(fh.getPtr(), hkind),
                            "cuMemImportFromShareableHandle",
                        )
                    box["handle"] = h
                    tx.add_undo(
                        "cuMemRelease(multicast)",
                        lambda: _cuda.check(drv.cuMemRelease(h), "cuMemRelease"),
                    )

                tx.step("mc_import", import_step)

                tx.step(
                    "mc_add_device",
                    lambda: _cuda.check(
                        drv.cuMulticastAddDevice(box["handle"], box["dev"]), "cuMulticastAddDevice"
                    ),
                )

                def bind_step():
                    h, dev, n = box["handle"], box["dev"], self.nbytes
                    _cuda.check(
                        drv.cuMulticastBindMem(h, 0, mem_handle, 0, n, 0), "cuMulticastBindMem"
                    )
                    tx.add_undo(
                        "cuMulticastUnbind",
                        lambda: _cuda.check(
                            drv.cuMulticastUnbind(h, dev, 0, n), "cuMulticastUnbind"
                        ),
                    )

                tx.step("mc_bind", bind_step)

                def map_step():
                    n = self.nbytes
                    va = int(
                        _cuda.check(drv.cuMemAddressReserve(n, gran, 0, 0), "cuMemAddressReserve")
                    )
                    tx.add_undo(
                        "cuMemAddressFree(multicast)",
                        lambda: _cuda.check(drv.cuMemAddressFree(va, n), "cuMemAddressFree"),
                    )
                    _cuda.check(drv.cuMemMap(va, n, 0, box["handle"], 0), "cuMemMap")
                    tx.add_undo(
                        "cuMemUnmap(multicast)",
                        lambda: _cuda.check(drv.cuMemUnmap(va, n), "cuMemUnmap"),
                    )
                    desc = drv.CUmemAccessDesc()
                    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                    desc.location.id = self.device
                    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    _cuda.check(drv.cuMemSetAccess(va, n, [desc], 1), "cuMemSetAccess")
                    box["va"] = va

                tx.step("mc_map", map_step)

        except BaseException:
            tx.rollback()  # a collective outside a step failed: give back what exists
            raise
        self.mc_ptr = box["va"]
        self._undo = tx.commit()
        self._closed = False

    def _release_local(self) -> None:
        """Undo setup on this rank only, in reverse (no collective; the caller synchronised):
        the undo a heap registers for its multicast object."""
        if self._closed:
            return
        self._closed = True
        self._undo_local()

    def _undo_local(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            errors = run_undo(self._undo, "MulticastObject.close")
        self.mc_ptr = 0
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Release the multicast object (collective, idempotent).

        Waits for the device, waits for every rank, then unmaps, frees the address range,
        unbinds, releases the handle and closes descriptors, in that order.

        Stream: synchronises the device.
        """
        super().close()

    def _close(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
        self.comm.barrier()
        self._undo_local()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"mc_ptr=0x{self.mc_ptr:x}"
        return (
            f"MulticastObject(rank={self.comm.rank}, world_size={self.comm.world_size}, "
            f"nbytes={getattr(self, 'nbytes', 0)}, {state})"
        )
