"""LseReduce: every rank gets the exact LSE-merged attention output of its own heads, in one
kernel over NVLink.

In decode context parallelism every rank computes attention of *all* ``H`` query heads over *its*
KV shard, which gives a partial output ``out_partial [T, H, D_v]`` and a partial log-sum-exp
``lse_partial [T, H]``. Rank ``r`` owns heads ``[r*H_r, (r+1)*H_r)`` (``H_r = H / world_size``)
and needs, for those heads, the merge of every rank's partial. Usage, on every rank::

    op = LseReduce(comm, max_tokens=T_max, num_heads=H, head_dim=D_v, dtype="bfloat16")
    # per decode step, every rank, same T, same order:
    out = op(out_partial, lse_partial)            # [T, H_r, D_v], heads of this rank
    out, lse = op(out_partial, lse_partial, out_lse=lse_buf)   # also the merged lse [T, H_r]
    ...
    op.close()                                    # collective

1. ``out_partial`` ``[T, H, D_v]`` (dtype of the workspace), ``lse_partial`` ``[T, H]`` (float32,
   float16 or bfloat16; natural log, or base 2 with ``lse_base=2``), optional masks ``seq_lens
   [S]`` / ``query_start_loc [S+1]`` (int32).
2. One kernel: each rank stores the owner's head slice of its partial output and lse into the
   owner's slot (16-byte unicast stores through peer pointers), publishes its epoch, then waits
   for every source and merges its own heads (NOTE [dcpkit epoch signalling] in
   ``kernels/dcpkit_ptx.cuh``; kernel in ``kernels/lse_reduce.cu``).
3. The result goes into ``out=`` or a workspace output buffer (lifetime: see
   :class:`LseReduce`).

:func:`lse_combine` is the merge alone over local arrays (the NCCL fallback runs it after its
``all_to_all``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import _cuda, jit
from .._arrays import (
    ArrayInfo,
    array_info,
    check_device,
    check_dtype,
    check_ndim,
    check_shape,
    dtype_name,
)
from .._launch import KernelParams
from .._plan import arrays_key
from ..comm import Communicator
from ..errors import InvalidArgument, InvalidType
from ..reference import check_lse_base, resolve_dtype
from ._workspace import (
    PROTO_PARAM_TYPES,
    OpWorkspace,
    _round_up,
    check_bool,
    check_positive_int,
    launch_config,
)

__all__ = ["LseReduce", "lse_combine", "LSE_REDUCE_PARAM_TYPES"]

#: Parameters of ``lse_reduce_kernel`` (kernels/lse_reduce.cu), every dtype variant:
#: DCPKIT_PROTO_PARAMS, then peer_data, slot_bytes, lse_offset, T_max, out_partial,
#: in_tok_stride, in_head_stride, lse_partial, lse_tok_stride, lse_head_stride, lse_scale,
#: seq_lens, query_start_loc, num_requests, out, out_lse, T, H, H_r, D_v.
LSE_REDUCE_PARAM_TYPES = PROTO_PARAM_TYPES + (
    "u64",
    "u64",
    "u64",
    "i32",
    "u64",
    "i64",
    "i64",
    "u64",
    "i64",
    "i64",
    "f32",
    "u64",
    "u64",
    "i32",
    "u64",
    "u64",
    "i32",
    "i32",
    "i32",
    "i32",
)
_P = len(PROTO_PARAM_TYPES)
_IN, _OUT, _OUT_LSE = _P + 4, _P + 14, _P + 15  # fields patched per call

#: Threads per CTA of both kernels (``lse_detail::kThreads`` in the kernel).
THREADS = 256
WARPS_PER_CTA = THREADS // 32
#: Largest world_size the merge handles (``lse_detail::kMaxSources``).
MAX_WORLD_SIZE = 64

_FILE = "lse_reduce.cu"
_BLOCK = (THREADS,)
_INT32_MAX = 2**31 - 1
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_UINT = {2: np.uint16, 4: np.uint32}  # byte containers of the float dtypes (copies, empties)


def _float_dtypes() -> tuple[np.dtype, np.dtype, np.dtype]:
    """bfloat16, float16, float32: the output and lse dtypes the kernels are built for."""
    return (resolve_dtype("bfloat16"), np.dtype(np.float16), _F32)


def _cxx_type(dt: np.dtype) -> str:
    bf16, fp16, fp32 = _float_dtypes()
    return {bf16: "dcpkit::bf16_t", fp16: "dcpkit::fp16_t", fp32: "float"}[dt]


def _reduce_variant(out_dt: np.dtype, lse_dt: np.dtype) -> str:
    return f"dcpkit::lse_reduce_kernel<{_cxx_type(out_dt)}, {_cxx_type(lse_dt)}>"


def _combine_variant(out_dt: np.dtype) -> str:
    return f"dcpkit::lse_combine_kernel<{_cxx_type(out_dt)}>"


def _c_contiguous(info: ArrayInfo) -> bool:
    """C-contiguous (dims of extent 1 may have any stride)."""
    want = info.itemsize
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _check_contiguous(info: ArrayInfo, op: str, name: str) -> None:
    if not _c_contiguous(info):
        raise InvalidArgument(
            f"{op}: {name} must be C-contiguous (got shape {info.shape}, "
            f"strides {info.strides} bytes)"
        )


def _check_nonneg_strides(info: ArrayInfo, op: str, name: str) -> None:
    for n, s in zip(info.shape, info.strides):
        if n > 1 and s < 0:
            raise InvalidArgument(
                f"{op}: {name} strides must be non-negative (got {info.strides} bytes)"
            )


def _check_index_array(x, op: str, name: str, dims: str, device: int) -> ArrayInfo:
    """An int32, 1-D, contiguous array on ``device`` (seq_lens, query_start_loc)."""
    info = array_info(x, op, name)
    if info.dtype != _I32:
        check_dtype(info, (np.int32,), op, name)
    check_ndim(info, 1, dims, op, name)
    _check_contiguous(info, op, name)
    check_device(info, device, op, name)
    return info


class _Plan(NamedTuple):
    """A validated call: everything the launch needs, nothing launched yet."""

    T: int
    ubatch: int
    x: ArrayInfo  # out_partial
    copy_input: bool  # innermost stride != itemsize: copy to a contiguous array first
    in_tok: int  # out_partial strides in elements (valid when not copy_input)
    in_head: int
    lse: ArrayInfo
    lse_tok: int  # lse_partial strides in elements
    lse_head: int
    seq_ptr: int
    qsl_ptr: int
    num_requests: int
    out: ArrayInfo | None
    out_lse: ArrayInfo | None
    want_lse: bool


class _CallPlan(NamedTuple):
    """A validated call, all its key determines (:mod:`dcpkit._plan`); no caller's array."""

    T: int
    ubatch: int
    copy_input: bool  # copy out_partial to a contiguous array per call
    out_ptr: int  # the caller's out= (0: none)
    out_lse_ptr: int  # the caller's out_lse= (0: none)
    want_lse: bool
    needs_output: bool  # a workspace output buffer is used
    lse_key: object  # the lse dtype: which kernel
    grid: int
    params: KernelParams | None
    out_field: object  # the ``out`` field of params (ctypes), patched per call
    lse_field: object  # the ``out_lse`` field
    debug_key: tuple
    views: dict  # workspace output buffer address -> (out view, lse view), memoised


