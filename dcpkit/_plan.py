"""A cache of validated call plans, keyed on everything the validation looked at.

An op call spends most of its host time checking its arguments and deriving what the launch
needs (grid, strides in elements, pointers, the packed kernel parameters). For a decode loop
those are the same on every step: the same buffers, the same ``T``, the same stream. The op
keeps one :class:`PlanCache`; a call builds its key with :func:`call_key` and either finds the
plan of an earlier identical call or runs the full validation (the *miss*), which raises exactly
as it does without the cache, and stores the plan only when it succeeded.

The key is the whole input of the validation, not a handle to an allocation:

* every array contributes :func:`dcpkit._arrays.array_key`: data pointer, shape, strides in
  bytes, dtype, device and the array's type. The validation of an argument reads nothing else,
  so a plan is a pure function of its key: memory that was freed and reused at the same address
  with the same layout is validated the same way (the plan is right for it), and the same
  address with another layout (a view with other strides, another dtype) is a different key
  that gets its own full validation. An array whose description cannot be read cheaply and
  exactly (an ``__cuda_array_interface__`` object without a known device) makes the call
  uncacheable: it is validated in full every time.
* every scalar contributes ``(type, value)``: ``True == 1`` and ``1.0 == 1`` in Python, so a
  value alone would let ``ubatch=True`` reuse the plan of ``ubatch=1`` and skip the check that
  rejects it.
* an absent optional argument contributes :data:`ABSENT`, which no array key equals.

What the key cannot carry is checked on every call, outside the plan: whether the workspace is
closed or poisoned, whether the stream is capturing, the debug-mode agreement.

The hot path's key. :func:`call_key` is general (any array type, any scalar) and costs a Python
call per part. For the common call, CuPy arrays (of a class :func:`~dcpkit._arrays.array_key`
accepted before) and scalars of their exact expected types, an op builds a flat key instead:
per array ``(pointer, shape, strides, dtype, device)`` read once each (a CuPy array's ``shape``
can be reassigned in place, so the shape is always read, never remembered), then the scalars
(:func:`pair_key`, :func:`arrays_key`). It keys exactly what the validation reads, as
:func:`call_key` does, so the same reasoning holds (a freed and reused address with the same
layout is validated the same way; any other layout is another key). A flat key never equals a
:func:`call_key` key (its first element is an int or None, theirs a tuple), so both live in
one :class:`PlanCache`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ._arrays import CUPY_CLASSES, array_key, is_cupy_array

__all__ = [
    "PlanCache",
    "LazyPlanCache",
    "call_key",
    "scalar_key",
    "pair_key",
    "arrays_key",
    "ABSENT",
]

#: Key part of an optional argument that was not given (None).
ABSENT = ("absent",)


def scalar_key(value) -> Hashable:
    """``(type(value), value)``: equal only for values of one type (``True`` is not ``1``).
    Unhashable values give ``None`` (the call is then uncacheable)."""
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value), value)


def call_key(arrays, scalars=()) -> tuple | None:
    """The plan-cache key of a call: one part per array argument (``None`` for an absent
    optional one) and one per scalar argument, in a fixed order; ``None`` when some part cannot
    be keyed (the call is then validated in full, never cached).

    Parameters
    ----------
    arrays : sequence
        The array arguments (CuPy arrays, ``__cuda_array_interface__`` objects, or None).
    scalars : sequence
        The other arguments that the validation reads (ubatch, flags, the stream handle).
    """
    parts = []
    for a in arrays:
        if a is None:
            parts.append(ABSENT)
            continue
        k = array_key(a)
        if k is None:
            return None
        parts.append(k)
    for s in scalars:
        t = type(s)
        if t is int or t is bool or t is str:  # hashable: no need to try
            parts.append((t, s))
            continue
        k = scalar_key(s)
        if k is None:
            return None
        parts.append(k)
    return tuple(parts)


def pair_key(x, out, ubatch, flag) -> tuple | None:
    """The flat key of a call with one input array ``x``, an optional ``out`` and two scalars,
    an int ``ubatch`` and a bool ``flag``; None when an argument is not of those exact types
    (the caller then keys the call with :func:`call_key`)."""
    fast = CUPY_CLASSES
    if type(ubatch) is not int or type(flag) is not bool:
        return None
    if type(x) not in fast and not is_cupy_array(x):
        return None
    m = x.data
    if out is None:
        return (m.ptr, x.shape, x.strides, x.dtype, m.device_id, ubatch, flag)
    if type(out) not in fast and not is_cupy_array(out):
        return None
    o = out.data
    return (
        m.ptr,
        x.shape,
        x.strides,
        x.dtype,
        m.device_id,
        o.ptr,
        out.shape,
        out.strides,
        out.dtype,
        o.device_id,
        ubatch,
        flag,
    )


def _part(a, fast) -> tuple | None:
    """One array's part of a flat key: ``(None,)`` when absent, five values starting with its
    pointer when a CuPy array, None otherwise."""
    if a is None:
        return (None,)
    if type(a) in fast or is_cupy_array(a):
        m = a.data
        return (m.ptr, a.shape, a.strides, a.dtype, m.device_id)
    return None


def arrays_key(arrays, ubatch) -> tuple | None:
    """The flat key of a call with the array arguments ``arrays`` (the first two CuPy arrays,
    the others CuPy arrays or None) and an int ``ubatch``; None when an argument is not of
    those exact types. An absent array contributes one None, a present one five values
    starting with its pointer (an int), so the key reads back unambiguously.

    The two calls of a decode loop, ``lse_reduce``'s six arrays with nothing or only ``out``
    after the first two, are one tuple each (no part built on its own, nothing concatenated);
    any other call is keyed part by part, to the same layout."""
    if type(ubatch) is not int:
        return None
    fast = CUPY_CLASSES
    x, y = arrays[0], arrays[1]
    if (type(x) not in fast and not is_cupy_array(x)) or (
        type(y) not in fast and not is_cupy_array(y)
    ):
        return None
    m, n = x.data, y.data
    if len(arrays) == 6 and arrays[2] is None and arrays[3] is None and arrays[5] is None:
        o = arrays[4]
        if o is None:
            return (
                m.ptr,
                x.shape,
                x.strides,
                x.dtype,
                m.device_id,
                n.ptr,
                y.shape,
                y.strides,
                y.dtype,
                n.device_id,
                None,
                None,
                None,
                None,
                ubatch,
            )
        if type(o) in fast or is_cupy_array(o):
            p = o.data
            return (
                m.ptr,
                x.shape,
                x.strides,
                x.dtype,
                m.device_id,
                n.ptr,
                y.shape,
                y.strides,
                y.dtype,
                n.device_id,
                None,
                None,
                p.ptr,
                o.shape,
                o.strides,
                o.dtype,
                p.device_id,
                None,
                ubatch,
            )
        return None
    parts = [(m.ptr, x.shape, x.strides, x.dtype, m.device_id)]
    parts.append((n.ptr, y.shape, y.strides, y.dtype, n.device_id))
    for a in arrays[2:]:
        if a is None:
            parts.append((None,))
        else:
            part = _part(a, fast)
            if part is None:
                return None
            parts.append(part)
    parts.append((ubatch,))
    return sum(parts, ())


class PlanCache:
    """Validated plans of an op's calls, at most ``max_entries`` of them (oldest dropped).

    Parameters
    ----------
    build : callable
        ``build(*args) -> plan``: the full validation of a call (raises on bad input, launches
        nothing). Run on every miss; its result is stored only when it returns.
    max_entries : int
        Bound on the plans kept (a decode loop needs a handful: one per distinct buffer set
        and ``T``).

    Attributes
    ----------
    hits, misses : int
        Counts of lookups served from the cache and of full validations.
    """

    __slots__ = ("_build", "_plans", "hits", "max_entries", "misses")

    def __init__(self, build: Callable[..., Any], max_entries: int = 256):
        if max_entries < 1:
            raise ValueError("PlanCache: max_entries must be >= 1")
        self._build = build
        self._plans: dict[Hashable, Any] = {}
        self.max_entries = int(max_entries)
        self.hits = 0
        self.misses = 0

    def lookup(self, key: Hashable | None, *args):
        """The plan of the call keyed ``key`` (built from ``args`` on a miss; ``key=None``:
        always built, never stored)."""
        if key is not None:
            plan = self._plans.get(key)
            if plan is not None:
                self.hits += 1
                return plan
        plan = self._build(*args)  # raises on bad input: nothing is stored
        self.misses += 1
        if key is not None and plan is not None:
            plans = self._plans
            if len(plans) >= self.max_entries:
                del plans[next(iter(plans))]
            plans[key] = plan
        return plan

    def get(self, key: Hashable | None, arrays, scalars, *args):
        """:meth:`lookup` with a flat key (:func:`pair_key`); ``key=None``: keyed by
        :func:`call_key` of ``arrays`` and ``scalars``."""
        if key is None:
            return self.lookup(call_key(arrays, scalars), *args)
        plan = self._plans.get(key)
        if plan is None:
            return self.lookup(key, *args)
        self.hits += 1
        return plan

    def clear(self) -> None:
        """Forget every plan (the op calls it at close and whenever its own state that plans
        depend on changes)."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class LazyPlanCache:
    """A class attribute that gives an object without a plan cache of its own (built with
    ``__new__``) a :class:`PlanCache` of its method ``build``, made on first read and kept in
    the instance's ``__dict__`` under the attribute's name (a non-data descriptor: the
    instance's own attribute wins from then on, at the cost of a plain attribute read)."""

    def __init__(self, build: str):
        self.build = build

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        plans = obj.__dict__[self.name] = PlanCache(getattr(obj, self.build))
        return plans
