"""What every direct op shares: the symmetric region, the per-ubatch protocol state, the timeout
record, output buffers, and the call bookkeeping.

See NOTE [dcpkit epoch signalling] in ``kernels/dcpkit_ptx.cuh`` for the protocol. Layout of an
op's symmetric region, per ubatch ``u`` (every part 256-byte aligned)::

    signals  u64 [2, world_size]       written only by peers (and by this rank for itself):
                                        (fingerprint << 32) | epoch (dcpkit/ops/_protocol.py)
    credits  u64 [world_size]           push gathers: credits[s] written only by rank s
                                        (NOTE [dcpkit zero-copy graph outputs] in
                                        ``kernels/gather.cuh``)
    counters u64 [world_size]           push gathers, lse_reduce: counters[s] grown only by
                                        rank s's CTAs
                                        (NOTE [dcpkit share counters], ``dcpkit_ptx.cuh``)
    slot 0   slot_bytes                 data of even epochs
    slot 1   slot_bytes                 data of odd epochs

after the ubatches, the push gathers keep their pool of graph output buffers in the region too
(``graph_outputs`` buffers of ``_pool_stride`` bytes), so that peers store into them.

(The gathers carve three data slots, chosen by ``epoch % 3``, out of these two: their results
are read after the kernel retired, see NOTE [dcpkit gather slots] in ``kernels/gather.cuh``.
Signals always keep two slots, ``epoch & 1``.)

Local (non-symmetric) device state per workspace: ``epoch u64 [U]``, ``arrive u32 [U]`` (CTA
arrival counters, zero between calls), ``abort u32 [1]``, ``work u32 [U, 2]`` (work counters of
the copy-out / combine, by epoch parity); the failure record
(``_protocol.RECORD_BYTES``, timeout or mismatch) in mapped pinned host memory.

Outputs. Parity of the slot a call uses is chosen on the device (``epoch & 1``). The host keeps a
shadow count of the calls of each ubatch; it is exact while the ubatch is only called eagerly.
* ``out=`` given: the kernel writes (or copies) the result into ``out``.
* eager call, ubatch never captured in a graph: the gathers return a view of the slot itself
  (zero copy); lse_reduce writes into one of two workspace output buffers.
* eager call after the ubatch was captured: the host no longer knows the device parity, so the
  result is copied into one of two workspace output buffers, alternating per eager call.
* call while the stream is capturing: the result goes to a graph output buffer of its own, taken
  from a pool of ``graph_outputs`` buffers allocated with the workspace (given back only by
  :meth:`OpWorkspace.release_graph_outputs`: a graph may be replayed at any time); a capture that
  finds the pool empty raises :class:`DcpkitError` (pass ``out=``, build the workspace with a
  larger ``graph_outputs``, or release the buffers of graphs that are gone). The push gathers'
  peers store straight into that buffer (zero copy, NOTE [dcpkit zero-copy graph outputs]).
In every eager case the returned view stays valid while it is consumed on the same stream before
call ``n + 2`` of the same ubatch is issued; a graph output stays valid until the next replay of
the graph that captured the call.

Capture. A workspace is never built, and its first call is never made, while the stream is
capturing (:func:`check_not_capturing`): setup compiles, loads modules, allocates and runs host
collectives, none of which a capture may contain.

Poison. After a timeout or a mismatch the workspace is poisoned: every later kernel of it (eager
or graph replay) fills its result with 0xFF bytes (NaN in every float dtype; the merged lse NaN),
and :attr:`OpWorkspace.poisoned` / :meth:`OpWorkspace.check` tell it from the mapped record
without synchronising. A replay-only loop detects it like this::

    for step in range(n):
        graph.launch(stream)
        if op.poisoned:          # a read of host memory, no device sync
            op.check()           # raises CollectiveTimeout or ConfigMismatch
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _cuda
from .._checks import (
    MAX_TIMEOUT_MS,
    check_bool,
    check_positive_int,
    check_timeout_ms,
    default_timeout_ms,
)
from .._launch import Launcher, ProgrammaticLauncher, check_programmatic_launch
from .._lifecycle import Resource
from .._plan import LazyPlanCache, PlanCache
from .._setup import debug_enabled, guarded, share_outcome
from .._sm_share import sm_share
from ..comm import Communicator
from ..errors import ClosedError, DcpkitError, InvalidArgument, InvalidType
from ..symmetric import MAX_NBYTES, check_heap
from . import _protocol
from ._outputs import DEFAULT_GRAPH_OUTPUTS, OutputBuffers

__all__ = [
    "OpWorkspace",
    "PROTO_PARAM_TYPES",
    "OP_IDS",
    "OP_NAMES",
    "default_timeout_ms",
    "check_timeout_ms",
    "debug_enabled",
    "share_outcome",
    "guarded",
    "check_heap",
    "TIMEOUT_RECORD_FIELDS",
    "MAX_TIMEOUT_MS",
    "MAX_LIVE_KERNELS",
    "DEFAULT_GRAPH_OUTPUTS",
    "check_not_capturing",
]

OP_IDS: dict[str, int] = {"lse_reduce": 1, "q_gather": 2, "kv_gather": 3, "ceilings": 4}
OP_NAMES: dict[int, str] = {v: k for k, v in OP_IDS.items()}
#: The first eight words of the failure record (the whole layout: _protocol.RECORD_FIELDS).
TIMEOUT_RECORD_FIELDS = _protocol.RECORD_FIELDS[:8]
#: dcpkit kernels of one rank that may be in flight at once without deadlock (NOTE [dcpkit
#: epoch signalling], co-residency rule): the default waiter_ctas is the SM share / this.
MAX_LIVE_KERNELS = 8

_ALIGN = 256

#: Kernel parameter types of DCPKIT_PROTO_PARAMS (kernels/dcpkit_ptx.cuh), in order: epoch,
#: arrive, abort, record, signals, peer_sig, mc_sig, rank, world, timeout_ns, op, ubatch,
#: fp_base, waiters, num_ubatches, sig_ustride, work. Every kernel takes them first; the ops'
#: ``*_PARAM_TYPES`` start with this tuple (checked against the PTX in the unit tests).
PROTO_PARAM_TYPES = ("u64",) * 7 + ("i32", "i32", "u64") + ("u32",) * 6 + ("u64",)


def _cupy_current_stream(device: int = -1):
    """CuPy's current stream of ``device`` (-1: current): ``_current_stream_fn``'s default."""
    import cupy

    return cupy.cuda.get_current_stream(device)


def _round_up(x: int, a: int = _ALIGN) -> int:
    return (x + a - 1) // a * a


def check_not_capturing(stream, op: str, what: str) -> None:
    """Raise :class:`DcpkitError` if ``stream`` is capturing a CUDA graph (``what``: the step
    refused, e.g. "construction")."""
    if stream is None:
        return
    try:
        capturing = bool(stream.is_capturing())
    except Exception:  # noqa: BLE001 - a stream that cannot tell is not capturing here
        return
    if capturing:
        raise DcpkitError(
            f"{op}: {what} must not happen while a CUDA graph is being captured "
            f"(got a capturing stream): build the workspace and make one eager "
            f"call before capturing"
        )


def _current_stream(cupy, device: int):
    """The current CuPy stream of ``device`` (None where it cannot be had: no driver)."""
    try:
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream()
    except Exception:  # noqa: BLE001 - no stream, nothing capturing
        return None


class OpWorkspace(OutputBuffers, Resource):
    """Base class of the direct ops (:class:`~dcpkit.ops.LseReduce`, ``QGather``, ``KVGather``).

    A subclass implements ``_init_geometry(world_size, **geometry keywords)`` (every check of
    its own arguments that needs no GPU and no collective, returning the values every rank must
    agree on) and ``_region_bytes()`` (the slot and output bytes the geometry needs);
    :meth:`_check_arguments` runs them with the checks every op shares. Its constructor calls
    :meth:`_setup` with that function bound to its arguments; :meth:`_setup` runs it on every
    rank inside one agreed exchange. The subclass then launches its kernels with
    :meth:`proto_args` first, and calls :meth:`begin_call` at the start of every call.

    Collective: construction, :meth:`close` and every call.
    """

    op_name = "op"
    #: Constructor arguments that size the workspace (named in size errors).
    size_arguments = "the geometry"
    #: Ranks of the group on this rank's GPU (set by the setup; 1 with one GPU per rank).
    ranks_on_gpu = 1

    # ------------------------------------------------------------------ construction
    def _check_arguments(
        self,
        world_size: int,
        *,
        num_ubatches=1,
        timeout_ms=None,
        graph_outputs=None,
        waiter_ctas=None,
        programmatic_launch=False,
        self_check=True,
        **geometry,
    ) -> tuple:
        """Every check of the constructor arguments that needs no GPU and no collective (the
        constructor's keywords): the protocol options, the op's ``_init_geometry(world_size,
        **geometry)``, ``num_ubatches``, ``timeout_ms`` (or ``DCPKIT_TIMEOUT_MS``) and the size of
        the symmetric region (from the op's ``_region_bytes()``). Sets the layout; returns what
        every rank must agree on: the geometry, then ``(num_ubatches, timeout_ms, region
        bytes)``."""
        self._check_protocol_options(graph_outputs, waiter_ctas, programmatic_launch, self_check)
        agreed = self._init_geometry(world_size, **geometry)
        slot_bytes, out_bytes = self._region_bytes()
        op = self.op_name
        self.num_ubatches = check_positive_int(num_ubatches, op, "num_ubatches")
        self.timeout_ms = check_timeout_ms(timeout_ms, op)
        W, U = int(world_size), self.num_ubatches
        # signals [2][W], credits [W], share counters [W]
        self._sig_bytes = _round_up(_protocol.share_counter_word(W, W) * 8)
        self.slot_bytes = _round_up(max(int(slot_bytes), 16))
        self._ubatch_stride = self._sig_bytes + 2 * self.slot_bytes
        self._out_bytes = int(out_bytes)
        self._pool_stride = _round_up(max(self._out_bytes, 1))
        self._pool_in_region = self._symmetric_graph_outputs()
        self._pool_bytes = self.graph_outputs * self._pool_stride
        self._region = U * self._ubatch_stride + (self._pool_bytes if self._pool_in_region else 0)
        if self._region > MAX_NBYTES or self._pool_bytes > MAX_NBYTES:
            raise InvalidArgument(
                f"{op}: {self._size_formula()} must be <= 2**40 bytes (got "
                f"{self._size_terms()}): lower {self.size_arguments}, num_ubatches or "
                f"graph_outputs"
            )
        return agreed + (U, self.timeout_ms, self._region)

    def _check_protocol_options(
        self, graph_outputs, waiter_ctas, programmatic_launch=False, self_check=True
    ) -> None:
        """The protocol knobs every op takes (no GPU or collective; need not agree): graph_outputs
        (>= 0), waiter_ctas (None or >= 1), programmatic_launch and _self_check (bools)."""
        op = self.op_name
        if graph_outputs is None:
            graph_outputs = DEFAULT_GRAPH_OUTPUTS
        self.graph_outputs = check_positive_int(graph_outputs, op, "graph_outputs", minimum=0)
        self._waiter_ctas_arg = (
            None if waiter_ctas is None else check_positive_int(waiter_ctas, op, "waiter_ctas")
        )
        self._self_check = check_bool(self_check, op, "_self_check")
        self.programmatic_launch = check_bool(programmatic_launch, op, "programmatic_launch")

    #: NVRTC options of a diagnostics subclass (scripts/kernel_timeline.py); none as shipped.
    _diagnostic_options: tuple[str, ...] = ()

    def _kernel_options(self) -> tuple[str, ...]:
        """NVRTC options of the op's kernels: ``_self_check=False`` drops the fingerprint check,
        ``programmatic_launch=True`` adds NOTE [dcpkit programmatic launch]'s wait; then
        :attr:`_diagnostic_options`."""
        check = () if getattr(self, "_self_check", True) else ("-DDCPKIT_SELF_CHECK=0",)
        pdl = ("-DDCPKIT_PDL=1",) if getattr(self, "programmatic_launch", False) else ()
        return check + pdl + self._diagnostic_options

    def _setup(
        self,
        comm: Communicator,
        check_arguments: Callable[[int], tuple],
        what: str,
        *,
        heap=None,
        multicast=None,
    ) -> None:
        """Agree on the arguments, then build the symmetric region, the local state and the
        timeout record (collective).

        ``check_arguments(world_size)`` validates the op's arguments (no GPU, no collective) and
        returns what every rank must agree on. It runs on every rank inside one exchange
        (:meth:`Communicator.agree_setup`) together with the dependency, device and ``heap=``
        checks: a rank that rejects its arguments raises its own error, every other rank
        :class:`PeerError`; differing values raise :class:`ConfigMismatch` on every rank. No
        rank is left waiting in a later collective. Nothing is reserved in ``heap`` before every
        rank passed every check.
        """
        op = self.op_name
        self._closed = True  # until setup completes
        if not isinstance(comm, Communicator):
            raise InvalidType(
                f"{op}: comm must be a dcpkit.Communicator (got {type(comm).__name__})"
            )
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size

        def init():
            values = tuple(check_arguments(comm.world_size))
            if multicast is not None and not isinstance(multicast, bool):
                raise InvalidType(
                    f"{op}: multicast must be True, False or None (got {multicast!r})"
                )
            cupy = _cuda.require_cupy()
            if heap is not None:
                check_heap(heap, comm, op, self._region)
            device = _cuda.require_device(op, None if heap is None else heap.device)
            check_programmatic_launch(cupy, device, op, getattr(self, "programmatic_launch", 0))
            # Inside the agreed exchange, so that every rank raises (the capturing one its
            # own error, the others PeerError), before any GPU work or other collective.
            check_not_capturing(_current_stream(cupy, device), op, "construction")
            if heap is None:
                self._check_fits(cupy, device)
            return values

        self._debug = debug_enabled()  # a host collective per call where on: on all ranks or none
        agreed = f"geometry ({what}, num_ubatches, timeout_ms, symmetric bytes)"
        comm.agree_setup(op, guarded(op, init), agreed, {"DCPKIT_DEBUG": self._debug})
        self._init_region(heap, multicast)
        self._closed = False

    def _setup_with(self, comm, keywords: dict, what: str, *, heap=None, multicast=None):
        """:meth:`_setup` with ``_check_arguments`` bound to the constructor's keywords
        (``keywords``: its ``locals()``; ``_self_check`` goes as ``self_check``)."""
        skip = ("self", "comm", "heap", "multicast", "__class__")
        kw = {k: v for k, v in keywords.items() if k not in skip}
        kw["self_check"] = kw.pop("_self_check", True)
        self._setup(
            comm, lambda W: self._check_arguments(W, **kw), what, heap=heap, multicast=multicast
        )

    def _check_fits(self, cupy, device: int) -> None:
        """The workspace's own heap must fit in the GPU's memory (an error naming the op's
        arguments, not the heap's)."""
        try:
            total = int(cupy.cuda.runtime.getDeviceProperties(device)["totalGlobalMem"])
        except Exception:  # noqa: BLE001 - unknown: the heap checks it again
            return
        if self._region + (0 if self._pool_in_region else self._pool_bytes) > total:
            raise InvalidArgument(
                f"{self.op_name}: {self._size_formula()} must be <= the memory of GPU "
                f"{device}, {total} bytes (got {self._size_terms()}): lower "
                f"{self.size_arguments}, num_ubatches or graph_outputs"
            )

    def _size_formula(self) -> str:
        return "num_ubatches * symmetric bytes per ubatch + graph_outputs * bytes per graph output"

    def _size_terms(self) -> str:
        U, n = self.num_ubatches, self.graph_outputs
        total = U * self._ubatch_stride + self._pool_bytes
        return f"{U} * {self._ubatch_stride} + {n} * {self._pool_stride} = {total}"

    def _init_region(self, heap, multicast) -> None:
        """The heap (own or reserved in ``heap``), then the local state; a failure anywhere
        releases this workspace's part on every rank and raises on every rank."""
        from ..symmetric import SymmetricHeap

        comm, op = self.comm, self.op_name
        self._owns_heap = heap is None
        if heap is None:
            heap = SymmetricHeap(comm, self._region, multicast=multicast)  # collective, agreed
            self._base = 0
        else:
            # Every rank checked the room before: this cannot fail. Never given back (the heap
            # is a bump allocator), also when a later step of this constructor fails.
            self._base = heap.reserve(self._region, align=_ALIGN)
        self.heap = heap
        self.device = heap.device
        self.multicast = bool(heap.mc_ptr)
        self._rec_ptr = 0
        err = None
        bus = None
        try:
            bus = self._init_local_state()
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            err = e
        try:
            every = share_outcome(comm, f"{op}: workspace state", err, comm.host, bus)
        except BaseException:
            self._free_local_state()
            if self._owns_heap:
                try:
                    heap.close()  # collective: every rank is here
                except Exception:  # noqa: BLE001 - the setup error is what matters
                    pass
            self.heap = None
            raise
        # Ranks of this group on this very GPU (more than one only in functional runs where
        # ranks share a GPU, e.g. under MPS): each rank takes at most its share of the SMs.
        self.ranks_on_gpu = sum(1 for hb in every if hb == (comm.host, bus))
        self.max_ctas = sm_share(self.sm_count, self.ranks_on_gpu)
        # Waiting CTAs per kernel (NOTE [dcpkit epoch signalling], co-residency rule).
        wc = getattr(self, "_waiter_ctas_arg", None)
        self.waiter_ctas = min(
            self.max_ctas, wc if wc is not None else max(1, self.max_ctas // MAX_LIVE_KERNELS)
        )
        U = self.num_ubatches
        self._calls = [0] * U  # host shadow of the epoch, exact until a capture
        self._captured = [False] * U  # whether a call of this ubatch was ever captured
        self._timeout_ns = np.uint64(int(self.timeout_ms * 1e6))
        self._proto = [self._make_proto(u) for u in range(U)]

    def _init_local_state(self) -> str:
        """Epochs, counters, peer tables, the timeout record, output buffers (this rank only).
        Returns the PCI bus id of the GPU."""
        import ctypes

        import cupy

        heap, U = self.heap, self.num_ubatches
        with cupy.cuda.Device(self.device):
            self._epoch = cupy.zeros(U, dtype=cupy.uint64)
            # arrive[U], abort, work[U][2] (copy-out / combine work counters by epoch parity)
            self._ctl = cupy.zeros(3 * U + 1, dtype=cupy.uint32)
            # peer_sig[u, s] = address of signals[0][0] of ubatch u on rank s
            tbl = np.array(
                [
                    [p + self._base + u * self._ubatch_stride for p in heap.peer_ptrs]
                    for u in range(U)
                ],
                dtype=np.uint64,
            )
            self._peer_sig = cupy.asarray(tbl)
            # peer_data[u, s] = address of slot 0 of ubatch u on rank s
            self._peer_data = cupy.asarray(tbl + np.uint64(self._sig_bytes))
            flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
            self._rec_ptr = cupy.cuda.runtime.hostAlloc(_protocol.RECORD_BYTES, flags)
            self._rec = np.ctypeslib.as_array(
                (ctypes.c_uint32 * _protocol.RECORD_WORDS).from_address(self._rec_ptr)
            )
            self._rec[:] = 0
            self._init_outputs(cupy, heap.local_ptr + self._base + U * self._ubatch_stride)
            props = cupy.cuda.runtime.getDeviceProperties(self.device)
            self.sm_count = props["multiProcessorCount"]
            return cupy.cuda.runtime.deviceGetPCIBusId(self.device)

    def _free_local_state(self) -> None:
        """Drop what :meth:`_init_local_state` made (after a failed setup, or at close)."""
        self._rec = np.zeros(_protocol.RECORD_WORDS, dtype=np.uint32)
        if getattr(self, "_rec_ptr", 0):
            try:
                import cupy

                cupy.cuda.runtime.freeHost(self._rec_ptr)
            finally:
                self._rec_ptr = 0
        self._epoch = self._ctl = self._peer_sig = self._peer_data = None
        self._graph_out = None
        self._eager_out = [None] * getattr(self, "num_ubatches", 0)

    def _make_proto(self, u: int) -> tuple:
        mc = 0
        if self.multicast:
            mc = self.heap.mc_ptr + self._base + u * self._ubatch_stride
        ctl = self._ctl.data.ptr
        fp_base = _protocol.fingerprint_base(OP_IDS[self.op_name], u, self.dtype)
        return (
            np.uint64(self._epoch.data.ptr + 8 * u),  # epoch
            np.uint64(ctl + 4 * u),  # arrive
            np.uint64(ctl + 4 * self.num_ubatches),  # abort
            np.uint64(self._rec_ptr),  # timeout record (UVA: host == device)
            np.uint64(self.heap.local_ptr + self._base + u * self._ubatch_stride),  # signals
            np.uint64(self._peer_sig.data.ptr + 8 * self.world_size * u),  # peer_sig
            np.uint64(mc),  # multicast signals (0 = none)
            np.int32(self.rank),
            np.int32(self.world_size),
            self._timeout_ns,
            np.uint32(OP_IDS[self.op_name]),
            np.uint32(u),
            np.uint32(fp_base),
            np.uint32(self.waiter_ctas),
            np.uint32(self.num_ubatches),
            np.uint32(self._ubatch_stride // 8),  # u64 words between ubatches' signals
            np.uint64(ctl + 4 * (self.num_ubatches + 1 + 2 * u)),  # work counters [2]
        )

    def _finish_setup(self) -> None:
        """Warm-up barrier: no rank may wait inside a kernel while a peer still compiles. A
        device error on any rank closes the workspace and raises on every rank."""
        import cupy

        err = None
        try:
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.deviceSynchronize()
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            err = e
        try:
            share_outcome(self.comm, f"{self.op_name}: warm-up", err)  # also the barrier
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ per call
    def proto_args(self, ubatch: int) -> tuple:
        """The protocol parameters (DCPKIT_PROTO_PARAMS) of ``ubatch``, in kernel order."""
        return self._proto[ubatch]

    def peer_data_ptr(self, ubatch: int) -> np.uint64:
        """Device address of the table ``u64 [world_size]``: slot 0 of ``ubatch`` on each rank."""
        return np.uint64(self._peer_data.data.ptr + 8 * self.world_size * ubatch)

    def mc_data_ptr(self, ubatch: int) -> np.uint64:
        """Multicast address of slot 0 of ``ubatch`` (0 without multicast)."""
        if not self.multicast:
            return np.uint64(0)
        return np.uint64(
            self.heap.mc_ptr + self._base + ubatch * self._ubatch_stride + self._sig_bytes
        )

    def local_slot_ptr(self, ubatch: int, parity: int) -> int:
        """Device address of slot ``parity`` of ``ubatch`` in this rank's copy."""
        return (
            self.heap.local_ptr
            + self._base
            + ubatch * self._ubatch_stride
            + self._sig_bytes
            + parity * self.slot_bytes
        )

    def check_open(self) -> None:
        """Raise if the workspace is closed or poisoned by a timeout or a mismatch."""
        if self._closed:
            raise ClosedError(f"{self.op_name}: the workspace is closed")
        if self._rec_head[0] != 0:
            self._raise_failure()
        if self._launch_failed is not None:
            self._raise_launch_failure()

    def _raise_launch_failure(self) -> None:
        raise DcpkitError(
            f"{self.op_name}: the workspace is unusable: a kernel launch failed "
            f"after the call was counted ({self._launch_failed}); close it on "
            f"every rank and build a new one"
        )

    def check(self) -> None:
        """Raise the failure that poisoned the workspace, if any: :class:`CollectiveTimeout` or
        :class:`ConfigMismatch`. Reads the host-mapped record only (no device sync, no
        collective): cheap enough for every step of a graph-replay loop.

        Raises
        ------
        ClosedError
            The workspace is closed.
        CollectiveTimeout, ConfigMismatch
            The workspace is poisoned.
        """
        self.check_open()

    def check_ubatch(self, ubatch) -> int:
        if isinstance(ubatch, bool) or not isinstance(ubatch, (int, np.integer)):
            raise InvalidType(f"{self.op_name}: ubatch must be an int (got {ubatch!r})")
        if not (0 <= ubatch < self.num_ubatches):
            raise InvalidArgument(
                f"{self.op_name}: ubatch must lie in [0, {self.num_ubatches}) (got {ubatch})"
            )
        return int(ubatch)

    def get_stream(self, stream):
        """``stream``, or the current CuPy stream of the op's GPU for None.

        Raises
        ------
        InvalidType
            ``stream`` is not a CuPy stream (``cupy.cuda.Stream`` / ``ExternalStream``).
        """
        if stream is None:
            import cupy

            return cupy.cuda.get_current_stream(self.device)
        if isinstance(stream, _cuda._STREAM_TYPES or _cuda.stream_types()):
            return stream
        return _cuda.check_stream(stream, self.op_name)  # raises InvalidType

    def begin_call(
        self, ubatch: int, stream, debug_key: tuple, *, needs_output: bool = False
    ) -> tuple[int, bool, bool]:
        """Bookkeeping at the start of a call, after validation and before the launch.

        Returns ``(parity, capturing, exact)``: the parity the device will use if the host shadow
        is exact, whether ``stream`` is capturing, and whether the shadow is exact (eager call of
        a ubatch that was never captured).

        With ``DCPKIT_DEBUG=1`` every rank first compares ``debug_key`` (op, T, dtype, ubatch,
        ...) and raises :class:`ConfigMismatch` naming the ranks that differ. A capturing call
        raises :class:`DcpkitError` (before it counts) when it is the workspace's first call, or
        when it ``needs_output`` (no ``out=``) and every graph output buffer is taken.
        """
        if self._debug:
            self.comm.agree(
                f"{self.op_name}: call arguments (op, T, dtype, ubatch, ...)",
                (self.op_name,) + tuple(debug_key),
            )
        capturing = bool(stream.is_capturing())
        if capturing:
            if not any(self._calls):
                check_not_capturing(stream, self.op_name, "the first call")
            if needs_output and self._graph_next >= self.graph_outputs:
                raise DcpkitError(
                    f"{self.op_name}: graph output buffers must suffice for every call captured "
                    f"without out= (got graph_outputs={self.graph_outputs}, all taken by "
                    f"earlier captured calls): pass out=, build the workspace with a larger "
                    f"graph_outputs, or call release_graph_outputs() once the graphs that "
                    f"used them are gone"
                )
            self._captured[ubatch] = True
        self._calls[ubatch] += 1
        parity = self._calls[ubatch] & 1
        return parity, capturing, (not capturing and not self._captured[ubatch])

    def synchronize(self, stream=None) -> None:
        """Wait for the stream (default: the current CuPy stream), then raise
        :class:`CollectiveTimeout` if any wait of this workspace expired.

        Stream: synchronises the host with ``stream``.
        """
        if self._closed:
            raise ClosedError(f"{self.op_name}: the workspace is closed")
        self.get_stream(stream).synchronize()
        if self._rec[0] != 0:
            self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise what the record holds: :class:`CollectiveTimeout` or :class:`ConfigMismatch`
        (:func:`~dcpkit.ops._protocol.failure_error`)."""
        raise _protocol.failure_error(
            self._rec, OP_NAMES, self.op_name, self.world_size, self.timeout_ms
        )

    @property
    def _rec(self):
        """The failure record: ``uint32`` words of mapped pinned host memory (NumPy)."""
        try:
            return self.__dict__["_rec_words"]
        except KeyError:
            raise AttributeError("_rec") from None

    @_rec.setter
    def _rec(self, words) -> None:
        # The hot path reads word 0 through a memoryview of the same memory (an int, no NumPy
        # scalar made per call). Cast to the native 'I' format: an array over ctypes memory (the
        # mapped record) exports '<I', which a memoryview cannot index.
        self.__dict__["_rec_words"] = words
        self.__dict__["_rec_head"] = memoryview(words).cast("B").cast("I")

    @property
    def poisoned(self) -> bool:
        """True once a wait of this workspace timed out or found a peer's call differing (a read
        of host-mapped memory: no device sync), or a launch failed after its call was counted
        (a host flag). Then :meth:`check` raises the error."""
        return (not self._closed) and (self._rec_head[0] != 0 or self._launch_failed is not None)

    # ------------------------------------------------------------------ fast path
    #: Set when a launch raised after the call was counted (see :meth:`_run`).
    _launch_failed: str | None = None

    def _init_fast_path(self, functions: dict[Any, Any], backend: str | None = None) -> None:
        """The call-plan cache (:mod:`dcpkit._plan`, built by the subclass's ``_plan``) and one
        :class:`~dcpkit._launch.Launcher` per loaded kernel (``functions``: key -> the loaded
        ``cupy.cuda.function.Function``; the subclass picks the key per plan), launching through
        ``backend`` (default: :func:`~dcpkit._launch.default_backend`)."""
        import cupy

        self._plans = PlanCache(self._plan)
        self._launch_failed = None  # read on every call: an instance attribute
        self._functions = dict(functions)
        self._set_launch_backend(backend)
        self._get_device = cupy.cuda.runtime.getDevice
        self._current_stream_fn = cupy.cuda.get_current_stream

    # No __getattr__ here: it would route every attribute read of the hot path through it (and
    # keep Python from specialising them). A workspace built with ``__new__`` (CPU tests) gets
    # its plan cache on first read, and CuPy's current stream, from the class.
    _plans = LazyPlanCache("_plan")
    _current_stream_fn = staticmethod(_cupy_current_stream)

    def _set_launch_backend(self, backend: str | None) -> None:
        """Launch through ``backend`` ("cupy", "bindings", "ctypes"; None: the default, or
        "bindings" for a programmatic launch); also the benchmark's hook to compare them."""
        cls = ProgrammaticLauncher if getattr(self, "programmatic_launch", False) else Launcher
        self._launchers = {
            k: cls(fn, self.THREADS, backend=backend) for k, fn in self._functions.items()
        }
        self.launch_backend = cls.resolve(backend)

    def _run(self, kernel_key, grid: int, params, stream) -> None:
        """Launch kernel ``kernel_key`` with the packed ``params`` on ``stream`` (a device
        switch only when another device is current).

        The call was counted before (:meth:`begin_call` advanced the host shadow of the epoch);
        a launch that raises leaves the shadow one ahead of the device, so the workspace is
        marked unusable on the host: every later call (and :meth:`check`) raises, and
        :attr:`poisoned` is True. No later call can read a slot the device did not write."""
        try:
            if self._get_device() == self.device:
                self._launchers[kernel_key].launch(grid, params, stream.ptr)
            else:
                import cupy

                with cupy.cuda.Device(self.device):
                    self._launchers[kernel_key].launch(grid, params, stream.ptr)
        except BaseException as e:
            self._launch_failed = f"{type(e).__name__}: {e}"
            raise

    def _plan(self, *args):
        """The full validation of a call plus everything its key determines (subclass)."""
        raise NotImplementedError

    def _memo_view(self, ptr: int, shape, dtype, nbytes: int, owner):
        """A C-contiguous CuPy array over workspace memory at ``ptr`` that keeps ``owner``
        alive, memoised per (address, shape, dtype): a later call's result over the same memory
        (by the lifetime rule) is the same object. Forgotten at close."""
        key = (ptr, shape, dtype)
        cache = self.__dict__.setdefault("_lse_view_cache", {})
        v = cache.get(key)
        if v is None:
            import cupy

            mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id=self.device)
            v = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
            if len(cache) > 4096:
                cache.clear()
            cache[key] = v
        return v

    def _clear_plans(self) -> None:
        """Forget every plan (at close, and when state that plans derive from changes)."""
        plans = self.__dict__.get("_plans")
        if plans is not None:
            plans.clear()
        self.__dict__.pop("_lse_view_cache", None)

    # ------------------------------------------------------------------ test hooks
    def _set_epoch(self, value: int) -> None:
        """Collective test hook: make every ubatch continue from epoch ``value`` (to test the
        32-bit wrap of signals). Signals, share counters, arrival and work counters are set to
        what the calls up to ``value`` would have left."""
        import cupy

        self.check_open()
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.barrier()
            W, U = self.world_size, self.num_ubatches
            # the arrival and work counters as a call leaves them for the next one: zero (the
            # next call's work counter would otherwise keep an earlier call's claims where the
            # epoch's parity moved)
            self._ctl[:U] = 0
            self._ctl[U + 1 :] = 0
            for u in range(self.num_ubatches):
                self._epoch[u] = value
                words = self._sig_bytes // 8
                block = self.heap.view(self._base + u * self._ubatch_stride, (words,), np.uint64)
                sig = block[: 2 * W].reshape(2, W)
                for e in (value, value - 1):
                    if e >= 0:
                        sig[e & 1, :] = e & 0xFFFFFFFF
                # the share counters (push gathers, lse_reduce): value calls' shares, no skip
                shares = (value << (_protocol.SHARE_SHIFT + _protocol.SKIP_BITS)) % 2**64
                for s in range(W):
                    block[_protocol.share_counter_word(W, s)] = np.uint64(shares)
                self._calls[u] = value
            self._clear_plans()
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.barrier()

    # ------------------------------------------------------------------ teardown
    #: :class:`~dcpkit._lifecycle.Resource`: the warning of a workspace dropped open.
    _unclosed_hint = "call close() on every rank (GPU memory is returned at process exit)"

    @property
    def _resource_name(self) -> str:
        return f"{self.op_name} workspace"

    def close(self) -> None:
        """Release the workspace (collective, idempotent).

        Waits for the device, then frees local state and, if the workspace created its own
        heap, closes the heap (collective). Later calls raise :class:`ClosedError`.
        """
        super().close()

    def _close(self) -> None:
        import cupy

        self.__dict__.pop("_view_cache", None)  # views over memory about to be freed
        self._clear_plans()
        errors: list[BaseException] = []
        with cupy.cuda.Device(self.device):
            try:
                cupy.cuda.runtime.deviceSynchronize()
            except Exception as e:  # noqa: BLE001 - go on: the heap close is collective
                errors.append(e)
            if self._owns_heap and self.heap is not None:
                try:
                    self.heap.close()
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            self.heap = None
            try:
                self._free_local_state()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


def launch_config(total_items: int, items_per_cta: int, max_ctas: int) -> int:
    """Number of CTAs: enough to cover ``total_items`` at ``items_per_cta`` each, at least 1, at
    most ``max_ctas`` (the rank's SM share; only ``waiter_ctas`` of them wait, NOTE [dcpkit
    epoch signalling])."""
    return max(1, min(max_ctas, -(-total_items // max(1, items_per_cta))))
