"""The host fast path of one op, assembled from :mod:`dcpkit._plan` and :mod:`dcpkit._launch`:
a q_gather call as the ops will make it once they hold a plan cache and a launcher.

:class:`FastQGather` wraps an open :class:`~dcpkit.ops.QGather` and gives the same calls the
same results (same validation, same errors, same bookkeeping, same result views); only the way
there changes. It exists so that the CPU micro-benchmark (``scripts/host_path_cpu.py``) and the
GPU one (``scripts/host_overhead.py``) measure the design before it is wired into every op.

Per call (the plan is everything the call's key determines; see :mod:`dcpkit._plan`):

1. ``check_open()``: closed or poisoned raises at every call, cached plan or not;
2. the key ``call_key((q, out), (ubatch, return_padded))`` and the stream's type; on a miss the
   op's own ``_validate`` (every check, every message) and the derivation of grid and kernel
   parameters, packed once into a :class:`~dcpkit._launch.KernelParams`;
3. the op's bookkeeping (``_destination``: epochs' host shadow, capture state, where the result
   goes); the output pointer is patched into the parameter buffer;
4. one ``cuLaunchKernel`` through :class:`~dcpkit._launch.Launcher` on the stream's handle;
5. the op's result view (memoised by the op).
"""

from __future__ import annotations

from typing import NamedTuple

from . import _cuda
from ._launch import KernelParams, Launcher
from ._plan import PlanCache, call_key

__all__ = ["FastQGather", "Q_GATHER_PARAM_TYPES"]

#: The q_gather kernel's parameters (kernels/q_gather.cu; DCPKIT_PROTO_PARAMS first).
Q_GATHER_PARAM_TYPES = (
    # DCPKIT_PROTO_PARAMS: epoch, arrive, abort, record, signals, peer_sig, mc_sig, rank,
    # world_size, timeout_ns, op, ubatch
    "u64", "u64", "u64", "u64", "u64", "u64", "u64", "i32", "i32", "u64", "u32", "u32",
    # peer_data, slot_bytes, mc_data, q, q_token_stride, row_vecs, slot_token_stride, tokens,
    # out, out_token_stride
    "u64", "u64", "u64", "u64", "i64", "u32", "i64", "u32", "u64", "i64",
)
_OUT = 20          # index of the ``out`` parameter


class _Plan(NamedTuple):
    T: int
    ubatch: int
    out_ptr: int            # the caller's out= (0: none)
    grid_copy: int          # grid when the kernel copies out (out= or an output buffer)
    grid_zero_copy: int     # grid when the result is read from the own slot
    params: KernelParams
    padded: bool


class FastQGather:
    """``op(q, ...)`` of an open :class:`~dcpkit.ops.QGather` through a plan cache and a packed
    parameter buffer (see the module docstring). Same arguments, results and errors.

    Parameters
    ----------
    op : QGather
        An open workspace (its kernel loaded).
    backend : {"ctypes", "bindings"}
        The :class:`~dcpkit._launch.Launcher` backend.
    """

    def __init__(self, op, backend: str = "ctypes"):
        self.op = op
        self.cache = PlanCache(self._build)
        self._launcher = None
        self._backend = backend
        import cupy  # noqa: WPS433

        self._current_device = cupy.cuda.runtime.getDevice

    def _get_launcher(self):
        if self._launcher is None:
            import cupy  # noqa: WPS433

            from .ops._gather import THREADS  # noqa: WPS433

            with cupy.cuda.Device(self.op.device):
                fn = self.op._kernel.kernel
            self._launcher = Launcher(fn, THREADS, backend=self._backend)
        return self._launcher

    def _build(self, q, ubatch, out, return_padded) -> _Plan:
        ws = self.op
        T, ub, qi, oi = ws._validate(q, ubatch, out, return_padded)
        if T == 0:
            return _Plan(0, ub, 0, 0, 0, None, bool(return_padded))
        W = ws.world_size
        full_row = ws.num_heads * ws.head_dim * ws.dtype.itemsize
        q_stride = qi.strides[0] if T > 1 else ws.row_bytes
        out_stride = (oi.strides[0] if T > 1 else full_row) if oi is not None \
            else ws.slot_token_bytes
        row_vecs = ws.row_bytes // 16
        head = ws._head_args(ub)
        values = [int(v) for v in head] + [qi.ptr, int(q_stride), row_vecs,
                                           int(ws.slot_token_bytes), T, 0, int(out_stride)]
        params = KernelParams(Q_GATHER_PARAM_TYPES, values)
        return _Plan(T, ub, oi.ptr if oi is not None else 0,
                     ws._grid(T * row_vecs * W), ws._grid(T * row_vecs), params,
                     bool(return_padded))

    def __call__(self, q, *, ubatch: int = 0, out=None, stream=None,
                 return_padded: bool = False):
        """``op(q, ubatch=..., out=..., stream=..., return_padded=...)``, see
        :meth:`~dcpkit.ops.QGather.__call__` (same result, same lifetime, same errors).

        Collective: as the op. Stream: one kernel on ``stream``; never blocks the host.

        Raises
        ------
        InvalidArgument, InvalidType, ClosedError, CollectiveTimeout
            As the op, before anything is launched or counted.
        CudaError
            ``cuLaunchKernel`` failed.
        """
        ws = self.op
        ws.check_open()
        plan = self.cache.lookup(call_key((q, out), (ubatch, return_padded)), q, ubatch, out,
                                 return_padded)
        if stream is not None and not isinstance(stream, _cuda._STREAM_TYPES
                                                 or _cuda.stream_types()):
            _cuda.check_stream(stream, ws.op_name)  # raises InvalidType (after the arguments,
            #                                         as the op checks them)
        if plan.T == 0:
            return ws(q, ubatch=ubatch, out=out, stream=stream, return_padded=return_padded)
        if stream is None:
            stream = ws.get_stream(None)
        kout, result = ws._destination(plan.ubatch, stream, (plan.T, str(ws.dtype),
                                                             plan.ubatch) if ws._debug else (),
                                       plan.out_ptr)
        params = plan.params
        params[_OUT] = kout   # the out stride was packed with the plan (out= or the slot's)
        grid = plan.grid_copy if kout else plan.grid_zero_copy
        if self._current_device() == ws.device:
            self._get_launcher().launch(grid, params, stream.ptr)
        else:
            import cupy  # noqa: WPS433

            with cupy.cuda.Device(ws.device):
                self._get_launcher().launch(grid, params, stream.ptr)
        if out is not None:
            return out
        return ws._result_view(result, plan.T, plan.padded)


