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
from dataclasses import dataclass

import numpy as np

from .. import _cuda, jit
from .._arrays import dtype_name
from .._launch import KernelParams
from .._lse_call import LseReduceCall
from ..comm import Communicator
from ..errors import InvalidArgument, InvalidType
from ..reference import check_lse_base, resolve_dtype
from ._lse_checks import (
    F32,
    FILE,
    INT32_MAX,
    MAX_WORLD_SIZE,
    THREADS,
    UINT,
    WARPS_PER_CTA,
    CallArgs,
    c_contiguous,
    float_dtypes,
    large_rows_per_warp,
    reduce_variant,
    validate_call,
)
from ._workspace import (
    PROTO_PARAM_TYPES,
    OpWorkspace,
    _round_up,
    check_bool,
    check_positive_int,
    launch_config,
)
from .lse_combine import lse_combine

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
#: The values ``LseReduce.REG_SOURCES`` may take (the kernel's static_assert).
_REG_SOURCES = (0, 1, 2, 4, 8)
_IN, _OUT, _OUT_LSE = _P + 4, _P + 14, _P + 15  # fields patched per call


def launch_table(W: int, H_r: int, max_tokens: int, max_ctas: int) -> list[tuple[int, bool]]:
    """Per T in ``[0, max_tokens]``: the grid of a call, and whether it takes the large kernel
    instance (at least :func:`~dcpkit.ops._lse_checks.large_rows_per_warp` rows per warp: the
    batched send and the wide combine of kernels/lse_reduce.cu). That bound is never below
    ``SEND_ROWS``, which the kernel checks itself, so either instance is correct."""
    table = []
    per_warp = large_rows_per_warp(W)
    for T in range(max_tokens + 1):
        grid = launch_config(W * T * H_r, WARPS_PER_CTA, max_ctas)
        table.append((grid, W * T * H_r >= per_warp * WARPS_PER_CTA * grid))
    return table


@dataclass(frozen=True, slots=True, eq=False)
class _CallPlan:
    """A validated call, all its key determines (:mod:`dcpkit._plan`); no caller's array.
    Read-only slots, as :class:`~dcpkit.ops._gather.GatherPlan`'s (a slot read is cheaper than
    a NamedTuple field's)."""

    T: int
    ubatch: int
    copy_input: bool  # copy out_partial to a contiguous array per call
    out_ptr: int  # the caller's out= (0: none)
    out_lse_ptr: int  # the caller's out_lse= (0: none)
    want_lse: bool
    needs_output: bool  # a workspace output buffer is used
    kernel: int  # which kernel: ``_kernel_ids[lse dtype, large instance]``
    grid: int
    params: KernelParams | None
    out_field: object  # the ``out`` field of params (ctypes), patched per call
    lse_field: object  # the ``out_lse`` field
    debug_key: tuple
    patch_lse: bool  # the merged lse goes to a workspace output buffer (want_lse, no out_lse=)
    parity_views: list  # per parity: (out address, lse address, out view, lse view) of the
    # eager output buffer the hot path uses (memoised: the buffers stay for the workspace's
    # life; None: not made yet)


