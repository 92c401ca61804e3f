"""The strided copy: ``dst[...] = src[...]`` for GPU arrays of any strides, in one kernel.

The NCCL ops use it to reorder heads and to copy strided inputs and outputs, and
:class:`~dcpkit.manager.DCPComm` to give the direct ops a layout they read in place. The
planning (:func:`copy_plan` and the two head reorders) is pure Python, tested on the CPU; the
kernel is ``fallback_copy_kernel`` of ``kernels/fallback.cu``, instantiated for elements of 1,
2, 4, 8 and 16 bytes. Also here: :func:`c_contiguous`, the layout test every caller shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from . import _cuda, jit
from ._arrays import ArrayInfo, array_info
from ._checks import COPY_ITEMSIZES
from ._overlap import check_disjoint, check_writable_layout
from .errors import InvalidArgument

__all__ = [
    "CopyPlan",
    "copy_plan",
    "owner_to_heads_plan",
    "heads_to_owner_plan",
    "strided_copy",
    "copy_arrays",
    "launch_copy",
    "load_copy_kernels",
    "c_contiguous",
    "grid",
    "THREADS",
    "KERNEL_FILE",
]

#: The kernel file of the strided copy (and of the NCCL ops' local kernels).
KERNEL_FILE = "fallback.cu"
#: Threads per CTA of the kernels of ``kernels/fallback.cu``.
THREADS = 256
_MAX_CTAS = 4096
#: C++ element type of the copy kernel, by element size in bytes.
_COPY_TYPES = dict(
    zip(COPY_ITEMSIZES, ("unsigned char", "unsigned short", "unsigned int", "uint2", "uint4"))
)


def c_contiguous(info: ArrayInfo) -> bool:
    """C-contiguous (dimensions of extent 1 may have any stride)."""
    want = info.itemsize
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def grid(n: int, per_cta: int = THREADS) -> tuple[int]:
    """The grid of a kernel of ``kernels/fallback.cu`` over ``n`` items (grid-stride loops)."""
    return (max(1, min(_MAX_CTAS, -(-int(n) // per_cta))),)


class CopyPlan(NamedTuple):
    """A 4-D copy in units of ``elem_bytes`` (1, 2, 4, 8 or 16)."""

    elem_bytes: int
    shape: tuple[int, int, int, int]
    dst_strides: tuple[int, int, int, int]  # in elements of elem_bytes
    src_strides: tuple[int, int, int, int]


def copy_plan(
    shape: Sequence[int],
    dst_strides: Sequence[int],
    src_strides: Sequence[int],
    itemsize: int,
    dst_ptr: int,
    src_ptr: int,
) -> CopyPlan:
    """Plan ``dst[...] = src[...]`` over ``shape`` (up to 4 dims, strides in bytes) with the
    widest element (up to 16 bytes) that the pointers, the strides and a contiguous innermost
    run allow. Pure Python (tested on CPU).

    Raises
    ------
    InvalidArgument
        More than 4 dimensions, or a strided innermost dimension whose itemsize is not 1, 2, 4,
        8 or 16 bytes or whose pointers / strides are not multiples of the itemsize.
    """
    nd = len(shape)
    if nd > 4 or len(dst_strides) != nd or len(src_strides) != nd:
        raise InvalidArgument(
            f"strided_copy: shape must have at most 4 dimensions with one "
            f"stride each (got shape {tuple(shape)})"
        )
    shp = [1] * (4 - nd) + [int(n) for n in shape]
    ds = [0] * (4 - nd) + [int(s) for s in dst_strides]
    ss = [0] * (4 - nd) + [int(s) for s in src_strides]
    # strides of extent-1 dimensions never matter
    ds = [0 if n == 1 else s for n, s in zip(shp, ds)]
    ss = [0 if n == 1 else s for n, s in zip(shp, ss)]
    inner_contig = shp[3] == 1 or (ds[3] == itemsize and ss[3] == itemsize)
    if inner_contig:
        run = shp[3] * itemsize
        for v in (16, 8, 4, 2, 1):
            vals = [run, dst_ptr, src_ptr] + ds[:3] + ss[:3]
            if all(x % v == 0 for x in vals):
                return CopyPlan(
                    v,
                    (shp[0], shp[1], shp[2], run // v),
                    (ds[0] // v, ds[1] // v, ds[2] // v, 1),
                    (ss[0] // v, ss[1] // v, ss[2] // v, 1),
                )
    v = int(itemsize)
    if v not in _COPY_TYPES or any(x % v for x in [dst_ptr, src_ptr] + ds + ss):
        raise InvalidArgument(
            f"strided_copy: a strided innermost dimension needs an itemsize "
            f"of 1, 2, 4, 8 or 16 bytes and pointers and strides that are "
            f"multiples of it (got itemsize {itemsize}, strides {tuple(ds)} "
            f"and {tuple(ss)} bytes)"
        )
    return CopyPlan(v, tuple(shp), tuple(x // v for x in ds), tuple(x // v for x in ss))


def owner_to_heads_plan(
    W: int,
    T: int,
    H_r: int,
    D: int,
    itemsize: int,
    out_strides: Sequence[int],
    out_ptr: int,
    src_ptr: int,
) -> CopyPlan:
    """Plan of the q_gather reorder: the contiguous all-gather result ``[W, T, H_r, D]`` into
    ``out[t, s*H_r + j, d]`` (``out`` ``[T, H, D]`` with byte strides ``out_strides``)."""
    st, sh, sd = out_strides
    isz = itemsize
    return copy_plan(
        (W, T, H_r, D),
        (H_r * sh, st, sh, sd),
        (T * H_r * D * isz, H_r * D * isz, D * isz, isz),
        isz,
        out_ptr,
        src_ptr,
    )


def heads_to_owner_plan(
    W: int,
    T: int,
    H_r: int,
    D: int,
    itemsize: int,
    x_strides: Sequence[int],
    dst_ptr: int,
    x_ptr: int,
) -> CopyPlan:
    """Plan of the lse_reduce all_to_all pack: ``x[t, s*H_r + j, d]`` (``x`` ``[T, H, D]``
    with byte strides ``x_strides``) into the contiguous per-owner blocks ``[W, T, H_r, D]``."""
    st, sh, sd = x_strides
    isz = itemsize
    return copy_plan(
        (W, T, H_r, D),
        (T * H_r * D * isz, H_r * D * isz, D * isz, isz),
        (H_r * sh, st, sh, sd),
        isz,
        dst_ptr,
        x_ptr,
    )


_COPY_KERNELS: dict[int, dict[int, object]] = {}


def load_copy_kernels(device: int) -> dict[int, object]:
    """The copy kernels on ``device``, by element size (compiled once per process by
    :mod:`dcpkit.jit`, cached on disk by CuPy). Load them before a capture: the copy itself
    allocates nothing.

    Raises
    ------
    MissingDependency, DcpkitError, CompileError
        No CuPy, no GPU, or NVRTC failed.
    """
    k = _COPY_KERNELS.get(device)
    if k is None:
        cupy = _cuda.require_cupy()
        _cuda.require_device(f"loading kernels/{KERNEL_FILE}", device)
        with cupy.cuda.Device(device):
            k = {
                b: jit.get_kernel(KERNEL_FILE, f"dcpkit::fallback_copy_kernel<{t}>").kernel
                for b, t in _COPY_TYPES.items()
            }
        _COPY_KERNELS[device] = k
    return k


def strided_copy(dst, src, stream=None) -> None:
    """``dst[...] = src[...]`` for GPU arrays of the same shape (up to 4-D) and itemsize, any
    strides (a bit copy: dtypes may differ if their itemsizes match). One kernel, allocates
    nothing (capture-safe once the kernels are loaded).

    Stream: enqueued on ``stream`` (default: the current CuPy stream).

    Raises
    ------
    InvalidType, InvalidArgument
        Host arrays, different shapes or itemsizes, arrays on different GPUs, ``dst`` sharing
        memory with ``src`` (unless both describe the very same elements), elements of ``dst``
        that overlap one another, a ``stream`` that is not a CuPy stream.
    MissingDependency
        CuPy is not installed.
    """
    di = array_info(dst, "strided_copy", "dst")
    si = array_info(src, "strided_copy", "src")
    check_writable_layout("strided_copy", "dst", di)
    if (di.ptr, di.shape, di.strides) != (si.ptr, si.shape, si.strides):
        check_disjoint("strided_copy", (("dst", di),), (("src", si),))
    _cuda.check_stream(stream, "strided_copy")
    copy_arrays(di, si, stream)


def copy_arrays(di: ArrayInfo, si: ArrayInfo, stream) -> None:
    """:func:`strided_copy` of two described arrays (:func:`~dcpkit._arrays.array_info`)."""
    if di.shape != si.shape or di.itemsize != si.itemsize:
        raise InvalidArgument(
            f"strided_copy: dst and src must have the same shape and itemsize "
            f"(got {di.shape}/{di.itemsize} and {si.shape}/{si.itemsize})"
        )
    if di.device != si.device:
        raise InvalidArgument(
            f"strided_copy: src device must be dst's GPU {di.device} (got GPU {si.device})"
        )
    n = 1
    for x in di.shape:
        n *= x
    if n == 0:
        return
    p = copy_plan(di.shape, di.strides, si.strides, di.itemsize, di.ptr, si.ptr)
    launch_copy(di.device, p, di.ptr, si.ptr, stream)


def launch_copy(device: int, p: CopyPlan, dst_ptr: int, src_ptr: int, stream) -> None:
    """Enqueue the copy ``p`` on ``stream`` (one kernel; nothing for an empty plan)."""
    n = p.shape[0] * p.shape[1] * p.shape[2] * p.shape[3]
    if n == 0:
        return
    fn = load_copy_kernels(device)[p.elem_bytes]
    args = (
        (np.uint64(dst_ptr), np.uint64(src_ptr))
        + tuple(np.int64(x) for x in p.shape)
        + tuple(np.int64(x) for x in p.dst_strides)
        + tuple(np.int64(x) for x in p.src_strides)
    )
    fn(grid(n), (THREADS,), args, shared_mem=0, stream=stream)
