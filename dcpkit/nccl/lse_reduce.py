"""``lse_reduce`` on NCCL, with a choice of three algorithms (:class:`NcclLseReduce`), and the
buffer layouts of those algorithms (:func:`lse_layout`, pure; tested on the CPU)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import _cuda, jit
from .._arrays import ArrayInfo
from .._checks import (
    INT32_MAX,
    check_bool,
    check_lse_base,
    check_masks,
    check_positive_int,
    cxx_type,
    float_dtypes,
    lse_dtypes,
    resolve_float_dtype,
)
from .._lse_call import LseReduceCall
from .._overlap import check_disjoint, check_writable_layout, shares_memory
from .._strided import KERNEL_FILE, THREADS, c_contiguous, grid, heads_to_owner_plan, launch_copy
from ..comm import Communicator
from ..errors import InvalidArgument
from .base import NcclOp
from .group import NcclGroup

__all__ = ["NcclLseReduce", "LSE_ALGORITHMS", "LseLayout", "lse_layout", "load_lse_kernels"]

#: The lse_reduce algorithms of :class:`NcclLseReduce`.
LSE_ALGORITHMS = ("all_to_all", "allgather_reduce_scatter", "allgather_all_reduce")
_F32 = np.dtype(np.float32)


class LseLayout(NamedTuple):
    """Where the kernels of one NcclLseReduce algorithm put things (element units)."""

    mask_offset: int  # float32 elements from the lse buffer start to the masked own lse
    mask_ss: int  # masked lse of head s*H_r + j, token t at s*mask_ss + t*mask_st + j
    mask_st: int
    y_ss: int  # scaled output of head s*H_r + j at s*y_ss + t*y_st + j*D + d
    y_st: int
    lse_h0: int  # heads whose merged lse the weight kernel writes: [lse_h0, lse_h1)
    lse_h1: int


def lse_layout(algorithm: str, rank: int, world_size: int, T: int, H: int, D: int) -> LseLayout:
    """The buffer layouts of :class:`NcclLseReduce` (pure; tested on CPU).

    * ``all_to_all``: masked lse in owner order ``[W, T, H_r]`` (the send buffer).
    * ``allgather_*``: masked own lse ``[T, H]`` at slot ``rank`` of the gathered
      ``[W, T, H]``; the scaled output ``y`` in owner order ``[W, T, H_r, D]`` for the
      reduce-scatter, ``[T, H, D]`` for the all-reduce.
    """
    H_r = H // world_size
    if algorithm == "all_to_all":
        return LseLayout(0, T * H_r, H_r, 0, 0, 0, 0)
    if algorithm == "allgather_all_reduce":
        return LseLayout(rank * T * H, H_r, H, H_r * D, H * D, 0, H)
    return LseLayout(rank * T * H, H_r, H, T * H_r * D, H_r * D, rank * H_r, (rank + 1) * H_r)


class LseKernels(NamedTuple):
    """The loaded lse kernels of ``kernels/fallback.cu`` on one device, by dtype."""

    mask: dict[np.dtype, object]  # lse -> float32 natural log, masked; by lse dtype
    weight: dict[np.dtype, object]  # weights times out_partial (fp32); by output dtype
    cast: dict[np.dtype, object]  # fp32 sum -> the output dtype


_LSE_KERNELS: dict[int, LseKernels] = {}


def load_lse_kernels(device: int) -> LseKernels:
    """The lse kernels on ``device`` (compiled once per process, cached on disk by CuPy)."""
    k = _LSE_KERNELS.get(device)
    if k is None:
        cupy = _cuda.require_cupy()
        _cuda.require_device(f"loading kernels/{KERNEL_FILE}", device)

        def load(kind: str, dtypes):
            return {
                dt: jit.get_kernel(
                    KERNEL_FILE, f"dcpkit::fallback_{kind}_kernel<{cxx_type(dt)}>"
                ).kernel
                for dt in dtypes
            }

        with cupy.cuda.Device(device):
            k = LseKernels(
                load("lse_mask", lse_dtypes()),
                load("lse_weight", float_dtypes()),
                load("cast", float_dtypes()),
            )
        _LSE_KERNELS[device] = k
    return k


class NcclLseReduce(LseReduceCall, NcclOp):
    """``lse_reduce`` on NCCL, with a choice of three algorithms.

    Naive equivalent (every rank ``r``)::

        l   = where(isnan(lse) | (lse == +inf), -inf, lse * ln(lse_base)), masked rows -inf
        m   = max over ranks of l;  w_s = exp(l_s - m) / sum_j exp(l_j - m)   (0 if m == -inf)
        out = sum_s w_s * out_partial_s   over the heads of rank r   (fp32, zero-weight sources
                                                                       never read)
        lse = m + log(sum_s exp(l_s - m))

    The merge of split-KV (flash-decoding) partials as used for decode context parallelism;
    here built from NCCL collectives (module docstring: ``all_to_all``,
    ``allgather_reduce_scatter``, ``allgather_all_reduce``).

    Parameters
    ----------
    comm, max_tokens, num_ubatches, nccl_group
        As :class:`~dcpkit.nccl.NcclQGather`.
    num_heads : int
        ``H``, a multiple of ``world_size``.
    head_dim : int
        ``D_v``. With ``algorithm="all_to_all"`` ``D_v * itemsize`` must be a multiple of 16.
    dtype : str or dtype
        bfloat16, float16 or float32: dtype of ``out_partial`` and of the result.
    lse_base : float
        ``math.e`` (default) or ``2``: base of ``lse_partial``.
    return_lse : bool
        Also return the merged natural-log lse from every call.
    timeout_ms, heap
        Accepted for signature compatibility with :class:`~dcpkit.ops.LseReduce`; unused.
    algorithm : str
        ``"all_to_all"`` (default), ``"allgather_reduce_scatter"`` or ``"allgather_all_reduce"``.

    Attributes
    ----------
    heads_per_rank : int
        ``H_r``.
    out_heads : int
        Heads of the result: ``H_r``, or ``H`` for ``"allgather_all_reduce"``.
    path, algorithm : str
        ``"nccl"`` and the algorithm.
    launches_per_call : int
        Kernels plus NCCL calls per call (all_to_all: mask, pack, 2 copies, 1 NCCL group,
        combine = 6; the all-gather variants: mask, all-gather, weight, reduce, cast = 5).

    Calls
    -----
    ``op(out_partial, lse_partial, *, seq_lens=None, query_start_loc=None, ubatch=0, out=None,
    out_lse=None, stream=None)`` takes the arguments of :meth:`LseReduce.__call__
    <dcpkit.ops.LseReduce.__call__>`, and more layouts: ``out_partial [T, H, D_v]`` (the
    workspace dtype) with any strides; ``lse_partial [T, H]`` bfloat16, float16, float32 or
    float64, any strides; ``out [T, H_out, D_v]`` and float32 ``out_lse [T, H_out]``
    (``H_out = out_heads``) with any strides. The result holds heads ``[rank*H_r,
    (rank+1)*H_r)`` (all heads for ``allgather_all_reduce``): ``out=`` or a view of a
    workspace buffer (lifetime: module docstring). Stream: on ``stream``, the host does not
    wait, capture-safe for ``T <= max_tokens``. A call raises :class:`InvalidArgument`,
    :class:`InvalidType` or :class:`ClosedError`.

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    InvalidArgument, InvalidType, MissingDependency, ConfigMismatch, PeerError
        As :class:`NcclQGather`; an unknown algorithm or ``lse_base``.
    """

    op_name = "lse_reduce"
    agreed_names = (
        "max_tokens, num_heads, head_dim, dtype, lse_base, return_lse, algorithm, num_ubatches"
    )

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
        algorithm: str = "all_to_all",
        nccl_group: NcclGroup | None = None,
    ):
        self._construct(locals())  # every keyword: none is left unchecked

    def _make_buffers(self) -> None:
        W, T = self.world_size, self.max_tokens
        H, H_r, Ho, D = self.num_heads, self.heads_per_rank, self.out_heads, self.head_dim
        isz = self.dtype.itemsize
        if self.algorithm == "all_to_all":
            from ..ops.lse_reduce import lse_combine

            self._combine = lse_combine
            self._send_out = self._per_ubatch(T * H * D * isz)
            self._recv_out = self._per_ubatch(T * H * D * isz)
            self._send_lse = self._per_ubatch(T * H * 4)
            self._recv_lse = self._per_ubatch(T * H * 4)
        else:
            self._lse_all = self._per_ubatch(W * T * H * 4)
            self._y = self._per_ubatch(T * H * D * 4)
            if self.algorithm == "allgather_reduce_scatter":
                self._rs = self._per_ubatch(T * H_r * D * 4)
        self._outs = self._result_slots(T * Ho * D * isz)
        self._lse_outs = self._result_slots(T * Ho * 4)

    @classmethod
    def _check_geometry(
        cls,
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
        algorithm="all_to_all",
    ) -> tuple[tuple, dict]:
        """Every check of the constructor keywords that needs no GPU and no collective; returns
        ``(agreed, geometry)`` as :meth:`NcclQGather._check_geometry`."""
        op = cls.op_name
        g = cls._check_common(world_size, max_tokens, num_ubatches, timeout_ms)
        W, T = g["world_size"], g["max_tokens"]
        H = g["num_heads"] = check_positive_int(num_heads, op, "num_heads", maximum=INT32_MAX)
        D = g["head_dim"] = check_positive_int(head_dim, op, "head_dim", maximum=INT32_MAX)
        if H % W:
            raise InvalidArgument(f"{op}: num_heads must be a multiple of world_size {W} (got {H})")
        dt = g["dtype"] = resolve_float_dtype(dtype, op)
        if algorithm not in LSE_ALGORITHMS:
            raise InvalidArgument(
                f"{op}: algorithm must be one of {list(LSE_ALGORITHMS)} (got {algorithm!r})"
            )
        g["algorithm"] = algorithm
        isz = dt.itemsize
        if algorithm == "all_to_all" and (D * isz) % 16:
            raise InvalidArgument(
                f"{op}: head_dim * itemsize must be a multiple of 16 bytes for "
                f"algorithm 'all_to_all' (got {D} * {isz}); use 'allgather_reduce_scatter'"
            )
        g["lse_base"] = check_lse_base(lse_base, op)
        g["return_lse"] = check_bool(return_lse, op, "return_lse")
        g["heads_per_rank"] = H // W
        Ho = g["out_heads"] = H if algorithm == "allgather_all_reduce" else H // W
        g["launches_per_call"] = 6 if algorithm == "all_to_all" else 5
        g["_scale"] = np.float32(1.0 if g["lse_base"] == math.e else math.log(2.0))
        g["_row_bytes"] = D * isz
        if algorithm == "all_to_all":
            scratch = 2 * T * H * D * isz + 2 * T * H * 4
        else:
            scratch = W * T * H * 4 + T * H * D * 4 + T * (H // W) * D * 4
        cls._check_buffer_bytes(
            g["num_ubatches"],
            scratch + 3 * T * Ho * (D * isz + 4),
            "max_tokens, num_heads, head_dim",
        )
        return (T, H, D, str(dt), g["lse_base"], g["return_lse"], algorithm, g["num_ubatches"]), g

    def _load_kernels(self) -> None:
        """The copy kernels, and the mask, weight and cast kernels of ``kernels/fallback.cu``."""
        super()._load_kernels()
        self._k = load_lse_kernels(self.device)

    def _free_buffers(self) -> None:
        for name in (
            "_send_out",
            "_recv_out",
            "_send_lse",
            "_recv_lse",
            "_lse_all",
            "_y",
            "_rs",
            "_outs",
            "_lse_outs",
        ):
            if hasattr(self, name):
                setattr(self, name, None)

    def _warmup_call(self, T: int) -> None:
        cupy = self._cupy
        x = cupy.zeros((T, self.num_heads, self._row_bytes), dtype=cupy.uint8).view(self.dtype)
        lse = cupy.zeros((T, self.num_heads), dtype=cupy.float32)
        self._call(x, lse, None, None, 0, None, None, None)

    def _lse_keyed(self, key, arrays: tuple, ubatch, stream):
        """:class:`~dcpkit._lse_call.LseReduceCall`'s entry (``key`` unused): the open check,
        then :meth:`_call`."""
        self.check_open()
        x, lse, seq, qsl, out, out_lse = arrays
        return self._call(x, lse, seq, qsl, ubatch, out, out_lse, stream)

    def _call(
        self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse, stream
    ):
        op = self.op_name
        u = self.check_ubatch(ubatch)
        H, D, Ho = self.num_heads, self.head_dim, self.out_heads
        dt, isz = self.dtype, self.dtype.itemsize
        x = self._checked(out_partial, "out_partial", (None, H, D), "T, H, D_v", dtype_first=True)
        T = x.shape[0]
        li = self._checked(
            lse_partial, "lse_partial", (T, H), "T, H", lse_dtypes(), dtype_first=True
        )
        for name, info in (("out_partial", x), ("lse_partial", li)):
            if any(s % info.itemsize for s in info.strides):
                raise InvalidArgument(
                    f"{op}: {name} strides must be multiples of its itemsize "
                    f"{info.itemsize} bytes (got {info.strides})"
                )
        S, qsl_ptr, seq_ptr = check_masks(op, seq_lens, query_start_loc, self.device)
        oi = oli = None
        if out is not None:
            oi = self._checked(out, "out", (T, Ho, D), "T, H_out, D_v", dtype_first=True)
        if out_lse is not None:
            oli = self._checked(
                out_lse, "out_lse", (T, Ho), "T, H_out", (np.float32,), dtype_first=True
            )
        masks = [
            (n, self._info(a, n))
            for n, a in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens))
            if a is not None
        ]
        check_disjoint(op, (("out", oi), ("out_lse", oli)), masks)
        check_writable_layout(op, "out", oi)
        check_writable_layout(op, "out_lse", oli)
        # An in-place call (an output over out_partial or lse_partial, which the NCCL kernels
        # read while they write the outputs): the results go to the workspace buffers first and
        # are copied into the caller's arrays at the end, after every read of the inputs.
        in_place = any(o is not None and shares_memory(o, i) for o in (oi, oli) for i in (x, li))
        want_lse = self.return_lse or out_lse is not None
        stream = self.get_stream(stream)
        if T == 0:
            res = out if out is not None else self._view(self._outs[u][0], (0, Ho, D), dt)
            if not want_lse:
                return res
            lres = (
                out_lse if out_lse is not None else self._view(self._lse_outs[u][0], (0, Ho), _F32)
            )
            return res, lres
        key = (T, str(dt), str(li.dtype), u, qsl_ptr != 0, seq_ptr != 0)
        idx, _ = self._begin(u, T, stream, key)

        # destinations: the caller's arrays when C-contiguous (and 16-byte aligned for the
        # merge), else workspace buffers copied out at the end
        obuf = self._out_buffer(self._outs, u, idx, T, T * Ho * D * isz, stream)
        ws_out = self._view(obuf, (T, Ho, D), dt)
        dst = (
            oi
            if (oi is not None and not in_place and c_contiguous(oi) and oi.ptr % 16 == 0)
            else self._info(ws_out, "out")
        )
        ldst = None
        ws_lse = None
        if want_lse:
            lbuf = self._out_buffer(self._lse_outs, u, idx, T, T * Ho * 4, stream)
            ws_lse = self._view(lbuf, (T, Ho), _F32)
            ldst = (
                oli
                if (oli is not None and not in_place and c_contiguous(oli) and oli.ptr % 4 == 0)
                else self._info(ws_lse, "out_lse")
            )

        lse_args = (li, qsl_ptr, seq_ptr, S)
        if self.algorithm == "all_to_all":
            self._all_to_all(u, T, x, lse_args, dst, ldst, stream)
        else:
            self._all_gather_lse(u, T, x, lse_args, dst, ldst, stream)

        # results
        if oi is None:
            res = ws_out
        else:
            if dst is not oi:
                self._copy(oi, dst, stream)
            res = out
        if not want_lse:
            return res
        if oli is None:
            return res, ws_lse
        if ldst is not oli:
            self._copy(oli, ldst, stream)
        return res, out_lse

    # ------------------------------------------------------------------ pieces
    def _mask(self, T: int, lse_args, dst_ptr: int, dst_ss: int, dst_st: int, stream) -> None:
        li, qsl_ptr, seq_ptr, S = lse_args
        H, H_r = self.num_heads, self.heads_per_rank
        l_st = li.strides[0] // li.itemsize if T > 1 else 0
        l_sh = li.strides[1] // li.itemsize if H > 1 else 0
        args = (
            np.uint64(dst_ptr),
            np.int64(dst_ss),
            np.int64(dst_st),
            np.uint64(li.ptr),
            np.int64(l_st),
            np.int64(l_sh),
            np.uint64(qsl_ptr),
            np.uint64(seq_ptr),
            np.int32(S),
            np.int32(T),
            np.int32(H),
            np.int32(H_r),
            self._scale,
        )
        self._k.mask[li.dtype](grid(T * H), (THREADS,), args, shared_mem=0, stream=stream)

    def _shape(self) -> tuple[int, int, int, int, int]:
        """``(W, H, D_v, H_r, rank)``."""
        return (self.world_size, self.num_heads, self.head_dim, self.heads_per_rank, self.rank)

    def _all_to_all(
        self, u: int, T: int, x: ArrayInfo, lse_args, dst: ArrayInfo, ldst: ArrayInfo | None, stream
    ) -> None:
        W, H, D, H_r, r = self._shape()
        isz = self.dtype.itemsize
        nccl, mod, sp = self._nccl, self._nccl_mod, stream.ptr
        blk = T * H_r * D * isz  # one owner's payload
        lblk = T * H_r * 4  # one owner's lse
        send_out = self._scratch(self._send_out, u, T, W * blk, stream)
        recv_out = self._scratch(self._recv_out, u, T, W * blk, stream)
        send_lse = self._scratch(self._send_lse, u, T, W * lblk, stream)
        recv_lse = self._scratch(self._recv_lse, u, T, W * lblk, stream)
        so, ro = send_out.data.ptr, recv_out.data.ptr
        sl, rl = send_lse.data.ptr, recv_lse.data.ptr
        # lse -> float32 natural log, masked, owner order [W, T, H_r]
        lay = lse_layout(self.algorithm, r, W, T, H, D)
        self._mask(T, lse_args, sl + 4 * lay.mask_offset, lay.mask_ss, lay.mask_st, stream)
        # payload: owner's head slice, [W, T, H_r, D]
        st, sh, sd = x.strides
        if T == 1 and (H == 1 or sh == D * isz) and (D == 1 or sd == isz):
            src_base, src_blk = x.ptr, H_r * D * isz  # already owner-major
        else:
            p = heads_to_owner_plan(W, T, H_r, D, isz, x.strides, so, x.ptr)
            launch_copy(self.device, p, so, x.ptr, stream)
            src_base, src_blk = so, blk
        # own slice: a local copy; every peer: one send and one recv of payload and of lse
        rt = self._cupy.cuda.runtime
        rt.memcpyAsync(ro + r * blk, src_base + r * src_blk, blk, rt.memcpyDeviceToDevice, sp)
        rt.memcpyAsync(rl + r * lblk, sl + r * lblk, lblk, rt.memcpyDeviceToDevice, sp)
        if W > 1:
            mod.groupStart()
            try:
                for s in range(W):
                    if s == r:
                        continue
                    nccl.send(src_base + s * src_blk, blk, mod.NCCL_UINT8, s, sp)
                    nccl.recv(ro + s * blk, blk, mod.NCCL_UINT8, s, sp)
                    nccl.send(sl + s * lblk, T * H_r, mod.NCCL_FLOAT32, s, sp)
                    nccl.recv(rl + s * lblk, T * H_r, mod.NCCL_FLOAT32, s, sp)
            finally:
                mod.groupEnd()
        src_out = self._view(recv_out, (W, T, H_r, D), self.dtype)
        src_lse = self._view(recv_lse, (W, T, H_r), _F32)
        self._combine(src_out, src_lse, dst.obj, None if ldst is None else ldst.obj, stream=stream)

    def _all_gather_lse(
        self, u: int, T: int, x: ArrayInfo, lse_args, dst: ArrayInfo, ldst: ArrayInfo | None, stream
    ) -> None:
        W, H, D, H_r, r = self._shape()
        dt, isz = self.dtype, self.dtype.itemsize
        nccl, mod, sp = self._nccl, self._nccl_mod, stream.ptr
        all_reduce = self.algorithm == "allgather_all_reduce"
        lse_all = self._scratch(self._lse_all, u, T, W * T * H * 4, stream)
        y = self._scratch(self._y, u, T, T * H * D * 4, stream)
        la = lse_all.data.ptr
        lay = lse_layout(self.algorithm, r, W, T, H, D)
        # own lse, masked, [T, H], straight into its place of the gathered [W, T, H]
        own = la + 4 * lay.mask_offset
        self._mask(T, lse_args, own, lay.mask_ss, lay.mask_st, stream)
        nccl.allGather(own, la, T * H, mod.NCCL_FLOAT32, sp)
        # y = w_r * out_partial (fp32), owner-major for the reduce-scatter
        y_ss, y_st, h0, h1 = lay.y_ss, lay.y_st, lay.lse_h0, lay.lse_h1
        st, sh, sd = (s // isz for s in x.strides)
        st = st if T > 1 else 0
        lse_ptr, lse_st = (
            (0, 0) if ldst is None else (ldst.ptr, ldst.strides[0] // 4 if T > 1 else 0)
        )
        assert ldst is None or ldst.shape[1] <= 1 or ldst.strides[1] == 4  # C-contiguous
        args = (
            np.uint64(y.data.ptr),
            np.int64(y_ss),
            np.int64(y_st),
            np.uint64(x.ptr),
            np.int64(st),
            np.int64(sh),
            np.int64(sd),
            np.uint64(la),
            np.uint64(lse_ptr),
            np.int64(lse_st),
            np.int32(h0),
            np.int32(h1),
            np.int32(W),
            np.int32(r),
            np.int32(T),
            np.int32(H),
            np.int32(H_r),
            np.int32(D),
        )
        self._k.weight[dt](grid(T * H * 32), (THREADS,), args, shared_mem=0, stream=stream)
        # fp32 sum; then the cast to the dtype (skipped when the result is fp32 already)
        direct_f32 = dt == _F32 and c_contiguous(dst)
        Hx = H if all_reduce else H_r
        if all_reduce:
            target = dst.ptr if direct_f32 else y.data.ptr
            nccl.allReduce(y.data.ptr, target, T * H * D, mod.NCCL_FLOAT32, mod.NCCL_SUM, sp)
            src = y.data.ptr
        else:
            rs = self._scratch(self._rs, u, T, T * H_r * D * 4, stream)
            target = dst.ptr if direct_f32 else rs.data.ptr
            nccl.reduceScatter(y.data.ptr, target, T * H_r * D, mod.NCCL_FLOAT32, mod.NCCL_SUM, sp)
            src = rs.data.ptr
        if direct_f32:
            return
        o_st, o_sh, o_sd = (s // isz for s in dst.strides)
        args = (
            np.uint64(dst.ptr),
            np.int64(o_st),
            np.int64(o_sh),
            np.int64(o_sd),
            np.uint64(src),
            np.int32(T),
            np.int32(Hx),
            np.int32(D),
        )
        self._k.cast[dt](grid(T * Hx * D), (THREADS,), args, shared_mem=0, stream=stream)