class LseReduce(OpWorkspace):
    """The direct ``lse_reduce`` op: all-to-all of partial attention plus the LSE-weighted merge.

    Naive equivalent (every rank ``r``, ``W = world_size``, ``H_r = H / W``)::

        parts = all_to_all(out_partial.split(H_r, dim=1))   # parts[s] = rank s's [T, H_r, D_v]
        lses  = all_to_all(lse_partial.split(H_r, dim=1))   # lses[s]  = rank s's [T, H_r]
        l   = where(isnan(lses) | (lses == +inf), -inf, lses * ln(lse_base))   # [W, T, H_r]
        l[s, masked rows of rank s] = -inf
        m   = l.max(0)
        w   = exp(l - m) / exp(l - m).sum(0)                 # 0 where l == -inf
        out = sum(w[s] * parts[s] for s with w[s] > 0)       # fp32, rounded once; 0 if m == -inf
        lse = m + log(exp(l - m).sum(0))                     # -inf if m == -inf

    The algorithm is the LSE merge of split-KV (flash-decoding) partials, as used for decode
    context parallelism in vLLM and FlashInfer; here the all-to-all and the merge are one kernel:
    each rank writes the owner's head slice of its partial output and lse straight into the
    owner's symmetric slot, publishes its epoch, and the owner merges once every source has
    published (NOTE [dcpkit epoch signalling] in ``kernels/dcpkit_ptx.cuh``).

    Parameters
    ----------
    comm : Communicator
        The group; rank ``r`` owns heads ``[r*H_r, (r+1)*H_r)``.
    max_tokens : int
        ``T_max``, the largest ``T`` of any call (sizes the symmetric slots:
        ``2 * world_size * T_max * H_r * (D_v * itemsize + 4)`` bytes per ubatch).
    num_heads : int
        ``H``, heads seen by attention on every rank; a multiple of ``world_size``.
    head_dim : int
        ``D_v``, the width of one output row; ``D_v * itemsize`` must be a multiple of 16 bytes.
    dtype : str or dtype
        Output dtype and dtype of ``out_partial``: bfloat16, float16 or float32 (a NumPy /
        ml_dtypes dtype or a name such as ``"bfloat16"``).
    num_ubatches : int
        Independent sets of epochs, signals and slots (micro-batches that may overlap).
    lse_base : float
        Base of ``lse_partial``: ``math.e`` (natural log, default) or ``2``.
    return_lse : bool
        Also return the merged natural-log lse ``[T, H_r]`` float32 from every call.
    timeout_ms : float, optional
        Deadline of every wait in (0, 3600000] milliseconds, any real number type (default
        ``DCPKIT_TIMEOUT_MS`` or 5000 ms).
    heap : SymmetricHeap, optional
        Reserve the workspace in this open heap of the same group (same ``world_size`` and
        ``rank`` as ``comm``) instead of allocating its own. The reservation is taken only
        after every rank passed every check, and is never given back (the heap is a bump
        allocator), also when a later setup step fails.
    graph_outputs : int
        Calls captured in CUDA graphs without ``out=`` (or, with ``return_lse``, without
        ``out_lse=``) that the workspace serves over its life, each with result buffers of its
        own (allocated with the workspace; default 4, 0 for none). One more raises
        :class:`DcpkitError` at capture time: pass ``out=`` / ``out_lse=`` then.
    waiter_ctas : int, optional
        CTAs that wait and combine (the others send and exit; default: the SM share / 8, at
        least 1; NOTE [dcpkit epoch signalling]). A measuring knob: more combine parallelism at
        large ``T``, but the co-residency rule holds only for the default.
    _self_check : bool
        Benchmark only: ``False`` compiles the variant whose waits compare the epoch only (no
        fingerprint check), to measure what the check costs.

    Attributes
    ----------
    heads_per_rank : int
        ``H_r``.
    launches_per_call : int
        Kernel launches per call: 1 (the epoch advance is folded into the kernel).
    waiter_ctas : int
        CTAs of a call that wait and combine.
    THREADS : int
        Threads per CTA.

    Notes
    -----
    Output lifetime. With ``out=`` the result is written there. Otherwise it lands in a
    workspace output buffer: an eager call's result stays valid while it is consumed on the
    same stream before call ``n + 2`` of the same ubatch is issued (two buffers alternate); a
    call captured in a CUDA graph writes a fixed buffer of its ubatch that stays valid until
    the next replay of the graph that captured the call (each captured call has buffers of its
    own). Copy the result to keep it
    longer.

    Poisoned workspace: after a timeout or a :class:`ConfigMismatch` (ranks that called with a
    different ``T``, lse dtype, mask presence or ubatch) every later kernel of the workspace,
    graph replays included, writes NaN into the whole output and merged lse. A graph-replay
    loop checks it without a device sync::

        graph.launch(stream)
        if op.poisoned:
            op.check()      # raises CollectiveTimeout or ConfigMismatch

    Collective: construction (compiles the kernels, ends with a barrier), every call (every rank,
    same ``T``, dtypes, masks present or not, ubatch, in the same order) and :meth:`close`.

    Raises
    ------
    DcpkitError
        The current stream is capturing a CUDA graph (on every rank).
    InvalidArgument, InvalidType
        A bad constructor argument (``H % world_size != 0``, ``D_v * itemsize % 16 != 0``, an
        unsupported dtype or ``lse_base``, ``world_size > 64``, a workspace over 2**40 bytes,
        a bad ``timeout_ms`` or ``DCPKIT_TIMEOUT_MS``, a ``heap`` of another group or without
        room).
    MissingDependency
        CuPy is not installed (names the ``cuda12`` / ``cuda13`` extra).
    DcpkitError
        No CUDA GPU is visible.
    PeerError
        Another rank rejected its arguments, missed CuPy or a GPU, or failed to compile the
        kernels.
    ConfigMismatch
        The ranks passed different geometries, ``num_ubatches`` or ``timeout_ms``.
    """

    op_name = "lse_reduce"
    size_arguments = "max_tokens, num_heads, head_dim"
    launches_per_call = 1
    THREADS = THREADS

    def __init__(
        self,
        comm: Communicator,
        *,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        dtype,
        num_ubatches: int = 1,
        lse_base: float = math.e,
        return_lse: bool = False,
        timeout_ms: float | None = None,
        heap=None,
        graph_outputs: int | None = None,
        waiter_ctas: int | None = None,
        _self_check: bool = True,
    ):
        op = self.op_name
        self._closed = True
        # One exchange: which ranks rejected their arguments (or miss CuPy, a GPU, room in the
        # heap), and whether the geometries agree.
        self._setup(
            comm,
            lambda W: self._check_arguments(
                W,
                max_tokens=max_tokens,
                num_heads=num_heads,
                head_dim=head_dim,
                dtype=dtype,
                num_ubatches=num_ubatches,
                lse_base=lse_base,
                return_lse=return_lse,
                timeout_ms=timeout_ms,
                graph_outputs=graph_outputs,
                waiter_ctas=waiter_ctas,
                self_check=_self_check,
            ),
            "max_tokens, num_heads, head_dim, dtype, lse_base, return_lse",
            heap=heap,
        )
        err = None
        try:
            self._load_kernels()
        except Exception as e:  # noqa: BLE001 - shared with the peers below, then re-raised
            err = e
        try:
            comm.all_ok(f"{op}: kernel compile", err)
        except BaseException:
            self.close()
            raise
        self._finish_setup()

    def _check_arguments(
        self,
        world_size: int,
        *,
        max_tokens,
        num_heads,
        head_dim,
        dtype,
        num_ubatches=1,
        lse_base=math.e,
        return_lse=False,
        timeout_ms=None,
        graph_outputs=None,
        waiter_ctas=None,
        self_check=True,
    ) -> tuple:
        """Every check of the constructor arguments that needs no GPU and no collective (the
        constructor's keywords); returns what every rank must agree on."""
        self._check_protocol_options(
            graph_outputs=graph_outputs, waiter_ctas=waiter_ctas, self_check=self_check
        )
        self._init_geometry(
            world_size,
            max_tokens=max_tokens,
            num_heads=num_heads,
            head_dim=head_dim,
            dtype=dtype,
            lse_base=lse_base,
            return_lse=return_lse,
        )
        return (
            self.max_tokens,
            self.num_heads,
            self.head_dim,
            str(self.dtype),
            self.lse_base,
            self.return_lse,
        ) + self._check_common(
            world_size,
            slot_bytes=self._slot_bytes_needed,
            out_bytes=self._out_bytes_needed,
            num_ubatches=num_ubatches,
            timeout_ms=timeout_ms,
        )

    # ------------------------------------------------------------------ construction helpers
    def _init_geometry(
        self, world_size: int, *, max_tokens, num_heads, head_dim, dtype, lse_base, return_lse
    ) -> None:
        """Validate the constructor arguments and derive the layout (no GPU, no collective)."""
        op = self.op_name
        self.max_tokens = check_positive_int(max_tokens, op, "max_tokens")
        self.num_heads = check_positive_int(num_heads, op, "num_heads")
        self.head_dim = check_positive_int(head_dim, op, "head_dim")
        for name, v in (("num_heads", self.num_heads), ("head_dim", self.head_dim)):
            if v > _INT32_MAX:  # int parameters of the kernel
                raise InvalidArgument(f"{op}: {name} must be <= 2**31 - 1 (got {v})")
        W = int(world_size)
        if W > MAX_WORLD_SIZE:
            raise InvalidArgument(f"{op}: world_size must be <= {MAX_WORLD_SIZE} (got {W})")
        if self.num_heads % W:
            raise InvalidArgument(
                f"{op}: num_heads must be a multiple of world_size {W} (got {self.num_heads})"
            )
        try:
            dt = resolve_dtype(dtype)
        except (TypeError, ValueError, AttributeError):
            raise InvalidType(
                f"{op}: dtype must be one of [bfloat16, float16, float32] (got {dtype!r})"
            ) from None
        if dt not in _float_dtypes():
            raise InvalidType(
                f"{op}: dtype must be one of [bfloat16, float16, float32] (got {dtype_name(dt)})"
            )
        self.dtype = dt
        row_bytes = self.head_dim * dt.itemsize
        if row_bytes % 16:
            raise InvalidArgument(
                f"{op}: head_dim * itemsize must be a multiple of 16 bytes "
                f"(got {self.head_dim} * {dt.itemsize} = {row_bytes})"
            )
        self.lse_base = check_lse_base(lse_base, op)
        self.return_lse = check_bool(return_lse, op, "return_lse")

        H_r = self.num_heads // W
        self.heads_per_rank = H_r
        if W * self.max_tokens * H_r > _INT32_MAX:
            raise InvalidArgument(
                f"{op}: world_size * max_tokens * heads_per_rank must be "
                f"< 2**31 (got {W * self.max_tokens * H_r})"
            )
        # Slot: payload OUT_T [W][T_max][H_r][D_v], then lse float [W][T_max][H_r].
        self._row_bytes = row_bytes
        self._lse_offset = _round_up(W * self.max_tokens * H_r * row_bytes)
        self._slot_bytes_needed = self._lse_offset + _round_up(W * self.max_tokens * H_r * 4)
        # Output buffer: out [T_max][H_r][D_v], then out_lse float [T_max][H_r] if return_lse.
        self._out_part_bytes = _round_up(self.max_tokens * H_r * row_bytes)
        self._out_lse_bytes = _round_up(self.max_tokens * H_r * 4)
        self._out_bytes_needed = self._out_part_bytes + (
            self._out_lse_bytes if self.return_lse else 0
        )
        self._lse_scale = np.float32(1.0 if self.lse_base == math.e else math.log(2.0))
        self._lse_dtypes = _float_dtypes()

    def _load_kernels(self) -> None:
        """Compile (one NVRTC run for the file, cached) and load the kernel of every lse dtype,
        and prebuild the constant kernel arguments."""
        import cupy

        self._cupy = cupy
        self._fn = {}
        with cupy.cuda.Device(self.device):
            for lse_dt in self._lse_dtypes:
                raw = jit.get_kernel(
                    _FILE, _reduce_variant(self.dtype, lse_dt), self._kernel_options()
                )
                self._fn[lse_dt] = raw.kernel  # the loaded cupy.cuda.function.Function
            self._init_fast_path(self._fn)
        W, H_r = self.world_size, self.heads_per_rank
        # DCPKIT_PROTO_PARAMS, peer_data, slot_bytes, lse_offset, T_max (per ubatch).
        self._head_args = [
            self.proto_args(u)
            + (
                self.peer_data_ptr(u),
                np.uint64(self.slot_bytes),
                np.uint64(self._lse_offset),
                np.int32(self.max_tokens),
            )
            for u in range(self.num_ubatches)
        ]
        # H, H_r, D_v (every call).
        self._tail_args = (np.int32(self.num_heads), np.int32(H_r), np.int32(self.head_dim))
        self._grids = [
            (launch_config(W * T * H_r, WARPS_PER_CTA, self.max_ctas),)
            for T in range(self.max_tokens + 1)
        ]

    def ctas_for(self, T: int) -> int:
        """The grid (CTA count, :attr:`THREADS` threads each) of a call with ``T`` tokens; the
        last ``min(grid, waiter_ctas)`` CTAs to arrive wait and combine."""
        return launch_config(
            self.world_size * int(T) * self.heads_per_rank, WARPS_PER_CTA, self.max_ctas
        )

    # ------------------------------------------------------------------ the call
    def __call__(
        self,
        out_partial,
        lse_partial,
        *,
        seq_lens=None,
        query_start_loc=None,
        ubatch: int = 0,
        out=None,
        out_lse=None,
        stream=None,
    ):
        """Merge every rank's partial attention into this rank's heads.

        Parameters
        ----------
        out_partial : array [T, H, D_v], dtype of the workspace
            This rank's partial attention output of all heads. ``1 <= T <= max_tokens`` (``T ==
            0`` returns empty arrays and launches nothing). Rows must be 16-byte aligned: data
            pointer, token stride and head stride multiples of 16 bytes (padded head or token
            storage is fine). An innermost stride other than the itemsize costs a copy to a
            contiguous array first (on ``stream``; it allocates, so avoid it under graph capture).
        lse_partial : array [T, H], float32, float16 or bfloat16
            This rank's partial log-sum-exp (base ``lse_base``), any non-negative strides. NaN
            and +inf count as -inf (an empty or invalid shard).
        seq_lens : int32 array [S], optional
            This rank's KV length of every request, contiguous; a request with 0 here counts as
            empty on this rank. Requires ``query_start_loc``.
        query_start_loc : int32 array [S+1], optional
            Row offsets of the requests (non-decreasing, equal on every rank), contiguous; rows
            at or past ``query_start_loc[S]`` are padding, empty on every rank. Rows before
            ``query_start_loc[0]`` belong to no request.
        ubatch : int
            Which ubatch's epochs, signals and slots to use, in ``[0, num_ubatches)``.
        out : array [T, H_r, D_v], dtype of the workspace, optional
            C-contiguous, 16-byte aligned destination (required for allocation-free capture
            of a result that must outlive the next replay).
        out_lse : float32 array [T, H_r], optional
            C-contiguous destination of the merged natural-log lse; passing it makes the call
            return ``(out, out_lse)``.
        stream : cupy.cuda.Stream, optional
            Stream of the launch (default: the current CuPy stream).

        Returns
        -------
        out : array [T, H_r, D_v]
            Output of heads ``[rank*H_r, (rank+1)*H_r)``: ``out=`` or a view of a workspace
            output buffer (lifetime: see the class docstring). Rows whose sources are all empty
            are 0.
        out_lse : float32 array [T, H_r]
            Only with ``return_lse=True`` or ``out_lse=``: the merged natural-log lse, -inf for
            rows whose sources are all empty.

        Collective: every rank calls with the same ``T``, dtypes, masks present or not and
        ubatch, in the same order.

        Stream: enqueued on ``stream``; the host does not wait.

        Raises
        ------
        InvalidType
            A host array or a non-array, a wrong dtype, a non-integer ubatch, a ``stream`` that
            is not a CuPy stream.
        InvalidArgument
            A wrong shape, ``T > max_tokens``, rows not 16-byte aligned, negative strides, an
            array on another GPU, ``seq_lens`` without ``query_start_loc`` or of the wrong
            length, a non-contiguous ``seq_lens`` / ``query_start_loc`` / ``out`` / ``out_lse``,
            a ubatch out of range.
        ClosedError
            The workspace is closed.
        CollectiveTimeout
            An earlier call timed out waiting for a peer (the workspace is poisoned).
        ConfigMismatch
            An earlier call found that the ranks called with a different ``T``, lse dtype, mask
            presence or ubatch (the workspace is poisoned); names the ranks and values.
        DcpkitError
            The workspace's first call is being captured, or every graph output buffer is taken
            while capturing a call that needs one.

        Every check runs before anything is launched or counted: after a rejected call the
        workspace is unchanged and usable.
        """
        arrays = (out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse)
        return self._call_keyed(arrays_key(arrays, ubatch), arrays, ubatch, stream)

    def _call_keyed(self, key, arrays: tuple, ubatch, stream):
        """A call whose flat key (:func:`dcpkit._plan.arrays_key` of ``arrays``, the call's
        arrays in the order of :meth:`__call__`) is ``key`` (None: keyed in full): the closed /
        poisoned check, the plan (the full validation on a miss), the stream check (every check
        runs before anything is counted or launched); then :meth:`_empty_result` (``T == 0``),
        :meth:`_launch` (a capturing stream, ``DCPKIT_DEBUG``, an input copy), or the eager hot
        path: the bookkeeping, the output fields patched, one launch, the result."""
        if self._closed or self._rec_head[0] or self._launch_failed is not None:
            self.check_open()  # raises: closed or poisoned, every call
        plans = self._plans
        plan = plans._plans.get(key)
        if plan is None:
            x, lse, seq, qsl, out, out_lse = arrays
            plan = plans.get(key, arrays, (ubatch,), x, lse, seq, qsl, ubatch, out, out_lse)
        else:
            plans.hits += 1
        if stream is not None and not isinstance(stream, _cuda._STREAM_TYPES):
            _cuda.check_stream(stream, self.op_name)  # raises InvalidType
        out, out_lse = arrays[4], arrays[5]
        if plan.T == 0:
            return self._empty_result(plan.want_lse, out, out_lse)
        if stream is None:
            stream = self._current_stream_fn()
        if plan.copy_input or self._debug or stream.is_capturing():
            return self._launch(plan, arrays[0], out, out_lse, stream)
        ub = plan.ubatch
        calls = self._calls
        calls[ub] += 1  # counted: a launch that raises below leaves the workspace unusable
        out_ptr, lse_ptr = plan.out_ptr, plan.out_lse_ptr
        res, lse_res = out, out_lse
        if plan.needs_output:  # one of the two eager output buffers of the ubatch
            base = self.output_ptr(ub, False)
            views = plan.views.get(base)
            if views is None:
                views = plan.views[base] = self._output_views(plan, base, self._eager_out[ub])
            if not out_ptr:
                out_ptr, res = base, views[0]
            if plan.want_lse and not lse_ptr:
                lse_ptr, lse_res = base + self._out_part_bytes, views[1]
        plan.out_field.value = out_ptr
        plan.lse_field.value = lse_ptr
        if self._get_device() == self.device:
            try:
                self._launchers[plan.lse_key].launch(plan.grid, plan.params, stream.ptr)
            except BaseException as e:
                self._launch_failed = f"{type(e).__name__}: {e}"
                raise
        else:
            self._run(plan.lse_key, plan.grid, plan.params, stream)
        return (res, lse_res) if plan.want_lse else res

    def _output_views(self, plan, base: int, owner) -> tuple:
        """The result views over the workspace output buffer at ``base`` that ``plan`` returns
        (None for the others): ``out [T, H_r, D_v]``, then the merged lse ``[T, H_r]`` float32
        after it."""
        T, H_r = plan.T, self.heads_per_rank
        res = lse = None
        if not plan.out_ptr:
            shape, nbytes = (T, H_r, self.head_dim), T * H_r * self._row_bytes
            res = self._memo_view(base, shape, self.dtype, nbytes, owner)
        if plan.want_lse and not plan.out_lse_ptr:
            lse_ptr = base + self._out_part_bytes
            lse = self._memo_view(lse_ptr, (T, H_r), _F32, T * H_r * 4, owner)
        return res, lse

    def _plan(
        self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse
    ) -> _CallPlan:
        """The full validation of a call (:meth:`_validate`: every check, every message), then
        everything its key determines: the grid and the packed kernel parameters."""
        v = self._validate(
            out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse
        )
        T, ub = v.T, v.ubatch
        out_ptr = v.out.ptr if v.out is not None else 0
        lse_ptr = v.out_lse.ptr if v.out_lse is not None else 0
        needs_output = v.out is None or (v.want_lse and v.out_lse is None)
        debug_key = (T, str(self.dtype), str(v.lse.dtype), ub, v.qsl_ptr != 0, v.seq_ptr != 0)
        if T == 0:
            return _CallPlan(
                0,
                ub,
                False,
                out_ptr,
                lse_ptr,
                v.want_lse,
                needs_output,
                v.lse.dtype,
                0,
                None,
                None,
                None,
                debug_key,
                {},
            )
        in_tok, in_head = v.in_tok, v.in_head
        if v.copy_input:  # the contiguous copy made per call
            in_tok, in_head = self.num_heads * self.head_dim, self.head_dim
        values = (
            [int(a) for a in self._head_args[ub]]
            + [
                v.x.ptr,
                in_tok,
                in_head,
                v.lse.ptr,
                v.lse_tok,
                v.lse_head,
                float(self._lse_scale),
                v.seq_ptr,
                v.qsl_ptr,
                v.num_requests,
                0,
                0,
                T,
            ]
            + [int(a) for a in self._tail_args]
        )
        params = KernelParams(LSE_REDUCE_PARAM_TYPES, values)
        return _CallPlan(
            T,
            ub,
            v.copy_input,
            out_ptr,
            lse_ptr,
            v.want_lse,
            needs_output,
            v.lse.dtype,
            self._grids[T][0],
            params,
            params.field(_OUT),
            params.field(_OUT_LSE),
            debug_key,
            {},
        )

    def _validate(
        self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse
    ) -> _Plan:
        """Every argument check of a call; needs no GPU (tests call it on CPU machines)."""
        op = self.op_name
        self.check_open()
        ub = self.check_ubatch(ubatch)
        H, H_r, D = self.num_heads, self.heads_per_rank, self.head_dim
        dt = self.dtype

        x = array_info(out_partial, op, "out_partial")
        if x.dtype != dt:
            check_dtype(x, (dt,), op, "out_partial")
        if len(x.shape) != 3 or x.shape[1] != H or x.shape[2] != D:
            check_shape(x, (None, H, D), "T, H, D_v", op, "out_partial")
        if x.device != self.device:
            check_device(x, self.device, op, "out_partial")
        T = x.shape[0]
        if T > self.max_tokens:
            raise InvalidArgument(
                f"{op}: out_partial tokens T must be <= max_tokens {self.max_tokens} (got {T})"
            )
        _check_nonneg_strides(x, op, "out_partial")
        isz = dt.itemsize
        s_tok, s_head, s_elem = x.strides
        copy_input = D > 1 and s_elem != isz
        in_tok = in_head = 0
        if not copy_input:
            s_tok = s_tok if T > 1 else 0
            s_head = s_head if H > 1 else 0
            if x.ptr % 16 or s_tok % 16 or s_head % 16:
                raise InvalidArgument(
                    f"{op}: out_partial rows must be 16-byte aligned: data pointer, token "
                    f"stride and head stride multiples of 16 bytes (got pointer offset "
                    f"{x.ptr % 16}, strides {x.strides} bytes)"
                )
            in_tok, in_head = s_tok // isz, s_head // isz

        lse = array_info(lse_partial, op, "lse_partial")
        if lse.dtype not in self._lse_dtypes:
            check_dtype(lse, self._lse_dtypes, op, "lse_partial")
        if lse.shape != (T, H):
            check_shape(lse, (T, H), "T, H", op, "lse_partial")
        if lse.device != self.device:
            check_device(lse, self.device, op, "lse_partial")
        _check_nonneg_strides(lse, op, "lse_partial")
        li = lse.itemsize
        l_tok = lse.strides[0] if T > 1 else 0
        l_head = lse.strides[1] if H > 1 else 0
        if lse.ptr % li or l_tok % li or l_head % li:
            raise InvalidArgument(
                f"{op}: lse_partial pointer and strides must be multiples of "
                f"its itemsize {li} bytes (got pointer offset {lse.ptr % li}, "
                f"strides {lse.strides} bytes)"
            )

        seq_ptr = qsl_ptr = 0
        S = 0
        if query_start_loc is None:
            if seq_lens is not None:
                raise InvalidArgument(
                    f"{op}: seq_lens requires query_start_loc (got query_start_loc=None)"
                )
        else:
            q = _check_index_array(query_start_loc, op, "query_start_loc", "S+1", self.device)
            if q.shape[0] < 1:
                raise InvalidArgument(
                    f"{op}: query_start_loc length must be >= 1 for [S+1] (got 0)"
                )
            S = q.shape[0] - 1
            qsl_ptr = q.ptr
            if seq_lens is not None:
                sl = _check_index_array(seq_lens, op, "seq_lens", "S", self.device)
                if sl.shape[0] != S:
                    raise InvalidArgument(
                        f"{op}: seq_lens length must be len(query_start_loc) - 1 = {S} "
                        f"(got {sl.shape[0]})"
                    )
                seq_ptr = sl.ptr

        o = None
        if out is not None:
            o = array_info(out, op, "out")
            if o.dtype != dt:
                check_dtype(o, (dt,), op, "out")
            if o.shape != (T, H_r, D):
                check_shape(o, (T, H_r, D), "T, H_r, D_v", op, "out")
            if o.device != self.device:
                check_device(o, self.device, op, "out")
            _check_contiguous(o, op, "out")
            if o.ptr % 16:
                raise InvalidArgument(
                    f"{op}: out data pointer must be 16-byte aligned "
                    f"(got pointer offset {o.ptr % 16})"
                )
        ol = None
        if out_lse is not None:
            ol = array_info(out_lse, op, "out_lse")
            if ol.dtype != _F32:
                check_dtype(ol, (np.float32,), op, "out_lse")
            if ol.shape != (T, H_r):
                check_shape(ol, (T, H_r), "T, H_r", op, "out_lse")
            if ol.device != self.device:
                check_device(ol, self.device, op, "out_lse")
            _check_contiguous(ol, op, "out_lse")
            if ol.ptr % 4:
                raise InvalidArgument(
                    f"{op}: out_lse data pointer must be 4-byte aligned "
                    f"(got pointer offset {ol.ptr % 4})"
                )
        return _Plan(
            T,
            ub,
            x,
            copy_input,
            in_tok,
            in_head,
            lse,
            l_tok // li,
            l_head // li,
            seq_ptr,
            qsl_ptr,
            S,
            o,
            ol,
            self.return_lse or ol is not None,
        )

    def _empty_result(self, want_lse: bool, out, out_lse):
        """``T == 0``: ``out`` / ``out_lse`` (the caller's) or empty arrays; nothing launched."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            res = (
                out
                if out is not None
                else cupy.empty(
                    (0, self.heads_per_rank, self.head_dim), dtype=_UINT[self.dtype.itemsize]
                ).view(self.dtype)
            )
            if not want_lse:
                return res
            lse = (
                out_lse
                if out_lse is not None
                else cupy.empty((0, self.heads_per_rank), dtype=np.float32)
            )
        return res, lse

    def _launch(self, plan: _CallPlan, out_partial, out, out_lse, stream):
        """A validated call (``T > 0``): the input copy if needed, bookkeeping, the per-call
        fields patched, one launch; returns the result."""
        cupy = self._cupy
        params = plan.params
        if plan.copy_input:  # documented slow path: innermost stride != itemsize
            with cupy.cuda.Device(self.device), stream:  # bytes only, through an unsigned
                # view; freed after the launch is enqueued (CuPy's pool: stream order)
                src = (
                    out_partial
                    if isinstance(out_partial, cupy.ndarray)
                    else cupy.asarray(out_partial)
                )
                xc = cupy.ascontiguousarray(src.view(_UINT[self.dtype.itemsize]))
            params[_IN] = xc.data.ptr
        T, ub = plan.T, plan.ubatch
        _parity, capturing, _exact = self.begin_call(
            ub, stream, plan.debug_key if self._debug else (), needs_output=plan.needs_output
        )
        H_r, D = self.heads_per_rank, self.head_dim
        base = None  # workspace output buffer of this call, taken only when needed
        if plan.out_ptr:
            res = out
            out_ptr = plan.out_ptr
        else:
            base = self.output_ptr(ub, capturing)
            owner = self._graph_out if capturing else self._eager_out[ub]
            out_ptr = base
            res = self._memo_view(base, (T, H_r, D), self.dtype, T * H_r * self._row_bytes, owner)
        lse_res = None
        lse_ptr = 0
        if plan.out_lse_ptr:
            lse_res = out_lse
            lse_ptr = plan.out_lse_ptr
        elif plan.want_lse:
            if base is None:  # out= given, merged lse into the workspace buffer
                base = self.output_ptr(ub, capturing)
            owner = self._graph_out if capturing else self._eager_out[ub]
            lse_ptr = base + self._out_part_bytes
            lse_res = self._memo_view(lse_ptr, (T, H_r), _F32, T * H_r * 4, owner)
        params[_OUT] = out_ptr
        params[_OUT_LSE] = lse_ptr
        self._run(plan.lse_key, plan.grid, params, stream)
        return res if lse_res is None else (res, lse_res)

    # ------------------------------------------------------------------ what the op accepts
    @classmethod
    def check_arguments(cls, world_size: int, **constructor_keywords) -> tuple:
        """Validate ``LseReduce`` constructor keywords for ``world_size`` ranks as the
        constructor would, before any GPU work or collective.

        Returns what every rank must agree on (the last value: the symmetric bytes of the
        workspace); raises :class:`InvalidArgument` / :class:`InvalidType` as the constructor
        does, with the same messages. ``heap`` is left to the constructor (it needs the group).
        See :func:`dcpkit._checks.check_constructor_keywords`.
        """
        from .._checks import check_constructor_keywords

        return check_constructor_keywords(cls, world_size, constructor_keywords)

    def accepts_layout(self, *, out_partial=None, lse_partial=None, out=None, out_lse=None) -> bool:
        """Whether this op takes the given arrays (or ``ArrayInfo``) without a copy by the
        caller: ``out_partial`` rows 16-byte aligned (or an innermost stride the op copies
        itself), ``lse_partial`` aligned to its itemsize, ``out`` / ``out_lse`` C-contiguous and
        16- / 4-byte aligned; no negative strides. A host array raises ``InvalidType``."""
        from .._checks import described

        def nonneg(i):
            return all(s >= 0 for n, s in zip(i.shape, i.strides) if n > 1)

        for name, i in described(
            self.op_name, out_partial=out_partial, lse_partial=lse_partial, out=out, out_lse=out_lse
        ):
            if name == "out_partial" and len(i.shape) == 3:
                if not nonneg(i):
                    return False
                if i.shape[2] > 1 and i.strides[2] != i.itemsize:
                    continue  # the op copies it to a contiguous array
                s_tok = i.strides[0] if i.shape[0] > 1 else 0
                s_head = i.strides[1] if i.shape[1] > 1 else 0
                if i.ptr % 16 or s_tok % 16 or s_head % 16:
                    return False
            elif name == "lse_partial":
                li = i.itemsize
                if (
                    not nonneg(i)
                    or i.ptr % li
                    or any(s % li for n, s in zip(i.shape, i.strides) if n > 1)
                ):
                    return False
            elif name in ("out", "out_lse"):
                if not _c_contiguous(i) or i.ptr % (16 if name == "out" else 4):
                    return False
        return True


# ----------------------------------------------------------------------------- local merge
class _CombinePlan(NamedTuple):
    W: int
    T: int
    H_r: int
    D: int
    src_out: ArrayInfo
    src_lse: ArrayInfo
    out: ArrayInfo
    out_lse: ArrayInfo | None


def _check_same_gpu(info: ArrayInfo, src_out: ArrayInfo, name: str) -> None:
    """lse_combine has no workspace: every array must live on ``src_out``'s GPU."""
    if info.device != src_out.device:
        raise InvalidArgument(
            f"lse_combine: {name} device must be src_out's GPU "
            f"{src_out.device} (got GPU {info.device})"
        )


