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
stream, one wrapper per stream handle), so a torch kernel that writes an input right before the
call and one that reads the output right after need no synchronisation. No copy, no extra
event.

Conversions. A :class:`TorchOps` call does not go through DLPack for its inputs: it describes
each tensor to the op as a CuPy array over ``data_ptr()`` (which already counts the storage
offset) with the tensor's shape, strides and dtype, memoised per description (data pointer,
shape, strides, storage offset, dtype, device, tensor class; see :class:`TensorConverter` for
why this key and not the tensor's identity). Results that are views of workspace memory cross
back through DLPack once per result array (memoised with the array's shape and strides, the only
parts of a CuPy array that can change in place), then as a fresh ``detach()`` alias of the
first. :func:`to_cupy` and :func:`from_cupy` stay plain DLPack round trips.

Outputs. With ``out=`` (and, for ``lse_reduce``, ``out_lse=`` or ``return_lse`` unset) the call
writes into the caller's tensors, allocates nothing (capture-safe) and returns them. It is the
custom op (``torch.ops.dcpkit.q_gather`` etc.) whenever torch must see it as one: under
``torch.compile`` tracing, under a torch dispatch mode, with tensor subclasses (fake or
functional tensors). A plain eager call does the custom op's work directly (the same call, then
the same version bump of the tensors written), without the dispatcher's cost.
Without ``out=`` the result is the op's own output (a view of workspace memory, with the op's
lifetime rule) wrapped as a torch tensor without a copy.

Custom ops take an integer handle: :class:`TorchOps` registers itself under a fresh id in a
registry of weak references (the registry keeps nothing alive) and removes it on
:meth:`TorchOps.close`. A graph that captured a custom op must not be replayed after the
dcpkit op it used is closed.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import _torch_registry as _reg
from ._arrays import CUPY_CLASSES, is_cupy_array
from ._checks import check_int as _int
from ._torch_streams import current_stream, raw_stream_fn, wrap_stream
from .errors import ClosedError, InvalidArgument, InvalidType, MissingDependency

__all__ = [
    "to_cupy",
    "from_cupy",
    "cupy_stream",
    "TorchOps",
    "register_custom_ops",
    "supported_dtypes",
    "TensorConverter",
]


_torch = _reg.torch_module


def _cupy():
    try:
        import cupy
    except ImportError as e:
        from ._cuda import cuda_extra

        raise MissingDependency("cupy", cuda_extra(), str(e)) from None
    return cupy


def supported_dtypes() -> tuple:
    """The torch dtypes that cross into CuPy: float16, bfloat16, float32, float64 and the
    integer types (float8 tensors: pass ``t.view(torch.uint8)``)."""
    torch = _torch()
    return (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
    )


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _check_tensor(t, name: str, device: int | None) -> None:
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"dcpkit.torch: {name} must be a torch.Tensor (got {_type_name(t)})")
    if t.device.type != "cuda":
        raise InvalidType(
            f"dcpkit.torch: {name} must be a CUDA tensor (got device {t.device}): "
            f"move it to the GPU with .cuda()"
        )
    if device is not None and t.device.index != device:
        raise InvalidArgument(
            f"dcpkit.torch: {name} device must be the op's GPU cuda:{device} (got {t.device})"
        )
    if t.dtype not in supported_dtypes():
        names = ", ".join(str(d).replace("torch.", "") for d in supported_dtypes())
        raise InvalidType(
            f"dcpkit.torch: {name} dtype must be one of [{names}] (got {t.dtype}); "
            f"pass float8 tensors as t.view(torch.uint8)"
        )


def to_cupy(t, *, name: str = "tensor", device: int | None = None):
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
    a = _cupy().from_dlpack(t.detach())
    if a.size and a.data.ptr != t.data_ptr():  # a consumer that ignored DLPack's byte_offset
        from .errors import DcpkitError

        raise DcpkitError(
            f"dcpkit.torch: {name} data pointer must survive the DLPack import "
            f"(got {a.data.ptr:#x} for data_ptr() {t.data_ptr():#x}: the "
            f"capsule's byte_offset was not applied)"
        )
    return a


