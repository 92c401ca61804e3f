"""Array descriptions and the argument checks every op runs before it launches anything.

Ops accept CuPy arrays and any object exposing ``__cuda_array_interface__`` (torch tensors go
through :mod:`dcpkit.torch`). :func:`array_info` reduces an argument to an :class:`ArrayInfo`
(shape, strides in bytes, dtype, data pointer, device); the ``check_*`` functions validate that
description, so every check runs, and is tested, without a GPU.

Messages follow ``"<op>: <argument> <property> must <constraint> (got <value>)"``.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from .errors import InvalidArgument, InvalidType

__all__ = [
    "ArrayInfo",
    "array_info",
    "check_dtype",
    "check_ndim",
    "check_device",
    "check_align",
    "check_shape",
    "dtype_name",
    "array_key",
    "is_cupy_array",
    "CUPY_CLASSES",
    "dlpack_info",
    "DLPackInfo",
]


class ArrayInfo(NamedTuple):
    """What the checks and kernels need to know of an array."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    dtype: np.dtype
    ptr: int  # device address of element [0, ..., 0]
    device: int  # CUDA device ordinal
    obj: object  # the original object (kept alive while in use)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def dtype_name(dt) -> str:
    """A short dtype name for messages: ``bfloat16`` for ml_dtypes' bf16 and CuPy's."""
    return str(np.dtype(dt)) if not isinstance(dt, str) else dt


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def array_info(x, op: str, name: str) -> ArrayInfo:
    """Describe ``x`` (a CuPy array or a ``__cuda_array_interface__`` object).

    Raises
    ------
    InvalidType
        ``x`` is a host array (NumPy, a CPU torch tensor), None, or not an array at all; its
        ``__cuda_array_interface__`` is not a dict, lacks ``shape`` / ``typestr`` / ``data``, or
        has a ``typestr`` / ``descr`` NumPy does not understand.
    InvalidArgument
        Its ``__cuda_array_interface__`` is malformed: ``shape`` / ``strides`` not tuples of
        ints (or of different lengths), negative dimensions, ``data`` not a ``(pointer,
        read_only)`` pair, a null pointer with elements, a ``mask``; or the pointer is not
        device memory.
    """
    cls = type(x)
    if cls.__module__.startswith("cupy") and hasattr(x, "data") and hasattr(x, "strides"):
        mem = x.data
        return ArrayInfo(
            tuple(x.shape), tuple(x.strides), x.dtype, int(mem.ptr), int(mem.device_id), x
        )
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        raise InvalidType(
            f"{op}: {name} must be a GPU array (got host {_type_name(x)}: "
            f"move it to the GPU with cupy.asarray first)"
        )
    if cls.__module__.startswith("torch"):
        raise InvalidType(
            f"{op}: {name} must be a CuPy array (got {_type_name(x)}): pass torch "
            f"tensors through dcpkit.torch, which converts them without a copy"
        )
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise InvalidType(f"{op}: {name} must be a GPU array (got {_type_name(x)})")
    shape, strides, dt, ptr = _parse_cai(cai, op, name)
    device = getattr(x, "_dcpkit_device", None)
    if device is None:
        device = _device_of_pointer(ptr, op, name)
    return ArrayInfo(shape, strides, dt, ptr, int(device), x)


#: Array classes that passed array_info's CuPy test (their description is read the same way).
CUPY_CLASSES: set = set()


def is_cupy_array(x) -> bool:
    """Whether ``x`` is described the way :func:`array_info` describes CuPy arrays (its class
    is then remembered in ``CUPY_CLASSES``, where the hot path looks it up)."""
    cls = type(x)
    if cls in CUPY_CLASSES:
        return True
    if cls.__module__.startswith("cupy") and hasattr(x, "data") and hasattr(x, "strides"):
        CUPY_CLASSES.add(cls)
        return True
    return False


