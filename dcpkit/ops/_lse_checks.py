"""What :class:`~dcpkit.ops.LseReduce` and :func:`~dcpkit.ops.lse_combine` check: the dtypes
their kernels are built for, the layouts they read, and the full validation of a call (no GPU
needed: every check runs, and is tested, on CPU machines).

Messages follow ``"<op>: <argument> <property> must <constraint> (got <value>)"``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _strided
from .._arrays import ArrayInfo, array_info, check_device, check_dtype, check_ndim, check_shape
from .._overlap import check_disjoint, check_outside_workspace
from ..errors import InvalidArgument
from ..reference import resolve_dtype

__all__ = [
    "THREADS",
    "WARPS_PER_CTA",
    "SEND_ROWS",
    "LARGE_ROWS_PER_WARP_WIDE",
    "large_rows_per_warp",
    "MAX_WORLD_SIZE",
    "FILE",
    "BLOCK",
    "INT32_MAX",
    "F32",
    "I32",
    "UINT",
    "float_dtypes",
    "reduce_variant",
    "combine_variant",
    "c_contiguous",
    "check_contiguous",
    "CallArgs",
    "validate_call",
    "CombinePlan",
    "validate_combine",
]

#: Threads per CTA of both kernels (``lse_detail::kThreads`` in the kernel).
THREADS = 256
WARPS_PER_CTA = THREADS // 32
#: Rows a warp of the large kernel instance sends at once (``lse_detail::kSendRows``); the
#: large instance needs at least this many rows per warp (its own rows stay in the input).
SEND_ROWS = 4
#: Rows per warp from which a call of ``W`` ranks takes the large kernel instance, by world size:
#: SEND_ROWS at W <= 2, four times that from W = 3 on (:func:`large_rows_per_warp`).
LARGE_ROWS_PER_WARP_WIDE = 4 * SEND_ROWS
#: Largest world_size the merge handles (``lse_detail::kMaxSources``).
MAX_WORLD_SIZE = 64


def large_rows_per_warp(W: int) -> int:
    """Rows per warp of a call's grid (``W * T * H_r`` rows over its warps) from which it takes
    the large kernel instance. At W = 2 the large instance's own rows, which stay in the input
    instead of being copied into the own slot, are half the call's, and it is faster from
    SEND_ROWS rows per warp on; from W = 3 on they are a third or less, and the small instance
    (the register merge) measured faster up to 8 rows per warp (one H200, 4 ranks
    sharing it: T=8 13.4 -> 11.8 us, T=16 18.2 -> 16.8 us in a graph; docs/performance.md).
    Never below SEND_ROWS, the large instance's own bound."""
    return SEND_ROWS if W <= 2 else LARGE_ROWS_PER_WARP_WIDE


FILE = "lse_reduce.cu"
BLOCK = (THREADS,)
INT32_MAX = 2**31 - 1
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
UINT = {2: np.uint16, 4: np.uint32}  # byte containers of the float dtypes (copies, empties)


def float_dtypes() -> tuple[np.dtype, np.dtype, np.dtype]:
    """bfloat16, float16, float32: the output and lse dtypes the kernels are built for."""
    return (resolve_dtype("bfloat16"), np.dtype(np.float16), F32)


def cxx_type(dt: np.dtype) -> str:
    bf16, fp16, fp32 = float_dtypes()
    return {bf16: "dcpkit::bf16_t", fp16: "dcpkit::fp16_t", fp32: "float"}[dt]


def reduce_variant(out_dt: np.dtype, lse_dt: np.dtype, large: bool = False) -> str:
    """The lse_reduce kernel of these dtypes; ``large``: the instance with the batched send and
    the wide combine (kernels/lse_reduce.cu ``kLarge``)."""
    flag = "true" if large else "false"
    return f"dcpkit::lse_reduce_kernel<{cxx_type(out_dt)}, {cxx_type(lse_dt)}, {flag}>"


def combine_variant(out_dt: np.dtype) -> str:
    return f"dcpkit::lse_combine_kernel<{cxx_type(out_dt)}>"


def c_contiguous(info: ArrayInfo) -> bool:
    """C-contiguous (:func:`dcpkit._strided.c_contiguous`); an array without elements is
    contiguous whatever its strides, as NumPy and CuPy say (CuPy gives a fresh empty array zero
    strides)."""
    return 0 in info.shape or _strided.c_contiguous(info)


def check_contiguous(info: ArrayInfo, op: str, name: str) -> None:
    if not c_contiguous(info):
        raise InvalidArgument(
            f"{op}: {name} must be C-contiguous (got shape {info.shape}, "
            f"strides {info.strides} bytes)"
        )


def check_nonneg_strides(info: ArrayInfo, op: str, name: str) -> None:
    for n, s in zip(info.shape, info.strides):
        if n > 1 and s < 0:
            raise InvalidArgument(
                f"{op}: {name} strides must be non-negative (got {info.strides} bytes)"
            )


def check_index_array(x, op: str, name: str, dims: str, device: int) -> ArrayInfo:
    """An int32, 1-D, contiguous array on ``device`` (seq_lens, query_start_loc)."""
    info = array_info(x, op, name)
    if info.dtype != I32:
        check_dtype(info, (np.int32,), op, name)
    check_ndim(info, 1, dims, op, name)
    check_contiguous(info, op, name)
    check_device(info, device, op, name)
    return info


class CallArgs(NamedTuple):
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