class LseReduce(LseReduceCall, OpWorkspace):
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
        Deadline of every wait in [0.001, 3600000] milliseconds, any real number type (default
        ``DCPKIT_TIMEOUT_MS`` or 5000 ms).
    heap : SymmetricHeap, optional
        Reserve the workspace in this open heap of the same group (same ``world_size`` and
        ``rank`` as ``comm``) instead of allocating its own. The reservation is taken only
        after every rank passed every check, and is never given back (the heap is a bump
        allocator), also when a later setup step fails.
    graph_outputs : int, optional
        Calls captured in CUDA graphs without ``out=`` (or, with ``return_lse``, without
        ``out_lse=``) that the workspace serves (until :meth:`release_graph_outputs`), each with
        result buffers of its own (``max_tokens * H_r * D * itemsize`` bytes, plus
        ``max_tokens * H_r * 4`` with ``return_lse``, each; allocated in device memory with the
        workspace; default 4, 0 for none). One more raises
        :class:`DcpkitError` at capture time: pass ``out=`` / ``out_lse=`` then.
    waiter_ctas : int, optional
        CTAs that wait and combine (the others send and exit; default: the SM share / 8, at
        least 1; NOTE [dcpkit epoch signalling]). A measuring knob: more combine parallelism at
        large ``T``, but the co-residency rule holds only for the default.
    programmatic_launch : bool
        Programmatic dependent launch, as in :class:`~dcpkit.ops.QGather` (needs compute
        capability 9.0+ and cuda.bindings; default False: a plain launch).
    _self_check : bool
        Benchmark only: as in :class:`~dcpkit.ops.QGather`.

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
    REG_SOURCES : int
        Worlds of at most this many ranks build the kernels with the register merge
        (``-DDCPKIT_LSE_REG_SOURCES``; class attribute, 0 for the warp merge everywhere).

    Notes
    -----
    Output lifetime. With ``out=`` the result is written there. Otherwise it lands in a
    workspace output buffer: an eager call's result stays valid while it is consumed on the
    same stream before call ``n + 2`` of the same ubatch is issued (two buffers alternate); a
    call captured in a CUDA graph writes graph output buffers of its own (from the pool of
    ``graph_outputs``), valid until the next replay of the graph that captured the call. Copy
    the result to keep it longer.

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
    MissingDependency, DcpkitError, PeerError, ConfigMismatch
        As :class:`~dcpkit.ops.QGather`: CuPy missing, no CUDA GPU, another rank failing
        (its arguments, CuPy, its GPU or compiling the kernels), different geometries,
        ``num_ubatches`` or ``timeout_ms``.
    """

    op_name = "lse_reduce"
    size_arguments = "max_tokens, num_heads, head_dim"
    launches_per_call = 1
    THREADS = THREADS
    #: Worlds of at most this many ranks build the kernels with ``-DDCPKIT_LSE_REG_SOURCES``: the
    #: small instance merges in registers (kernels/lse_reduce.cu ``combine_rows_regs``, the bits
    #: of the warp merge in fewer dependent steps). 0, 1, 2, 4 or 8; 0: the warp merge for every
    #: world.
    REG_SOURCES = 4

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
        programmatic_launch: bool = False,
        _self_check: bool = True,
    ):
        self._closed = True
        # One exchange: which ranks rejected their arguments (or miss CuPy, a GPU, room in the
        # heap), and whether the geometries agree.
        self._setup_with(
            comm,
            locals(),
            "max_tokens, num_heads, head_dim, dtype, lse_base, return_lse",
            heap=heap,
        )
        op = self.op_name
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

    def _region_bytes(self) -> tuple[int, int]:
        """The slot and output bytes :meth:`_init_geometry` derived."""
        return self._slot_bytes_needed, self._out_bytes_needed

    # ------------------------------------------------------------------ construction helpers
    def _init_geometry(
        self,
        world_size: int,
        *,
        max_tokens,
        num_heads,
        head_dim,
        dtype,
        lse_base=math.e,
        return_lse=False,
    ) -> tuple:
        """Validate the constructor arguments and derive the layout (no GPU, no collective);
        returns the geometry every rank must agree on."""
        op = self.op_name
        self.max_tokens = check_positive_int(max_tokens, op, "max_tokens")
        self.num_heads = check_positive_int(num_heads, op, "num_heads")
        self.head_dim = check_positive_int(head_dim, op, "head_dim")
        for name, v in (("num_heads", self.num_heads), ("head_dim", self.head_dim)):
            if v > INT32_MAX:  # int parameters of the kernel
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
        if dt not in float_dtypes():
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
        if W * self.max_tokens * H_r > INT32_MAX:
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
        self._lse_dtypes = float_dtypes()
        # Every kernel's launcher by a small int (the plan holds it): a lookup by ``(lse dtype,
        # large)`` would build and hash that tuple, a NumPy dtype in it, on every call.
        kernels = [(d, large) for d in self._lse_dtypes for large in (False, True)]
        self._kernel_ids = {k: i for i, k in enumerate(kernels)}
        return (
            self.max_tokens,
            self.num_heads,
            self.head_dim,
            str(self.dtype),
            self.lse_base,
            self.return_lse,
        )

    def _kernel_options(self) -> tuple[str, ...]:
        """The options of :meth:`OpWorkspace._kernel_options`, then
        ``-DDCPKIT_LSE_REG_SOURCES=<REG_SOURCES>`` when the world has at most
        :attr:`REG_SOURCES` ranks (a module of its own: the options are part of its cache key)."""
        opts = super()._kernel_options()
        n = self.REG_SOURCES
        if type(n) is not int or n not in _REG_SOURCES:
            raise InvalidArgument(
                f"{self.op_name}: REG_SOURCES must be one of {list(_REG_SOURCES)} (got {n!r})"
            )
        W = getattr(self, "world_size", None)  # None: no group yet (nothing is built then)
        if n and W is not None and W <= n:
            opts += (f"-DDCPKIT_LSE_REG_SOURCES={n}",)
        return opts

    def _load_kernels(self) -> None:
        """Compile (one NVRTC run for the file, cached) and load the kernel of every lse dtype,
        and prebuild the constant kernel arguments."""
        import cupy

        self._cupy = cupy
        self._fn = {}
        with cupy.cuda.Device(self.device):
            for lse_dt in self._lse_dtypes:
                for large in (False, True):
                    raw = jit.get_kernel(
                        FILE, reduce_variant(self.dtype, lse_dt, large), self._kernel_options()
                    )
                    # the loaded cupy.cuda.function.Function
                    self._fn[lse_dt, large] = raw.kernel
            self._init_fast_path({self._kernel_ids[k]: fn for k, fn in self._fn.items()})
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
        self._grids = launch_table(W, H_r, self.max_tokens, self.max_ctas)

    def ctas_for(self, T: int) -> int:
        """The grid (CTA count, :attr:`THREADS` threads each) of a call with ``T`` tokens; the
        last ``min(grid, waiter_ctas)`` CTAs by index wait and combine."""
        return launch_config(
            self.world_size * int(T) * self.heads_per_rank, WARPS_PER_CTA, self.max_ctas
        )

    # ------------------------------------------------------------------ the call
    def _lse_keyed(self, key, arrays: tuple, ubatch, stream):
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
        dev = self._get_device()  # the launch path; the stream: as in GatherWorkspace._call_keyed
        if stream is None:
            stream = self._current_stream_fn(self.device)
        elif getattr(stream, "device_id", -1) not in (-1, self.device):
            _cuda.check_stream_device(stream, self.device, self.op_name)  # raises
        if plan.copy_input or self._debug or stream.is_capturing():
            return self._launch(plan, arrays[0], out, out_lse, stream)
        ub = plan.ubatch
        calls = self._calls
        n = calls[ub] + 1
        calls[ub] = n  # counted: a launch that raises below leaves the workspace unusable
        res, lse_res = out, out_lse
        # A field that holds the caller's pointer (or 0) was packed with it: every path writes
        # that same value. Only a field into a workspace output buffer is patched, by parity.
        if plan.needs_output:  # one of the two eager output buffers of the ubatch
            parity = n & 1
            views = plan.parity_views[parity]
            if views is None:
                base = self.output_ptr(ub, False)
                views = plan.parity_views[parity] = (base, base + self._out_part_bytes) + (
                    self._output_views(plan, base, self._eager_out[ub])
                )
            if not plan.out_ptr:
                plan.out_field.value = views[0]
                res = views[2]
            if plan.patch_lse:
                plan.lse_field.value = views[1]
                lse_res = views[3]
        if dev == self.device:
            try:
                self._launchers[plan.kernel].launch(plan.grid, plan.params, stream.ptr)
            except BaseException as e:
                self._launch_failed = f"{type(e).__name__}: {e}"
                raise
        else:
            self._run(plan.kernel, plan.grid, plan.params, stream)
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
            lse = self._memo_view(lse_ptr, (T, H_r), F32, T * H_r * 4, owner)
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
                self._kernel_ids[v.lse.dtype, False],
                0,
                None,
                None,
                None,
                debug_key,
                False,
                [None, None],
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
                out_ptr,  # the caller's out= / out_lse= (0: patched per call, or none)
                lse_ptr,
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
            self._kernel_ids[v.lse.dtype, self._grids[T][1]],
            self._grids[T][0],
            params,
            params.field(_OUT),
            params.field(_OUT_LSE),
            debug_key,
            v.want_lse and v.out_lse is None,
            [None, None],
        )

    def _validate(
        self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse
    ) -> CallArgs:
        """Every argument check of a call (:func:`~dcpkit.ops._lse_checks.validate_call`)."""
        return validate_call(
            self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse
        )

    def _empty_result(self, want_lse: bool, out, out_lse):
        """``T == 0``: ``out`` / ``out_lse`` (the caller's) or empty arrays; nothing launched."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            res = (
                out
                if out is not None
                else cupy.empty(
                    (0, self.heads_per_rank, self.head_dim), dtype=UINT[self.dtype.itemsize]
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
                xc = cupy.ascontiguousarray(src.view(UINT[self.dtype.itemsize]))
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
            lse_res = self._memo_view(lse_ptr, (T, H_r), F32, T * H_r * 4, owner)
        params[_OUT] = out_ptr
        params[_OUT_LSE] = lse_ptr
        self._run(plan.kernel, plan.grid, params, stream)
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
                if not c_contiguous(i) or i.ptr % (16 if name == "out" else 4):
                    return False
        return True
