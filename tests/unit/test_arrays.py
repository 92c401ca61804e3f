"""dcpkit._arrays.array_info on malformed ``__cuda_array_interface__`` objects: every defect
raises InvalidArgument / InvalidType naming the op and the argument, never a bare KeyError,
TypeError or ValueError. No GPU: the objects describe made-up addresses on "device 0"."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from dcpkit._arrays import array_info
from dcpkit.errors import InvalidArgument, InvalidType

PTR = 0x7F0000000000


class Cai:
    """An object exposing the given ``__cuda_array_interface__`` on device 0."""

    def __init__(self, cai):
        self.__cuda_array_interface__ = cai
        self._dcpkit_device = 0


def good(**change):
    cai = {"shape": (4, 8), "typestr": "<f4", "data": (PTR, False), "strides": None, "version": 3}
    cai.update(change)
    return {k: v for k, v in cai.items() if v is not _DROP}


_DROP = object()


def test_well_formed_interfaces():
    i = array_info(Cai(good()), "op", "x")
    assert (i.shape, i.strides, i.dtype, i.ptr, i.device) == ((4, 8), (32, 4), np.float32, PTR, 0)
    i = array_info(Cai(good(strides=(4, 16), shape=[8, 4], data=[PTR, True])), "op", "x")
    assert (i.shape, i.strides) == ((8, 4), (4, 16))
    i = array_info(Cai(good(shape=(np.int64(3),), typestr="|u1", strides=_DROP)), "op", "x")
    assert (i.shape, i.strides, i.dtype) == ((3,), (1,), np.uint8)
    # a zero-size array may carry a null pointer (protocol v3)
    assert array_info(Cai(good(shape=(0, 8), data=(0, False))), "op", "x").ptr == 0
    assert array_info(Cai(good(mask=None)), "op", "x").shape == (4, 8)


@pytest.mark.parametrize(
    "cai,exc,fragment",
    [
        ("not a dict", InvalidType, "__cuda_array_interface__ must be a dict (got builtins.str)"),
        (
            good(shape=_DROP),
            InvalidType,
            "must have the keys 'shape', 'typestr' and 'data' (missing ['shape'])",
        ),
        (good(typestr=_DROP, data=_DROP), InvalidType, "(missing ['typestr', 'data'])"),
        (good(shape=(4.0, 8)), InvalidArgument, "['shape'] must be a tuple of ints (got (4.0, 8))"),
        (good(shape=("4", 8)), InvalidArgument, "['shape'] must be a tuple of ints"),
        (good(shape=(True, 8)), InvalidArgument, "['shape'] must be a tuple of ints"),
        (good(shape=4), InvalidArgument, "['shape'] must be a tuple of ints (got 4)"),
        (good(shape=None), InvalidArgument, "['shape'] must be a tuple of ints (got None)"),
        (good(shape=(4, -8)), InvalidArgument, "['shape'] dimensions must be >= 0 (got (4, -8))"),
        (
            good(typestr="<q9"),
            InvalidType,
            "['typestr'] must be a NumPy type string such as '<f4' (got '<q9'",
        ),
        (good(typestr=None), InvalidType, "['typestr'] must be a NumPy type string"),
        (good(typestr=4), InvalidType, "['typestr'] must be a NumPy type string"),
        (good(typestr="|V0"), InvalidType, "['typestr'] must describe a fixed-size type"),
        (
            good(descr=[("a", "<zz"), ("b", "<f4")]),
            InvalidType,
            "['typestr'] must be a NumPy type string",
        ),
        (
            good(strides=(4,)),
            InvalidArgument,
            "['strides'] length must equal the number of dimensions 2 (got (4,))",
        ),
        (good(strides=(4.0, 1.0)), InvalidArgument, "['strides'] must be None or a tuple of ints"),
        (good(strides="C"), InvalidArgument, "['strides'] must be None or a tuple of ints"),
        (
            good(data=None),
            InvalidArgument,
            "['data'] must be a (pointer, read_only) pair with an int pointer (got None)",
        ),
        (good(data=PTR), InvalidArgument, "['data'] must be a (pointer, read_only) pair"),
        (good(data=(None, False)), InvalidArgument, "['data'] must be a (pointer, read_only) pair"),
        (good(data=("0x10", False)), InvalidArgument, "['data'] must be a (pointer, read_only)"),
        (good(data=(True, False)), InvalidArgument, "['data'] must be a (pointer, read_only)"),
        (good(data=(PTR,)), InvalidArgument, "['data'] must be a (pointer, read_only)"),
        (good(data=(-16, False)), InvalidArgument, "['data'] pointer must be >= 0 (got -16)"),
        (
            good(data=(0, False)),
            InvalidArgument,
            "['data'] pointer must not be null for an array with elements",
        ),
        (
            good(mask=object()),
            InvalidArgument,
            "['mask'] must be None: masked arrays are not supported",
        ),
    ],
)
def test_malformed_interface(cai, exc, fragment):
    with pytest.raises(exc) as ei:
        array_info(Cai(cai), "lse_reduce", "out_partial")
    msg = str(ei.value)
    assert msg.startswith("lse_reduce: out_partial __cuda_array_interface__"), msg
    assert fragment in msg, msg


def test_not_an_array():
    for x in (None, 3, "x", object()):
        with pytest.raises(InvalidType, match=r"^q_gather: q must be a GPU array"):
            array_info(x, "q_gather", "q")
    with pytest.raises(InvalidType, match=r"got host numpy.ndarray"):
        array_info(np.zeros(3), "q_gather", "q")


# ----------------------------------------------------------------------------- DLPack
class _Managed(ctypes.Structure):
    from dcpkit._arrays import _DLTensor

    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


def _capsule(data, byte_offset, shape, strides=None, *, versioned=False, device=(2, 3)):
    """A DLPack capsule made by hand, as a producer that slices with byte_offset would."""
    from dcpkit._arrays import _DLManagedTensorVersioned

    keep = []
    m = _DLManagedTensorVersioned() if versioned else _Managed()
    t = m.dl_tensor
    t.data, t.byte_offset = data, byte_offset
    t.device.device_type, t.device.device_id = device
    t.ndim = len(shape)
    sh = (ctypes.c_int64 * len(shape))(*shape)
    keep.append(sh)
    t.shape = ctypes.cast(sh, ctypes.POINTER(ctypes.c_int64))
    if strides is not None:
        st = (ctypes.c_int64 * len(strides))(*strides)
        keep.append(st)
        t.strides = ctypes.cast(st, ctypes.POINTER(ctypes.c_int64))
    t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 16, 1
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = b"dltensor_versioned" if versioned else b"dltensor"
    return new(ctypes.addressof(m), name, None), (m, keep)


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_pointer_counts_the_byte_offset(versioned):
    from dcpkit._arrays import dlpack_info

    cap, keep = _capsule(PTR, 4096 + 64, (3, 8), (16, 1), versioned=versioned)
    info = dlpack_info(cap)
    assert info.ptr == PTR + 4096 + 64  # not the base allocation's address
    assert (info.device_type, info.device_id) == (2, 3)
    assert (info.shape, info.strides) == ((3, 8), (16, 1))
    assert (info.dtype_code, info.dtype_bits, info.dtype_lanes) == (2, 16, 1)
    cap, keep = _capsule(PTR, 0, (5,), versioned=versioned)
    assert dlpack_info(cap).ptr == PTR and dlpack_info(cap).strides is None
    with pytest.raises(InvalidType, match="must be an unconsumed DLPack capsule"):
        dlpack_info(object())


def test_dlpack_pointer_of_real_slices():
    torch = pytest.importorskip("torch")
    from dcpkit._arrays import dlpack_info

    x = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    for t in (x, x[2:], x[:, 3:], x[1::2, 5:]):
        assert dlpack_info(t.__dlpack__()).ptr == t.data_ptr()
