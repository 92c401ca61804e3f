"""The three ops on NCCL (through CuPy's ``cupy.cuda.nccl``): the fallback of
:class:`~dcpkit.manager.DCPComm` and the baseline of the benchmark.

Each class takes the constructor keywords and the call signature of its direct op
(:class:`~dcpkit.ops.QGather`, :class:`~dcpkit.ops.KVGather`, :class:`~dcpkit.ops.LseReduce`) and
returns the same result: bit for bit for the gathers, within
:func:`dcpkit.reference.lse_reduce_tolerance` for ``lse_reduce``. Usage, on every rank::

    group = NcclGroup(comm)                         # one NCCL communicator, shared (optional)
    qg = NcclQGather(comm, max_tokens=128, heads_per_rank=32, head_dim=576,
                     dtype="bfloat16", nccl_group=group)
    lr = NcclLseReduce(comm, max_tokens=128, num_heads=128, head_dim=512, dtype="bfloat16",
                       algorithm="all_to_all", nccl_group=group)
    q_all = qg(q)                                   # [T, H_r, D] -> [T, H, D]
    out = lr(out_partial, lse_partial)              # [T, H, D_v], [T, H] -> [T, H_r, D_v]
    ...
    lr.close(); qg.close(); group.close()           # collective

What runs per call (``W = world_size``, rank ``r``; kernels in ``kernels/fallback.cu``):

* ``NcclQGather``: ``q`` (copied to a contiguous buffer first if it is strided) is all-gathered
  into ``[W, T, H_r, D]``, then one strided copy puts it in ``[T, H, D]`` order. For ``T == 1``
  the two layouts coincide and NCCL gathers straight into the result.
* ``NcclKVGather``: one all-gather into ``[W*T, D_kv]``.
* ``NcclLseReduce``, ``algorithm=``

  - ``"all_to_all"`` (default): the lse is converted to float32 natural log and masked (NaN,
    +inf and masked rows become -inf) into ``[W, T, H_r]`` in owner order, the owner's head slice
    of ``out_partial`` is packed into ``[W, T, H_r, D_v]``; one NCCL group of send/recv pairs
    (two per peer: payload and lse) is the all-to-all; then
    :func:`dcpkit.ops.lse_reduce.lse_combine` (the direct op's merge) produces
    ``out [T, H_r, D_v]``. Needs ``D_v * itemsize`` to be a multiple of 16.
  - ``"allgather_reduce_scatter"``: the masked lse ``[T, H]`` is all-gathered into
    ``[W, T, H]``; every rank computes the weights of all heads and scales its own
    ``out_partial`` by its weight in fp32 (exactly 0 where the weight is 0, whatever the payload)
    into ``[W, T, H_r, D_v]`` owner order; a fp32 sum reduce-scatter leaves the own heads
    ``[T, H_r, D_v]``, cast to the dtype.
  - ``"allgather_all_reduce"``: the same, with an all-reduce over ``[T, H, D_v]``: every rank
    ends with **all** heads, ``out [T, H, D_v]`` and ``out_lse [T, H]`` (prefill context
    parallelism).

Buffers and lifetime. Every buffer is allocated at construction for ``max_tokens``; a call
allocates nothing, so calls are capture-safe (NCCL calls are graph-capturable). Results without
``out=`` are views of workspace buffers with the lifetime rule of the direct ops: two eager
buffers alternate by a host counter, so the view of call ``n`` stays valid while it is consumed
on the same stream before call ``n + 2`` of the same ubatch; a call captured in a CUDA graph
writes the ubatch's graph buffer, valid until the next replay. ``T > max_tokens`` is served too:
the call then allocates its scratch and output from CuPy's pool on the call's stream (the
returned array is freshly allocated); that is refused while capturing.

No timeouts: NCCL waits are not bounded by ``timeout_ms`` (accepted for signature compatibility).
A rank that raises on bad arguments before its NCCL call leaves its peers waiting inside NCCL:
with ``DCPKIT_DEBUG=1`` every call first compares its arguments across ranks.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _cuda, jit
from ._arrays import ArrayInfo, array_info, check_device, check_dtype, check_shape, dtype_name
from ._cuda import cuda_extra
from .comm import Communicator
from .errors import (ClosedError, CudaError, InvalidArgument, InvalidType, MissingDependency,
                     PeerError)
from .ops._workspace import (check_bool, check_positive_int, check_timeout_ms, debug_enabled,
                             guarded)
from .reference import check_lse_base, resolve_dtype
from .symmetric import MAX_NBYTES

__all__ = [
    "NcclGroup", "NcclQGather", "NcclKVGather", "NcclLseReduce", "LSE_ALGORITHMS",
    "PATH_NCCL", "nccl_module", "strided_copy", "copy_plan", "CopyPlan", "owner_to_heads_plan",
    "heads_to_owner_plan", "lse_layout", "LseLayout",
]

#: Name of the path every NCCL op records (``DCPComm.last_path``).
PATH_NCCL = "nccl"
#: The lse_reduce algorithms of :class:`NcclLseReduce`.
LSE_ALGORITHMS = ("all_to_all", "allgather_reduce_scatter", "allgather_all_reduce")

_FILE = "fallback.cu"
_THREADS = 256
_MAX_CTAS = 4096
_COPY_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "uint2",
               16: "uint4"}
_F32 = np.dtype(np.float32)
_INT32_MAX = 2**31 - 1


def _float_dtypes() -> Tuple[np.dtype, np.dtype, np.dtype]:
    return (resolve_dtype("bfloat16"), np.dtype(np.float16), _F32)


def _cxx_type(dt: np.dtype) -> str:
    bf16, fp16, fp32 = _float_dtypes()
    return {bf16: "dcpkit::bf16_t", fp16: "dcpkit::fp16_t", fp32: "float",
            np.dtype(np.float64): "double"}[np.dtype(dt)]


def _lse_dtypes() -> Tuple[np.dtype, ...]:
    """lse_partial dtypes of the NCCL path (the direct kernels take the first three)."""
    return _float_dtypes() + (np.dtype(np.float64),)


# ----------------------------------------------------------------------------- NCCL module
def nccl_module():
    """``cupy.cuda.nccl``, checked to be usable.

    Raises
    ------
    MissingDependency
        CuPy or its NCCL library is not installed; the message names the ``cuda12`` /
        ``cuda13`` extra (which brings ``nvidia-nccl-cu12`` / ``-cu13``).
    """
    try:
        from cupy.cuda import nccl  # noqa: WPS433 (lazy: CuPy is optional at import)
    except ImportError as e:
        raise MissingDependency("cupy (cupy.cuda.nccl)", cuda_extra(), str(e)) from None
    if not getattr(nccl, "available", False):
        raise MissingDependency("NCCL for cupy.cuda.nccl (libnccl.so.2)", cuda_extra(),
                                "cupy.cuda.nccl.available is False")
    return nccl


def _share_outcome(comm: Communicator, what: str, err: Optional[BaseException]) -> None:
    """One collective step: raise this rank's own error, or PeerError naming the ranks that
    failed, on every rank, when any rank failed."""
    msgs = comm.allgather(None if err is None else f"{type(err).__name__}: {err}")
    if err is not None:
        raise err
    failed = {r: m for r, m in enumerate(msgs) if m is not None}
    if failed:
        raise PeerError(what, failed)


class NcclGroup:
    """One NCCL communicator over the ranks of a :class:`~dcpkit.comm.Communicator`, on this
    rank's current CuPy device. The NCCL ops can share one (``nccl_group=``).

    Rank 0 draws the NCCL unique id (``ncclGetUniqueId``), the Communicator broadcasts it, every
    rank calls ``ncclCommInitRank``.

    Attributes
    ----------
    nccl : cupy.cuda.nccl.NcclCommunicator
    device : int
        The GPU of this rank.

    Collective: construction and :meth:`close`.

    Raises
    ------
    MissingDependency
        CuPy or NCCL is not usable through CuPy (on any rank: the others raise PeerError).
    DcpkitError
        No CUDA GPU is visible (on any rank: the others raise PeerError).
    """

    def __init__(self, comm: Communicator):
        self._closed = True
        if not isinstance(comm, Communicator):
            raise InvalidType(f"NcclGroup: comm must be a dcpkit.Communicator "
                              f"(got {type(comm).__name__})")
        self.comm = comm

        def init():
            # CuPy, NCCL and a GPU on every rank, agreed before any rank enters NCCL.
            _cuda.require_cupy()
            self._nccl_mod = nccl_module()
            self.device = _cuda.require_device("NcclGroup")

        comm.agree_setup("NcclGroup", guarded("NcclGroup", init), "nothing")
        import cupy  # noqa: WPS433

        nccl = self._nccl_mod
        err: Optional[BaseException] = None
        uid = None
        if comm.rank == 0:
            try:
                uid = nccl.get_unique_id()
            except Exception as e:  # noqa: BLE001 - shared below
                err = e
        _share_outcome(comm, "NcclGroup: ncclGetUniqueId on rank 0", err)
        uid = comm.broadcast(uid, root=0)
        try:
            with cupy.cuda.Device(self.device):
                self.nccl = nccl.NcclCommunicator(comm.world_size, uid, comm.rank)
        except Exception as e:  # noqa: BLE001 - shared below
            err = e
        _share_outcome(comm, "NcclGroup: ncclCommInitRank", err)
        self._closed = False

    def check_async_error(self) -> None:
        """Raise :class:`CudaError` if NCCL reported an asynchronous error."""
        try:
            self.nccl.check_async_error()
        except self._nccl_mod.NcclError as e:
            raise CudaError("ncclCommGetAsyncError", str(e),
                            "the NCCL communicator is unusable: close it") from None

    def close(self) -> None:
        """Wait for the device, then destroy the NCCL communicator (collective, idempotent)."""
        if getattr(self, "_closed", True):
            return
        import cupy  # noqa: WPS433

        self._closed = True
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self.nccl.destroy()
        self.nccl = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "NcclGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # never collective work here: warn only
        if getattr(self, "_closed", True) is False:
            try:
                import warnings  # noqa: WPS433

                warnings.warn("dcpkit NcclGroup was not closed; call close() on every rank",
                              ResourceWarning, stacklevel=1)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


# ----------------------------------------------------------------------------- strided copy
class CopyPlan(NamedTuple):
    """A 4-D copy in units of ``elem_bytes`` (1, 2, 4, 8 or 16)."""

    elem_bytes: int
    shape: Tuple[int, int, int, int]
    dst_strides: Tuple[int, int, int, int]   # in elements of elem_bytes
    src_strides: Tuple[int, int, int, int]


def copy_plan(shape: Sequence[int], dst_strides: Sequence[int], src_strides: Sequence[int],
              itemsize: int, dst_ptr: int, src_ptr: int) -> CopyPlan:
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
        raise InvalidArgument(f"strided_copy: shape must have at most 4 dimensions with one "
                              f"stride each (got shape {tuple(shape)})")
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
                return CopyPlan(v, (shp[0], shp[1], shp[2], run // v),
                                (ds[0] // v, ds[1] // v, ds[2] // v, 1),
                                (ss[0] // v, ss[1] // v, ss[2] // v, 1))
    v = int(itemsize)
    if v not in _COPY_TYPES or any(x % v for x in [dst_ptr, src_ptr] + ds + ss):
        raise InvalidArgument(f"strided_copy: a strided innermost dimension needs an itemsize "
                              f"of 1, 2, 4, 8 or 16 bytes and pointers and strides that are "
                              f"multiples of it (got itemsize {itemsize}, strides {tuple(ds)} "
                              f"and {tuple(ss)} bytes)")
    return CopyPlan(v, tuple(shp), tuple(x // v for x in ds), tuple(x // v for x in ss))


def owner_to_heads_plan(W: int, T: int, H_r: int, D: int, itemsize: int,
                        out_strides: Sequence[int], out_ptr: int, src_ptr: int) -> CopyPlan:
    """Plan of the q_gather reorder: the contiguous all-gather result ``[W, T, H_r, D]`` into
    ``out[t, s*H_r + j, d]`` (``out`` ``[T, H, D]`` with byte strides ``out_strides``)."""
    st, sh, sd = out_strides
    isz = itemsize
    return copy_plan((W, T, H_r, D), (H_r * sh, st, sh, sd),
                     (T * H_r * D * isz, H_r * D * isz, D * isz, isz), isz, out_ptr, src_ptr)


def heads_to_owner_plan(W: int, T: int, H_r: int, D: int, itemsize: int,
                        x_strides: Sequence[int], dst_ptr: int, x_ptr: int) -> CopyPlan:
    """Plan of the lse_reduce all_to_all pack: ``x[t, s*H_r + j, d]`` (``x`` ``[T, H, D]``
    with byte strides ``x_strides``) into the contiguous per-owner blocks ``[W, T, H_r, D]``."""
    st, sh, sd = x_strides
    isz = itemsize
    return copy_plan((W, T, H_r, D), (T * H_r * D * isz, H_r * D * isz, D * isz, isz),
                     (H_r * sh, st, sh, sd), isz, dst_ptr, x_ptr)


class LseLayout(NamedTuple):
    """Where the kernels of one NcclLseReduce algorithm put things (element units)."""

    mask_offset: int    # float32 elements from the lse buffer start to the masked own lse
    mask_ss: int        # masked lse of head s*H_r + j, token t at s*mask_ss + t*mask_st + j
    mask_st: int
    y_ss: int           # scaled output of head s*H_r + j at s*y_ss + t*y_st + j*D + d
    y_st: int
    lse_h0: int         # heads whose merged lse the weight kernel writes: [lse_h0, lse_h1)
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


def _grid(n: int, per_cta: int = _THREADS) -> Tuple[int]:
    return (max(1, min(_MAX_CTAS, -(-int(n) // per_cta))),)


class _Kernels:
    """The loaded kernels of ``kernels/fallback.cu`` on one device (compiled once per process
    by :mod:`dcpkit.jit`, cached on disk by CuPy)."""

    def __init__(self, device: int):
        cupy = _cuda.require_cupy()
        _cuda.require_device(f"loading kernels/{_FILE}", device)
        with cupy.cuda.Device(device):
            self.copy = {b: jit.get_kernel(_FILE, f"dcpkit::fallback_copy_kernel<{t}>").kernel
                         for b, t in _COPY_TYPES.items()}
            self.mask = {dt: jit.get_kernel(
                _FILE, f"dcpkit::fallback_lse_mask_kernel<{_cxx_type(dt)}>").kernel
                for dt in _lse_dtypes()}
            self.weight = {dt: jit.get_kernel(
                _FILE, f"dcpkit::fallback_lse_weight_kernel<{_cxx_type(dt)}>").kernel
                for dt in _float_dtypes()}
            self.cast = {dt: jit.get_kernel(
                _FILE, f"dcpkit::fallback_cast_kernel<{_cxx_type(dt)}>").kernel
                for dt in _float_dtypes()}


_KERNELS: Dict[int, _Kernels] = {}


def _kernels(device: int) -> _Kernels:
    k = _KERNELS.get(device)
    if k is None:
        k = _KERNELS[device] = _Kernels(device)
    return k


def strided_copy(dst, src, stream=None) -> None:
    """``dst[...] = src[...]`` for GPU arrays of the same shape (up to 4-D) and itemsize, any
    strides (a bit copy: dtypes may differ if their itemsizes match). One kernel, allocates
    nothing (capture-safe once the kernels are loaded).

    Stream: enqueued on ``stream`` (default: the current CuPy stream).

    Raises
    ------
    InvalidType, InvalidArgument
        Host arrays, different shapes or itemsizes, arrays on different GPUs, a ``stream``
        that is not a CuPy stream.
    MissingDependency
        CuPy is not installed.
    """
    di = array_info(dst, "strided_copy", "dst")
    si = array_info(src, "strided_copy", "src")
    _cuda.check_stream(stream, "strided_copy")
    _copy_infos(di, si, stream)


def _copy_infos(di: ArrayInfo, si: ArrayInfo, stream) -> None:
    if di.shape != si.shape or di.itemsize != si.itemsize:
        raise InvalidArgument(f"strided_copy: dst and src must have the same shape and itemsize "
                              f"(got {di.shape}/{di.itemsize} and {si.shape}/{si.itemsize})")
    if di.device != si.device:
        raise InvalidArgument(f"strided_copy: src device must be dst's GPU {di.device} "
                              f"(got GPU {si.device})")
    n = 1
    for x in di.shape:
        n *= x
    if n == 0:
        return
    p = copy_plan(di.shape, di.strides, si.strides, di.itemsize, di.ptr, si.ptr)
    _launch_copy(di.device, p, di.ptr, si.ptr, stream)


def _launch_copy(device: int, p: CopyPlan, dst_ptr: int, src_ptr: int, stream) -> None:
    n = p.shape[0] * p.shape[1] * p.shape[2] * p.shape[3]
    if n == 0:
        return
    fn = _kernels(device).copy[p.elem_bytes]
    args = (np.uint64(dst_ptr), np.uint64(src_ptr)) + tuple(np.int64(x) for x in p.shape) \
        + tuple(np.int64(x) for x in p.dst_strides) + tuple(np.int64(x) for x in p.src_strides)
    fn(_grid(n), (_THREADS,), args, shared_mem=0, stream=stream)


def _c_contiguous(info: ArrayInfo) -> bool:
    want = info.itemsize
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


# ----------------------------------------------------------------------------- base class
class _NcclOp:
    """What the three NCCL ops share: the NCCL group, call counters, buffers, lifetime."""

    op_name = "op"
    path = PATH_NCCL
    algorithm = ""
    multicast = False
    transport = "nccl"

    # ------------------------------------------------------------------ construction
    def _agree_geometry(self, comm: Communicator, check_arguments, what: str,
                        nccl_group: Optional["NcclGroup"]) -> None:
        """Run ``check_arguments(world_size)`` (argument checks, returns the geometry tuple),
        then the CuPy, NCCL, GPU and ``nccl_group`` checks, on every rank in one exchange:
        raise on every rank if any rank failed or if the geometries differ."""
        self._closed = True
        op = self.op_name
        if not isinstance(comm, Communicator):
            raise InvalidType(f"{op}: comm must be a dcpkit.Communicator "
                              f"(got {type(comm).__name__})")
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size

        def init():
            values = tuple(check_arguments(comm.world_size))
            _cuda.require_cupy()
            if nccl_group is None:
                nccl_module()  # the group this op creates needs it
                _cuda.require_device(op)
                return values
            device = _cuda.require_device(op)
            if not isinstance(nccl_group, NcclGroup):
                raise InvalidType(f"{op}: nccl_group must be a dcpkit.fallback.NcclGroup "
                                  f"(got {type(nccl_group).__name__})")
            if nccl_group.closed:
                raise ClosedError(f"{op}: nccl_group must be open (got a closed NcclGroup)")
            if (nccl_group.device, nccl_group.comm.world_size) != (device, comm.world_size):
                raise InvalidArgument(
                    f"{op}: nccl_group must be a group on GPU {device} with world_size "
                    f"{comm.world_size} (got GPU {nccl_group.device}, world_size "
                    f"{nccl_group.comm.world_size})")
            return values

        comm.agree_setup(f"{op} (nccl)", guarded(op, init), f"geometry ({what})")

    def _check_common(self, world_size: int, max_tokens, num_ubatches, timeout_ms) -> None:
        op = self.op_name
        self.world_size = int(world_size)
        self.max_tokens = check_positive_int(max_tokens, op, "max_tokens")
        if self.max_tokens > _INT32_MAX:  # T is an int parameter of the kernels
            raise InvalidArgument(f"{op}: max_tokens must be <= 2**31 - 1 (got "
                                  f"{self.max_tokens})")
        self.num_ubatches = check_positive_int(num_ubatches, op, "num_ubatches")
        self.timeout_ms = check_timeout_ms(timeout_ms, op)

    def _check_buffer_bytes(self, per_ubatch: int, size_arguments: str) -> None:
        """The buffers allocated at construction must stay <= 2**40 bytes."""
        U = self.num_ubatches
        if U * per_ubatch > MAX_NBYTES:
            raise InvalidArgument(
                f"{self.op_name}: num_ubatches * buffer bytes per ubatch must be <= 2**40 (got "
                f"{U} * {per_ubatch} = {U * per_ubatch}): lower {size_arguments} or "
                f"num_ubatches")

    def _setup_nccl(self, nccl_group: Optional[NcclGroup]) -> None:
        """The NCCL group (shared or own), the device, counters and kernels (collective)."""
        import cupy  # noqa: WPS433

        self._cupy = cupy
        self._debug = debug_enabled()
        if nccl_group is not None:  # checked on every rank by _agree_geometry
            self.device = nccl_group.device
            self._owns_group = False
        else:
            nccl_group = NcclGroup(self.comm)  # collective, agreed
            self._owns_group = True
            self.device = nccl_group.device
        self.nccl_group = nccl_group
        self._nccl = nccl_group.nccl
        self._nccl_mod = nccl_group._nccl_mod
        U = self.num_ubatches
        self._calls = [0] * U
        self._captured = [False] * U
        err = None
        try:
            self._k = _kernels(self.device)
        except Exception as e:  # noqa: BLE001 - shared below
            err = e
        try:
            _share_outcome(self.comm, f"{self.op_name} (nccl): kernel compile", err)
        except BaseException:
            self._release()
            raise

    def _allocate(self, build) -> None:
        """Run ``build()`` (buffer allocation) on every rank; a failure anywhere releases what
        was set up and raises on every rank."""
        err = None
        try:
            build()
        except Exception as e:  # noqa: BLE001 - shared below
            err = e
        try:
            _share_outcome(self.comm, f"{self.op_name} (nccl): buffers", err)
        except BaseException:
            self._release()
            raise

    def _alloc(self, nbytes: int):
        """A device buffer of ``nbytes`` (at least 256) on this op's GPU."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            return cupy.empty(max(int(nbytes), 256), dtype=cupy.uint8)

    def _view(self, buf, shape: Tuple[int, ...], dtype, offset: int = 0):
        """A C-contiguous typed view of ``buf`` (a uint8 CuPy array) at byte ``offset``."""
        return self._cupy.ndarray(tuple(shape), dtype, memptr=buf.data + int(offset))

    def _finish(self) -> None:
        """Warm-up (compiles, NCCL connections for the sizes used), then a barrier."""
        cupy = self._cupy
        err = None
        try:
            with cupy.cuda.Device(self.device):
                for T in sorted({1, self.max_tokens}):
                    self._warmup_call(T)
                cupy.cuda.runtime.deviceSynchronize()
        except Exception as e:  # noqa: BLE001 - shared below
            err = e
        try:
            _share_outcome(self.comm, f"{self.op_name} (nccl): warm-up", err)
        except BaseException:
            self._release()
            raise
        self._calls = [0] * self.num_ubatches
        self._closed = False
        self.comm.barrier()

    # ------------------------------------------------------------------ per call
    def check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.op_name}: the workspace is closed")

    def check_ubatch(self, ubatch) -> int:
        if isinstance(ubatch, bool) or not isinstance(ubatch, (int, np.integer)):
            raise InvalidType(f"{self.op_name}: ubatch must be an int (got {ubatch!r})")
        if not (0 <= ubatch < self.num_ubatches):
            raise InvalidArgument(f"{self.op_name}: ubatch must lie in [0, {self.num_ubatches}) "
                                  f"(got {ubatch})")
        return int(ubatch)

    def get_stream(self, stream):
        """``stream``, or the current CuPy stream for None; :class:`InvalidType` unless a CuPy
        stream."""
        if stream is None:
            return self._cupy.cuda.get_current_stream()
        if isinstance(stream, _cuda._STREAM_TYPES or _cuda.stream_types()):
            return stream
        return _cuda.check_stream(stream, self.op_name)  # raises InvalidType

    def _begin(self, ubatch: int, T: int, stream, debug_key: Tuple) -> Tuple[int, bool]:
        """Bookkeeping after validation, before the first launch. Returns ``(buffer index,
        capturing)``: 0/1 alternate for eager calls, 2 is the ubatch's graph buffer."""
        if self._debug:
            self.comm.agree(f"{self.op_name} (nccl): call arguments (op, T, dtype, ubatch, ...)",
                            (self.op_name,) + tuple(debug_key))
        capturing = bool(stream.is_capturing())
        if capturing and T > self.max_tokens:
            raise InvalidArgument(
                f"{self.op_name}: T must be <= max_tokens {self.max_tokens} while a CUDA graph "
                f"is being captured (got {T}): beyond max_tokens the NCCL path allocates its "
                f"buffers per call")
        if capturing:
            self._captured[ubatch] = True
        self._calls[ubatch] += 1
        return (2 if capturing else self._calls[ubatch] & 1), capturing

    def _scratch(self, per_ubatch: List, ubatch: int, T: int, nbytes: int, stream):
        """The preallocated buffer of ``ubatch`` when ``T <= max_tokens``, else a fresh one from
        CuPy's pool on ``stream`` (eager calls only: :meth:`_begin` refused capture)."""
        if T <= self.max_tokens:
            return per_ubatch[ubatch]
        cupy = self._cupy
        with cupy.cuda.Device(self.device), stream:
            return cupy.empty(max(int(nbytes), 256), dtype=cupy.uint8)

    def _out_buffer(self, outs: List, ubatch: int, index: int, T: int, nbytes: int, stream):
        if T <= self.max_tokens:
            return outs[ubatch][index]
        return self._scratch([], ubatch, T, nbytes, stream)

    def _copy(self, dst: ArrayInfo, src: ArrayInfo, stream) -> None:
        p = copy_plan(dst.shape, dst.strides, src.strides, dst.itemsize, dst.ptr, src.ptr)
        _launch_copy(self.device, p, dst.ptr, src.ptr, stream)

    def _info(self, arr, name: str) -> ArrayInfo:
        return array_info(arr, self.op_name, name)

    def synchronize(self, stream=None) -> None:
        """Wait for ``stream`` (default: the current CuPy stream), then raise if NCCL reported
        an asynchronous error. Stream: synchronises the host with ``stream``."""
        self.check_open()
        self.get_stream(stream).synchronize()
        self.nccl_group.check_async_error()

    @property
    def poisoned(self) -> bool:
        """Always False: NCCL ops have no deadline (see the module docstring)."""
        return False

    def _set_epoch(self, value: int) -> None:
        """Test hook of the direct ops; here it only sets the host call counters."""
        self.check_open()
        self._calls = [int(value)] * self.num_ubatches

    # ------------------------------------------------------------------ teardown
    def _release(self) -> None:
        self._closed = True
        if getattr(self, "_owns_group", False) and getattr(self, "nccl_group", None) is not None:
            self.nccl_group.close()
        self.nccl_group = None
        self._nccl = None
        self._free_buffers()

    def _free_buffers(self) -> None:  # overridden
        pass

    def close(self) -> None:
        """Wait for the device and free the buffers; close the NCCL group if this op created it
        (collective, idempotent). Later calls raise :class:`ClosedError`."""
        if getattr(self, "_closed", True):
            return
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # never collective work here: warn only
        if getattr(self, "_closed", True) is False:
            try:
                import warnings  # noqa: WPS433

                warnings.warn(f"dcpkit {self.op_name} (nccl) was not closed; call close() on "
                              f"every rank", ResourceWarning, stacklevel=1)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def _resolve_any_dtype(dtype, op: str) -> np.dtype:
    try:
        dt = resolve_dtype(dtype)
    except (TypeError, ValueError, AttributeError, ImportError):
        raise InvalidType(f"{op}: dtype must be a NumPy dtype or dtype name (got {dtype!r})") \
            from None
    if dt.hasobject or dt.itemsize == 0:
        raise InvalidType(f"{op}: dtype must be a fixed-size data type (got {dt})")
    if dt.itemsize not in _COPY_TYPES:
        raise InvalidType(f"{op}: dtype itemsize must be 1, 2, 4, 8 or 16 bytes "
                          f"(got {dtype_name(dt)}, {dt.itemsize} bytes)")
    return dt