def array_key(x) -> tuple | None:
    """A hashable key that determines :func:`array_info` of ``x`` (everything but ``obj``), or
    None where that cannot be read cheaply and exactly.

    Two objects with equal keys get equal descriptions, so a check of one holds for the other
    (see :mod:`dcpkit._plan`): a CuPy array gives ``(class, pointer, shape, strides, dtype,
    device)``; an ``__cuda_array_interface__`` object that names its device (``_dcpkit_device``)
    gives ``(class, device, the interface dict frozen with the type of every value)`` (a bool
    where an int belongs, or a list where a tuple belongs, is a different key, so the check
    that rejects it is never skipped). Anything else gives None: validated in full on every
    call.
    """
    cls = type(x)
    if is_cupy_array(x):
        mem = x.data
        return (cls, mem.ptr, x.shape, x.strides, x.dtype, mem.device_id)
    device = getattr(x, "_dcpkit_device", None)
    if device is None or cls.__module__.startswith("torch") or isinstance(x, np.ndarray):
        return None
    cai = getattr(x, "__cuda_array_interface__", None)
    if type(cai) is not dict:
        return None
    try:
        return (cls, _freeze(device), _freeze(cai))
    except TypeError:  # an unhashable value somewhere
        return None


def _freeze(v):
    """``v`` as a hashable value that is equal only to values of the same types throughout."""
    t = type(v)
    if t is dict:
        return (dict, tuple(sorted(((k, _freeze(x)) for k, x in v.items()), key=repr)))
    if t is tuple or t is list:
        return (t, tuple(_freeze(x) for x in v))
    hash(v)  # TypeError when unhashable
    return (t, v)


def _int_tuple(v) -> tuple[int, ...] | None:
    """``v`` as a tuple of ints (Python or NumPy ints, never bools), or None if it is not one."""
    if not isinstance(v, (tuple, list)):
        return None
    out = []
    for s in v:
        if isinstance(s, (bool, np.bool_)):
            return None
        try:
            out.append(operator.index(s))
        except TypeError:
            return None
    return tuple(out)


def _parse_cai(cai, op: str, name: str) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype, int]:
    """(shape, strides in bytes, dtype, pointer) of a ``__cuda_array_interface__`` dict, every
    field checked (version 2 and 3 of the protocol)."""
    what = f"{op}: {name} __cuda_array_interface__"
    if not isinstance(cai, dict):
        raise InvalidType(f"{what} must be a dict (got {_type_name(cai)})")
    missing = [k for k in ("shape", "typestr", "data") if k not in cai]
    if missing:
        raise InvalidType(
            f"{what} must have the keys 'shape', 'typestr' and 'data' (missing {missing})"
        )
    shape = _int_tuple(cai["shape"])
    if shape is None:
        raise InvalidArgument(f"{what}['shape'] must be a tuple of ints (got {cai['shape']!r})")
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{what}['shape'] dimensions must be >= 0 (got {shape})")
    typestr, descr = cai["typestr"], cai.get("descr")
    try:
        if not isinstance(typestr, str):
            raise TypeError("not a str")
        dt = np.dtype(typestr) if not descr or len(descr) <= 1 else np.dtype(descr)
    except (TypeError, ValueError) as e:
        shown = typestr if not descr or len(descr) <= 1 else descr
        raise InvalidType(
            f"{what}['typestr'] must be a NumPy type string such as '<f4' (got {shown!r}: {e})"
        ) from None
    if dt.itemsize == 0:
        raise InvalidType(f"{what}['typestr'] must describe a fixed-size type (got {typestr!r})")
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        acc, st = dt.itemsize, []
        for s in reversed(shape):
            st.append(acc)
            acc *= s
        strides = tuple(reversed(st))
    else:
        got = strides
        strides = _int_tuple(strides)
        if strides is None:
            raise InvalidArgument(
                f"{what}['strides'] must be None or a tuple of ints (got {got!r})"
            )
        if len(strides) != len(shape):
            raise InvalidArgument(
                f"{what}['strides'] length must equal the number of "
                f"dimensions {len(shape)} (got {strides})"
            )
    data = cai["data"]
    ptr = None
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and not isinstance(data[0], (bool, np.bool_))
    ):
        try:
            ptr = operator.index(data[0])
        except TypeError:
            ptr = None
    if ptr is None:
        raise InvalidArgument(
            f"{what}['data'] must be a (pointer, read_only) pair with an int pointer (got {data!r})"
        )
    if ptr < 0:
        raise InvalidArgument(f"{what}['data'] pointer must be >= 0 (got {ptr})")
    if ptr == 0 and all(shape):
        raise InvalidArgument(
            f"{what}['data'] pointer must not be null for an array with "
            f"elements (got 0, shape {shape})"
        )
    if cai.get("mask") is not None:
        raise InvalidArgument(
            f"{what}['mask'] must be None: masked arrays are not supported "
            f"(got {_type_name(cai['mask'])})"
        )
    return shape, strides, dt, ptr


