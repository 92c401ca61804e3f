"""q_gather: every rank gets the queries of all heads, in one kernel over NVLink.

Usage (every rank, same arguments, same order)::

    qg = QGather(comm, max_tokens=128, heads_per_rank=32, head_dim=576, dtype="bfloat16")
    q_all = qg(q)              # q [T, 32, 576] on this rank -> q_all [T, 32 * world_size, 576]
    attention(q_all, ...)      # consume it on the same stream before the call after next
    ...
    qg.close()

Kernel: ``kernels/q_gather.cu`` (device code in ``kernels/gather.cuh``); reference:
``dcpkit.reference.q_gather_reference``; tests: ``tests/unit/test_gather_validation.py``,
``tests/mpi/test_q_gather.py``.
"""

from __future__ import annotations

from .._arrays import ArrayInfo, array_info, check_align, check_device, check_dtype, check_shape
from .._checks import resolve_bytes_dtype
from .._overlap import check_disjoint, check_outside_workspace
from .._plan import pair_key
from ..comm import Communicator
from ..errors import InvalidArgument
from ._gather import MAX_VECTORS, GatherPlan, GatherWorkspace
from ._workspace import PROTO_PARAM_TYPES, check_bool, check_positive_int

__all__ = ["QGather", "Q_GATHER_PARAM_TYPES"]

#: Parameters of ``q_gather_kernel`` (kernels/q_gather.cu), both transports: DCPKIT_PROTO_PARAMS,
#: then peer_data, slot_bytes, mc_data, q, q_token_stride, row_vecs, slot_token_stride, tokens,
#: out, out_token_stride.
Q_GATHER_PARAM_TYPES = PROTO_PARAM_TYPES + (
    "u64",
    "u64",
    "u64",
    "u64",
    "i64",
    "u32",
    "i64",
    "u32",
    "u64",
    "i64",
)
_OUT = len(PROTO_PARAM_TYPES) + 8  # index of ``out`` (patched per call)


