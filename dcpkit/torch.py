"""torch interop: every dcpkit op takes torch CUDA tensors and returns torch tensors, zero-copy
through DLPack, ordered on the caller's current torch stream; the ops are also torch custom ops
(``torch.ops.dcpkit.*``) so that they can live inside ``torch.cuda.CUDAGraph`` captures.

torch is imported on first use, never at import time: ``import dcpkit.torch`` works without it
(every function then raises :class:`~dcpkit.errors.MissingDependency` naming the ``torch``
extra). Inside this module ``import torch`` is an absolute import and finds the real torch (do
not run scripts from inside the ``dcpkit/`` folder, where ``torch.py`` would shadow it).

Usage, on every rank::

    import torch, dcpkit
    from dcpkit.torch import TorchOps

    comm = dcpkit.Communicator.from_torch()          # or Communicator.from_mpi()
    dcp = dcpkit.DCPComm(comm, max_tokens=128, num_heads=128, q_head_dim=576,
                         v_head_dim=512, dtype="bfloat16")
    ops = TorchOps(dcp)                              # or TorchOps(QGather(...)), ...
    q_all = ops.q_gather(q)                          # torch bf16 [T, H_r, D] -> [T, H, D]
    ops.lse_reduce(out_partial, lse, out=o)          # custom op dcpkit::lse_reduce, writes o
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):                        # after an eager warm-up call
        ops.q_gather(q_static, out=q_all_static)
        ops.lse_reduce(o_part_static, lse_static, out=o_static)
    g.replay()
    ...
    ops.close(); dcp.close()

Streams. A call runs on ``torch.cuda.current_stream()`` of the op's GPU (wrapped as a CuPy
stream), so a torch kernel that writes an input right before the call and one that reads the
output right after need no synchronisation. Conversions use DLPack on that same stream: no
copy, no extra event.

Outputs. With ``out=`` (and, for ``lse_reduce``, ``out_lse=`` or ``return_lse`` unset) the call
goes through the custom op (``torch.ops.dcpkit.q_gather`` etc., which writes into the
caller's tensors and allocates nothing: capture-safe) and returns the caller's tensors.
Without ``out=`` the result is the op's own output (a view of workspace memory, with the op's
lifetime rule) wrapped as a torch tensor without a copy.

Custom ops take an integer handle: :class:`TorchOps` registers itself under a fresh id in a
registry of weak references (the registry keeps nothing alive) and removes it on
:meth:`TorchOps.close`. A graph that captured a custom op must not be replayed after the
dcpkit op it used is closed.
"""

from __future__ import annotations

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

from .errors import ClosedError, InvalidArgument, InvalidType, MissingDependency

__all__ = ["to_cupy", "from_cupy", "cupy_stream", "TorchOps", "register_custom_ops",
           "supported_dtypes"]


def _torch():
    """The torch module, or MissingDependency naming the ``torch`` extra."""
    try:
        import torch  # noqa: WPS433 (absolute: the real torch, not this module)
    except ImportError as e:
        raise MissingDependency("torch", "torch", str(e)) from None
    return torch


def _cupy():
    try:
        import cupy  # noqa: WPS433
    except ImportError as e:
        from ._cuda import cuda_extra  # noqa: WPS433

        raise MissingDependency("cupy", cuda_extra(), str(e)) from None
    return cupy


def supported_dtypes() -> Tuple:
    """The torch dtypes that cross into CuPy: float16, bfloat16, float32, float64 and the
    integer types (float8 tensors: pass ``t.view(torch.uint8)``)."""
    torch = _torch()
    return (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
            torch.uint8, torch.int16, torch.int32, torch.int64)


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _check_tensor(t, name: str, device: Optional[int]) -> None:
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"dcpkit.torch: {name} must be a torch.Tensor (got {_type_name(t)})")
    if t.device.type != "cuda":
        raise InvalidType(f"dcpkit.torch: {name} must be a CUDA tensor (got device {t.device}): "
                          f"move it to the GPU with .cuda()")
    if device is not None and t.device.index != device:
        raise InvalidArgument(f"dcpkit.torch: {name} device must be the op's GPU cuda:{device} "
                              f"(got {t.device})")
    if t.dtype not in supported_dtypes():
        names = ", ".join(str(d).replace("torch.", "") for d in supported_dtypes())
        raise InvalidType(f"dcpkit.torch: {name} dtype must be one of [{names}] (got {t.dtype}); "
                          f"pass float8 tensors as t.view(torch.uint8)")