def _device_of_pointer(ptr: int, op: str = "array_info", name: str = "array") -> int:
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: not a pointer CUDA knows
        raise InvalidArgument(
            f"{op}: {name} data pointer must be device memory (got "
            f"{ptr:#x}: {type(e).__name__}: {e})"
        ) from None
    return int(attrs.device)


def check_dtype(info: ArrayInfo, allowed: Iterable, op: str, name: str) -> None:
    """Raise :class:`InvalidType` unless ``info.dtype`` is one of ``allowed``."""
    dt = info.dtype
    for a in allowed:  # fast path of the hot loop: the workspace's own dtype object
        if dt is a:
            return
    allowed = [np.dtype(a) for a in allowed]
    if info.dtype not in allowed:
        names = ", ".join(dtype_name(a) for a in allowed)
        raise InvalidType(
            f"{op}: {name} dtype must be one of [{names}] (got {dtype_name(info.dtype)})"
        )


def check_ndim(info: ArrayInfo, ndim: int, dims: str, op: str, name: str) -> None:
    """Raise :class:`InvalidArgument` unless ``info`` has ``ndim`` dimensions (named ``dims``)."""
    if len(info.shape) != ndim:
        raise InvalidArgument(
            f"{op}: {name} must have {ndim} dimensions [{dims}] (got shape {info.shape})"
        )


def check_shape(
    info: ArrayInfo, expected: Sequence[int | None], dims: str, op: str, name: str
) -> None:
    """Raise :class:`InvalidArgument` unless ``info.shape`` matches ``expected`` (None = any)."""
    check_ndim(info, len(expected), dims, op, name)
    for got, want in zip(info.shape, expected):
        if want is not None and got != want:
            exp = ", ".join("*" if w is None else str(w) for w in expected)
            raise InvalidArgument(
                f"{op}: {name} shape must be [{exp}] for [{dims}] (got {info.shape})"
            )


def check_device(info: ArrayInfo, device: int, op: str, name: str) -> None:
    """Raise :class:`InvalidArgument` unless ``info`` lives on ``device``."""
    if info.device != device:
        raise InvalidArgument(
            f"{op}: {name} device must be the workspace's GPU {device} (got GPU {info.device})"
        )


def check_align(value: int, align: int, op: str, what: str) -> None:
    """Raise :class:`InvalidArgument` unless ``value`` (a pointer or a byte count) is a multiple
    of ``align``."""
    if value % align:
        raise InvalidArgument(f"{op}: {what} must be a multiple of {align} bytes (got {value})")


# ----------------------------------------------------------------------------- DLPack
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


class DLPackInfo(NamedTuple):
    """What a DLPack capsule describes. ``ptr`` is ``data + byte_offset``: the address of
    element ``[0, ..., 0]``; ``strides`` are in elements (None: C-contiguous)."""

    ptr: int
    device_type: int
    device_id: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    dtype_code: int
    dtype_bits: int
    dtype_lanes: int


def dlpack_info(capsule) -> DLPackInfo:
    """Read a DLPack capsule (``"dltensor"`` or ``"dltensor_versioned"``) without consuming it.

    The data pointer is ``data + byte_offset``: producers may hand out a slice as the base
    allocation plus a non-zero ``byte_offset``, and a consumer that reads ``data`` alone points
    at the wrong element.

    Raises
    ------
    InvalidType
        ``capsule`` is not a DLPack capsule (or one already consumed).
    """
    api = ctypes.pythonapi
    api.PyCapsule_IsValid.restype = ctypes.c_int
    api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    if api.PyCapsule_IsValid(capsule, b"dltensor"):
        # DLManagedTensor: the DLTensor comes first
        t = _DLTensor.from_address(api.PyCapsule_GetPointer(capsule, b"dltensor"))
    elif api.PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        t = _DLManagedTensorVersioned.from_address(
            api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        ).dl_tensor
    else:
        raise InvalidType(
            f"dlpack_info: capsule must be an unconsumed DLPack capsule (got {_type_name(capsule)})"
        )
    nd = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(nd))
    strides = tuple(int(t.strides[i]) for i in range(nd)) if t.strides else None
    return DLPackInfo(
        int(t.data or 0) + int(t.byte_offset),
        int(t.device.device_type),
        int(t.device.device_id),
        shape,
        strides,
        int(t.dtype.code),
        int(t.dtype.bits),
        int(t.dtype.lanes),
    )