class QGather(GatherWorkspace):
    """Gather the query heads of every rank: one direct kernel per call.

    Naive equivalent::

        q_all = torch.cat(all_gather(q), dim=1)      # [T, H_r, D] per rank -> [T, H, D]

    Rank ``s`` owns heads ``[s*H_r, (s+1)*H_r)``; the result is bit for bit that concatenation.
    Every rank stores its ``q`` into the same place of every rank's symmetric data slot
    (16-byte stores through peer pointers, CTA ``b`` of rank ``r`` starting with peer
    ``(r + 1 + b) % world_size``; or one ``multimem.st`` per vector with multicast), then
    signals; the epoch advance is folded into the same kernel (``launches_per_call == 1``). The
    algorithm is the one-shot (direct) push all-gather of symmetric-memory libraries such as
    NVSHMEM (``fcollect``) and PyTorch symmetric memory, with the signal protocol of
    NOTE [dcpkit epoch signalling] (``kernels/dcpkit_ptx.cuh``) and three data slots
    (NOTE [dcpkit gather slots], ``kernels/gather.cuh``).

    Parameters
    ----------
    comm : Communicator
        The group; every rank constructs the workspace with the same arguments.
    max_tokens : int
        ``T_max``, the largest ``T`` of a call.
    heads_per_rank : int
        ``H_r``; the result has ``H = H_r * world_size`` heads.
    head_dim : int
        ``D``.
    dtype : dtype or str
        Element type of ``q`` and of the result. Any fixed-size type (the kernel moves bytes):
        float32, float16, bfloat16, float8_e4m3fn (ml_dtypes), uint8, int8, ...
        ``H_r * D * itemsize`` must be a multiple of 16 bytes.
    num_ubatches : int
        Independent sets of epochs, signals and slots (calls of different ubatches may overlap
        on different streams).
    padded_num_heads : int, optional
        ``H_pad >= H``: the result sits in storage with room for ``H_pad`` heads per token (for
        attention kernels with a fixed head count that over-read). ``H_pad * D * itemsize`` must
        be a multiple of 16. The pad heads ``[H, H_pad)`` are never written by dcpkit: their
        contents are unspecified. Get the padded storage with ``return_padded=True``.
    timeout_ms : float, optional
        Deadline of every wait in [0.001, 3600000] milliseconds, any real number type (default
        ``DCPKIT_TIMEOUT_MS`` or 5000).
    heap : SymmetricHeap, optional
        Reserve the workspace in this open heap of the same group (same ``world_size`` and
        ``rank`` as ``comm``) instead of allocating its own. The reservation is taken only
        after every rank passed every check, and is never given back (the heap is a bump
        allocator), also when a later setup step fails.
    multicast : bool, optional
        Ask for a multicast heap (used only where dcpkit's multicast guard allows it).
    graph_outputs : int, optional
        Calls captured in CUDA graphs without ``out=`` that the workspace serves (until
        :meth:`release_graph_outputs`), each with a result buffer of its own
        (``max_tokens * H_pad * D * itemsize`` bytes each, in the symmetric region; default 4,
        0 for none). From 16 KiB per rank (``T * H_r * D * itemsize``; unicast, up to 64
        ranks) every rank stores its heads straight into that buffer (zero copy): in a graph,
        the view form costs no copy, ``out=`` one. One more raises
        :class:`DcpkitError` at capture time: pass ``out=`` then.
    waiter_ctas : int, optional
        CTAs of a copy-out call that wait and copy out (default: the SM share / 8, at least 1;
        NOTE [dcpkit epoch signalling]). A measuring knob: more copy-out parallelism at large
        ``T``, but the co-residency rule holds only for the default.
    programmatic_launch : bool
        Launch the kernels with programmatic dependent launch (``cuLaunchKernelEx``, the
        programmatic stream serialization attribute): a call's kernel may start while the kernel
        before it on the stream finishes, and waits for it (``griddepcontrol.wait``) before it
        reads or writes anything, so the launch overlaps that kernel's tail (NOTE [dcpkit
        programmatic launch]). Eager and captured calls alike. Needs compute capability 9.0+ and
        cuda.bindings (default False: a plain launch).
    _self_check : bool
        Benchmark only: ``False`` compiles the variant whose waits compare the epoch only (no
        fingerprint check), to measure what the check costs.

    Attributes
    ----------
    num_heads : int
        ``H``.
    transport : str
        ``"multicast"`` or ``"unicast"``: the variant every call launches.
    launches_per_call : int
        1.

    Collective: construction (compiles the kernel, then a barrier), every call, :meth:`close`.

    Poisoned workspace: after a timeout or a :class:`ConfigMismatch` every later kernel of the
    workspace (graph replays included) fills its result with 0xFF bytes (NaN for float
    dtypes, all-ones bytes for the others). A graph-replay loop checks it without a device sync::

        graph.launch(stream)
        if qg.poisoned:
            qg.check()      # raises CollectiveTimeout or ConfigMismatch

    Raises
    ------
    DcpkitError
        The current stream is capturing a CUDA graph (on every rank: the check is part of the
        agreed setup exchange).
    InvalidArgument, InvalidType
        A geometry argument is out of range, the row bytes are not a multiple of 16, the
        workspace would exceed 2**40 bytes, a bad ``timeout_ms`` / ``DCPKIT_TIMEOUT_MS`` /
        ``multicast``, a ``heap`` of another group or without room.
    MissingDependency
        CuPy is not installed (names the ``cuda12`` / ``cuda13`` extra).
    DcpkitError
        No CUDA GPU is visible.
    PeerError
        Another rank rejected its arguments, missed CuPy or a GPU, or failed to compile the
        kernel.
    ConfigMismatch
        Ranks passed different geometries, ``num_ubatches`` or ``timeout_ms``.
    """

    op_name = "q_gather"
    size_arguments = "max_tokens, heads_per_rank, head_dim, padded_num_heads"

    def __init__(
        self,
        comm: Communicator,
        *,
        max_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype,
        num_ubatches: int = 1,
        padded_num_heads: int | None = None,
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
            comm,
            locals(),
            "max_tokens, heads_per_rank, head_dim, dtype, padded_num_heads",
            heap=heap,
            multicast=multicast,
        )
        self.transport = "multicast" if self.multicast else "unicast"
        tr = "Multicast" if self.multicast else "Unicast"
        self._kernel = self._compile(
            "q_gather.cu", f"dcpkit::q_gather_kernel<dcpkit::Transport::{tr}>"
        )
        self._finish_setup()

    def _data_bytes(self) -> int:
        """Bytes of one data slot and one output buffer: ``max_tokens`` padded tokens."""
        return self.max_tokens * self.slot_token_bytes

    def _init_geometry(
        self, world_size: int, max_tokens, heads_per_rank, head_dim, dtype, padded_num_heads=None
    ) -> tuple:
        """Check and record the geometry (no GPU, no collective); returns it."""
        op = self.op_name
        self.world_size = int(world_size)
        self.max_tokens = check_positive_int(max_tokens, op, "max_tokens")
        self.heads_per_rank = check_positive_int(heads_per_rank, op, "heads_per_rank")
        self.head_dim = check_positive_int(head_dim, op, "head_dim")
        self.dtype = resolve_bytes_dtype(dtype, op)
        self.num_heads = self.heads_per_rank * self.world_size
        if padded_num_heads is None:
            padded_num_heads = self.num_heads
        self.padded_num_heads = check_positive_int(
            padded_num_heads, op, "padded_num_heads", minimum=self.num_heads
        )
        isz = self.dtype.itemsize
        self.row_bytes = self.heads_per_rank * self.head_dim * isz
        if self.row_bytes % 16:
            raise InvalidArgument(
                f"{op}: heads_per_rank*head_dim*itemsize must be a multiple of 16 bytes "
                f"(got {self.heads_per_rank}*{self.head_dim}*{isz} = {self.row_bytes})"
            )
        self.slot_token_bytes = self.padded_num_heads * self.head_dim * isz
        if self.slot_token_bytes % 16:
            raise InvalidArgument(
                f"{op}: padded_num_heads*head_dim*itemsize must be a multiple of 16 bytes "
                f"(got {self.padded_num_heads}*{self.head_dim}*{isz} = "
                f"{self.slot_token_bytes})"
            )
        if self.max_tokens * self.num_heads * self.head_dim * isz // 16 > MAX_VECTORS:
            raise InvalidArgument(
                f"{op}: max_tokens*H*head_dim*itemsize must be < 32 GiB "
                f"(got {self.max_tokens * self.num_heads * self.head_dim * isz})"
            )
        return (
            self.max_tokens,
            self.heads_per_rank,
            self.head_dim,
            str(self.dtype),
            self.padded_num_heads,
        )

    # ------------------------------------------------------------------ call
    def __call__(self, q, *, ubatch: int = 0, out=None, stream=None, return_padded: bool = False):
        """Gather ``q`` of every rank: ``[T, H_r, D]`` here -> ``[T, H, D]`` everywhere.

        Naive equivalent: ``torch.cat(all_gather(q), dim=1)``.

        Parameters
        ----------
        q : GPU array [T, H_r, D], the workspace dtype
            ``T <= max_tokens``, equal on every rank. Head stride exactly ``D`` elements,
            elements contiguous; token stride ``>= H_r*D`` elements (padded storage, e.g.
            ``x[:, :H_r]`` of a wider array, is read in place). Data pointer and token stride
            16-byte aligned.
        ubatch : int
            ``0 <= ubatch < num_ubatches``; every rank uses the same.
        out : GPU array [T, H, D], optional
            Destination (head stride ``D`` elements, elements contiguous, token stride
            ``>= H*D`` elements, 16-byte aligned). With ``out`` the result is copied there and
            ``out`` is returned (nothing allocated: safe to capture in a CUDA graph).
        stream : cupy.cuda.Stream, optional
            Default: the current CuPy stream of the op's GPU (whichever GPU is current);
            a stream of another GPU is refused.
        return_padded : bool
            Return the ``[T, H_pad, D]`` storage instead of its ``[T, H, D]`` prefix (heads
            ``[H, H_pad)`` never written, unspecified). Only with ``out=None``.

        Returns
        -------
        GPU array [T, H, D] (or [T, H_pad, D]), the workspace dtype
            ``out``, or a view of workspace memory with token stride ``H_pad*D`` elements:
            the own symmetric data slot (zero copy) when the ubatch was never captured in a
            CUDA graph, else a workspace output buffer. **Lifetime**: a view returned by call
            ``n`` stays valid while it is consumed on the same stream before call ``n + 2`` of
            the same ubatch is issued (call ``n + 3``, or a peer's call ``n + 3``, may reuse its
            storage); a view returned while capturing lives in a graph output buffer of its
            own, valid until the next replay of the graph that captured it. Views are invalid
            after :meth:`close`. ``T == 0`` returns an empty array without launching. After
            the workspace is poisoned the result is 0xFF bytes (see the class docstring).

        Collective: every rank calls with the same ``T``, dtype and ubatch, in the same order.

        Stream: one kernel on ``stream``; never blocks the host; capture-safe.

        Raises
        ------
        InvalidArgument, InvalidType
            A bad shape, dtype, stride, alignment, device, ``T``, ubatch, a host array, or a
            ``stream`` that is not a CuPy stream; raised before anything is launched and
            before the call counts.
        ClosedError
            The workspace is closed.
        CollectiveTimeout
            A previous wait of this workspace expired (the workspace is poisoned).
        ConfigMismatch
            A previous call found that the ranks called with different ``T`` / dtype / ubatch
            (the workspace is poisoned); the message names the ranks and values.
        DcpkitError
            The workspace's first call is being captured, or every graph output buffer is
            taken and ``out`` is None while capturing.
        """
        return self._call_keyed(
            pair_key(q, out, ubatch, return_padded), q, ubatch, out, stream, return_padded
        )

    def _plan(self, q, ubatch, out, return_padded) -> GatherPlan:
        """The full validation of a call (:meth:`_validate`: every check, every message), then
        everything its key determines: grids, strides, the packed kernel parameters."""
        T, ubatch, qi, oi = self._validate(q, ubatch, out, return_padded)
        isz = self.dtype.itemsize
        heads = self.padded_num_heads if return_padded else self.num_heads
        shape = (T, heads, self.head_dim)
        strides = (self.slot_token_bytes, self.head_dim * isz, isz)
        if T == 0:
            return self._gather_plan(0, ubatch, oi, (), (), _OUT, shape, strides)
        full_row = self.num_heads * self.head_dim * isz
        q_stride = qi.strides[0] if T > 1 else self.row_bytes
        if oi is not None:
            out_stride = oi.strides[0] if T > 1 else full_row
        else:
            out_stride = self.slot_token_bytes
        tail = (qi.ptr, q_stride, self.row_bytes // 16, self.slot_token_bytes, T, 0, out_stride)
        return self._gather_plan(T, ubatch, oi, tail, Q_GATHER_PARAM_TYPES, _OUT, shape, strides)

    def _vectors(self, T: int, copy_out: bool) -> int:
        return T * (self.row_bytes // 16) * (self.world_size if copy_out else 1)

    def _result_view(self, ptr: int, T: int, padded: bool):
        isz = self.dtype.itemsize
        heads = self.padded_num_heads if padded else self.num_heads
        return self._view(
            ptr, (T, heads, self.head_dim), (self.slot_token_bytes, self.head_dim * isz, isz)
        )

    # ------------------------------------------------------------------ validation
    def _validate(
        self, q, ubatch, out, return_padded
    ) -> tuple[int, int, ArrayInfo, ArrayInfo | None]:
        """Every check of a call, before anything is launched or counted (no GPU needed).
        Returns ``(T, ubatch, q_info, out_info or None)``."""
        op = self.op_name
        self.check_open()
        ubatch = self.check_ubatch(ubatch)
        return_padded = check_bool(return_padded, op, "return_padded")
        if return_padded and out is not None:
            raise InvalidArgument(
                f"{op}: return_padded must be False when out= is given (got return_padded=True)"
            )
        qi = array_info(q, op, "q")
        check_shape(qi, (None, self.heads_per_rank, self.head_dim), "T, H_r, D", op, "q")
        check_dtype(qi, (self.dtype,), op, "q")
        check_device(qi, self.device, op, "q")
        T = qi.shape[0]
        if T > self.max_tokens:
            raise InvalidArgument(
                f"{op}: q tokens T must be <= max_tokens {self.max_tokens} (got {T})"
            )
        if T > 0:
            self._check_rows(qi, "q", self.heads_per_rank)
        oi = None
        if out is not None:
            oi = array_info(out, op, "out")
            check_shape(oi, (T, self.num_heads, self.head_dim), "T, H, D", op, "out")
            check_dtype(oi, (self.dtype,), op, "out")
            check_device(oi, self.device, op, "out")
            if T > 0:
                self._check_rows(oi, "out", self.num_heads)
            check_disjoint(op, (("out", oi),), (("q", qi),))
            check_outside_workspace(self, op, (("out", oi),))
        return T, ubatch, qi, oi

    def _check_rows(self, info: ArrayInfo, name: str, heads: int) -> None:
        """Heads contiguous, token stride >= one token's heads and 16-byte aligned."""
        op = self.op_name
        isz = self.dtype.itemsize
        D = self.head_dim
        T = info.shape[0]
        if D > 1 and info.strides[2] != isz:
            raise InvalidArgument(
                f"{op}: {name} head_dim stride must be one element "
                f"({isz} bytes) (got {info.strides[2]} bytes)"
            )
        if heads > 1 and info.strides[1] != D * isz:
            raise InvalidArgument(
                f"{op}: {name} head stride must be head_dim elements "
                f"({D * isz} bytes) (got {info.strides[1]} bytes)"
            )
        row = heads * D * isz
        if T > 1 and (info.strides[0] < row or info.strides[0] % 16):
            raise InvalidArgument(
                f"{op}: {name} token stride must be >= {row} bytes and a "
                f"multiple of 16 bytes (got {info.strides[0]} bytes)"
            )
        check_align(info.ptr, 16, op, f"{name} data pointer")

    # ------------------------------------------------------------------ what the op accepts
    @classmethod
    def check_arguments(cls, world_size: int, **constructor_keywords) -> tuple:
        """``QGather(comm, **constructor_keywords)``'s checks for ``world_size`` ranks, without a
        GPU or a collective.

        Returns what every rank must agree on (the last value: the symmetric bytes of the
        workspace); raises :class:`InvalidArgument` / :class:`InvalidType` as the constructor
        does, with the same messages. ``heap`` is left to the constructor (it needs the group).
        See :func:`dcpkit._checks.check_constructor_keywords`.
        """
        from .._checks import check_constructor_keywords

        return check_constructor_keywords(cls, world_size, constructor_keywords)

    def accepts_layout(self, *, q=None, out=None) -> bool:
        """True when a call takes ``q`` and ``out`` (arrays or ``ArrayInfo``) in place: head
        stride ``D`` elements, token stride a multiple of 16 bytes, 16-byte aligned data.
        Shapes the call rejects anyway count as True; ``InvalidType`` for a host array."""
        from .._checks import described

        heads = {"q": self.heads_per_rank, "out": self.num_heads}
        for name, i in described(self.op_name, q=q, out=out):
            if len(i.shape) != 3 or i.shape[0] == 0:
                continue
            try:
                self._check_rows(i, name, heads[name])
            except InvalidArgument:
                return False
        return True