def _validate_combine(src_out, src_lse, out, out_lse) -> _CombinePlan:
    """Argument checks of :func:`lse_combine` (no GPU needed)."""
    op = "lse_combine"
    so = array_info(src_out, op, "src_out")
    check_dtype(so, _float_dtypes(), op, "src_out")
    check_ndim(so, 4, "W, T, H_r, D_v", op, "src_out")
    W, T, H_r, D = so.shape
    if not 1 <= W <= MAX_WORLD_SIZE:
        raise InvalidArgument(
            f"{op}: src_out sources W must lie in [1, {MAX_WORLD_SIZE}] (got {W})"
        )
    if (D * so.itemsize) % 16:
        raise InvalidArgument(
            f"{op}: src_out D_v * itemsize must be a multiple of 16 bytes "
            f"(got {D} * {so.itemsize} = {D * so.itemsize})"
        )
    _check_contiguous(so, op, "src_out")
    if so.ptr % 16:
        raise InvalidArgument(
            f"{op}: src_out data pointer must be 16-byte aligned (got pointer offset {so.ptr % 16})"
        )
    sl = array_info(src_lse, op, "src_lse")
    check_dtype(sl, (np.float32,), op, "src_lse")
    check_shape(sl, (W, T, H_r), "W, T, H_r", op, "src_lse")
    _check_contiguous(sl, op, "src_lse")
    _check_same_gpu(sl, so, "src_lse")
    o = array_info(out, op, "out")
    check_dtype(o, (so.dtype,), op, "out")
    check_shape(o, (T, H_r, D), "T, H_r, D_v", op, "out")
    _check_contiguous(o, op, "out")
    _check_same_gpu(o, so, "out")
    if o.ptr % 16:
        raise InvalidArgument(
            f"{op}: out data pointer must be 16-byte aligned (got pointer offset {o.ptr % 16})"
        )
    ol = None
    if out_lse is not None:
        ol = array_info(out_lse, op, "out_lse")
        check_dtype(ol, (np.float32,), op, "out_lse")
        check_shape(ol, (T, H_r), "T, H_r", op, "out_lse")
        _check_contiguous(ol, op, "out_lse")
        _check_same_gpu(ol, so, "out_lse")
    if sl.ptr % 4 or (ol is not None and ol.ptr % 4):
        raise InvalidArgument(f"{op}: src_lse and out_lse must be 4-byte aligned")
    return _CombinePlan(W, T, H_r, D, so, sl, o, ol)


