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
  together (``fabric_refusal`` records why). Its setup is :mod:`dcpkit._cumem`.
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

import logging
import math
import os
from collections.abc import Callable

import numpy as np

from . import _cuda, _cumem
from ._checks import check_comm, check_int, check_multicast, check_real
from ._lifecycle import Resource
from ._setup import collective_step, run_undo
from .errors import ClosedError, ConfigMismatch, DcpkitError, InvalidArgument, InvalidType
from .multicast import agree_multicast, multicast_decision

__all__ = ["SymmetricHeap", "BACKENDS", "HANDLE_TYPES", "MAX_NBYTES", "check_heap"]

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
    _noun = "heap"
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
        use_mc, reason = agree_multicast(
            comm,
            lambda: multicast_decision(
                multicast,
                os.environ,
                lambda: _cuda.device_attribute("MULTICAST_SUPPORTED", dev) == 1,
            ),
        )
        self.multicast_reason = reason
        if multicast is not None or use_mc:
            log.info("dcpkit SymmetricHeap rank %d: %s", self.rank, reason)

        if backend == "cumem":
            self._setup_cumem(int(nbytes), handle_type, use_mc, float(timeout_s), tag)
        else:
            self._setup_nvshmem(int(nbytes), use_mc)
        self._closed = False

    # ------------------------------------------------------------------ backends
    def _setup_cumem(
        self, nbytes: int, handle_type: str, use_mc: bool, timeout_s: float, tag: str
    ) -> None:
        got = _cumem.setup_heap(  # collective
            self.comm, self.device, nbytes, handle_type, use_mc, timeout_s, tag
        )
        if got.multicast_reason is not None:
            self.multicast_reason = got.multicast_reason
        self.fabric_refusal = got.fabric_refusal
        self.handle_type = got.handle_type
        self.nbytes = got.nbytes
        self.peer_ptrs = got.peer_ptrs
        self.local_ptr = got.local_ptr
        self._mc = got.mc
        self.mc_ptr = got.mc_ptr
        self._undo = got.undo

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
        off = _cumem.round_up(self._next, a)
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


def check_heap(heap, comm, op: str, nbytes: int) -> None:
    """Checks of a ``heap=`` argument (no collective): an open :class:`SymmetricHeap` of this
    very group (same world_size, same rank) with ``nbytes`` free after its last reservation."""
    if not isinstance(heap, SymmetricHeap):
        raise InvalidType(f"{op}: heap must be a dcpkit.SymmetricHeap (got {type(heap).__name__})")
    if heap.closed:
        raise ClosedError(f"{op}: heap must be open (got a closed SymmetricHeap)")
    if (heap.world_size, heap.rank) != (comm.world_size, comm.rank):
        raise InvalidArgument(
            f"{op}: heap must belong to the group of comm: heap world_size and "
            f"rank must be {comm.world_size} and {comm.rank} (got "
            f"{heap.world_size} and {heap.rank})"
        )
    off = -(-heap.reserved_bytes // 256) * 256  # where reserve() would place it
    if off + nbytes > heap.nbytes:
        raise InvalidArgument(
            f"{op}: heap free bytes must be >= {nbytes}, the size of the "
            f"workspace (got {max(heap.nbytes - off, 0)} bytes free after "
            f"offset {off} of {heap.nbytes})"
        )
