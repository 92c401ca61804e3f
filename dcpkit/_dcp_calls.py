"""The calls of :class:`~dcpkit.manager.DCPComm`: the path of each call, and the call itself.

Route plans. DCPComm's own checks of a call (array_info, ndim, :meth:`DCPCalls.path_for`, the
layouts the direct op takes in place) read only the call's arrays' descriptions and values fixed
at construction, equal on every rank: their outcome is memoised per call key and per op
(:mod:`dcpkit._plan`; a failed check stores nothing, so a bad call raises every time). The key
is the flat key the direct op itself uses (:func:`~dcpkit._plan.pair_key`,
:func:`~dcpkit._plan.arrays_key`), a superset of what the route reads: on a hit whose direct
op takes every array in place, the call goes straight to the op's keyed entry with that same
key, so the arguments are keyed once and validated once (by the op, on its own miss).
"""

from __future__ import annotations

import numpy as np

from . import _cuda
from ._arrays import ArrayInfo, array_info, check_ndim
from ._checks import resolve_stream
from ._lse_call import lse_reduce_method
from ._overlap import check_disjoint, check_outside_workspace, check_writable_layout
from ._plan import PlanCache, pair_key
from ._strided import copy_arrays, strided_copy
from .errors import InvalidArgument
from .selection import OPS, PATH_NCCL, direct_call_blocker, select_path

__all__ = ["DCPCalls"]

#: The array arguments of ``lse_reduce`` that DCPComm checks itself.
_LSE_NAMES = ("out_partial", "lse_partial", "out", "out_lse")
#: ``key`` of :meth:`DCPCalls._gather` when the caller has no key: the call is keyed there.
_UNKEYED = object()


