"""Whether a call's arrays share memory.

An output that shares bytes with an input (or with the other output) is read and written by the
same kernels, and what it holds at the end depends on the order of their loads and stores: a
result that can look right and be wrong. Every op refuses such a call with
:class:`~dcpkit.errors.InvalidArgument` before anything is launched or counted. The check runs
where a call is validated in full (a plan miss: plans are keyed on the arrays' addresses, shapes
and strides, so another layout or address is validated again).

The test is exact (NumPy's overlap solver on the addresses, shapes and strides; it never reads
the memory): disjoint interleaved views of one buffer, such as two column slices, pass. A layout
that the solver cannot decide within a bounded effort counts as overlapping.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ._arrays import ArrayInfo
from .errors import InvalidArgument

__all__ = [
    "check_disjoint",
    "check_outside_workspace",
    "check_writable_layout",
    "overlaps_itself",
    "shares_memory",
    "workspace_region",
]

#: Effort bound of NumPy's solver; beyond it a pair counts as overlapping.
_MAX_WORK = 1 << 16
_TOO_HARD = getattr(np, "exceptions", np).TooHardError


class _Extent:
    """An array interface over an address: the solver reads only address, shape and strides."""

    __slots__ = ("__array_interface__",)

    def __init__(self, info: ArrayInfo):
        self.__array_interface__ = {
            "data": (int(info.ptr), True),
            "shape": tuple(int(n) for n in info.shape),
            "strides": tuple(int(s) for s in info.strides),
            "typestr": f"|V{int(info.itemsize)}",
            "version": 3,
        }


def _bounds(info: ArrayInfo) -> tuple[int, int]:
    """``[lo, hi)``: the bytes an array with no empty dimension can touch."""
    lo = hi = int(info.ptr)
    for n, s in zip(info.shape, info.strides):
        step = int(s) * (int(n) - 1)
        if step < 0:
            lo += step
        else:
            hi += step
    return lo, hi + int(info.itemsize)


def shares_memory(a: ArrayInfo, b: ArrayInfo) -> bool:
    """True when ``a`` and ``b`` have a byte in common (or the solver cannot tell)."""
    if not all(a.shape) or not all(b.shape):
        return False  # an empty array has no bytes
    a_lo, a_hi = _bounds(a)
    b_lo, b_hi = _bounds(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    try:
        return bool(
            np.shares_memory(np.asarray(_Extent(a)), np.asarray(_Extent(b)), max_work=_MAX_WORK)
        )
    except (_TOO_HARD, ValueError):  # too hard to decide, or too big for NumPy: overlapping
        return True


def overlaps_itself(info: ArrayInfo) -> bool:
    """True when two elements of ``info`` may share a byte (a zero stride over an extent > 1,
    or strides too small for the extents below them), so that writing it depends on the order
    of the stores. Sufficient, not exact: the dimensions sorted by stride must each step past
    the whole span of the ones below (every C- or F-ordered, padded or sliced layout does)."""
    if not all(info.shape):
        return False
    span = int(info.itemsize)
    dims = sorted(
        ((int(n), abs(int(s))) for n, s in zip(info.shape, info.strides) if int(n) > 1),
        key=lambda d: d[1],
    )
    for n, s in dims:
        if s < span:
            return True
        span = s * (n - 1) + span
    return False


def check_writable_layout(op: str, name: str, info: ArrayInfo | None) -> None:
    """Raise :class:`InvalidArgument` when an output's elements overlap one another
    (:func:`overlaps_itself`): a broadcast view, or strides smaller than a row."""
    if info is not None and overlaps_itself(info):
        raise InvalidArgument(
            f"{op}: {name} elements must not overlap one another (got shape {info.shape}, "
            f"strides {info.strides} bytes): give {name} memory of its own"
        )


def check_disjoint(
    op: str,
    outputs: Iterable[tuple[str, ArrayInfo | None]],
    inputs: Iterable[tuple[str, ArrayInfo | None]] = (),
) -> None:
    """Raise :class:`InvalidArgument` when an output shares memory with an input or with
    another output. ``outputs`` and ``inputs``: ``(argument name, ArrayInfo or None)``, None
    for an argument not given."""
    outs = [(n, i) for n, i in outputs if i is not None]
    ins = [(n, i) for n, i in inputs if i is not None]
    for k, (name, info) in enumerate(outs):
        for other, other_info in outs[k + 1 :] + ins:
            if shares_memory(info, other_info):
                raise InvalidArgument(
                    f"{op}: {name} must not share memory with {other}: give {name} memory of "
                    f"its own"
                )


def workspace_region(ws) -> ArrayInfo | None:
    """The symmetric region of the op workspace ``ws`` on this rank as one byte array (its
    signals, data slots and, for the push gathers, graph output buffers), or None for a
    workspace not set up yet (no heap)."""
    heap = getattr(ws, "heap", None)
    n = int(getattr(ws, "_region", 0))
    if heap is None or n <= 0:
        return None
    lo = int(heap.local_ptr) + int(getattr(ws, "_base", 0))
    return ArrayInfo((n,), (1,), np.dtype(np.uint8), lo, int(getattr(ws, "device", 0)), None)


def check_outside_workspace(ws, op: str, outputs: Iterable[tuple[str, ArrayInfo | None]]) -> None:
    """Raise :class:`InvalidArgument` when an output shares a byte with the symmetric region
    of the op workspace ``ws`` (:func:`workspace_region`): for the gathers, a view an earlier
    call returned; for every op, heap memory the op reserved. The peers store into that region
    while a call runs, so a result written there would be overwritten. Exact, as
    :func:`shares_memory`."""
    region = workspace_region(ws)
    if region is None:
        return
    for name, info in outputs:
        if info is not None and shares_memory(info, region):
            raise InvalidArgument(
                f"{op}: {name} must not lie in the op's own workspace memory (a view an "
                f"earlier call returned, or heap memory the op reserved: the peers store "
                f"there while a call runs): give {name} memory of its own"
            )