def validate_call(
    self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse
) -> CallArgs:
    """Every argument check of a call of the :class:`~dcpkit.ops.LseReduce` ``self``; needs no
    GPU (tests call it on CPU machines). Messages name the op's arguments."""
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
    check_nonneg_strides(x, op, "out_partial")
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
    check_nonneg_strides(lse, op, "lse_partial")
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
    q = sl = None
    if query_start_loc is None:
        if seq_lens is not None:
            raise InvalidArgument(
                f"{op}: seq_lens requires query_start_loc (got query_start_loc=None)"
            )
    else:
        q = check_index_array(query_start_loc, op, "query_start_loc", "S+1", self.device)
        if q.shape[0] < 1:
            raise InvalidArgument(f"{op}: query_start_loc length must be >= 1 for [S+1] (got 0)")
        S = q.shape[0] - 1
        qsl_ptr = q.ptr
        if seq_lens is not None:
            sl = check_index_array(seq_lens, op, "seq_lens", "S", self.device)
            if sl.shape[0] != S:
                raise InvalidArgument(
                    f"{op}: seq_lens length must be len(query_start_loc) - 1 = {S} "
                    f"(got {sl.shape[0]})"
                )
            seq_ptr = sl.ptr

    def on_gpu(info: ArrayInfo, name: str) -> None:
        if info.device != self.device:
            check_device(info, self.device, op, name)

    o, ol = check_destinations(op, out, out_lse, dt, (T, H_r, D), on_gpu)
    if ol is not None and ol.ptr % 4:
        raise InvalidArgument(
            f"{op}: out_lse data pointer must be 4-byte aligned (got pointer offset {ol.ptr % 4})"
        )
    # out= / out_lse= over out_partial or lse_partial is an in-place call, which the kernel
    # serves (it reads the whole input before it writes an output); the masks are read while
    # the outputs are written, and the two outputs are written together.
    check_disjoint(op, (("out", o), ("out_lse", ol)), (("query_start_loc", q), ("seq_lens", sl)))
    check_outside_workspace(self, op, (("out", o), ("out_lse", ol)))
    return CallArgs(
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


def check_destinations(op: str, out, out_lse, dtype, shape: tuple, on_gpu) -> tuple:
    """``(ArrayInfo of out, ArrayInfo of out_lse)`` (None for an absent one) of a merge into
    ``out [T, H_r, D_v]`` of ``dtype`` (16-byte aligned) and float32 ``out_lse [T, H_r]``, each
    C-contiguous on the GPU ``on_gpu(info, name)`` checks. ``out_lse``'s alignment is left to
    the caller."""
    o = ol = None
    if out is not None:
        o = array_info(out, op, "out")
        if o.dtype != dtype:
            check_dtype(o, (dtype,), op, "out")
        if o.shape != shape:
            check_shape(o, shape, "T, H_r, D_v", op, "out")
        on_gpu(o, "out")
        check_contiguous(o, op, "out")
        if o.ptr % 16:
            raise InvalidArgument(
                f"{op}: out data pointer must be 16-byte aligned (got pointer offset {o.ptr % 16})"
            )
    if out_lse is not None:
        ol = array_info(out_lse, op, "out_lse")
        if ol.dtype != F32:
            check_dtype(ol, (np.float32,), op, "out_lse")
        if ol.shape != shape[:2]:
            check_shape(ol, shape[:2], "T, H_r", op, "out_lse")
        on_gpu(ol, "out_lse")
        check_contiguous(ol, op, "out_lse")
    return o, ol


class CombinePlan(NamedTuple):
    W: int
    T: int
    H_r: int
    D: int
    src_out: ArrayInfo
    src_lse: ArrayInfo
    out: ArrayInfo
    out_lse: ArrayInfo | None


def check_same_gpu(info: ArrayInfo, src_out: ArrayInfo, name: str) -> None:
    """lse_combine has no workspace: every array must live on ``src_out``'s GPU."""
    if info.device != src_out.device:
        raise InvalidArgument(
            f"lse_combine: {name} device must be src_out's GPU "
            f"{src_out.device} (got GPU {info.device})"
        )


def validate_combine(src_out, src_lse, out, out_lse) -> CombinePlan:
    """Argument checks of :func:`lse_combine` (no GPU needed)."""
    op = "lse_combine"
    so = array_info(src_out, op, "src_out")
    check_dtype(so, float_dtypes(), op, "src_out")
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
    check_contiguous(so, op, "src_out")
    if so.ptr % 16:
        raise InvalidArgument(
            f"{op}: src_out data pointer must be 16-byte aligned (got pointer offset {so.ptr % 16})"
        )
    sl = array_info(src_lse, op, "src_lse")
    check_dtype(sl, (np.float32,), op, "src_lse")
    check_shape(sl, (W, T, H_r), "W, T, H_r", op, "src_lse")
    check_contiguous(sl, op, "src_lse")
    check_same_gpu(sl, so, "src_lse")
    o, ol = check_destinations(
        op, out, out_lse, so.dtype, (T, H_r, D), lambda info, name: check_same_gpu(info, so, name)
    )
    if sl.ptr % 4 or (ol is not None and ol.ptr % 4):
        raise InvalidArgument(f"{op}: src_lse and out_lse must be 4-byte aligned")
    check_disjoint(op, (("out", o), ("out_lse", ol)), (("src_out", so), ("src_lse", sl)))
    return CombinePlan(W, T, H_r, D, so, sl, o, ol)