def lse_combine(src_out, src_lse, out, out_lse=None, stream=None):
    """Merge ``W`` partial outputs with their lse values, on one GPU (no communication).

    Naive equivalent::

        l   = where(isnan(src_lse) | (src_lse == +inf), -inf, src_lse)    # [W, T, H_r]
        m   = l.max(0);  w = exp(l - m) / exp(l - m).sum(0)
        out = sum(w[s] * src_out[s] for s with w[s] > 0)   # fp32, rounded once; 0 if m == -inf
        out_lse = m + log(exp(l - m).sum(0))               # -inf if m == -inf

    The same merge (same kernel code) as :class:`LseReduce`, for the NCCL fallback: after an
    ``all_to_all`` has gathered every source's slice of the owned heads.

    Parameters
    ----------
    src_out : array [W, T, H_r, D_v], bfloat16, float16 or float32
        C-contiguous, 16-byte aligned; ``D_v * itemsize`` a multiple of 16; ``W <= 64``.
    src_lse : float32 array [W, T, H_r]
        Natural-log lse of every source, C-contiguous.
    out : array [T, H_r, D_v], dtype of ``src_out``
        C-contiguous, 16-byte aligned destination.
    out_lse : float32 array [T, H_r], optional
        C-contiguous destination of the merged lse.
    stream : cupy.cuda.Stream, optional
        Stream of the launch (default: the current CuPy stream).

    Returns
    -------
    out, or (out, out_lse) when ``out_lse`` is given.

    Collective: no (local). Stream: enqueued on ``stream``; the host does not wait.

    Raises
    ------
    InvalidType, InvalidArgument
        A host array, a wrong dtype, shape, layout or alignment, arrays on different GPUs, a
        ``stream`` that is not a CuPy stream.
    MissingDependency
        CuPy is not installed.
    DcpkitError
        No CUDA GPU is visible.
    """
    plan = _validate_combine(src_out, src_lse, out, out_lse)
    if stream is not None and not isinstance(stream, _cuda._STREAM_TYPES or _cuda.stream_types()):
        _cuda.check_stream(stream, "lse_combine")  # raises InvalidType
    if plan.T == 0 or plan.H_r == 0:
        return out if out_lse is None else (out, out_lse)
    cupy = _cuda.require_cupy()
    dev = plan.src_out.device
    key = (dev, plan.src_out.dtype)
    fn = _COMBINE_FNS.get(key)
    if fn is None:
        _cuda.require_device("lse_combine", dev)
        with cupy.cuda.Device(dev):
            fn = _COMBINE_FNS[key] = jit.get_kernel(_FILE, _combine_variant(key[1])).kernel
    grid = (launch_config(plan.T * plan.H_r, WARPS_PER_CTA, 1 << 16),)
    args = (
        plan.src_out.ptr,
        plan.src_lse.ptr,
        plan.out.ptr,  # pointers: 8-byte ints
        0 if plan.out_lse is None else plan.out_lse.ptr,
        np.int32(plan.W),
        np.int32(plan.T),
        np.int32(plan.H_r),
        np.int32(plan.D),
    )
    if cupy.cuda.runtime.getDevice() == dev:
        fn(grid, _BLOCK, args, shared_mem=0, stream=stream)  # None: the current stream
    else:
        with cupy.cuda.Device(dev):
            fn(grid, _BLOCK, args, shared_mem=0, stream=stream)
    return out if out_lse is None else (out, out_lse)


#: (device, output dtype) -> loaded lse_combine kernel (cupy.cuda.function.Function).
_COMBINE_FNS: dict = {}
