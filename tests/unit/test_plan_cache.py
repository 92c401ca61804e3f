"""dcpkit._plan: the call-plan cache and its keys. A cached plan never hides an error: the same
pointer with another layout, dtype, device or argument type is another key and gets the full
validation; a failed validation stores nothing. No GPU: CuPy arrays over made-up addresses and
``__cuda_array_interface__`` objects."""

from __future__ import annotations

import numpy as np
import pytest

from dcpkit._arrays import CUPY_CLASSES, array_info, array_key
from dcpkit._plan import ABSENT, PlanCache, call_key, scalar_key
from dcpkit.errors import InvalidArgument, InvalidType
from dcpkit.ops.q_gather import QGather

cupy = pytest.importorskip("cupy")
PTR = 1 << 36


def cp(shape, dtype=np.float16, strides=None, ptr=PTR, device=0):
    mem = cupy.cuda.UnownedMemory(ptr, 1 << 24, None, device)
    return cupy.ndarray(tuple(shape), dtype, cupy.cuda.MemoryPointer(mem, 0), strides=strides)


class Cai:
    def __init__(self, cai, device=0):
        self.__cuda_array_interface__ = cai
        if device is not None:
            self._dcpkit_device = device


def cai(**change):
    d = {"shape": (4, 8), "typestr": "<f2", "data": (PTR, False), "strides": None, "version": 3}
    d.update(change)
    return d


# ----------------------------------------------------------------------------- keys
def test_cupy_key_is_the_whole_description():
    a = cp((4, 8))
    assert array_key(a) == array_key(cp((4, 8)))  # another object, same memory
    i = array_info(a, "op", "a")
    assert array_key(a)[1:] == (i.ptr, i.shape, i.strides, i.dtype, i.device)
    different = [
        cp((4, 8), strides=(32, 2)),  # same pointer, padded rows
        cp((8, 4)),  # same pointer, other shape
        cp((4, 8), np.uint16),  # same pointer, other dtype
        cp((4, 8), device=1),  # same address, other GPU
        cp((4, 8), ptr=PTR + 256),
    ]
    keys = {array_key(x) for x in different}
    assert len(keys) == len(different) and array_key(a) not in keys


def test_cai_key_carries_the_type_of_every_value():
    base = array_key(Cai(cai()))
    assert base is not None and base == array_key(Cai(cai()))
    for other in (
        cai(shape=(True, 8)),
        cai(shape=[4, 8]),
        cai(data=(PTR, 0)),
        cai(strides=(16, 2)),
        cai(typestr="<u2"),
        cai(mask=None),
        cai(shape=(np.int64(4), 8)),
    ):
        assert array_key(Cai(other)) != base, other
    assert array_key(Cai(cai(), device=1)) != base
    assert array_key(Cai(cai(), device=None)) is None  # device unknown: never cached
    assert array_key(Cai(cai(shape=[[4], 8]))) is not None
    assert array_key(Cai(cai(descr=[{"a", "b"}]))) is None  # unhashable inside: never cached
    assert array_key(np.zeros(3)) is None and array_key(object()) is None


def test_scalar_keys_tell_types_apart():
    assert scalar_key(1) != scalar_key(True) and scalar_key(1) != scalar_key(1.0)
    assert scalar_key(1) == scalar_key(1)
    assert scalar_key([1]) is None
    assert call_key([cp((2, 2)), None], [0]) == call_key([cp((2, 2)), None], [0])
    assert call_key([None], []) == (ABSENT,)
    assert call_key([cp((2, 2))], [0]) != call_key([cp((2, 2))], [False])
    assert call_key([Cai(cai(), device=None)], [0]) is None
    assert call_key([cp((2, 2))], [[0]]) is None


# ----------------------------------------------------------------------------- the cache
def test_a_failed_validation_stores_nothing_and_raises_again():
    calls = []

    def build(x):
        calls.append(x)
        if x < 0:
            raise InvalidArgument(f"op: x must be >= 0 (got {x})")
        return ("plan", x)

    c = PlanCache(build, max_entries=2)
    assert c.lookup(("k", 1), 1) == ("plan", 1) and c.lookup(("k", 1), 1) == ("plan", 1)
    assert (c.hits, c.misses, len(calls)) == (1, 1, 1)
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="x must be >= 0"):
            c.lookup(("k", -1), -1)
    assert len(c) == 1 and len(calls) == 3
    assert c.lookup(None, 5) == ("plan", 5) and c.lookup(None, 5) == ("plan", 5)
    assert len(c) == 1 and c.misses == 3  # uncacheable: validated every time
    c.lookup(("k", 2), 2)
    c.lookup(("k", 3), 3)  # bound 2: the oldest goes
    assert len(c) == 2 and c.lookup(("k", 1), 1) and c.misses == 6
    c.clear()
    assert len(c) == 0
    with pytest.raises(ValueError):
        PlanCache(build, max_entries=0)