def from_cupy(a):
    """A torch tensor sharing the CuPy array ``a``'s memory (DLPack, no copy; bfloat16
    included). The tensor keeps ``a``'s memory alive; a view of workspace memory is still only
    valid under the op's lifetime rule.

    Raises
    ------
    MissingDependency
        torch is not installed.
    InvalidType
        ``a`` is not a CuPy array (a NumPy array, None, a tensor).
    """
    torch = _torch()
    if not is_cupy_array(a):
        raise InvalidType(f"dcpkit.torch.from_cupy: a must be a CuPy array (got {_type_name(a)})")
    return torch.from_dlpack(a)


#: A CuPy stream object over a stream handle (no new stream); torch's current stream handle.
_wrap_stream = wrap_stream


def _raw_stream_fn():
    return raw_stream_fn(_torch())


def cupy_stream(device: int | None = None):
    """torch's current stream on ``device`` (default: torch's current device) as a CuPy
    stream object (no new stream is created; the handle is shared).

    Raises
    ------
    MissingDependency
        torch (or CuPy) is not installed.
    InvalidType, InvalidArgument
        ``device`` is neither None nor the ordinal of a GPU torch sees.
    DcpkitError
        torch cannot reach a CUDA GPU (a CPU build of torch, no driver, no device).
    """
    torch = _torch()
    device = _reg.cuda_device(torch, device, "dcpkit.torch.cupy_stream")
    return current_stream(torch, device)


def describe(t) -> tuple:
    """The description a tensor is memoised under (:class:`TensorConverter`, :class:`TorchOps`'
    call plans, which read these seven fields inline into one flat key per call): ``(class,
    data_ptr(), shape, stride(), storage_offset(), dtype, device index)``. Raises
    AttributeError / TypeError / RuntimeError for what is not a tensor."""
    return (type(t), t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.get_device())


class TensorConverter:
    """torch tensors -> CuPy arrays over the same memory, memoised per tensor description.

    Naive equivalent: ``cupy.from_dlpack(t.detach())`` after :func:`to_cupy`'s checks.

    The key is ``(class, data_ptr(), shape, stride(), storage_offset(), dtype, device index)``:
    what the CuPy array describes (the storage offset is already in ``data_ptr()``; it is keyed
    too so that the key alone says which element the array starts at), so two tensors with equal
    keys get equal arrays. Why not the tensor's identity (``id(t)``, ``t._cdata``, the version
    counter): an identity is reused once the tensor is freed, and a live tensor's shape or
    strides can change under it (``as_strided_``, ``set_``, ``resize_``), so an identity key
    could hand out an array that describes other memory or another layout. With the description
    as the key, memory freed and reused at the same address with the same layout is described
    rightly by the cached array, and any other layout is a new key, checked in full
    (:func:`to_cupy`'s checks) before it is stored. The cached arrays own nothing (they do not
    keep a tensor alive): an array is only handed out for a live tensor of its very description,
    for the duration of a call. The data pointer is ``data_ptr()``, which counts the storage
    offset: a slice's array starts at the slice.

    Parameters
    ----------
    device : int, optional
        Required CUDA device ordinal (None: any GPU).
    max_entries : int
        Bound on the arrays kept (the oldest is dropped).
    check : callable, optional
        ``check(t, name, device)``, the checks of a new description (default: those of
        :func:`to_cupy`).

    Raises
    ------
    InvalidType, InvalidArgument
        ``device`` is not an int >= 0, ``max_entries`` not one >= 1, ``check`` not callable.
    """

    __slots__ = ("_arrays", "_check", "_np", "device", "hits", "max_entries", "misses")

    def __init__(self, device: int | None = None, max_entries: int = 256, check=None):
        op = "TensorConverter"
        self.device = None if device is None else _int(device, op, "device")
        self.max_entries = _int(max_entries, op, "max_entries", minimum=1)
        if check is not None and not callable(check):
            raise InvalidType(f"{op}: check must be None or a callable (got {_type_name(check)})")
        self._arrays: dict[tuple, Any] = {}
        self._check = check or _check_tensor
        self._np = None
        self.hits = self.misses = 0

    def cached(self, key) -> bool:
        """Whether the array of the description ``key`` (:func:`describe`) is memoised."""
        return key in self._arrays

    def _dtype(self, t):
        if self._np is None:
            from .reference import resolve_dtype

            self._np = {d: resolve_dtype(str(d).replace("torch.", "")) for d in supported_dtypes()}
        return self._np[t.dtype]

    def __call__(self, t, name: str = "tensor"):
        """The CuPy array of ``t`` (raises as :func:`to_cupy` does)."""
        try:
            key = describe(t)
        except (AttributeError, TypeError, RuntimeError):
            key = None
        a = self._arrays.get(key) if key is not None else None
        if a is not None:
            self.hits += 1
            return a
        self._check(t, name, self.device)  # raises for anything to_cupy refuses
        self.misses += 1
        if key is None or t.numel() == 0:
            return _cupy().from_dlpack(t.detach())
        cupy = _cupy()
        isz = t.element_size()
        nbytes = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * isz + isz
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, None, max(t.get_device(), 0))
        a = cupy.ndarray(
            tuple(t.shape),
            self._dtype(t),
            cupy.cuda.MemoryPointer(mem, 0),
            strides=tuple(s * isz for s in t.stride()),
        )
        if len(self._arrays) >= self.max_entries:
            del self._arrays[next(iter(self._arrays))]
        self._arrays[key] = a
        return a

    def clear(self) -> None:
        self._arrays.clear()


