"""kv_gather: every rank gets every rank's chunk of compressed KV, in one kernel over NVLink.

Usage (every rank, same arguments, same order)::

    kg = KVGather(comm, max_tokens=8192, row_dim=576, dtype="bfloat16")
    kv_all = kg(kv)            # kv [T, 576] on this rank -> kv_all [world_size * T, 576]
    prefill_attention(q, kv_all, ...)   # consume on the same stream before the call after next
    ...
    kg.close()

Kernel: ``kernels/kv_gather.cu`` (device code in ``kernels/gather.cuh``); reference:
``dcpkit.reference.kv_gather_reference``; tests: ``tests/unit/test_gather_validation.py``,
``tests/mpi/test_kv_gather.py``.
"""

from __future__ import annotations

from .._arrays import ArrayInfo, array_info, check_align, check_device, check_dtype, check_shape
from .._checks import resolve_bytes_dtype
from .._overlap import check_disjoint, check_outside_workspace
from .._plan import pair_key
from ..comm import Communicator
from ..errors import InvalidArgument
from ._gather import MAX_VECTORS, GatherPlan, GatherWorkspace
from ._workspace import PROTO_PARAM_TYPES, check_positive_int

__all__ = ["KVGather", "ALGORITHMS", "KV_GATHER_PUSH_PARAM_TYPES", "KV_GATHER_PULL_PARAM_TYPES"]

#: Parameters of ``kv_gather_push_kernel`` (kernels/kv_gather.cu), both transports:
#: DCPKIT_PROTO_PARAMS, then peer_data, slot_bytes, mc_data, kv, block_vecs, tokens, out.
KV_GATHER_PUSH_PARAM_TYPES = PROTO_PARAM_TYPES + ("u64", "u64", "u64", "u64", "u32", "u32", "u64")
#: Parameters of ``kv_gather_pull_kernel``: as the push kernel's, without mc_data.
KV_GATHER_PULL_PARAM_TYPES = PROTO_PARAM_TYPES + ("u64", "u64", "u64", "u32", "u32", "u64")

#: The kv_gather algorithms: ``"push"`` (stores into every peer's slot) and ``"pull"`` (loads
#: from every peer's slot).
ALGORITHMS = ("push", "pull")


