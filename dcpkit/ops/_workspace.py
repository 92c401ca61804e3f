"""What every direct op shares: the symmetric region, the per-ubatch protocol state, the timeout
record, output buffers, and the call bookkeeping.

See NOTE [dcpkit epoch signalling] in ``kernels/dcpkit_ptx.cuh`` for the protocol. Layout of an
op's symmetric region, per ubatch ``u`` (every part 256-byte aligned)::

    signals  u32 [2, world_size]       written only by peers (and by this rank for itself)
    slot 0   slot_bytes                 data of even epochs
    slot 1   slot_bytes                 data of odd epochs

(The gathers carve three data slots, chosen by ``epoch % 3``, out of these two: their results
are read after the kernel retired, see NOTE [dcpkit gather slots] in ``kernels/gather.cuh``.
Signals always keep two slots, ``epoch & 1``.)

Local (non-symmetric) device state per workspace: ``epoch u64 [U]``, ``arrive u32 [U]`` (CTA
arrival counters, zero between calls), ``abort u32 [1]``; a 32-byte timeout record in mapped
pinned host memory.

Outputs. Parity of the slot a call uses is chosen on the device (``epoch & 1``). The host keeps a
shadow count of the calls of each ubatch; it is exact while the ubatch is only called eagerly.
* ``out=`` given: the kernel writes (or copies) the result into ``out``.
* eager call, ubatch never captured in a graph: the gathers return a view of the slot itself
  (zero copy); lse_reduce writes into one of two workspace output buffers.
* eager call after the ubatch was captured: the host no longer knows the device parity, so the
  result is copied into one of two workspace output buffers, alternating per eager call.
* call while the stream is capturing: the result goes to the ubatch's graph output buffer, a
  fixed address that the graph's later kernels can read on every replay.
In every eager case the returned view stays valid while it is consumed on the same stream before
call ``n + 2`` of the same ubatch is issued; a graph output stays valid until the next replay of
a graph that captured a call of this ubatch.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..comm import Communicator
from ..errors import ClosedError, CollectiveTimeout, InvalidArgument, InvalidType

__all__ = ["OpWorkspace", "OP_IDS", "OP_NAMES", "default_timeout_ms", "debug_enabled",
           "TIMEOUT_RECORD_FIELDS"]

OP_IDS: Dict[str, int] = {"lse_reduce": 1, "q_gather": 2, "kv_gather": 3, "ceilings": 4}
OP_NAMES: Dict[int, str] = {v: k for k, v in OP_IDS.items()}
TIMEOUT_RECORD_FIELDS = ("state", "op", "rank", "peer", "expected", "observed", "ubatch", "pad")

_ALIGN = 256


def _round_up(x: int, a: int = _ALIGN) -> int:
    return (x + a - 1) // a * a


def default_timeout_ms() -> float:
    """The wait deadline used when an op is built without ``timeout_ms``: ``DCPKIT_TIMEOUT_MS``
    or 5000 ms."""
    v = os.environ.get("DCPKIT_TIMEOUT_MS", "")
    try:
        return float(v) if v else 5000.0
    except ValueError:
        raise InvalidArgument(f"DCPKIT_TIMEOUT_MS must be a number of milliseconds (got {v!r})") \
            from None


def debug_enabled() -> bool:
    """True when ``DCPKIT_DEBUG`` is set to anything but ``""`` or ``"0"``."""
    return os.environ.get("DCPKIT_DEBUG", "") not in ("", "0")


def check_positive_int(value, op: str, name: str, *, minimum: int = 1) -> int:
    """Validate an integer constructor argument (bools are rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidType(f"{op}: {name} must be an int (got {type(value).__name__} {value!r})")
    if value < minimum:
        raise InvalidArgument(f"{op}: {name} must be >= {minimum} (got {value})")
    return int(value)


class OpWorkspace:
    """Base class of the direct ops (:class:`~dcpkit.ops.LseReduce`, ``QGather``, ``KVGather``).

    A subclass calls :meth:`_setup` from its constructor with the number of bytes one slot needs
    and the number of bytes of one output, launches its kernels with :meth:`proto_args` first,
    and calls :meth:`_begin_call` at the start of every call.

    Collective: construction, :meth:`close` and every call.
    """

    op_name = "op"

    # ------------------------------------------------------------------ construction
    def _setup(self, comm: Communicator, *, slot_bytes: int, out_bytes: int, num_ubatches: int,
               timeout_ms: Optional[float], heap=None, multicast=None) -> None:
        import cupy  # noqa: WPS433

        from ..symmetric import SymmetricHeap  # noqa: WPS433

        op = self.op_name
        if not isinstance(comm, Communicator):
            raise InvalidType(f"{op}: comm must be a dcpkit.Communicator "
                              f"(got {type(comm).__name__})")
        self._closed = True  # until setup completes
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.num_ubatches = check_positive_int(num_ubatches, op, "num_ubatches")
        if timeout_ms is None:
            timeout_ms = default_timeout_ms()
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)) \
                or not (0 < timeout_ms <= 3_600_000):
            raise InvalidArgument(f"{op}: timeout_ms must be in (0, 3600000] milliseconds "
                                  f"(got {timeout_ms!r})")
        self.timeout_ms = float(timeout_ms)
        self._debug = debug_enabled()

        W, U = self.world_size, self.num_ubatches
        self._sig_bytes = _round_up(2 * W * 4)
        self.slot_bytes = _round_up(max(int(slot_bytes), 16))
        self._ubatch_stride = self._sig_bytes + 2 * self.slot_bytes
        region = U * self._ubatch_stride
        comm.agree(f"{op}: workspace geometry (symmetric bytes, ubatches, timeout_ms)",
                   (region, U, self.timeout_ms))

        self._owns_heap = heap is None
        if heap is None:
            heap = SymmetricHeap(comm, region, multicast=multicast)
            self._base = 0
        else:
            self._base = heap.reserve(region, align=_ALIGN)
        self.heap = heap
        self.device = heap.device
        self.multicast = bool(heap.mc_ptr)

        with cupy.cuda.Device(self.device):
            self._epoch = cupy.zeros(U, dtype=cupy.uint64)
            self._ctl = cupy.zeros(U + 1, dtype=cupy.uint32)  # arrive[U], abort
            # peer_sig[u, s] = address of signals[0][0] of ubatch u on rank s
            tbl = np.array([[p + self._base + u * self._ubatch_stride for p in heap.peer_ptrs]
                            for u in range(U)], dtype=np.uint64)
            self._peer_sig = cupy.asarray(tbl)
            # peer_data[u, s] = address of slot 0 of ubatch u on rank s
            self._peer_data = cupy.asarray(tbl + np.uint64(self._sig_bytes))
            flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
            self._rec_ptr = cupy.cuda.runtime.hostAlloc(32, flags)
            import ctypes  # noqa: WPS433

            self._rec = np.ctypeslib.as_array((ctypes.c_uint32 * 8).from_address(self._rec_ptr))
            self._rec[:] = 0
            self._out_bytes = int(out_bytes)
            self._graph_out = cupy.empty(max(self._out_bytes, 1) * U, dtype=cupy.uint8)
            self._eager_out: List[Optional[object]] = [None] * U
            self.sm_count = cupy.cuda.runtime.getDeviceProperties(self.device)["multiProcessorCount"]
            bus = cupy.cuda.runtime.deviceGetPCIBusId(self.device)
        # Ranks of this group on this very GPU (more than one only in functional runs where
        # ranks share a GPU, e.g. under MPS). Every CTA of a dcpkit kernel that waits must be
        # co-resident with the CTAs it waits for, the other ranks' included when they share
        # the SMs: each rank takes at most its share of the SMs.
        every = comm.allgather((comm.host, bus))
        self.ranks_on_gpu = sum(1 for hb in every if hb == (comm.host, bus))
        self.max_ctas = max(1, self.sm_count // self.ranks_on_gpu)
        self._calls = [0] * U          # host shadow of the epoch, exact until a capture
        self._captured = [False] * U   # whether a call of this ubatch was ever captured
        self._timeout_ns = np.uint64(int(self.timeout_ms * 1e6))
        self._proto = [self._make_proto(u) for u in range(U)]
        self._closed = False

    def _make_proto(self, u: int) -> Tuple:
        mc = 0
        if self.multicast:
            mc = self.heap.mc_ptr + self._base + u * self._ubatch_stride
        ctl = self._ctl.data.ptr
        return (
            np.uint64(self._epoch.data.ptr + 8 * u),   # epoch
            np.uint64(ctl + 4 * u),                    # arrive
            np.uint64(ctl + 4 * self.num_ubatches),    # abort
            np.uint64(self._rec_ptr),                  # timeout record (UVA: host == device)
            np.uint64(self.heap.local_ptr + self._base + u * self._ubatch_stride),  # signals
            np.uint64(self._peer_sig.data.ptr + 8 * self.world_size * u),           # peer_sig
            np.uint64(mc),                             # multicast signals (0 = none)
            np.int32(self.rank), np.int32(self.world_size), self._timeout_ns,
            np.uint32(OP_IDS[self.op_name]), np.uint32(u),
        )

    def _finish_setup(self) -> None:
        """Warm-up barrier: no rank may wait inside a kernel while a peer still compiles."""
        import cupy  # noqa: WPS433

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
        self.comm.barrier()

    # ------------------------------------------------------------------ per call
    def proto_args(self, ubatch: int) -> Tuple:
        """The protocol parameters (DCPKIT_PROTO_PARAMS) of ``ubatch``, in kernel order."""
        return self._proto[ubatch]

    def peer_data_ptr(self, ubatch: int) -> np.uint64:
        """Device address of the table ``u64 [world_size]``: slot 0 of ``ubatch`` on each rank."""
        return np.uint64(self._peer_data.data.ptr + 8 * self.world_size * ubatch)

    def mc_data_ptr(self, ubatch: int) -> np.uint64:
        """Multicast address of slot 0 of ``ubatch`` (0 without multicast)."""
        if not self.multicast:
            return np.uint64(0)
        return np.uint64(self.heap.mc_ptr + self._base + ubatch * self._ubatch_stride
                         + self._sig_bytes)

    def local_slot_ptr(self, ubatch: int, parity: int) -> int:
        """Device address of slot ``parity`` of ``ubatch`` in this rank's copy."""
        return (self.heap.local_ptr + self._base + ubatch * self._ubatch_stride + self._sig_bytes
                + parity * self.slot_bytes)

    def check_open(self) -> None:
        """Raise if the workspace is closed or poisoned by a timeout."""
        if self._closed:
            raise ClosedError(f"{self.op_name}: the workspace is closed")
        if self._rec[0] != 0:
            self._raise_timeout()

    def check_ubatch(self, ubatch) -> int:
        if isinstance(ubatch, bool) or not isinstance(ubatch, (int, np.integer)):
            raise InvalidType(f"{self.op_name}: ubatch must be an int (got {ubatch!r})")
        if not (0 <= ubatch < self.num_ubatches):
            raise InvalidArgument(f"{self.op_name}: ubatch must lie in [0, {self.num_ubatches}) "
                                  f"(got {ubatch})")
        return int(ubatch)

    def get_stream(self, stream):
        import cupy  # noqa: WPS433

        return cupy.cuda.get_current_stream() if stream is None else stream

    def begin_call(self, ubatch: int, stream, debug_key: Tuple) -> Tuple[int, bool, bool]:
        """Bookkeeping at the start of a call, after validation and before the launch.

        Returns ``(parity, capturing, exact)``: the parity the device will use if the host shadow
        is exact, whether ``stream`` is capturing, and whether the shadow is exact (eager call of
        a ubatch that was never captured).

        With ``DCPKIT_DEBUG=1`` every rank first compares ``debug_key`` (op, T, dtype, ubatch,
        ...) and raises :class:`ConfigMismatch` naming the ranks that differ.
        """
        if self._debug:
            self.comm.agree(f"{self.op_name}: call arguments (op, T, dtype, ubatch, ...)",
                            (self.op_name,) + tuple(debug_key))
        capturing = bool(stream.is_capturing())
        if capturing:
            self._captured[ubatch] = True
        self._calls[ubatch] += 1
        parity = self._calls[ubatch] & 1
        return parity, capturing, (not capturing and not self._captured[ubatch])

    def output_ptr(self, ubatch: int, capturing: bool) -> int:
        """Device address of the workspace output buffer for this call (``out=None``)."""
        import cupy  # noqa: WPS433

        if capturing:
            return self._graph_out.data.ptr + ubatch * self._out_bytes
        buf = self._eager_out[ubatch]
        if buf is None:
            with cupy.cuda.Device(self.device):
                buf = cupy.empty(2 * max(self._out_bytes, 1), dtype=cupy.uint8)
            self._eager_out[ubatch] = buf
        return buf.data.ptr + (self._calls[ubatch] & 1) * self._out_bytes

    def synchronize(self, stream=None) -> None:
        """Wait for the stream (default: the current CuPy stream), then raise
        :class:`CollectiveTimeout` if any wait of this workspace expired.

        Stream: synchronises the host with ``stream``.
        """
        if self._closed:
            raise ClosedError(f"{self.op_name}: the workspace is closed")
        self.get_stream(stream).synchronize()
        if self._rec[0] != 0:
            self._raise_timeout()

    def _raise_timeout(self) -> None:
        rec = dict(zip(TIMEOUT_RECORD_FIELDS, (int(v) for v in self._rec)))
        op = OP_NAMES.get(rec["op"], self.op_name)
        raise CollectiveTimeout(op, rec["rank"], rec["peer"], rec["expected"], rec["observed"],
                                ubatch=rec["ubatch"], timeout_ms=self.timeout_ms)

    @property
    def poisoned(self) -> bool:
        """True once a wait of this workspace timed out."""
        return (not self._closed) and self._rec[0] != 0

    # ------------------------------------------------------------------ test hooks
    def _set_epoch(self, value: int) -> None:
        """Collective test hook: make every ubatch continue from epoch ``value`` (to test the
        32-bit wrap of signals). Signals are set to what the last two calls would have left."""
        import cupy  # noqa: WPS433

        self.check_open()
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.barrier()
            W = self.world_size
            for u in range(self.num_ubatches):
                self._epoch[u] = value
                sig = self.heap.view(self._base + u * self._ubatch_stride, (2, W), np.uint32)
                for e in (value, value - 1):
                    if e >= 0:
                        sig[e & 1, :] = e & 0xFFFFFFFF
                self._calls[u] = value
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.barrier()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release the workspace (collective, idempotent).

        Waits for the device, then frees local state and, if the workspace created its own
        heap, closes the heap (collective). Later calls raise :class:`ClosedError`.
        """
        if getattr(self, "_closed", True):
            return
        import cupy  # noqa: WPS433

        self._closed = True
        self.__dict__.pop("_view_cache", None)  # views over memory about to be freed
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            if self._owns_heap:
                self.heap.close()
            self.heap = None
            cupy.cuda.runtime.freeHost(self._rec_ptr)
            self._rec = np.zeros(8, dtype=np.uint32)
            self._rec_ptr = 0
            self._epoch = self._ctl = self._peer_sig = self._peer_data = None
            self._graph_out = None
            self._eager_out = [None] * self.num_ubatches

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # never collective work here: warn only
        if getattr(self, "_closed", True) is False:
            try:
                warnings.warn(f"dcpkit {self.op_name} workspace was not closed; call close() "
                              f"on every rank (GPU memory is returned at process exit)",
                              ResourceWarning, stacklevel=1)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def launch_config(total_items: int, items_per_cta: int, max_ctas: int) -> int:
    """Number of CTAs: enough to cover ``total_items`` at ``items_per_cta`` each, at least 1, at
    most ``max_ctas`` (the co-resident limit: dcpkit kernels that wait need every CTA resident)."""
    return max(1, min(max_ctas, -(-total_items // max(1, items_per_cta))))