# ----------------------------------------------------------------------------- q_gather
class NcclQGather(_NcclOp):
    """``q_gather`` on NCCL: an all-gather of ``q`` plus the head reorder.

    Naive equivalent::

        q_all = torch.cat(all_gather(q), dim=1)      # [T, H_r, D] per rank -> [T, H, D]

    ``ncclAllGather`` of ``q`` (made contiguous) into ``[W, T, H_r, D]``, then one strided copy
    into ``[T, H, D]`` (``T == 1``: NCCL gathers straight into the result). Bit for bit the
    result of :class:`~dcpkit.ops.QGather`.

    Parameters
    ----------
    comm : Communicator
    max_tokens : int
        ``T_max``: buffers are sized for it. Larger ``T`` works eagerly (allocates per call).
    heads_per_rank : int
        ``H_r``; the result has ``H = H_r * world_size`` heads.
    head_dim : int
        ``D``.
    dtype : dtype or str
        Any dtype of 1, 2, 4, 8 or 16 bytes (bytes are moved).
    num_ubatches : int
        Independent buffer sets (calls of different ubatches may overlap on different streams).
    padded_num_heads : int, optional
        ``H_pad >= H``: the workspace result sits in ``[T, H_pad, D]`` storage (pad heads never
        written); ``return_padded=True`` returns that storage.
    timeout_ms, heap, multicast
        Accepted for signature compatibility with :class:`~dcpkit.ops.QGather`; unused.
    nccl_group : NcclGroup, optional
        Share this NCCL communicator instead of creating one.

    Attributes
    ----------
    path : str
        ``"nccl"``.
    algorithm : str
        ``"all_gather"``.
    launches_per_call : int
        2 (all-gather and reorder; 1 for ``T == 1`` with contiguous ``q``).

    Collective: construction (NCCL init, warm-up, barrier), every call, :meth:`close`.

    Raises
    ------
    InvalidArgument, InvalidType
        A bad geometry argument.
    MissingDependency
        NCCL is not usable through CuPy (names the cuda12 / cuda13 extra).
    ConfigMismatch, PeerError
        Ranks passed different geometries, or another rank failed.
    """

    op_name = "q_gather"
    algorithm = "all_gather"
    launches_per_call = 2

    def __init__(self, comm: Communicator, *, max_tokens: int, heads_per_rank: int,
                 head_dim: int, dtype, num_ubatches: int = 1,
                 padded_num_heads: Optional[int] = None, timeout_ms: Optional[float] = None,
                 heap=None, multicast: Optional[bool] = None,
                 nccl_group: Optional[NcclGroup] = None):
        self._agree_geometry(comm, lambda W: self._check_arguments(
            W, max_tokens=max_tokens, heads_per_rank=heads_per_rank, head_dim=head_dim,
            dtype=dtype, num_ubatches=num_ubatches, padded_num_heads=padded_num_heads,
            timeout_ms=timeout_ms), "max_tokens, heads_per_rank, head_dim, dtype, "
                                    "padded_num_heads, num_ubatches", nccl_group)
        self._setup_nccl(nccl_group)
        isz = self.dtype.itemsize
        self.row_bytes = self.heads_per_rank * self.head_dim * isz
        self._token_bytes = self.padded_num_heads * self.head_dim * isz
        T, W, U = self.max_tokens, self.world_size, self.num_ubatches

        def build():
            self._send = [self._alloc(T * self.row_bytes) for _ in range(U)]
            self._gather = [self._alloc(W * T * self.row_bytes) for _ in range(U)]
            self._outs = [[self._alloc(T * self._token_bytes) for _ in range(3)]
                          for _ in range(U)]

        self._allocate(build)
        self._finish()

    def _check_arguments(self, world_size: int, *, max_tokens, heads_per_rank, head_dim, dtype,
                         num_ubatches=1, padded_num_heads=None, timeout_ms=None) -> Tuple:
        """Every check of the constructor arguments that needs no GPU and no collective (the
        constructor's keywords); returns what every rank must agree on."""
        op = self.op_name
        self._check_common(world_size, max_tokens, num_ubatches, timeout_ms)
        self.heads_per_rank = check_positive_int(heads_per_rank, op, "heads_per_rank")
        self.head_dim = check_positive_int(head_dim, op, "head_dim")
        self.dtype = _resolve_any_dtype(dtype, op)
        self.num_heads = self.heads_per_rank * self.world_size
        pad = self.num_heads if padded_num_heads is None else padded_num_heads
        self.padded_num_heads = check_positive_int(pad, op, "padded_num_heads",
                                                   minimum=self.num_heads)
        isz, T, W = self.dtype.itemsize, self.max_tokens, self.world_size
        row = self.heads_per_rank * self.head_dim * isz
        self._check_buffer_bytes(T * row * (1 + W) + 3 * T * self.padded_num_heads
                                 * self.head_dim * isz,
                                 "max_tokens, heads_per_rank, head_dim, padded_num_heads")
        return (self.max_tokens, self.heads_per_rank, self.head_dim, str(self.dtype),
                self.padded_num_heads, self.num_ubatches)

    def _free_buffers(self) -> None:
        self._send = self._gather = self._outs = None

    def _warmup_call(self, T: int) -> None:
        cupy = self._cupy
        q = cupy.zeros((T, self.heads_per_rank, self.head_dim * self.dtype.itemsize),
                       dtype=cupy.uint8).view(self.dtype)
        self._call(q, 0, None, None, False)

    def __call__(self, q, *, ubatch: int = 0, out=None, stream=None,
                 return_padded: bool = False):
        """Gather ``q`` of every rank: ``[T, H_r, D]`` here -> ``[T, H, D]`` everywhere.

        Parameters
        ----------
        q : GPU array [T, H_r, D], the workspace dtype
            Any strides (a strided ``q`` is first copied to a contiguous buffer).
        ubatch : int
        out : GPU array [T, H, D], optional
            Any strides; ``out`` is returned.
        stream : cupy.cuda.Stream, optional
            Default: the current CuPy stream.
        return_padded : bool
            Return the ``[T, H_pad, D]`` storage (only with ``out=None``).

        Returns
        -------
        GPU array [T, H, D] (or [T, H_pad, D])
            ``out``, or a view of a workspace buffer with token stride ``H_pad*D`` (lifetime:
            module docstring; ``T > max_tokens``: a fresh array).

        Collective: every rank, same ``T``, dtype and ubatch, same order.

        Stream: NCCL and copy kernels on ``stream``; the host does not wait; capture-safe for
        ``T <= max_tokens``.

        Raises
        ------
        InvalidArgument, InvalidType
            Bad shape, dtype, device, ubatch; ``T > max_tokens`` while capturing.
        ClosedError
        """
        self.check_open()
        return self._call(q, ubatch, out, stream, return_padded)

    def _call(self, q, ubatch, out, stream, return_padded):
        op = self.op_name
        u = self.check_ubatch(ubatch)
        if return_padded and out is not None:
            raise InvalidArgument(f"{op}: return_padded must be False when out= is given "
                                  f"(got return_padded=True)")
        H_r, D, H, isz = self.heads_per_rank, self.head_dim, self.num_heads, self.dtype.itemsize
        qi = self._info(q, "q")
        check_shape(qi, (None, H_r, D), "T, H_r, D", op, "q")
        check_dtype(qi, (self.dtype,), op, "q")
        check_device(qi, self.device, op, "q")
        T = qi.shape[0]
        oi = None
        if out is not None:
            oi = self._info(out, "out")
            check_shape(oi, (T, H, D), "T, H, D", op, "out")
            check_dtype(oi, (self.dtype,), op, "out")
            check_device(oi, self.device, op, "out")
        stream = self.get_stream(stream)
        if T == 0:
            if out is not None:
                return out
            v = self._view(self._outs[u][0], (0, self.padded_num_heads, D), self.dtype)
            return v if return_padded else v[:, :H]
        idx, _ = self._begin(u, T, stream, (T, str(self.dtype), u))
        W = self.world_size
        res = None
        if oi is None:
            buf = self._out_buffer(self._outs, u, idx, T, T * self._token_bytes, stream)
            full = self._view(buf, (T, self.padded_num_heads, D), self.dtype)
            res = full if return_padded else full[:, :H]
            oi = self._info(full[:, :H], "out")
        else:
            res = out
        # send buffer: q itself when contiguous, else a contiguous copy
        if _c_contiguous(qi):
            send_ptr = qi.ptr
        else:
            sbuf = self._scratch(self._send, u, T, T * self.row_bytes, stream)
            sv = self._info(self._view(sbuf, (T, H_r, D), self.dtype), "q")
            self._copy(sv, qi, stream)
            send_ptr = sv.ptr
        nbytes = T * self.row_bytes
        heads_contig = (H == 1 or oi.strides[1] == D * isz) and (D == 1 or oi.strides[2] == isz)
        if T == 1 and heads_contig:
            # [W, 1, H_r, D] is [1, H, D]: gather straight into the result
            self._nccl.allGather(send_ptr, oi.ptr, nbytes, self._nccl_mod.NCCL_UINT8, stream.ptr)
            return res
        gbuf = self._scratch(self._gather, u, T, W * nbytes, stream)
        self._nccl.allGather(send_ptr, gbuf.data.ptr, nbytes, self._nccl_mod.NCCL_UINT8,
                             stream.ptr)
        # [W, T, H_r, D] -> out[t, s*H_r + j, d]
        p = owner_to_heads_plan(W, T, H_r, D, isz, oi.strides, oi.ptr, gbuf.data.ptr)
        _launch_copy(self.device, p, oi.ptr, gbuf.data.ptr, stream)
        return res