# ----------------------------------------------------------------------------- with an op
def _q_workspace():
    ws = QGather.__new__(QGather)
    ws.rank, ws.world_size, ws.num_ubatches, ws.device = 0, 2, 2, 0
    ws._closed, ws._rec = False, np.zeros(8, dtype=np.uint32)
    ws._calls, ws._captured, ws._debug = [0, 0], [False, False], False
    ws._init_geometry(2, 8, 4, 64, "float16", None)
    return ws


def _cached_validate(ws, cache, q, ubatch=0, out=None, padded=False):
    key = call_key((q, out), (ubatch, padded))
    return cache.lookup(key, q, ubatch, out, padded)


def test_a_cached_q_gather_plan_never_hides_an_error():
    ws = _q_workspace()
    cache = PlanCache(ws._validate)
    good = cp((5, 4, 64))
    for _ in range(3):
        T, ub, qi, oi = _cached_validate(ws, cache, good, 1)
        assert (T, ub, qi.ptr, oi) == (5, 1, PTR, None)
    assert (cache.hits, cache.misses) == (2, 1)
    # the same address, re-described: a padded token stride that is not 16-byte aligned
    with pytest.raises(InvalidArgument, match="token stride"):
        _cached_validate(ws, cache, cp((5, 4, 64), strides=(520, 128, 2)), 1)
    # the same address, another dtype; then another head count
    with pytest.raises(InvalidType, match="q dtype must be"):
        _cached_validate(ws, cache, cp((5, 4, 64), np.float32), 1)
    with pytest.raises(InvalidArgument, match="q shape must be"):
        _cached_validate(ws, cache, cp((5, 3, 64)), 1)
    # ubatch True after ubatch 1 was cached: still refused
    with pytest.raises(InvalidType, match="ubatch must be an int"):
        _cached_validate(ws, cache, good, True)
    # a fake array at the cached address with another layout (freed and reused memory)
    with pytest.raises(InvalidArgument, match="head stride"):
        _cached_validate(
            ws,
            cache,
            Cai(
                {
                    "shape": (5, 4, 64),
                    "typestr": "<f2",
                    "data": (PTR, False),
                    "strides": (1024, 256, 2),
                }
            ),
            1,
        )
    assert len(cache) == 1


def test_flat_keys_are_the_whole_description_and_only_for_exact_types():
    """The hot path's keys (pair_key, arrays_key): every field array_info reads, once per
    array; an argument of another type (an interface object, a bool ubatch, an int flag) gives
    no flat key (the call is keyed by call_key instead); absent arrays cannot shift a key."""
    from dcpkit._plan import arrays_key, pair_key

    a, b = cp((2, 4, 8)), cp((2, 8, 8), ptr=PTR + 4096)
    base = pair_key(a, b, 0, False)
    assert base == pair_key(cp((2, 4, 8)), cp((2, 8, 8), ptr=PTR + 4096), 0, False)
    variants = [
        pair_key(cp((2, 4, 8), strides=(128, 16, 2)), b, 0, False),  # a padded token stride
        pair_key(cp((2, 4, 8), np.float32), b, 0, False),
        pair_key(cp((2, 4, 8), device=1), b, 0, False),
        pair_key(cp((2, 4, 8), ptr=PTR + 16), b, 0, False),
        pair_key(a, None, 0, False),
        pair_key(a, b, 1, False),
        pair_key(a, b, 0, True),
    ]
    assert base is not None and None not in variants
    assert len({base, *variants}) == len(variants) + 1
    moved = cp((2, 4, 8))
    moved.shape = (2, 32)  # reshaped in place: the key reads the shape every time
    assert pair_key(moved, b, 0, False) != base
    cai = Cai({"shape": (2, 4, 8), "typestr": "<f2", "data": (PTR, False), "version": 3})
    assert pair_key(cai, b, 0, False) is None and pair_key(a, cai, 0, False) is None
    assert pair_key(a, b, True, False) is None and pair_key(a, b, 0, 0) is None
    x, y, s = cp((2, 8, 8)), cp((2, 8), np.float32, ptr=PTR + 8192), cp((3,), np.int32)
    keys = [
        arrays_key((x, y, s, None, None, None), 0),
        arrays_key((x, y, None, s, None, None), 0),
        arrays_key((x, y, None, None, s, None), 0),
        arrays_key((x, y, None, None, None, s), 0),
        arrays_key((x, y, None, None, None, None), 0),
    ]
    assert None not in keys and len(set(keys)) == len(keys)  # position is part of the key
    assert arrays_key((x, y, cai, None, None, None), 0) is None
    assert arrays_key((x, y, None, None, None, None), False) is None
    assert all(k[0] != call_key((x,))[0] for k in keys)  # never a call_key key


