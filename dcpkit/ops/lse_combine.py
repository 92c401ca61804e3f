"""lse_combine: the LSE-weighted merge of ``W`` partial outputs on one GPU (no communication),
the merge of :class:`~dcpkit.ops.LseReduce` alone. The NCCL fallback runs it after its
``all_to_all``; kernel ``lse_combine_kernel`` in ``kernels/lse_reduce.cu``.
"""

from __future__ import annotations

import numpy as np

from .. import _cuda, jit
from ._lse_checks import BLOCK, FILE, WARPS_PER_CTA, combine_variant, validate_combine
from ._workspace import launch_config

__all__ = ["lse_combine"]


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
    plan = validate_combine(src_out, src_lse, out, out_lse)
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
            # The default build, the warp merge for every W: this merge follows an NCCL
            # all_to_all, next to which LseReduce's register merge (-DDCPKIT_LSE_REG_SOURCES)
            # is not worth a second module (not measured).
            fn = _COMBINE_FNS[key] = jit.get_kernel(FILE, combine_variant(key[1])).kernel
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
        fn(grid, BLOCK, args, shared_mem=0, stream=stream)  # None: the current stream
    else:
        with cupy.cuda.Device(dev):
            fn(grid, BLOCK, args, shared_mem=0, stream=stream)
    return out if out_lse is None else (out, out_lse)


#: (device, output dtype) -> loaded lse_combine kernel (cupy.cuda.function.Function).
_COMBINE_FNS: dict = {}