# The custom ops and the registry of live handles their kernels look up: dcpkit._torch_registry
# (process-wide, shared by a reload of this module).
_REGISTRY = _reg.REGISTRY
_NEXT_HANDLE = _reg.NEXT_HANDLE
_LOCK = _reg.LOCK
register_custom_ops = _reg.register_custom_ops


# ----------------------------------------------------------------------------- front end
#: The tensor arguments of ``lse_reduce``, in the order of its signature.
_LSE_TENSORS = ("out_partial", "lse_partial", "seq_lens", "query_start_loc", "out", "out_lse")


def _keyed_entries(target) -> dict[str, tuple]:
    """op name -> ``(entry, dcp)``: the target's keyed entry of that op, which takes the flat
    key of its arrays (:mod:`dcpkit._plan`) instead of building it. A gather's entry is
    DCPComm's ``_gather(op, x, name, ubatch, out, stream, key)`` (``dcp`` True) or a direct
    gather's ``_call_keyed(key, x, ubatch, out, stream, False)``; ``lse_reduce``'s is
    ``_lse_keyed(key, arrays, ubatch, stream)`` (DCPComm's, any lse_reduce op's). Only for
    targets that have one; the others are called plainly."""
    from ._lse_call import LseReduceCall

    entries = {}
    if hasattr(target, "_lse_keyed") and hasattr(target, "_gather"):  # DCPComm
        entries["q_gather"] = entries["kv_gather"] = (target._gather, True)
        entries["lse_reduce"] = (target._lse_keyed, True)
    elif isinstance(target, LseReduceCall):
        entries["lse_reduce"] = (target._lse_keyed, False)
    elif getattr(target, "op_name", None) in ("q_gather", "kv_gather") and hasattr(
        target, "_gather_plan"
    ):  # a direct gather (GatherWorkspace)
        entries[target.op_name] = (target._call_keyed, False)
    return entries


# NOTE [dcpkit torch plain eager]: a call with ``out=`` may skip the custom op when it is plain
# eager: every tensor a plain ``torch.Tensor`` (no subclass such as a fake or functional
# tensor), no torch dispatch mode active and no ``torch.compile`` tracing. It then does exactly
# what the custom op's kernel does (``_gather_work`` or ``_lse_work``, then the version bump of
# what it wrote), without the dispatcher. The test is read inline in ``TorchOps.q_gather``,
# ``kv_gather`` and ``lse_reduce`` (no Python call between the method and the work).