class _RouteCaches:
    """A class attribute that gives a DCPComm its route caches (op -> :class:`PlanCache` of
    :meth:`DCPCalls._route`) on first read, stored in the instance's ``__dict__`` under the
    same name (a non-data descriptor: the instance's own attribute wins from then on, at the
    cost of a plain attribute read per call)."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        caches = obj.__dict__["_route_caches"] = {o: PlanCache(obj._route) for o in OPS}
        return caches


class DCPCalls:
    """The per-call half of :class:`~dcpkit.manager.DCPComm` (a mixin: the state it reads is
    set up by DCPComm's constructor)."""

    def _check_built(self, op: str) -> None:
        if op not in self.ops:
            raise InvalidArgument(
                f"DCPComm.{op}: kv_row_dim must be given at construction to "
                f"use kv_gather (got kv_row_dim=None)"
            )

    def path_for(self, op: str, tokens: int, lse_dtype=None) -> str:
        """The path a call of ``op`` with ``T = tokens`` (and ``lse_dtype``) takes; raises
        where :meth:`lse_reduce` etc. would."""
        blocker = self.direct_reason[op] or direct_call_blocker(
            op, tokens=tokens, max_tokens=self.max_tokens, lse_dtype=lse_dtype
        )
        nccl_blocker = None
        if self.nccl_ops[op] is None:
            nccl_blocker = self.nccl_reason or "no NCCL op was built"
        return select_path(
            f"DCPComm.{op}",
            self.policy,
            direct_path=self._direct_path[op],
            direct_blocker=blocker,
            nccl_blocker=nccl_blocker,
        )

    def _record(self, op: str, path: str) -> None:
        self.last_path = path
        self.counters[op][path] += 1

    def _stream(self, stream):
        """``stream``, or the current CuPy stream for None; :class:`InvalidType` unless a CuPy
        stream."""
        return resolve_stream(stream, "DCPComm", self.device)

    def _normalised(self, arr, info: ArrayInfo, ok: bool, name: str, op: str, stream):
        """``arr`` itself when the direct kernel reads its layout, else a C-contiguous copy
        (eager only: the copy allocates)."""
        if ok:
            return arr
        if stream.is_capturing():
            raise InvalidArgument(
                f"DCPComm.{op}: {name} layout must be C-contiguous and 16-byte aligned while a "
                f"CUDA graph is being captured (got strides {info.strides} bytes, pointer "
                f"offset {info.ptr % 16}): the copy that fixes it would allocate"
            )
        import cupy

        with cupy.cuda.Device(self.device), stream:
            nbytes = int(np.prod(info.shape)) * info.itemsize
            fresh = cupy.empty(max(nbytes, 16), dtype=cupy.uint8)[:nbytes]
            c = fresh.view(info.dtype).reshape(info.shape)
        copy_arrays(array_info(c, f"DCPComm.{op}", name), info, stream)
        return c

    def _copy_out(self, dst, src, stream) -> None:
        strided_copy(dst, src, stream)

    # ------------------------------------------------------------------ routes
    #: op -> its route plans (one cache per op: the same arrays may be a valid call of one op
    #: and a bad call of another), made on first read and kept in the instance's ``__dict__``.
    _route_caches = _RouteCaches()

    def _routes(self, op: str) -> PlanCache:
        """The route plans of ``op``."""
        return self._route_caches[op]

    def _check_outputs(self, name: str, given: list) -> None:
        """The outputs ``given`` (``(argument, ArrayInfo)``) of a call: no element over
        another (a copy into them would depend on the order of its stores), none in the
        workspace of any of this object's direct ops (whichever path serves the call: the
        copy route writes them with a copy, not with the op's kernel)."""
        for n, info in given:
            check_writable_layout(name, n, info)
        for direct in self.direct_ops.values():
            if direct is not None:
                check_outside_workspace(direct, name, given)

    def _route(self, op: str, arrays: tuple, masks: tuple = ()) -> tuple:
        """``(path, in_place, ok)``: the path of the call, whether the direct op takes every
        array in place, and per array whether it does (None arrays: True). ``arrays``: ``(x,
        out)`` of a gather, ``(out_partial, lse_partial, out, out_lse)`` of ``lse_reduce``, and
        ``masks`` its ``(seq_lens, query_start_loc)``. An output sharing memory with another
        array (for ``lse_reduce``, but its own partials: an in-place call) is refused here,
        whichever path would serve the call (:func:`~dcpkit._overlap.check_disjoint`)."""
        name = f"DCPComm.{op}"
        if op == "lse_reduce":
            names = _LSE_NAMES
            x = array_info(arrays[0], name, "out_partial")
            check_ndim(x, 3, "T, H, D_v", name, "out_partial")
            li = array_info(arrays[1], name, "lse_partial")
            check_ndim(li, 2, "T, H", name, "lse_partial")
            path = self.path_for(op, x.shape[0], lse_dtype=li.dtype)
            given = [
                (n, array_info(a, name, n)) for n, a in zip(names[2:], arrays[2:]) if a is not None
            ]
            # out= / out_lse= over the partials: an in-place call, which every path serves
            masked = [
                (n, array_info(a, name, n))
                for n, a in zip(("seq_lens", "query_start_loc"), masks)
                if a is not None
            ]
            check_disjoint(name, given, masked)
        else:
            names = ("q" if op == "q_gather" else "kv", "out")
            dims = (3, "T, H_r, D") if op == "q_gather" else (2, "T, D_kv")
            x = array_info(arrays[0], name, names[0])
            check_ndim(x, dims[0], dims[1], name, names[0])
            path = self.path_for(op, x.shape[0])
            given = [] if arrays[1] is None else [("out", array_info(arrays[1], name, "out"))]
            check_disjoint(name, given, ((names[0], x),))
        self._check_outputs(name, given)
        if path == PATH_NCCL:
            return (path, False, ())
        direct = self.direct_ops[op]
        ok = tuple(
            a is None or direct.accepts_layout(**{n: array_info(a, name, n)})
            for n, a in zip(names, arrays)
        )
        return (path, all(ok), ok)

    # ------------------------------------------------------------------ calls
    def q_gather(self, q, *, ubatch: int = 0, out=None, stream=None):
        """``q [T, H_r, D_q]`` on every rank -> ``[T, H, D_q]``: see
        :meth:`QGather.__call__ <dcpkit.ops.QGather.__call__>` (same arguments, same result,
        same output lifetime).

        Collective: every rank, same ``T`` and ubatch. Stream: on ``stream``.

        Raises
        ------
        InvalidArgument
            ``policy="direct"`` and the direct op cannot serve the call; bad arguments (from
            the op that serves the call).
        """
        return self._gather("q_gather", q, "q", ubatch, out, stream)

    def kv_gather(self, kv, *, ubatch: int = 0, out=None, stream=None):
        """``kv [T, D_kv]`` on every rank -> ``[world_size*T, D_kv]``: see
        :meth:`KVGather.__call__ <dcpkit.ops.KVGather.__call__>`. Collective, stream and errors
        as :meth:`q_gather`; also :class:`InvalidArgument` when ``kv_row_dim`` was not given at
        construction.
        """
        if not self._closed:
            self._check_built("kv_gather")
        return self._gather("kv_gather", kv, "kv", ubatch, out, stream)

    def _gather(self, op: str, x, name: str, ubatch, out, stream, key=_UNKEYED):
        """One gather call (``q_gather`` or ``kv_gather``) on the path :meth:`path_for` picks;
        an input or ``out=`` the direct op cannot take in place is copied (module docstring of
        :mod:`dcpkit.manager`). ``key``: the call's flat key
        (:func:`~dcpkit._plan.pair_key` of ``x, out, ubatch, False``) where the caller has it
        already (:mod:`dcpkit.torch`, for arrays whose description cannot change)."""
        if self._closed:
            self._check_open(op)
        if key is _UNKEYED:
            key = pair_key(x, out, ubatch, False)
        routes = self._route_caches[op]  # the route, read inline (as in _lse_keyed)
        route = routes._plans.get(key)
        if route is None:
            route = routes.get(key, (x, out), (op,), op, (x, out))
        else:
            routes.hits += 1
        path, in_place, ok = route
        if in_place:  # the direct op's keyed entry: its own checks, with the same key
            if stream is not None and not isinstance(stream, _cuda._STREAM_TYPES):
                stream = self._stream(stream)  # raises InvalidType
            res = self.direct_ops[op]._call_keyed(key, x, ubatch, out, stream, False)
        elif path == PATH_NCCL:
            res = self.nccl_ops[op](x, ubatch=ubatch, out=out, stream=stream)
        else:
            stream = self._stream(stream)
            direct = self.direct_ops[op]
            x = self._normalised(x, array_info(x, f"DCPComm.{op}", name), ok[0], name, op, stream)
            if not ok[1]:
                res = direct(x, ubatch=ubatch, stream=stream)
                self._copy_out(out, res, stream)
                res = out
            else:
                res = direct(x, ubatch=ubatch, out=out, stream=stream)
        self.last_path = path
        self.counters[op][path] += 1
        return res

    lse_reduce = lse_reduce_method(
        "DCPCalls.lse_reduce",
        """Merge every rank's partial attention into this rank's heads: see
        :meth:`LseReduce.__call__ <dcpkit.ops.LseReduce.__call__>` (same arguments, same result
        within :func:`~dcpkit.reference.lse_reduce_tolerance`, same output lifetime).

        Returns ``out [T, H_r, D_v]``, or ``(out, out_lse [T, H_r] float32)`` with ``out_lse=``
        or ``return_lse=True``.

        Collective: every rank, same ``T``, dtypes, masks present or not, ubatch.
        Stream: on ``stream``.

        Raises
        ------
        InvalidArgument
            ``policy="direct"`` and the direct op cannot serve the call; bad arguments.
        """,
    )

    def _lse_keyed(self, key, arrays: tuple, ubatch, stream):
        """:meth:`lse_reduce` with its flat key ``key`` (:func:`~dcpkit._plan.arrays_key` of
        ``arrays``, the call's six arrays in the order of the signature)."""
        op = "lse_reduce"
        if self._closed:
            self._check_open(op)
        routes = self._route_caches[op]
        route = routes._plans.get(key)
        if route is None:
            out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse = arrays
            checked = (out_partial, lse_partial, out, out_lse)
            masks = (seq_lens, query_start_loc)
            route = routes.get(key, checked, (op,), op, checked, masks)
        else:
            routes.hits += 1
        path, in_place, ok = route
        if in_place:  # the direct op's keyed entry: its result has DCPComm's form
            if stream is not None and not isinstance(stream, _cuda._STREAM_TYPES):
                stream = self._stream(stream)  # raises InvalidType
            r = self.direct_ops[op]._lse_keyed(key, arrays, ubatch, stream)
            self.last_path = path
            self.counters[op][path] += 1
            return r
        out_partial, lse_partial, seq_lens, query_start_loc, out, out_lse = arrays
        want_lse = self.return_lse or out_lse is not None
        kw = dict(seq_lens=seq_lens, query_start_loc=query_start_loc, ubatch=ubatch)
        if path == PATH_NCCL:
            res, lse = self.nccl_ops[op](
                out_partial, lse_partial, out=out, out_lse=out_lse, stream=stream, **kw
            )
        else:
            res, lse = self._lse_reduce_copied(
                out_partial, lse_partial, out, out_lse, ok, kw, stream
            )
        self._record(op, path)
        return (res, lse) if want_lse else res

    def _lse_reduce_copied(self, out_partial, lse_partial, out, out_lse, ok, kw, stream):
        """A direct ``lse_reduce`` call with an array the op cannot take in place: inputs copied
        to contiguous arrays, results copied into ``out`` / ``out_lse``. Returns ``(out,
        out_lse or None)``."""
        op, name = "lse_reduce", "DCPComm.lse_reduce"
        stream = self._stream(stream)
        direct = self.direct_ops[op]
        out_partial, lse_partial = (
            self._normalised(a, array_info(a, name, arg), in_place, arg, op, stream)
            for a, arg, in_place in (
                (out_partial, "out_partial", ok[0]),
                (lse_partial, "lse_partial", ok[1]),
            )
        )
        o_fix, l_fix = not ok[2], not ok[3]
        lse_tmp = None
        if l_fix and not self.return_lse:  # the op needs an out_lse it can write
            lse_tmp = self._normalised(
                out_lse, array_info(out_lse, name, "out_lse"), False, "out_lse", op, stream
            )
        r = direct(
            out_partial,
            lse_partial,
            stream=stream,
            out=None if o_fix else out,
            out_lse=lse_tmp if l_fix else out_lse,
            **kw,
        )
        res, lse = r if (self.return_lse or out_lse is not None) else (r, None)
        if o_fix:
            self._copy_out(out, res, stream)
            res = out
        if l_fix:
            self._copy_out(out_lse, lse, stream)
            lse = out_lse
        return res, lse