def to_cupy(t, *, name: str = "tensor", device: Optional[int] = None):
    """A CuPy array sharing ``t``'s memory (DLPack, no copy; bfloat16 included).

    Parameters
    ----------
    t : torch.Tensor
        A CUDA tensor of a supported dtype (:func:`supported_dtypes`), any strides.
    name : str
        Argument name for error messages.
    device : int, optional
        Required CUDA device ordinal.

    Returns
    -------
    cupy.ndarray
        Same shape, strides, dtype and data pointer (``data.ptr == t.data_ptr()``).

    Stream: DLPack makes CuPy's current stream wait for torch's current stream when they
    differ (:class:`TorchOps` runs both on the same stream, so nothing is inserted).

    Raises
    ------
    MissingDependency
        torch is not installed (the ``torch`` extra).
    InvalidType
        Not a tensor, a CPU tensor, an unsupported dtype.
    InvalidArgument
        A tensor on another GPU than ``device``.
    """
    _check_tensor(t, name, device)
    return _cupy().from_dlpack(t.detach())


def from_cupy(a):
    """A torch tensor sharing the CuPy array ``a``'s memory (DLPack, no copy; bfloat16
    included). The tensor keeps ``a``'s memory alive; a view of workspace memory is still only
    valid under the op's lifetime rule.

    Raises
    ------
    MissingDependency
        torch is not installed.
    """
    return _torch().from_dlpack(a)