def test_the_decode_loop_keys_of_arrays_key_equal_the_part_by_part_key():
    """arrays_key builds the two keys of a decode loop (nothing, or only ``out``, after the
    first two arrays) in one expression: they equal the key built part by part, and an ``out``
    that is not a CuPy array still gives no flat key."""
    from dcpkit._plan import _part, arrays_key

    x, y, o = cp((2, 8, 8)), cp((2, 8), np.float32, ptr=PTR + 8192), cp((2, 4, 8), ptr=PTR + 1024)

    def by_parts(arrays, ubatch):
        key = _part(arrays[0], CUPY_CLASSES) + _part(arrays[1], CUPY_CLASSES)
        for a in arrays[2:]:
            key += _part(a, CUPY_CLASSES)
        return key + (ubatch,)

    for arrays in ((x, y, None, None, None, None), (x, y, None, None, o, None)):
        for ub in (0, 3):
            assert arrays_key(arrays, ub) == by_parts(arrays, ub), arrays
    cai = Cai({"shape": (2, 4, 8), "typestr": "<f2", "data": (PTR, False), "version": 3})
    assert arrays_key((x, y, None, None, cai, None), 0) is None
    assert arrays_key((x, y, None, None, o, o), 1) == by_parts((x, y, None, None, o, o), 1)

    # every field of every array is in the decode loop's keys: the same pointer re-described
    # (strides, shape, dtype, device) is another key, for each of the three arrays
    def redescribed(a, ptr):
        shape, dt = a.shape, a.dtype
        return [
            cp(shape, dt, strides=tuple(2 * s for s in a.strides), ptr=ptr),
            cp(shape[::-1], dt, ptr=ptr),
            cp(shape, np.float64 if dt != np.float64 else np.float32, ptr=ptr),
            cp(shape, dt, ptr=ptr, device=1),
        ]

    base = arrays_key((x, y, None, None, o, None), 0)
    keys = {base, arrays_key((x, y, None, None, None, None), 0)}
    for i, (a, ptr) in enumerate(((x, PTR), (y, PTR + 8192), (o, PTR + 1024))):
        for other in redescribed(a, ptr):
            arrays = [x, y, None, None, o, None]
            arrays[(0, 1, 4)[i]] = other
            keys.add(arrays_key(tuple(arrays), 0))
            if i < 2:
                arrays[4] = None
                keys.add(arrays_key(tuple(arrays), 0))
    assert None not in keys and len(keys) == 2 + 4 * 5


def test_op_classes_read_attributes_plainly_and_make_their_plan_cache_on_first_use():
    """No class of an op defines ``__getattr__`` (it would route every attribute read of the hot
    path through it); a workspace built with ``__new__`` gets its plan cache on first read, kept
    in the instance, and CuPy's current-stream function from the class."""
    from dcpkit.ops import KVGather, LseReduce
    from dcpkit.ops._workspace import _cupy_current_stream

    for cls in (QGather, KVGather, LseReduce):
        assert all("__getattr__" not in vars(k) for k in cls.__mro__ if k is not object), cls
        ws = cls.__new__(cls)
        plans = ws._plans
        assert (
            isinstance(plans, PlanCache) and ws._plans is plans and ws.__dict__["_plans"] is plans
        )
        assert ws._current_stream_fn is _cupy_current_stream
    fresh = QGather.__new__(QGather)
    assert fresh._plans is not plans and len(fresh._plans) == 0