class KVGather(GatherWorkspace):
    """Gather every rank's KV rows, rank-major: one direct kernel per call.

    Naive equivalent::

        torch.distributed.all_gather_into_tensor(kv_all, kv)   # [T, D_kv] -> [W*T, D_kv]

    Rows ``[s*T, (s+1)*T)`` of the result are rank ``s``'s ``kv``, bit for bit. The slot holds
    the contiguous ``[W*T, D_kv]`` result, so each rank's block is one flat run of 16-byte
    vectors. Two algorithms, both one kernel per call with the epoch advance folded in:

    * ``"push"``: every rank stores its block into every rank's slot (16-byte stores through
      peer pointers, CTA ``b`` of rank ``r`` starting with peer ``(r + 1 + b) % world_size`` so
      that every link is busy from the start; or one ``multimem.st`` per vector with multicast),
      then signals. The one-shot all-gather of symmetric-memory libraries (NVSHMEM
      ``fcollect``, PyTorch symmetric memory).
    * ``"pull"``: every rank stages its block in its own slot and signals; then every rank loads
      each peer's block from that peer's slot over NVLink (unicast only, also on a multicast
      heap). Copying into ``out`` (graphs, ``out=``) costs no extra pass over the peers' data.

    The protocol is NOTE [dcpkit epoch signalling] (``kernels/dcpkit_ptx.cuh``) with three data
    slots (NOTE [dcpkit gather slots], ``kernels/gather.cuh``).

    Parameters
    ----------
    comm : Communicator
        The group; every rank constructs the workspace with the same arguments.
    max_tokens : int
        ``T_max``, the largest ``T`` (rows per rank) of a call.
    row_dim : int
        ``D_kv``, elements per row. ``D_kv * itemsize`` must be a multiple of 16 bytes (pad
        ``D_kv``).
    dtype : dtype or str
        Element type (any fixed-size type: the kernel moves bytes; fp8 as float8_e4m3fn or
        uint8).
    num_ubatches : int
        Independent sets of epochs, signals and slots.
    algorithm : {"push", "pull"}
        See above; default ``"push"``.
    timeout_ms : float, optional
        Deadline of every wait in [0.001, 3600000] milliseconds, any real number type (default
        ``DCPKIT_TIMEOUT_MS`` or 5000).
    heap : SymmetricHeap, optional
        Reserve the workspace in this open heap of the same group (same ``world_size`` and
        ``rank`` as ``comm``) instead of allocating its own. The reservation is taken only
        after every rank passed every check, and is never given back (the heap is a bump
        allocator), also when a later setup step fails. The workspace takes
        ``3 * world_size * max_tokens * D_kv * itemsize`` bytes per ubatch (plus signals).
    multicast : bool, optional
        Ask for a multicast heap (used only where dcpkit's multicast guard allows it).
    graph_outputs : int, optional
        Calls captured in CUDA graphs without ``out=`` that the workspace serves (until
        :meth:`release_graph_outputs`), each with a result buffer of its own
        (``world_size * max_tokens * D_kv * itemsize`` bytes each; default 4, 0 for none). With
        ``algorithm="push"`` the buffers lie in the symmetric region and, from 16 KiB per rank
        (unicast, up to 64 ranks), every rank stores its block straight into them (zero copy:
        in a graph, the view form costs no copy, ``out=`` one). One more raises
        :class:`DcpkitError` at capture time: pass ``out=`` then.
    waiter_ctas : int, optional
        CTAs of a copy-out (push) or any pull call that wait and copy (default: the SM share /
        8, at least 1; NOTE [dcpkit epoch signalling]). A measuring knob; the co-residency rule
        holds only for the default.
    programmatic_launch : bool
        Programmatic dependent launch, as in :class:`~dcpkit.ops.QGather` (needs compute
        capability 9.0+ and cuda.bindings; default False: a plain launch).
    _self_check : bool
        Benchmark only: ``False`` compiles the variant whose waits compare the epoch only.

    Attributes
    ----------
    algorithm : str
        ``"push"`` or ``"pull"``.
    transport : str
        ``"multicast"`` (push on a multicast heap) or ``"unicast"``.
    launches_per_call : int
        1.

    Collective, and the poisoned workspace (results of 0xFF bytes, ``poisoned`` / ``check()``
    without a device sync): as :class:`~dcpkit.ops.QGather`.

    Raises
    ------
    DcpkitError
        The current stream is capturing a CUDA graph (on every rank).
    InvalidArgument, InvalidType
        As :class:`~dcpkit.ops.QGather`, and an unknown ``algorithm``.
    MissingDependency, DcpkitError, PeerError
        As :class:`~dcpkit.ops.QGather`.
    ConfigMismatch
        Ranks passed different geometries, ``num_ubatches`` or ``timeout_ms`` or algorithms.
    """

    op_name = "kv_gather"
    size_arguments = "max_tokens, row_dim"

    def __init__(
        self,
        comm: Communicator,
        *,
        max_tokens: int,
        row_dim: int,
        dtype,
        num_ubatches: int = 1,
        algorithm: str = "push",
        timeout_ms: float | None = None,
        heap=None,
        multicast: bool | None = None,
        graph_outputs: int | None = None,
        waiter_ctas: int | None = None,
        programmatic_launch: bool = False,
        _self_check: bool = True,
    ):
        self._closed = True  # until the setup completes
        # One exchange: arguments, CuPy, the GPU or room in the heap, equal geometries.
        self._setup_with(
            comm, locals(), "max_tokens, row_dim, dtype, algorithm", heap=heap, multicast=multicast
        )
        if self.algorithm == "pull":
            self.transport = "unicast"
            name = "dcpkit::kv_gather_pull_kernel"
        else:
            self.transport = "multicast" if self.multicast else "unicast"
            tr = "Multicast" if self.multicast else "Unicast"
            name = f"dcpkit::kv_gather_push_kernel<dcpkit::Transport::{tr}>"
        self._kernel = self._compile("kv_gather.cu", name)
        self._finish_setup()

    def _data_bytes(self) -> int:
        """Bytes of one data slot and one output buffer: every rank's ``max_tokens`` rows."""
        return self.world_size * self.max_tokens * self.row_bytes

    def _init_geometry(
        self, world_size: int, max_tokens, row_dim, dtype, algorithm="push"
    ) -> tuple:
        """Check and record the geometry (no GPU, no collective); returns it."""
        op = self.op_name
        self.world_size = int(world_size)
        self.max_tokens = check_positive_int(max_tokens, op, "max_tokens")
        self.row_dim = check_positive_int(row_dim, op, "row_dim")
        self.dtype = resolve_bytes_dtype(dtype, op)
        if algorithm not in ALGORITHMS:
            raise InvalidArgument(
                f"{op}: algorithm must be one of {list(ALGORITHMS)} (got {algorithm!r})"
            )
        self.algorithm = algorithm
        isz = self.dtype.itemsize
        self.row_bytes = self.row_dim * isz
        if self.row_bytes % 16:
            raise InvalidArgument(
                f"{op}: row bytes (row_dim*itemsize) must be a multiple of 16 (pad D_kv to a "
                f"multiple of 16 bytes) (got {self.row_dim}*{isz} = {self.row_bytes} bytes)"
            )
        total = self.world_size * self.max_tokens * self.row_bytes
        if total // 16 > MAX_VECTORS:
            raise InvalidArgument(
                f"{op}: world_size*max_tokens*row_dim*itemsize must be < 32 GiB (got {total} bytes)"
            )
        return (self.max_tokens, self.row_dim, str(self.dtype), self.algorithm)

    # ------------------------------------------------------------------ call
    def __call__(self, kv, *, ubatch: int = 0, out=None, stream=None):
        """Gather ``kv`` of every rank: ``[T, D_kv]`` here -> ``[world_size*T, D_kv]``.

        Naive equivalent: ``all_gather_into_tensor(out, kv)``.

        Parameters
        ----------
        kv : GPU array [T, D_kv], the workspace dtype
            C-contiguous, 16-byte aligned, ``T <= max_tokens``, equal on every rank.
        ubatch : int
            ``0 <= ubatch < num_ubatches``; every rank uses the same.
        out : GPU array [world_size*T, D_kv], optional
            C-contiguous, 16-byte aligned destination. With ``out`` the result is copied there
            and ``out`` is returned (nothing allocated: safe to capture in a CUDA graph).
        stream : cupy.cuda.Stream, optional
            Default: the current CuPy stream of the op's GPU; a stream of another GPU is
            refused.

        Returns
        -------
        GPU array [world_size*T, D_kv], the workspace dtype, C-contiguous
            ``out``, or a view of workspace memory: the own symmetric data slot (zero copy)
            when the ubatch was never captured in a CUDA graph, else a workspace output buffer.
            The lifetime of a view, the ``T == 0`` and the poisoned results are those of
            :meth:`QGather.__call__ <dcpkit.ops.QGather.__call__>`.

        Collective, Stream, Raises: as :meth:`QGather.__call__ <dcpkit.ops.QGather.__call__>`
        (a non-contiguous ``kv`` or ``out`` is an ``InvalidArgument`` here).
        """
        return self._call_keyed(pair_key(kv, out, ubatch, False), kv, ubatch, out, stream, False)

    def _plan(self, kv, ubatch, out, _flag: bool = False) -> GatherPlan:
        """The full validation of a call (:meth:`_validate`: every check, every message), then
        everything its key determines: grids and the packed kernel parameters."""
        T, ubatch, ki, oi = self._validate(kv, ubatch, out)
        shape = (self.world_size * T, self.row_dim)
        strides = (self.row_bytes, self.dtype.itemsize)
        if T == 0:
            return self._gather_plan(0, ubatch, oi, (), (), 0, shape, strides)
        tail = (ki.ptr, T * self.row_bytes // 16, T, 0)
        pull = self.algorithm == "pull"
        types = KV_GATHER_PULL_PARAM_TYPES if pull else KV_GATHER_PUSH_PARAM_TYPES
        return self._gather_plan(
            T, ubatch, oi, tail, types, len(types) - 1, shape, strides, mc_arg=not pull
        )  # the pull kernel takes no multicast address

    def _vectors(self, T: int, copy_out: bool) -> int:
        block_vecs = T * self.row_bytes // 16
        if self.algorithm == "pull":
            return self.world_size * block_vecs
        return block_vecs * (self.world_size if copy_out else 1)

    def _grid_zero_copy(self, vectors: int) -> int:
        """Push: :meth:`GatherWorkspace._grid_zero_copy`. Pull: the whole share (its waiters
        load every peer's block, so fewer CTAs means less of the copy in flight: at 16 MiB per
        rank, W=2, ranks sharing one H200, an eager call took 52.0 us on half the share and
        41.6 us on the whole one)."""
        if self.algorithm == "pull":
            return self._grid(vectors)
        return super()._grid_zero_copy(vectors)

    def _result_view(self, ptr: int, T: int):
        return self._view(
            ptr, (self.world_size * T, self.row_dim), (self.row_bytes, self.dtype.itemsize)
        )

    # ------------------------------------------------------------------ validation
    def _validate(self, kv, ubatch, out) -> tuple[int, int, ArrayInfo, ArrayInfo | None]:
        """Every check of a call, before anything is launched or counted (no GPU needed).
        Returns ``(T, ubatch, kv_info, out_info or None)``."""
        op = self.op_name
        self.check_open()
        ubatch = self.check_ubatch(ubatch)
        ki = array_info(kv, op, "kv")
        check_shape(ki, (None, self.row_dim), "T, D_kv", op, "kv")
        check_dtype(ki, (self.dtype,), op, "kv")
        check_device(ki, self.device, op, "kv")
        T = ki.shape[0]
        if T > self.max_tokens:
            raise InvalidArgument(
                f"{op}: kv tokens T must be <= max_tokens {self.max_tokens} (got {T})"
            )
        W = self.world_size
        if W * T * self.row_bytes > self.data_slot_bytes:
            raise InvalidArgument(
                f"{op}: world_size*T*row bytes must be <= the slot capacity "
                f"{self.data_slot_bytes} bytes (got {W}*{T}*{self.row_bytes} = "
                f"{W * T * self.row_bytes})"
            )
        if T > 0:
            self._check_contiguous(ki, "kv")
        oi = None
        if out is not None:
            oi = array_info(out, op, "out")
            check_shape(oi, (W * T, self.row_dim), "world_size*T, D_kv", op, "out")
            check_dtype(oi, (self.dtype,), op, "out")
            check_device(oi, self.device, op, "out")
            if T > 0:
                self._check_contiguous(oi, "out")
            check_disjoint(op, (("out", oi),), (("kv", ki),))
            check_outside_workspace(self, op, (("out", oi),))
        return T, ubatch, ki, oi

    def _check_contiguous(self, info: ArrayInfo, name: str) -> None:
        op = self.op_name
        isz = self.dtype.itemsize
        rows = info.shape[0]
        if (self.row_dim > 1 and info.strides[1] != isz) or (
            rows > 1 and info.strides[0] != self.row_bytes
        ):
            raise InvalidArgument(
                f"{op}: {name} must be C-contiguous with strides ({self.row_bytes}, {isz}) "
                f"bytes (got strides {tuple(info.strides)}; use cupy.ascontiguousarray)"
            )
        check_align(info.ptr, 16, op, f"{name} data pointer")

    # ------------------------------------------------------------------ what the op accepts
    @classmethod
    def check_arguments(cls, world_size: int, **constructor_keywords) -> tuple:
        """The argument checks of ``KVGather(comm, **constructor_keywords)`` on a group of
        ``world_size`` ranks, needing no GPU and no collective.

        Returns what every rank must agree on (the last value: the symmetric bytes of the
        workspace); raises :class:`InvalidArgument` / :class:`InvalidType` as the constructor
        does, with the same messages. ``heap`` is left to the constructor (it needs the group).
        See :func:`dcpkit._checks.check_constructor_keywords`.
        """
        from .._checks import check_constructor_keywords

        return check_constructor_keywords(cls, world_size, constructor_keywords)

    def accepts_layout(self, *, kv=None, out=None) -> bool:
        """Whether ``kv`` and ``out`` (arrays or ``ArrayInfo``) are rows this op reads and
        writes without a copy: C-contiguous and 16-byte aligned. An array of a shape the call
        refuses is not judged (True); a host array raises ``InvalidType``."""
        from .._checks import described

        for name, i in described(self.op_name, kv=kv, out=out):
            if len(i.shape) == 2 and i.shape[0] > 0 and i.shape[1] == self.row_dim:
                try:
                    self._check_contiguous(i, name)
                except InvalidArgument:
                    return False
        return True