class _StreamHandle:
    """A CUDA stream handle with the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def cupy_stream(device: Optional[int] = None):
    """torch's current stream on ``device`` (default: torch's current device) as a CuPy
    stream object (no new stream is created; the handle is shared)."""
    torch, cupy = _torch(), _cupy()
    ptr = torch.cuda.current_stream(device).cuda_stream
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, -1 if device is None else int(device))


# ----------------------------------------------------------------------------- registry
# handle -> weak reference to a live TorchOps. Owned by the TorchOps objects: each adds itself
# at construction and removes itself in close() (or when it is garbage-collected).
_REGISTRY: Dict[int, "weakref.ref[TorchOps]"] = {}
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def _lookup(handle: int, op: str) -> "TorchOps":
    ref = _REGISTRY.get(int(handle))
    obj = ref() if ref is not None else None
    if obj is None or obj.closed:
        raise ClosedError(f"dcpkit::{op}: handle {handle} must name a live dcpkit.torch.TorchOps "
                          f"(got a closed or unknown handle)")
    return obj


# ----------------------------------------------------------------------------- custom ops
def _q_gather_impl(handle: int, q, out, ubatch: int) -> None:
    _lookup(handle, "q_gather")._invoke("q_gather", [("q", q)], {"ubatch": ubatch, "out": out})


def _kv_gather_impl(handle: int, kv, out, ubatch: int) -> None:
    _lookup(handle, "kv_gather")._invoke("kv_gather", [("kv", kv)],
                                         {"ubatch": ubatch, "out": out})


def _lse_reduce_impl(handle: int, out_partial, lse_partial, seq_lens, query_start_loc, out,
                     out_lse, ubatch: int) -> None:
    _lookup(handle, "lse_reduce")._invoke(
        "lse_reduce", [("out_partial", out_partial), ("lse_partial", lse_partial)],
        {"seq_lens": seq_lens, "query_start_loc": query_start_loc, "ubatch": ubatch, "out": out,
         "out_lse": out_lse})


def _gather_fake(handle, x, out, ubatch) -> None:
    return None


def _lse_reduce_fake(handle, out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse,
                     ubatch) -> None:
    return None


_SCHEMAS = {
    "q_gather": ("(int handle, Tensor q, Tensor(a!) out, int ubatch) -> ()", ("out",),
                 _q_gather_impl, _gather_fake),
    "kv_gather": ("(int handle, Tensor kv, Tensor(a!) out, int ubatch) -> ()", ("out",),
                  _kv_gather_impl, _gather_fake),
    "lse_reduce": ("(int handle, Tensor out_partial, Tensor lse_partial, Tensor? seq_lens, "
                   "Tensor? query_start_loc, Tensor(a!) out, Tensor(b!)? out_lse, int ubatch) "
                   "-> ()", ("out", "out_lse"), _lse_reduce_impl, _lse_reduce_fake),
}
_CUSTOM_OPS: Optional[Dict[str, Any]] = None


def register_custom_ops() -> Dict[str, Any]:
    """Register ``dcpkit::q_gather``, ``dcpkit::kv_gather`` and ``dcpkit::lse_reduce`` with
    ``torch.library.custom_op`` (once per process; :class:`TorchOps` calls it).

    Schemas (all return nothing and write into caller-provided tensors)::

        dcpkit::q_gather(int handle, Tensor q, Tensor(a!) out, int ubatch)
        dcpkit::kv_gather(int handle, Tensor kv, Tensor(a!) out, int ubatch)
        dcpkit::lse_reduce(int handle, Tensor out_partial, Tensor lse_partial,
                           Tensor? seq_lens, Tensor? query_start_loc, Tensor(a!) out,
                           Tensor(b!)? out_lse, int ubatch)

    ``handle`` is :attr:`TorchOps.handle`. Returns op name -> the ``CustomOpDef``.
    """
    global _CUSTOM_OPS
    with _LOCK:
        if _CUSTOM_OPS is None:
            torch = _torch()
            ops = {}
            for name, (schema, mutates, impl, fake) in _SCHEMAS.items():
                op = torch.library.custom_op(f"dcpkit::{name}", impl, mutates_args=mutates,
                                             schema=schema)
                op.register_fake(fake)
                ops[name] = op
            _CUSTOM_OPS = ops
    return _CUSTOM_OPS


# ----------------------------------------------------------------------------- front end
class TorchOps:
    """torch front end of a :class:`~dcpkit.manager.DCPComm`, a direct op
    (:class:`~dcpkit.ops.QGather`, ...) or an NCCL op (:mod:`dcpkit.fallback`).

    Naive equivalent: the target's own calls, with torch tensors converted to CuPy arrays and
    back by DLPack (no copies) and ``stream=`` set to torch's current stream.

    Parameters
    ----------
    target : DCPComm or op
        What the calls run. It is not closed by :meth:`close` (its owner closes it).

    Attributes
    ----------
    handle : int
        Id of this object in the custom-op registry (first argument of ``torch.ops.dcpkit.*``).
    device : int
        The target's GPU; every tensor must live there.
    ops : tuple of str
        The ops this target serves.

    Raises
    ------
    MissingDependency
        torch (or CuPy) is not installed.
    InvalidType
        ``target`` is not a dcpkit op or DCPComm.
    """

    def __init__(self, target):
        _torch()
        if hasattr(target, "lse_reduce") and hasattr(target, "q_gather"):
            ops = tuple(getattr(target, "ops", ("q_gather", "lse_reduce", "kv_gather")))
            self._fns = {op: getattr(target, op) for op in ops}
        elif getattr(target, "op_name", None) in ("q_gather", "lse_reduce", "kv_gather"):
            ops = (target.op_name,)
            self._fns = {target.op_name: target}
        else:
            raise InvalidType(f"TorchOps: target must be a dcpkit op or DCPComm "
                              f"(got {_type_name(target)})")
        self.target = target
        self.ops = ops
        self.device = int(target.device)
        register_custom_ops()
        self._closed = True
        with _LOCK:
            self.handle = next(_NEXT_HANDLE)
            _REGISTRY[self.handle] = weakref.ref(self)
        weakref.finalize(self, _REGISTRY.pop, self.handle, None)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Remove this object from the custom-op registry (idempotent, local). The target stays
        open."""
        if self._closed:
            return
        self._closed = True
        with _LOCK:
            _REGISTRY.pop(self.handle, None)

    def __enter__(self) -> "TorchOps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ core
    def _fn(self, op: str):
        if self._closed:
            raise ClosedError(f"TorchOps.{op}: closed")
        fn = self._fns.get(op)
        if fn is None:
            raise InvalidArgument(f"TorchOps.{op}: the target must serve {op} "
                                  f"(got a target serving {list(self.ops)})")
        return fn

    def _invoke(self, op: str, args, kwargs: Dict[str, Any]):
        """Run ``op`` on torch's current stream with every tensor converted to CuPy; convert
        the result back (returning the caller's tensors where they were the destinations)."""
        torch, cupy = _torch(), _cupy()
        fn = self._fn(op)
        dev = self.device
        with cupy.cuda.Device(dev):
            stream = cupy_stream(dev)
            with stream:
                cargs = [to_cupy(t, name=n, device=dev) for n, t in args]
                ckw = {}
                back = {}
                for k, v in kwargs.items():
                    if isinstance(v, torch.Tensor) or (v is not None and k in
                                                       ("out", "out_lse", "seq_lens",
                                                        "query_start_loc")):
                        c = to_cupy(v, name=k, device=dev)
                        back[id(c)] = v
                        ckw[k] = c
                    else:
                        ckw[k] = v
                res = fn(*cargs, stream=stream, **ckw)
                if isinstance(res, tuple):
                    return tuple(back[id(r)] if id(r) in back else from_cupy(r) for r in res)
                return back[id(res)] if id(res) in back else from_cupy(res)

    def _custom(self, op: str):
        return getattr(_torch().ops.dcpkit, op)

    # ------------------------------------------------------------------ ops
    def q_gather(self, q, *, ubatch: int = 0, out=None):
        """``q`` torch ``[T, H_r, D]`` -> ``[T, H, D]`` (see :class:`~dcpkit.ops.QGather`).
        With ``out`` the call is the custom op ``torch.ops.dcpkit.q_gather`` (capture-safe)."""
        self._fn("q_gather")
        if out is not None:
            self._custom("q_gather")(self.handle, q, out, int(ubatch))
            return out
        return self._invoke("q_gather", [("q", q)], {"ubatch": ubatch})

    def kv_gather(self, kv, *, ubatch: int = 0, out=None):
        """``kv`` torch ``[T, D_kv]`` -> ``[world_size*T, D_kv]`` (see
        :class:`~dcpkit.ops.KVGather`). With ``out`` the call is the custom op."""
        self._fn("kv_gather")
        if out is not None:
            self._custom("kv_gather")(self.handle, kv, out, int(ubatch))
            return out
        return self._invoke("kv_gather", [("kv", kv)], {"ubatch": ubatch})

    def lse_reduce(self, out_partial, lse_partial, *, seq_lens=None, query_start_loc=None,
                   ubatch: int = 0, out=None, out_lse=None):
        """Merge partial attention (see :class:`~dcpkit.ops.LseReduce`): torch
        ``out_partial [T, H, D_v]``, ``lse_partial [T, H]`` -> ``out [T, H_r, D_v]`` (and
        ``out_lse [T, H_r]`` float32 with ``out_lse=`` or a target built with
        ``return_lse=True``). With ``out`` (and every returned tensor caller-provided) the call
        is the custom op ``torch.ops.dcpkit.lse_reduce``."""
        self._fn("lse_reduce")
        returns_lse = bool(getattr(self.target, "return_lse", False))
        if out is not None and (out_lse is not None or not returns_lse):
            self._custom("lse_reduce")(self.handle, out_partial, lse_partial, seq_lens,
                                       query_start_loc, out, out_lse, int(ubatch))
            return out if out_lse is None else (out, out_lse)
        return self._invoke("lse_reduce", [("out_partial", out_partial),
                                           ("lse_partial", lse_partial)],
                            {"seq_lens": seq_lens, "query_start_loc": query_start_loc,
                             "ubatch": ubatch, "out": out, "out_lse": out_lse})

    def __call__(self, *args, **kwargs):
        """For a single-op target: the op's method (``q_gather``, ``kv_gather`` or
        ``lse_reduce``)."""
        if len(self.ops) != 1:
            raise InvalidArgument(f"TorchOps: calling the object needs a single-op target "
                                  f"(got a target serving {list(self.ops)}): call q_gather, "
                                  f"lse_reduce or kv_gather")
        return getattr(self, self.ops[0])(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"TorchOps(handle={self.handle}, ops={list(self.ops)}, device={self.device}, "
                f"closed={self._closed})")