#: Keyword arguments of the ops that are tensors (converted; returned as the caller's tensors).
_TENSOR_KEYWORDS = frozenset(("out", "out_lse", "seq_lens", "query_start_loc"))


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
            raise InvalidType(
                f"TorchOps: target must be a dcpkit op or DCPComm (got {_type_name(target)})"
            )
        self.target = target
        self.ops = ops
        self.device = int(target.device)
        self._custom_ops = register_custom_ops()
        self._conv = TensorConverter(self.device)
        self._streams: dict[int, Any] = {}  # stream handle -> CuPy stream object
        self._results: dict[int, tuple] = {}  # id(res) -> (res, shape, strides, tensor)
        self._raw_stream = _raw_stream_fn()
        self._get_device = _cupy().cuda.runtime.getDevice
        self._cupy_stream_now = _cupy().cuda.get_current_stream
        torch = _torch()
        self._tensor_type = torch.Tensor
        # where torch cannot tell, every out= call goes through the custom op
        self._dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
        self._compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: True)
        self._returns_lse = bool(getattr(target, "return_lse", False))
        # Call plans: what a call's tensor descriptions (and ubatch) determine: the converted
        # arrays and the flat key the target's keyed entry takes (see _plan_for).
        self._plans: dict[tuple, Any] = {}
        self._entries = _keyed_entries(target)
        # the version bump of what an eager out= call wrote (the custom ops' own)
        self._bump = _reg.state["increment_version"]
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

    def __enter__(self) -> TorchOps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ core
    def _fn(self, op: str):
        if self._closed:
            raise ClosedError(f"TorchOps.{op}: closed")
        fn = self._fns.get(op)
        if fn is None:
            raise InvalidArgument(
                f"TorchOps.{op}: the target must serve {op} (got a target serving {list(self.ops)})"
            )
        return fn

    def _stream(self):
        """torch's current stream on the op's GPU as a CuPy stream (one object per handle: the
        handle is the stream, so a handle seen again is the same stream)."""
        ptr = self._raw_stream(self.device)
        s = self._streams.get(ptr)
        if s is None:
            if len(self._streams) >= 64:
                self._streams.clear()
            s = self._streams[ptr] = _wrap_stream(ptr, self.device)
        return s

    def _to_torch(self, res):
        """A torch tensor over the CuPy result ``res`` (a view of workspace memory): DLPack
        once per result array, then a fresh alias (``detach()``) of that tensor (a caller that
        changes the returned tensor's metadata in place changes its own alias only).

        The memo is keyed on the array object together with its shape and strides: the entry
        holds the array (its id cannot be reused while the entry lives, and the DLPack tensor
        holds it anyway), and a CuPy array's data pointer, dtype and device cannot change in
        place, only its shape and strides can (``a.shape = ...``), which are compared on
        every hit; an array reshaped in place gets a new tensor."""
        ent = self._results.get(id(res))
        if ent is not None and ent[0] is res and ent[1] == res.shape and ent[2] == res.strides:
            return ent[3].detach()
        t = from_cupy(res)
        if type(res) not in CUPY_CLASSES and not is_cupy_array(res):
            return t
        if len(self._results) >= 256 and id(res) not in self._results:
            del self._results[next(iter(self._results))]
        self._results[id(res)] = (res, res.shape, res.strides, t)
        return t.detach()

    def _invoke(self, op: str, args, kwargs: dict[str, Any]):
        """Run ``op`` on torch's current stream with every tensor described as a CuPy array;
        convert the result back (returning the caller's tensors where they were the
        destinations).

        ``args``: ``((name, tensor), ...)``, the positional tensors; ``kwargs``: the keywords,
        tensors among them converted."""
        fn = self._fns.get(op) if not self._closed else None
        if fn is None:
            fn = self._fn(op)  # raises: closed, or an op the target does not serve
        conv = self._conv
        if len(args) == 1:
            ((n, t),) = args
            cargs = (conv(t, n),)
        else:
            cargs = tuple(conv(t, n) for n, t in args)
        ckw = {}
        back = None  # id of a converted destination -> the caller's tensor
        for k, v in kwargs.items():
            if v is not None and k in _TENSOR_KEYWORDS:
                c = conv(v, k)
                if back is None:
                    back = {}
                back[id(c)] = v
                ckw[k] = c
            else:
                ckw[k] = v
        # torch's current stream on the op's GPU as a CuPy stream (one object per handle: the
        # handle is the stream, so a handle seen again is the same stream)
        ptr = self._raw_stream(self.device)
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._stream()
        if self._get_device() == self.device:
            if self._cupy_stream_now(self.device).ptr == ptr:  # CuPy's current is torch's
                res = fn(*cargs, stream=stream, **ckw)
            else:  # made CuPy's current for the call: what the op allocates is ordered on it
                with stream:
                    res = fn(*cargs, stream=stream, **ckw)
        else:
            with _cupy().cuda.Device(self.device), stream:
                res = fn(*cargs, stream=stream, **ckw)
        if back is None:
            if type(res) is tuple:
                return tuple(self._to_torch(r) for r in res)
            return self._to_torch(res)
        if type(res) is tuple:
            return tuple(back[id(r)] if id(r) in back else self._to_torch(r) for r in res)
        return back[id(res)] if id(res) in back else self._to_torch(res)

    def _custom(self, op: str):
        return self._custom_ops[op]

    # ------------------------------------------------------------------ ops
    def q_gather(self, q, *, ubatch: int = 0, out=None):
        """``q`` torch ``[T, H_r, D]`` -> ``[T, H, D]``: see :meth:`QGather.__call__
        <dcpkit.ops.QGather.__call__>`. With ``out`` the call is the custom op
        ``torch.ops.dcpkit.q_gather`` (capture-safe) when traced or under a dispatch mode, the
        same work called directly otherwise (NOTE [dcpkit torch plain eager])."""
        if self._closed or "q_gather" not in self._fns:
            self._fn("q_gather")  # raises
        if out is None:
            return self._gather_work("q_gather", "q", q, ubatch, None)
        T = self._tensor_type
        if type(q) is T and type(out) is T and not self._dispatch_modes() and not self._compiling():
            self._gather_work("q_gather", "q", q, int(ubatch), out)  # what the custom op runs
            self._bump((out,))
        else:
            self._custom("q_gather")(self.handle, q, out, int(ubatch))
        return out

    def kv_gather(self, kv, *, ubatch: int = 0, out=None):
        """``kv`` torch ``[T, D_kv]`` -> ``[world_size*T, D_kv]``: see :meth:`KVGather.__call__
        <dcpkit.ops.KVGather.__call__>`; ``out`` as in :meth:`q_gather`."""
        if self._closed or "kv_gather" not in self._fns:
            self._fn("kv_gather")  # raises
        if out is None:
            return self._gather_work("kv_gather", "kv", kv, ubatch, None)
        T = self._tensor_type
        if (
            type(kv) is T
            and type(out) is T
            and not self._dispatch_modes()
            and not self._compiling()
        ):
            self._gather_work("kv_gather", "kv", kv, int(ubatch), out)  # what the custom op runs
            self._bump((out,))
        else:
            self._custom("kv_gather")(self.handle, kv, out, int(ubatch))
        return out

    def _gather_work(self, op: str, name: str, x, ubatch, out):
        """The work of a gather call (also the custom op's kernel): through the call plan of
        the tensors' descriptions where the target has a keyed entry, else :meth:`_invoke`.
        Returns the result (``out`` itself when given).

        The plan's key is ``(op, ubatch)`` followed by :func:`describe`'s seven fields of ``x``
        and, with ``out``, of ``out``: one flat tuple (no tuple per tensor), read inline."""
        entry = self._entries.get(op)
        if entry is not None and type(ubatch) is int:
            try:
                if out is None:
                    key = (op, ubatch, type(x), x.data_ptr(), x.shape, x.stride(),
                           x.storage_offset(), x.dtype, x.get_device())  # fmt: skip
                else:
                    key = (op, ubatch, type(x), x.data_ptr(), x.shape, x.stride(),
                           x.storage_offset(), x.dtype, x.get_device(),
                           type(out), out.data_ptr(), out.shape, out.stride(),
                           out.storage_offset(), out.dtype, out.get_device())  # fmt: skip
            except (AttributeError, TypeError, RuntimeError):
                key = None
            plan = self._plans.get(key)
            if plan is None and key is not None:
                plan = self._plan_for(key, ((name, x), ("out", out)), ubatch)
            if plan is not None:
                (cx, cout), flat = plan
                fn, dcp = entry
                ptr = self._raw_stream(self.device)
                stream = self._streams.get(ptr)
                if stream is None:
                    stream = self._stream()
                dev = self.device
                if self._get_device() == dev and self._cupy_stream_now(dev).ptr == ptr:
                    if dcp:
                        res = fn(op, cx, name, ubatch, cout, stream, flat)
                    else:
                        res = fn(flat, cx, ubatch, cout, stream, False)
                else:
                    args = (op, cx, name, ubatch, cout, stream, flat) if dcp else (
                        flat, cx, ubatch, cout, stream, False)  # fmt: skip
                    res = self._made_current(stream, fn, args)
                return out if out is not None else self._to_torch(res)
        kw = {"ubatch": ubatch} if out is None else {"ubatch": ubatch, "out": out}
        return self._invoke(op, ((name, x),), kw)

    def _lse_work(self, tensors: tuple, ubatch, results: bool = True):
        """The work of an ``lse_reduce`` call (``tensors``: the six of the signature, None for
        an absent one; also the custom op's kernel), as :meth:`_gather_work` does it. Returns
        the result in the target's form, the caller's tensors where they were written; None
        without ``results`` (a caller that returns its own tensors: no result is converted).

        The plan's key: for the decode loop's calls (no masks, no ``out_lse``) ``("lse_reduce",
        ubatch)``, then :func:`describe`'s fields of the two inputs and of ``out``, or of the
        two inputs then None (one flat tuple of 23 or 17 values); for any other call
        ``("lse_reduce", ubatch)`` and the six descriptions (None for an absent tensor: 8
        values). Keys of different forms differ in length, so never compare equal."""
        entry = self._entries.get("lse_reduce")
        if entry is not None and type(ubatch) is int:
            x, lse, seq, qsl, out, out_lse = tensors
            try:
                if seq is None and qsl is None and out_lse is None and out is not None:
                    key = ("lse_reduce", ubatch, type(x), x.data_ptr(), x.shape, x.stride(),
                           x.storage_offset(), x.dtype, x.get_device(),
                           type(lse), lse.data_ptr(), lse.shape, lse.stride(),
                           lse.storage_offset(), lse.dtype, lse.get_device(),
                           type(out), out.data_ptr(), out.shape, out.stride(),
                           out.storage_offset(), out.dtype, out.get_device())  # fmt: skip
                elif seq is None and qsl is None and out_lse is None:
                    key = ("lse_reduce", ubatch, type(x), x.data_ptr(), x.shape, x.stride(),
                           x.storage_offset(), x.dtype, x.get_device(),
                           type(lse), lse.data_ptr(), lse.shape, lse.stride(),
                           lse.storage_offset(), lse.dtype, lse.get_device(), None)  # fmt: skip
                else:
                    key = ("lse_reduce", ubatch) + tuple(
                        None if t is None else describe(t) for t in tensors
                    )
            except (AttributeError, TypeError, RuntimeError):
                key = None
            plan = self._plans.get(key)
            if plan is None and key is not None:
                plan = self._plan_for(key, tuple(zip(_LSE_TENSORS, tensors)), ubatch)
            if plan is not None:
                arrays, flat = plan
                fn = entry[0]
                ptr = self._raw_stream(self.device)
                stream = self._streams.get(ptr)
                if stream is None:
                    stream = self._stream()
                dev = self.device
                if self._get_device() == dev and self._cupy_stream_now(dev).ptr == ptr:
                    res = fn(flat, arrays, ubatch, stream)
                else:
                    res = self._made_current(stream, fn, (flat, arrays, ubatch, stream))
                if not results:
                    return None
                if type(res) is tuple:
                    r, lse = res
                    r = out if r is arrays[4] and out is not None else self._to_torch(r)
                    if not (lse is arrays[5] and out_lse is not None):
                        lse = self._to_torch(lse)
                    else:
                        lse = out_lse
                    return r, lse
                return out if res is arrays[4] and out is not None else self._to_torch(res)
        names = _LSE_TENSORS
        kw = dict(zip(names[2:], tensors[2:]))
        kw["ubatch"] = ubatch
        res = self._invoke("lse_reduce", tuple(zip(names[:2], tensors[:2])), kw)
        return res if results else None

    def _plan_for(self, key: tuple, named: tuple, ubatch):
        """The call plan of ``key``: every tensor converted (its checks run on a new
        description: raises as :func:`to_cupy` does), then the flat key of the converted arrays
        (:mod:`dcpkit._plan`). The converted arrays are this object's own (nobody else can
        change their shape), so the flat key stays theirs. None, and nothing stored, when a
        tensor's array is not memoised (an empty tensor): the call then goes through
        :meth:`_invoke`."""
        from ._plan import arrays_key, pair_key

        conv = self._conv
        arrays = []
        for n, t in named:
            if t is None:
                arrays.append(None)
                continue
            a = conv(t, n)
            if not conv.cached(describe(t)):
                return None
            arrays.append(a)
        if len(arrays) == 2:
            arrays = tuple(arrays)
            plan = (arrays, pair_key(arrays[0], arrays[1], ubatch, False))
        else:
            arrays = tuple(arrays)
            plan = (arrays, arrays_key(arrays, ubatch))
        if len(self._plans) >= 256:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def _made_current(self, stream, fn, args):
        """``fn(*args)`` with ``stream`` (torch's current stream) made CuPy's current stream and
        the op's GPU CuPy's current device, for a call where either is not already (what the
        target allocates is then ordered on the stream)."""
        if self._get_device() == self.device:
            with stream:
                return fn(*args)
        with _cupy().cuda.Device(self.device), stream:
            return fn(*args)

    def lse_reduce(
        self,
        out_partial,
        lse_partial,
        *,
        seq_lens=None,
        query_start_loc=None,
        ubatch: int = 0,
        out=None,
        out_lse=None,
    ):
        """Merge partial attention: see :meth:`LseReduce.__call__
        <dcpkit.ops.LseReduce.__call__>` (torch tensors, same shapes; returns ``out``, or
        ``(out, out_lse)`` with ``out_lse=`` or a target built with ``return_lse=True``). With
        ``out`` (and every returned tensor caller-provided) the call is the custom op
        ``torch.ops.dcpkit.lse_reduce``, or the same work called directly, as in
        :meth:`q_gather`."""
        op = "lse_reduce"
        if self._closed or op not in self._fns:
            self._fn(op)  # raises
        tensors = (out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse)
        if out is None or (out_lse is None and self._returns_lse):
            return self._lse_work(tensors, ubatch)
        T = self._tensor_type  # plain eager (NOTE [dcpkit torch plain eager])
        if (
            type(out_partial) is T
            and type(lse_partial) is T
            and type(out) is T
            and (seq_lens is None or type(seq_lens) is T)
            and (query_start_loc is None or type(query_start_loc) is T)
            and (out_lse is None or type(out_lse) is T)
            and not self._dispatch_modes()
            and not self._compiling()
        ):
            self._lse_work(tensors, int(ubatch), False)  # what the custom op would run
            self._bump((out,) if out_lse is None else (out, out_lse))
        else:
            self._custom(op)(self.handle, *tensors, int(ubatch))
        return out if out_lse is None else (out, out_lse)

    def __call__(self, *args, **kwargs):
        """For a single-op target: the op's method (``q_gather``, ``kv_gather`` or
        ``lse_reduce``)."""
        if len(self.ops) != 1:
            raise InvalidArgument(
                f"TorchOps: calling the object needs a single-op target "
                f"(got a target serving {list(self.ops)}): call q_gather, "
                f"lse_reduce or kv_gather"
            )
        return getattr(self, self.ops[0])(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"TorchOps(handle={self.handle}, ops={list(self.ops)}, device={self.device}, "
            f"closed={self._closed})"
        )