# ----------------------------------------------------------------------------- kv_gather
class NcclKVGather(_NcclOp):
    """``kv_gather`` on NCCL: one ``ncclAllGather``.

    Naive equivalent::

        out = all_gather_into_tensor(kv)             # [T, D_kv] per rank -> [W*T, D_kv]

    Bit for bit the result of :class:`~dcpkit.ops.KVGather`.

    Parameters
    ----------
    comm : Communicator
    max_tokens : int
        ``T_max``: buffers are sized for it. Larger ``T`` works eagerly (allocates per call).
    row_dim : int
        ``D_kv``.
    dtype : dtype or str
        Any dtype of 1, 2, 4, 8 or 16 bytes.
    num_ubatches : int
    algorithm, timeout_ms, heap, multicast
        Accepted for signature compatibility with :class:`~dcpkit.ops.KVGather` (``algorithm``
        must still be ``"push"`` or ``"pull"``); unused.
    nccl_group : NcclGroup, optional

    Attributes
    ----------
    path : str
        ``"nccl"``.
    algorithm : str
        ``"all_gather"``.
    launches_per_call : int
        1 (plus a copy for a strided ``kv`` or ``out``).

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    InvalidArgument, InvalidType, MissingDependency, ConfigMismatch, PeerError
        As :class:`NcclQGather`.
    """

    op_name = "kv_gather"
    algorithm = "all_gather"
    launches_per_call = 1

    def __init__(self, comm: Communicator, *, max_tokens: int, row_dim: int, dtype,
                 num_ubatches: int = 1, algorithm: str = "push",
                 timeout_ms: Optional[float] = None, heap=None,
                 multicast: Optional[bool] = None, nccl_group: Optional[NcclGroup] = None):
        self._agree_geometry(comm, lambda W: self._check_arguments(
            W, max_tokens=max_tokens, row_dim=row_dim, dtype=dtype, num_ubatches=num_ubatches,
            algorithm=algorithm, timeout_ms=timeout_ms),
            "max_tokens, row_dim, dtype, num_ubatches", nccl_group)
        self._setup_nccl(nccl_group)
        self.row_bytes = self.row_dim * self.dtype.itemsize
        T, W, U = self.max_tokens, self.world_size, self.num_ubatches

        def build():
            self._send = [self._alloc(T * self.row_bytes) for _ in range(U)]
            self._outs = [[self._alloc(W * T * self.row_bytes) for _ in range(3)]
                          for _ in range(U)]

        self._allocate(build)
        self._finish()

    def _check_arguments(self, world_size: int, *, max_tokens, row_dim, dtype, num_ubatches=1,
                         algorithm="push", timeout_ms=None) -> Tuple:
        """Every check of the constructor arguments that needs no GPU and no collective (the
        constructor's keywords); returns what every rank must agree on."""
        op = self.op_name
        self._check_common(world_size, max_tokens, num_ubatches, timeout_ms)
        self.row_dim = check_positive_int(row_dim, op, "row_dim")
        self.dtype = _resolve_any_dtype(dtype, op)
        if algorithm not in ("push", "pull"):
            raise InvalidArgument(f"{op}: algorithm must be 'push' or 'pull' "
                                  f"(got {algorithm!r})")
        row = self.row_dim * self.dtype.itemsize
        self._check_buffer_bytes(self.max_tokens * row * (1 + 3 * self.world_size),
                                 "max_tokens, row_dim")
        return (self.max_tokens, self.row_dim, str(self.dtype), self.num_ubatches)

    def _free_buffers(self) -> None:
        self._send = self._outs = None

    def _warmup_call(self, T: int) -> None:
        cupy = self._cupy
        kv = cupy.zeros((T, self.row_bytes), dtype=cupy.uint8).view(self.dtype)
        self._call(kv, 0, None, None)

    def __call__(self, kv, *, ubatch: int = 0, out=None, stream=None):
        """Gather ``kv`` of every rank: ``[T, D_kv]`` here -> ``[world_size*T, D_kv]``.

        Parameters
        ----------
        kv : GPU array [T, D_kv], the workspace dtype
            Any strides (a strided ``kv`` is first copied to a contiguous buffer).
        ubatch : int
        out : GPU array [world_size*T, D_kv], optional
            Any strides; ``out`` is returned.
        stream : cupy.cuda.Stream, optional

        Returns
        -------
        GPU array [world_size*T, D_kv]
            ``out``, or a C-contiguous view of a workspace buffer (lifetime: module docstring).

        Collective: every rank, same ``T``, dtype and ubatch, same order.

        Stream: on ``stream``; the host does not wait; capture-safe for ``T <= max_tokens``.

        Raises
        ------
        InvalidArgument, InvalidType, ClosedError
        """
        self.check_open()
        return self._call(kv, ubatch, out, stream)

    def _call(self, kv, ubatch, out, stream):
        op = self.op_name
        u = self.check_ubatch(ubatch)
        W, Dk = self.world_size, self.row_dim
        ki = self._info(kv, "kv")
        check_shape(ki, (None, Dk), "T, D_kv", op, "kv")
        check_dtype(ki, (self.dtype,), op, "kv")
        check_device(ki, self.device, op, "kv")
        T = ki.shape[0]
        oi = None
        if out is not None:
            oi = self._info(out, "out")
            check_shape(oi, (W * T, Dk), "world_size*T, D_kv", op, "out")
            check_dtype(oi, (self.dtype,), op, "out")
            check_device(oi, self.device, op, "out")
        stream = self.get_stream(stream)
        if T == 0:
            return out if out is not None else self._view(self._outs[u][0], (0, Dk), self.dtype)
        idx, _ = self._begin(u, T, stream, (T, str(self.dtype), u))
        nbytes = T * self.row_bytes
        if _c_contiguous(ki):
            send_ptr = ki.ptr
        else:
            sbuf = self._scratch(self._send, u, T, nbytes, stream)
            sv = self._info(self._view(sbuf, (T, Dk), self.dtype), "kv")
            self._copy(sv, ki, stream)
            send_ptr = sv.ptr
        if oi is not None and _c_contiguous(oi):
            self._nccl.allGather(send_ptr, oi.ptr, nbytes, self._nccl_mod.NCCL_UINT8, stream.ptr)
            return out
        buf = self._out_buffer(self._outs, u, idx, T, W * nbytes, stream)
        res = self._view(buf, (W * T, Dk), self.dtype)
        self._nccl.allGather(send_ptr, buf.data.ptr, nbytes, self._nccl_mod.NCCL_UINT8,
                             stream.ptr)
        if oi is None:
            return res
        self._copy(oi, self._info(res, "out"), stream)
        return out


# ----------------------------------------------------------------------------- lse_reduce
class NcclLseReduce(_NcclOp):
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
    comm : Communicator
    max_tokens : int
        ``T_max``: buffers are sized for it. Larger ``T`` works eagerly (allocates per call).
    num_heads : int
        ``H``, a multiple of ``world_size``.
    head_dim : int
        ``D_v``. With ``algorithm="all_to_all"`` ``D_v * itemsize`` must be a multiple of 16.
    dtype : str or dtype
        bfloat16, float16 or float32: dtype of ``out_partial`` and of the result.
    num_ubatches : int
    lse_base : float
        ``math.e`` (default) or ``2``: base of ``lse_partial``.
    return_lse : bool
        Also return the merged natural-log lse from every call.
    timeout_ms, heap
        Accepted for signature compatibility with :class:`~dcpkit.ops.LseReduce`; unused.
    algorithm : str
        ``"all_to_all"`` (default), ``"allgather_reduce_scatter"`` or ``"allgather_all_reduce"``.
    nccl_group : NcclGroup, optional

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

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    InvalidArgument, InvalidType, MissingDependency, ConfigMismatch, PeerError
        As :class:`NcclQGather`; an unknown algorithm or ``lse_base``.
    """

    op_name = "lse_reduce"

    def __init__(self, comm: Communicator, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype, num_ubatches: int = 1, lse_base: float = math.e,
                 return_lse: bool = False, timeout_ms: Optional[float] = None, heap=None,
                 algorithm: str = "all_to_all", nccl_group: Optional[NcclGroup] = None):
        self._agree_geometry(comm, lambda W: self._check_arguments(
            W, max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
            num_ubatches=num_ubatches, lse_base=lse_base, return_lse=return_lse,
            timeout_ms=timeout_ms, algorithm=algorithm),
            "max_tokens, num_heads, head_dim, dtype, lse_base, return_lse, algorithm, "
            "num_ubatches", nccl_group)
        self._setup_nccl(nccl_group)
        W, T, U = self.world_size, self.max_tokens, self.num_ubatches
        H, D = self.num_heads, self.head_dim
        H_r = self.heads_per_rank = H // W
        self.out_heads = H if self.algorithm == "allgather_all_reduce" else H_r
        self.launches_per_call = 6 if self.algorithm == "all_to_all" else 5
        self._scale = np.float32(1.0 if self.lse_base == math.e else math.log(2.0))
        isz = self.dtype.itemsize
        self._row_bytes = D * isz
        Ho = self.out_heads

        def build():
            if self.algorithm == "all_to_all":
                from .ops.lse_reduce import lse_combine  # noqa: WPS433 (the direct op's merge)

                self._combine = lse_combine
                self._send_out = [self._alloc(T * H * D * isz) for _ in range(U)]
                self._recv_out = [self._alloc(T * H * D * isz) for _ in range(U)]
                self._send_lse = [self._alloc(T * H * 4) for _ in range(U)]
                self._recv_lse = [self._alloc(T * H * 4) for _ in range(U)]
            else:
                self._lse_all = [self._alloc(W * T * H * 4) for _ in range(U)]
                self._y = [self._alloc(T * H * D * 4) for _ in range(U)]
                if self.algorithm == "allgather_reduce_scatter":
                    self._rs = [self._alloc(T * H_r * D * 4) for _ in range(U)]
            self._outs = [[self._alloc(T * Ho * D * isz) for _ in range(3)] for _ in range(U)]
            self._lse_outs = [[self._alloc(T * Ho * 4) for _ in range(3)] for _ in range(U)]

        self._allocate(build)
        self._finish()

    def _check_arguments(self, world_size: int, *, max_tokens, num_heads, head_dim, dtype,
                         num_ubatches=1, lse_base=math.e, return_lse=False, timeout_ms=None,
                         algorithm="all_to_all") -> Tuple:
        """Every check of the constructor arguments that needs no GPU and no collective (the
        constructor's keywords); returns what every rank must agree on."""
        op = self.op_name
        self._check_common(world_size, max_tokens, num_ubatches, timeout_ms)
        self.num_heads = check_positive_int(num_heads, op, "num_heads")
        self.head_dim = check_positive_int(head_dim, op, "head_dim")
        for name, v in (("num_heads", self.num_heads), ("head_dim", self.head_dim)):
            if v > _INT32_MAX:  # int parameters of the kernels
                raise InvalidArgument(f"{op}: {name} must be <= 2**31 - 1 (got {v})")
        W = self.world_size
        if self.num_heads % W:
            raise InvalidArgument(f"{op}: num_heads must be a multiple of world_size {W} "
                                  f"(got {self.num_heads})")
        try:
            dt = resolve_dtype(dtype)
        except (TypeError, ValueError, AttributeError, ImportError):
            raise InvalidType(f"{op}: dtype must be one of [bfloat16, float16, float32] "
                              f"(got {dtype!r})") from None
        if dt not in _float_dtypes():
            raise InvalidType(f"{op}: dtype must be one of [bfloat16, float16, float32] "
                              f"(got {dtype_name(dt)})")
        self.dtype = dt
        if algorithm not in LSE_ALGORITHMS:
            raise InvalidArgument(f"{op}: algorithm must be one of {list(LSE_ALGORITHMS)} "
                                  f"(got {algorithm!r})")
        self.algorithm = algorithm
        if algorithm == "all_to_all" and (self.head_dim * dt.itemsize) % 16:
            raise InvalidArgument(
                f"{op}: head_dim * itemsize must be a multiple of 16 bytes for "
                f"algorithm 'all_to_all' (got {self.head_dim} * {dt.itemsize}); use "
                f"'allgather_reduce_scatter'")
        self.lse_base = check_lse_base(lse_base, op)
        self.return_lse = check_bool(return_lse, op, "return_lse")
        W, T, H, D, isz = (self.world_size, self.max_tokens, self.num_heads, self.head_dim,
                           dt.itemsize)
        Ho = H if algorithm == "allgather_all_reduce" else H // W
        if algorithm == "all_to_all":
            scratch = 2 * T * H * D * isz + 2 * T * H * 4
        else:
            scratch = W * T * H * 4 + T * H * D * 4 + T * (H // W) * D * 4
        self._check_buffer_bytes(scratch + 3 * T * Ho * (D * isz + 4),
                                 "max_tokens, num_heads, head_dim")
        return (self.max_tokens, self.num_heads, self.head_dim, str(self.dtype),
                self.lse_base, self.return_lse, self.algorithm, self.num_ubatches)

    def _free_buffers(self) -> None:
        for name in ("_send_out", "_recv_out", "_send_lse", "_recv_lse", "_lse_all", "_y", "_rs",
                     "_outs", "_lse_outs"):
            if hasattr(self, name):
                setattr(self, name, None)

    def _warmup_call(self, T: int) -> None:
        cupy = self._cupy
        x = cupy.zeros((T, self.num_heads, self._row_bytes), dtype=cupy.uint8).view(self.dtype)
        lse = cupy.zeros((T, self.num_heads), dtype=cupy.float32)
        self._call(x, lse, None, None, 0, None, None, None)

    def __call__(self, out_partial, lse_partial, *, seq_lens=None, query_start_loc=None,
                 ubatch: int = 0, out=None, out_lse=None, stream=None):
        """Merge every rank's partial attention (see the class docstring).

        Parameters
        ----------
        out_partial : array [T, H, D_v], the workspace dtype
            Any strides.
        lse_partial : array [T, H], bfloat16, float16, float32 or float64
            Base ``lse_base``; any strides; NaN and +inf count as -inf.
        seq_lens : int32 array [S], optional
            This rank's KV length per request (0: the request's rows are empty here).
            Contiguous. Requires ``query_start_loc``.
        query_start_loc : int32 array [S+1], optional
            Row offsets of the requests, non-decreasing, equal on every rank; rows at or past
            ``query_start_loc[S]`` are padding (empty on every rank). Contiguous.
        ubatch : int
        out : array [T, H_out, D_v], optional
            ``H_out = out_heads``; any strides.
        out_lse : float32 array [T, H_out], optional
            Any strides; passing it makes the call return ``(out, out_lse)``.
        stream : cupy.cuda.Stream, optional

        Returns
        -------
        out : array [T, H_out, D_v]
            Heads ``[rank*H_r, (rank+1)*H_r)`` (all heads for ``allgather_all_reduce``);
            ``out=`` or a view of a workspace buffer (lifetime: module docstring). Rows whose
            sources are all empty are 0.
        out_lse : float32 array [T, H_out]
            With ``return_lse=True`` or ``out_lse=``: the merged natural-log lse, -inf for
            all-empty rows.

        Collective: every rank, same ``T``, dtypes, masks present or not, ubatch, same order.

        Stream: on ``stream``; the host does not wait; capture-safe for ``T <= max_tokens``.

        Raises
        ------
        InvalidArgument, InvalidType, ClosedError
        """
        self.check_open()
        return self._call(out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out,
                          out_lse, stream)

    def _index_array(self, x, name: str, dims: str) -> ArrayInfo:
        op = self.op_name
        info = self._info(x, name)
        check_dtype(info, (np.int32,), op, name)
        if len(info.shape) != 1:
            raise InvalidArgument(f"{op}: {name} must have 1 dimension [{dims}] "
                                  f"(got shape {info.shape})")
        if info.shape[0] > 1 and info.strides[0] != 4:
            raise InvalidArgument(f"{op}: {name} must be contiguous (got stride "
                                  f"{info.strides[0]} bytes)")
        check_device(info, self.device, op, name)
        return info

    def _call(self, out_partial, lse_partial, seq_lens, query_start_loc, ubatch, out, out_lse,
              stream):
        op = self.op_name
        u = self.check_ubatch(ubatch)
        H, D, Ho = self.num_heads, self.head_dim, self.out_heads
        dt, isz = self.dtype, self.dtype.itemsize
        x = self._info(out_partial, "out_partial")
        check_dtype(x, (dt,), op, "out_partial")
        check_shape(x, (None, H, D), "T, H, D_v", op, "out_partial")
        check_device(x, self.device, op, "out_partial")
        T = x.shape[0]
        li = self._info(lse_partial, "lse_partial")
        check_dtype(li, _lse_dtypes(), op, "lse_partial")
        check_shape(li, (T, H), "T, H", op, "lse_partial")
        check_device(li, self.device, op, "lse_partial")
        for name, info in (("out_partial", x), ("lse_partial", li)):
            if any(s % info.itemsize for s in info.strides):
                raise InvalidArgument(f"{op}: {name} strides must be multiples of its itemsize "
                                      f"{info.itemsize} bytes (got {info.strides})")
        qsl_ptr = seq_ptr = 0
        S = 0
        if query_start_loc is None:
            if seq_lens is not None:
                raise InvalidArgument(f"{op}: seq_lens requires query_start_loc (got "
                                      f"query_start_loc=None)")
        else:
            qi = self._index_array(query_start_loc, "query_start_loc", "S+1")
            if qi.shape[0] < 1:
                raise InvalidArgument(f"{op}: query_start_loc length must be >= 1 for [S+1] "
                                      f"(got 0)")
            S, qsl_ptr = qi.shape[0] - 1, qi.ptr
            if seq_lens is not None:
                si = self._index_array(seq_lens, "seq_lens", "S")
                if si.shape[0] != S:
                    raise InvalidArgument(f"{op}: seq_lens length must be "
                                          f"len(query_start_loc) - 1 = {S} (got {si.shape[0]})")
                seq_ptr = si.ptr
        oi = oli = None
        if out is not None:
            oi = self._info(out, "out")
            check_dtype(oi, (dt,), op, "out")
            check_shape(oi, (T, Ho, D), "T, H_out, D_v", op, "out")
            check_device(oi, self.device, op, "out")
        if out_lse is not None:
            oli = self._info(out_lse, "out_lse")
            check_dtype(oli, (np.float32,), op, "out_lse")
            check_shape(oli, (T, Ho), "T, H_out", op, "out_lse")
            check_device(oli, self.device, op, "out_lse")
        want_lse = self.return_lse or out_lse is not None
        stream = self.get_stream(stream)
        if T == 0:
            res = out if out is not None else self._view(self._outs[u][0], (0, Ho, D), dt)
            if not want_lse:
                return res
            lres = out_lse if out_lse is not None else \
                self._view(self._lse_outs[u][0], (0, Ho), _F32)
            return res, lres
        key = (T, str(dt), str(li.dtype), u, qsl_ptr != 0, seq_ptr != 0)
        idx, _ = self._begin(u, T, stream, key)

        # destinations: the caller's arrays when C-contiguous (and 16-byte aligned for the
        # merge), else workspace buffers copied out at the end
        obuf = self._out_buffer(self._outs, u, idx, T, T * Ho * D * isz, stream)
        ws_out = self._view(obuf, (T, Ho, D), dt)
        dst = oi if (oi is not None and _c_contiguous(oi) and oi.ptr % 16 == 0) else \
            self._info(ws_out, "out")
        ldst = None
        ws_lse = None
        if want_lse:
            lbuf = self._out_buffer(self._lse_outs, u, idx, T, T * Ho * 4, stream)
            ws_lse = self._view(lbuf, (T, Ho), _F32)
            ldst = oli if (oli is not None and _c_contiguous(oli) and oli.ptr % 4 == 0) else \
                self._info(ws_lse, "out_lse")

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
        args = (np.uint64(dst_ptr), np.int64(dst_ss), np.int64(dst_st), np.uint64(li.ptr),
                np.int64(l_st), np.int64(l_sh), np.uint64(qsl_ptr), np.uint64(seq_ptr),
                np.int32(S), np.int32(T), np.int32(H), np.int32(H_r), self._scale)
        self._k.mask[li.dtype](_grid(T * H), (_THREADS,), args, shared_mem=0, stream=stream)

    def _all_to_all(self, u: int, T: int, x: ArrayInfo, lse_args, dst: ArrayInfo,
                    ldst: Optional[ArrayInfo], stream) -> None:
        W, H, D, H_r, r = (self.world_size, self.num_heads, self.head_dim, self.heads_per_rank,
                           self.rank)
        dt, isz = self.dtype, self.dtype.itemsize
        nccl, mod, sp = self._nccl, self._nccl_mod, stream.ptr
        blk = T * H_r * D * isz       # one owner's payload
        lblk = T * H_r * 4            # one owner's lse
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
            src_base, src_blk = x.ptr, H_r * D * isz      # already owner-major
        else:
            p = heads_to_owner_plan(W, T, H_r, D, isz, x.strides, so, x.ptr)
            _launch_copy(self.device, p, so, x.ptr, stream)
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
        src_out = self._view(recv_out, (W, T, H_r, D), dt)
        src_lse = self._view(recv_lse, (W, T, H_r), _F32)
        self._combine(src_out, src_lse, dst.obj, None if ldst is None else ldst.obj,
                      stream=stream)

    def _all_gather_lse(self, u: int, T: int, x: ArrayInfo, lse_args, dst: ArrayInfo,
                        ldst: Optional[ArrayInfo], stream) -> None:
        W, H, D, H_r, r = (self.world_size, self.num_heads, self.head_dim, self.heads_per_rank,
                           self.rank)
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
        lse_ptr, lse_st = (0, 0) if ldst is None else \
            (ldst.ptr, ldst.strides[0] // 4 if T > 1 else 0)
        assert ldst is None or ldst.shape[1] <= 1 or ldst.strides[1] == 4  # C-contiguous
        args = (np.uint64(y.data.ptr), np.int64(y_ss), np.int64(y_st), np.uint64(x.ptr),
                np.int64(st), np.int64(sh), np.int64(sd), np.uint64(la), np.uint64(lse_ptr),
                np.int64(lse_st), np.int32(h0), np.int32(h1), np.int32(W), np.int32(r),
                np.int32(T), np.int32(H), np.int32(H_r), np.int32(D))
        self._k.weight[dt](_grid(T * H * 32), (_THREADS,), args, shared_mem=0, stream=stream)
        # fp32 sum; then the cast to the dtype (skipped when the result is fp32 already)
        direct_f32 = dt == _F32 and _c_contiguous(dst)
        Hx = H if all_reduce else H_r
        if all_reduce:
            target = dst.ptr if direct_f32 else y.data.ptr
            nccl.allReduce(y.data.ptr, target, T * H * D, mod.NCCL_FLOAT32, mod.NCCL_SUM, sp)
            src = y.data.ptr
        else:
            rs = self._scratch(self._rs, u, T, T * H_r * D * 4, stream)
            target = dst.ptr if direct_f32 else rs.data.ptr
            nccl.reduceScatter(y.data.ptr, target, T * H_r * D, mod.NCCL_FLOAT32, mod.NCCL_SUM,
                               sp)
            src = rs.data.ptr
        if direct_f32:
            return
        o_st, o_sh, o_sd = (s // isz for s in dst.strides)
        args = (np.uint64(dst.ptr), np.int64(o_st), np.int64(o_sh), np.int64(o_sd),
                np.uint64(src), np.int32(T), np.int32(Hx), np.int32(D))
        self._k.cast[dt](_grid(T * Hx * D), (_THREADS,), args, shared_mem=0, stream=stream)
