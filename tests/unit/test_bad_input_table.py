"""The bad-input table, CPU part: bad calls across the three ops and the symmetric heap, each
raising its specific error class with its message fragment before anything is launched or
counted, and the workspace still accepting a good call afterwards. Every op row runs cold, and
again after warm-up calls (through the whole call, the launch recorded) with the same arrays and
with good arrays at the addresses of the bad ones.

No GPU: workspaces are built with ``__new__`` plus the state ``_setup`` would give them (no
heap, no kernels: a launch attempt would fail with another error); arrays are small objects
exposing ``__cuda_array_interface__`` over made-up addresses (never dereferenced). The same
table runs on GPUs, with real arrays and a correct call after every row, in
``tests/mpi/test_reliability.py::test_bad_input_table``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dcpkit.comm import Communicator
from dcpkit.errors import ClosedError, CollectiveTimeout, InvalidArgument, InvalidType
from dcpkit.ops._workspace import OP_IDS
from dcpkit.ops.kv_gather import KVGather
from dcpkit.ops.lse_reduce import LseReduce
from dcpkit.ops.q_gather import QGather
from dcpkit.symmetric import SymmetricHeap

W, RANK, DEV = 4, 1, 0
T_MAX, T = 16, 8
H_R, D, D_KV, D_V = 2, 64, 256, 64
H = H_R * W
F16, F32, I32 = np.float16, np.float32, np.int32
BASE = 1 << 36  # made-up, 256-byte aligned device address


class Dev:
    """Describes a device array through ``__cuda_array_interface__``; owns no memory."""

    _next = BASE

    def __init__(self, shape, dtype=F16, strides_el=None, *, offset=0, device=DEV, ptr=None):
        dt = np.dtype(dtype)
        if ptr is None:
            Dev._next += 1 << 24
            ptr = Dev._next + offset
        self.ptr = ptr
        strides = None if strides_el is None else tuple(s * dt.itemsize for s in strides_el)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": dt.str,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }
        self._dcpkit_device = device


def _state(ws, num_ubatches=2):
    ws.rank, ws.world_size, ws.device = RANK, W, DEV
    ws.num_ubatches = num_ubatches
    ws.timeout_ms = 300.0
    ws._debug = False
    ws._closed = False
    ws._rec = np.zeros(8, dtype=np.uint32)
    ws._calls = [0] * num_ubatches
    ws._captured = [False] * num_ubatches
    ws._kernel = None  # the gathers: a launch attempt would fail with TypeError
    return ws


def make(kind):
    if kind == "q":
        ws = QGather.__new__(QGather)
        ws._init_geometry(W, T_MAX, H_R, D, "float16", None)
    elif kind == "kv":
        ws = KVGather.__new__(KVGather)
        ws._init_geometry(W, T_MAX, D_KV, "float16", "push")
        ws.data_slot_bytes = W * T_MAX * ws.row_bytes
    else:
        ws = LseReduce.__new__(LseReduce)
        ws._init_geometry(
            W,
            max_tokens=T_MAX,
            num_heads=H,
            head_dim=D_V,
            dtype=F16,
            lse_base=math.e,
            return_lse=False,
        )
    return _state(ws)


def good_call(kind, ws):
    """Validate a good call (no launch): the workspace is still usable."""
    if kind == "q":
        return ws._validate(Dev((T, H_R, D)), 1, Dev((T, H, D)), False)
    if kind == "kv":
        return ws._validate(Dev((T, D_KV)), 1, Dev((W * T, D_KV)))
    return ws._validate(
        Dev((T, H, D_V)),
        Dev((T, H), F32),
        Dev((3,), I32),
        Dev((4,), I32),
        1,
        Dev((T, H_R, D_V)),
        Dev((T, H_R), F32),
    )


def _bad_call(positional, defaults, kw):
    """``ws -> ws(*positional arrays, **keywords)`` of one row; ``.args`` holds every argument
    by name and ``.bad`` the names the row changed (the warm-up replaces them)."""
    a = dict(defaults)
    a.update(kw)

    def call(ws):
        rest = {k: v for k, v in a.items() if k not in positional}
        return ws(*[a[k] for k in positional], **rest)

    call.args, call.bad, call.positional = a, set(kw), positional
    return call


def _q(**kw):
    return _bad_call(("q",), dict(q=Dev((T, H_R, D))), kw)


def _kv(**kw):
    return _bad_call(("kv",), dict(kv=Dev((T, D_KV))), kw)


def _lse(**kw):
    return _bad_call(
        ("out_partial", "lse_partial"),
        dict(out_partial=Dev((T, H, D_V)), lse_partial=Dev((T, H), F32)),
        kw,
    )


def _closed(ws):
    ws._closed = True
    return ws


def _poisoned(op):
    def f(ws):
        # state, op, rank, silent peer, expected, observed, ubatch, pad
        ws._rec[:] = [2, OP_IDS[op], RANK, 3, 7, 5, 1, 0]
        return ws

    return f


#: (id, workspace kind, workspace change, bad call, error class, message fragment)
ROWS = [
    # ---- q_gather: q [T, H_r, D]
    ("q dtype float32", "q", None, _q(q=Dev((T, H_R, D), F32)), InvalidType, "q dtype must be"),
    (
        "q host numpy",
        "q",
        None,
        _q(q=np.zeros((T, H_R, D), F16)),
        InvalidType,
        "q must be a GPU array",
    ),
    ("q not an array", "q", None, _q(q=[[1.0]]), InvalidType, "q must be a GPU array"),
    ("q 2-D", "q", None, _q(q=Dev((T, H_R * D))), InvalidArgument, "q must have 3 dimensions"),
    ("q heads H_r+1", "q", None, _q(q=Dev((T, H_R + 1, D))), InvalidArgument, "q shape must be"),
    (
        "q T > max_tokens",
        "q",
        None,
        _q(q=Dev((T_MAX + 1, H_R, D))),
        InvalidArgument,
        f"must be <= max_tokens {T_MAX}",
    ),
    (
        "q element stride 2",
        "q",
        None,
        _q(q=Dev((T, H_R, D), strides_el=(2 * H_R * D, 2 * D, 2))),
        InvalidArgument,
        "head_dim stride must be one element",
    ),
    (
        "q head stride 2*D",
        "q",
        None,
        _q(q=Dev((T, H_R, D), strides_el=(2 * H_R * D, 2 * D, 1))),
        InvalidArgument,
        "head stride must be head_dim elements",
    ),
    (
        "q token stride not 16-byte aligned",
        "q",
        None,
        _q(q=Dev((T, H_R, D), strides_el=(H_R * D + 1, D, 1))),
        InvalidArgument,
        "token stride",
    ),
    (
        "q misaligned pointer (one element off)",
        "q",
        None,
        _q(q=Dev((T, H_R, D), offset=2)),
        InvalidArgument,
        "q data pointer must be a multiple of 16",
    ),
    (
        "q on another GPU",
        "q",
        None,
        _q(q=Dev((T, H_R, D), device=1)),
        InvalidArgument,
        "q device must be the workspace's GPU 0 (got GPU 1)",
    ),
    ("q out shape", "q", None, _q(out=Dev((T, H - 1, D))), InvalidArgument, "out shape must be"),
    ("q out dtype", "q", None, _q(out=Dev((T, H, D), F32)), InvalidType, "out dtype must be"),
    (
        "q out misaligned",
        "q",
        None,
        _q(out=Dev((T, H, D), offset=2)),
        InvalidArgument,
        "out data pointer",
    ),
    ("q ubatch out of range", "q", None, _q(ubatch=2), InvalidArgument, "ubatch must lie in"),
    ("q ubatch not an int", "q", None, _q(ubatch="0"), InvalidType, "ubatch must be an int"),
    (
        "q return_padded with out",
        "q",
        None,
        _q(out=Dev((T, H, D)), return_padded=True),
        InvalidArgument,
        "return_padded must be False",
    ),
    ("q closed workspace", "q", _closed, _q(), ClosedError, "q_gather: the workspace is closed"),
    (
        "q poisoned workspace",
        "q",
        _poisoned("q_gather"),
        _q(),
        CollectiveTimeout,
        "waiting for peer 3",
    ),
    # ---- kv_gather: kv [T, D_kv] contiguous
    ("kv dtype float32", "kv", None, _kv(kv=Dev((T, D_KV), F32)), InvalidType, "kv dtype must be"),
    ("kv 3-D", "kv", None, _kv(kv=Dev((T, 1, D_KV))), InvalidArgument, "kv must have 2 dimensions"),
    ("kv row_dim", "kv", None, _kv(kv=Dev((T, D_KV - 8))), InvalidArgument, "kv shape must be"),
    (
        "kv T > max_tokens",
        "kv",
        None,
        _kv(kv=Dev((T_MAX + 1, D_KV))),
        InvalidArgument,
        f"must be <= max_tokens {T_MAX}",
    ),
    (
        "kv padded rows",
        "kv",
        None,
        _kv(kv=Dev((T, D_KV), strides_el=(2 * D_KV, 1))),
        InvalidArgument,
        "kv must be C-contiguous",
    ),
    (
        "kv misaligned pointer",
        "kv",
        None,
        _kv(kv=Dev((T, D_KV), offset=2)),
        InvalidArgument,
        "kv data pointer must be a multiple of 16",
    ),
    (
        "kv host numpy",
        "kv",
        None,
        _kv(kv=np.zeros((T, D_KV), F16)),
        InvalidType,
        "kv must be a GPU array",
    ),
    (
        "kv on another GPU",
        "kv",
        None,
        _kv(kv=Dev((T, D_KV), device=2)),
        InvalidArgument,
        "kv device must be",
    ),
    (
        "kv out rows",
        "kv",
        None,
        _kv(out=Dev((W * T - 1, D_KV))),
        InvalidArgument,
        "out shape must be",
    ),
    (
        "kv out strided",
        "kv",
        None,
        _kv(out=Dev((W * T, D_KV), strides_el=(D_KV + 8, 1))),
        InvalidArgument,
        "out must be C-contiguous",
    ),
    ("kv ubatch -1", "kv", None, _kv(ubatch=-1), InvalidArgument, "ubatch must lie in"),
    (
        "kv closed workspace",
        "kv",
        _closed,
        _kv(),
        ClosedError,
        "kv_gather: the workspace is closed",
    ),
    # ---- lse_reduce: out_partial [T, H, D_v], lse_partial [T, H], masks, outputs
    (
        "lse out_partial dtype",
        "lse",
        None,
        _lse(out_partial=Dev((T, H, D_V), F32)),
        InvalidType,
        "out_partial dtype must be",
    ),
    (
        "lse out_partial heads",
        "lse",
        None,
        _lse(out_partial=Dev((T, H - 1, D_V))),
        InvalidArgument,
        "out_partial shape must be",
    ),
    (
        "lse T > max_tokens",
        "lse",
        None,
        _lse(out_partial=Dev((T_MAX + 1, H, D_V)), lse_partial=Dev((T_MAX + 1, H), F32)),
        InvalidArgument,
        f"must be <= max_tokens {T_MAX}",
    ),
    (
        "lse out_partial misaligned",
        "lse",
        None,
        _lse(out_partial=Dev((T, H, D_V), offset=2)),
        InvalidArgument,
        "out_partial rows must be 16-byte aligned",
    ),
    (
        "lse out_partial negative stride",
        "lse",
        None,
        _lse(out_partial=Dev((T, H, D_V), strides_el=(-H * D_V, D_V, 1))),
        InvalidArgument,
        "out_partial strides must be non-negative",
    ),
    (
        "lse host lse_partial",
        "lse",
        None,
        _lse(lse_partial=np.zeros((T, H), F32)),
        InvalidType,
        "lse_partial must be a GPU array",
    ),
    (
        "lse lse_partial int32",
        "lse",
        None,
        _lse(lse_partial=Dev((T, H), I32)),
        InvalidType,
        "lse_partial dtype must be",
    ),
    (
        "lse lse_partial tokens",
        "lse",
        None,
        _lse(lse_partial=Dev((T - 1, H), F32)),
        InvalidArgument,
        "lse_partial shape must be",
    ),
    (
        "lse lse_partial on another GPU",
        "lse",
        None,
        _lse(lse_partial=Dev((T, H), F32, device=1)),
        InvalidArgument,
        "lse_partial device must be",
    ),
    (
        "lse seq_lens without query_start_loc",
        "lse",
        None,
        _lse(seq_lens=Dev((3,), I32)),
        InvalidArgument,
        "seq_lens requires query_start_loc",
    ),
    (
        "lse seq_lens / query_start_loc mismatch",
        "lse",
        None,
        _lse(seq_lens=Dev((4,), I32), query_start_loc=Dev((4,), I32)),
        InvalidArgument,
        "seq_lens length must be len(query_start_loc) - 1 = 3 (got 4)",
    ),
    (
        "lse seq_lens int64",
        "lse",
        None,
        _lse(seq_lens=Dev((3,), np.int64), query_start_loc=Dev((4,), I32)),
        InvalidType,
        "seq_lens dtype must be",
    ),
    (
        "lse query_start_loc host",
        "lse",
        None,
        _lse(query_start_loc=np.zeros(4, I32)),
        InvalidType,
        "query_start_loc must be a GPU array",
    ),
    (
        "lse query_start_loc empty",
        "lse",
        None,
        _lse(query_start_loc=Dev((0,), I32)),
        InvalidArgument,
        "query_start_loc length must be >= 1",
    ),
    (
        "lse out shape",
        "lse",
        None,
        _lse(out=Dev((T, H, D_V))),
        InvalidArgument,
        "out shape must be",
    ),
    (
        "lse out misaligned",
        "lse",
        None,
        _lse(out=Dev((T, H_R, D_V), offset=2)),
        InvalidArgument,
        "out data pointer must be 16-byte aligned",
    ),
    (
        "lse out_lse dtype",
        "lse",
        None,
        _lse(out_lse=Dev((T, H_R), F16)),
        InvalidType,
        "out_lse dtype must be",
    ),
    ("lse ubatch True", "lse", None, _lse(ubatch=True), InvalidType, "ubatch must be an int"),
    (
        "lse closed workspace",
        "lse",
        _closed,
        _lse(),
        ClosedError,
        "lse_reduce: the workspace is closed",
    ),
    (
        "lse poisoned workspace",
        "lse",
        _poisoned("lse_reduce"),
        _lse(),
        CollectiveTimeout,
        "waiting for peer 3",
    ),
]


@pytest.mark.parametrize(
    "kind,change,bad,exc,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_bad_call_raises_before_launch_and_workspace_stays_usable(kind, change, bad, exc, fragment):
    ws = make(kind)
    if change is not None:
        ws = change(ws)
    with pytest.raises(exc) as info:
        bad(ws)
    assert fragment in str(info.value), f"{str(info.value)!r} lacks {fragment!r}"
    assert ws._calls == [0, 0] and ws._captured == [False, False], (
        f"the rejected call was counted: {ws._calls} {ws._captured}"
    )
    if change is None:
        good_call(kind, ws)  # unchanged workspace: a good call still validates


# ----------------------------------------------------------------------------- the heap
def _heap():
    return SymmetricHeap._unbacked(1 << 20, world_size=W, rank=RANK)


def _closed_heap():
    h = _heap()
    h._closed = True
    return h


HEAP_ROWS = [
    (
        "view past the end",
        _heap,
        lambda h: h.view((1 << 20) - 64, (128,), np.uint8),
        InvalidArgument,
        "offset + view bytes must be <=",
    ),
    (
        "view negative offset",
        _heap,
        lambda h: h.view(-256, (16,), np.uint8),
        InvalidArgument,
        "offset must be >= 0",
    ),
    (
        "view rank = world_size",
        _heap,
        lambda h: h.view(0, (16,), np.uint8, rank=W),
        InvalidArgument,
        "rank must lie in",
    ),
    (
        "view offset misaligned for float32",
        _heap,
        lambda h: h.view(2, (4,), np.float32),
        InvalidArgument,
        "multiple of the itemsize",
    ),
    (
        "view shape not ints",
        _heap,
        lambda h: h.view(0, "abc", np.uint8),
        InvalidType,
        "shape must be",
    ),
    ("view object dtype", _heap, lambda h: h.view(0, (4,), object), InvalidType, "dtype must be"),
    (
        "reserve more than the heap",
        _heap,
        lambda h: h.reserve((1 << 20) + 1),
        InvalidArgument,
        "must fit in the heap",
    ),
    (
        "reserve align not a power of two",
        _heap,
        lambda h: h.reserve(64, align=48),
        InvalidArgument,
        "align must be a power of two",
    ),
    ("reserve 0 bytes", _heap, lambda h: h.reserve(0), InvalidArgument, "nbytes must be >= 1"),
    (
        "view after close",
        _closed_heap,
        lambda h: h.view(0, (16,), np.uint8),
        ClosedError,
        "the heap is closed",
    ),
    (
        "reserve after close",
        _closed_heap,
        lambda h: h.reserve(256),
        ClosedError,
        "the heap is closed",
    ),
]


@pytest.mark.parametrize(
    "make_heap,bad,exc,fragment", [r[1:] for r in HEAP_ROWS], ids=[r[0] for r in HEAP_ROWS]
)
def test_bad_heap_use_raises_and_heap_stays_usable(make_heap, bad, exc, fragment):
    h = make_heap()
    with pytest.raises(exc) as info:
        bad(h)
    assert fragment in str(info.value), f"{str(info.value)!r} lacks {fragment!r}"
    if not h._closed:
        assert h.reserved_bytes == 0
        assert h.reserve(4096) == 0 and h.reserve(1, align=512) == 4096


# ----------------------------------------------------------------------------- constructors
CTOR_ROWS = [
    (
        "q_gather max_tokens 0",
        lambda c: QGather(c, max_tokens=0, heads_per_rank=2, head_dim=64, dtype="float16"),
        InvalidArgument,
        "max_tokens must be >= 1",
    ),
    (
        "q_gather row not 16 bytes",
        lambda c: QGather(c, max_tokens=8, heads_per_rank=1, head_dim=3, dtype="float16"),
        InvalidArgument,
        "multiple of 16 bytes",
    ),
    (
        "kv_gather unknown algorithm",
        lambda c: KVGather(c, max_tokens=8, row_dim=64, dtype="float16", algorithm="ring"),
        InvalidArgument,
        "algorithm must be one of",
    ),
    (
        "lse_reduce int8 dtype",
        lambda c: LseReduce(c, max_tokens=8, num_heads=2, head_dim=64, dtype="int8"),
        InvalidType,
        "dtype must be one of",
    ),
    (
        "lse_reduce lse_base 10",
        lambda c: LseReduce(
            c, max_tokens=8, num_heads=2, head_dim=64, dtype="float16", lse_base=10
        ),
        InvalidArgument,
        "lse_base must be",
    ),
    (
        "q_gather comm not a Communicator",
        lambda c: QGather(object(), max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16"),
        InvalidType,
        "comm must be a dcpkit.Communicator",
    ),
    ("heap nbytes 0", lambda c: SymmetricHeap(c, 0), InvalidArgument, "nbytes must lie in"),
]


@pytest.mark.parametrize(
    "build,exc,fragment", [r[1:] for r in CTOR_ROWS], ids=[r[0] for r in CTOR_ROWS]
)
def test_bad_constructor_raises_before_any_gpu_work(build, exc, fragment):
    comm = Communicator.single()
    with pytest.raises(exc) as info:
        build(comm)
    assert fragment in str(info.value), f"{str(info.value)!r} lacks {fragment!r}"


def test_the_table_has_at_least_30_bad_calls():
    assert len(ROWS) + len(HEAP_ROWS) + len(CTOR_ROWS) >= 30
    kinds = {r[1] for r in ROWS}
    assert kinds == {"q", "kv", "lse"}


# ----------------------------------------------------------------------------- warm, then bad
# The same rows after warm-up calls: a cached plan (or any other state a good call leaves)
# must never let a bad call through. "same arrays": the warm-up calls use the row's own good
# arrays; "reused addresses": they use good arrays at the very addresses of the row's bad ones
# (memory freed and reused with another layout).
#: Good (shape, dtype) of every array argument, by workspace kind.
GOOD = {
    "q": {"q": ((T, H_R, D), F16), "out": ((T, H, D), F16)},
    "kv": {"kv": ((T, D_KV), F16), "out": ((W * T, D_KV), F16)},
    "lse": {
        "out_partial": ((T, H, D_V), F16),
        "lse_partial": ((T, H), F32),
        "seq_lens": ((3,), I32),
        "query_start_loc": ((4,), I32),
        "out": ((T, H_R, D_V), F16),
        "out_lse": ((T, H_R), F32),
    },
}
_STUBS = {}


def _stubs():
    """scripts/host_path_cpu.py: workspaces whose calls run in full with the launch recorded."""
    if not _STUBS:
        from _scripts import load_script

        _STUBS["mod"] = load_script("host_path_cpu")
    return _STUBS["mod"]


def make_callable(kind):
    """A workspace of ``kind`` whose calls run in full on CPU, every launch recorded."""
    pytest.importorskip("cupy")
    mod = _stubs()
    if kind == "q":
        ws = QGather.__new__(QGather)
        ws._check_arguments(
            W,
            max_tokens=T_MAX,
            heads_per_rank=H_R,
            head_dim=D,
            dtype="float16",
            num_ubatches=2,
            timeout_ms=300.0,
        )
    elif kind == "kv":
        ws = KVGather.__new__(KVGather)
        ws._check_arguments(
            W, max_tokens=T_MAX, row_dim=D_KV, dtype="float16", num_ubatches=2, timeout_ms=300.0
        )
    else:
        ws = LseReduce.__new__(LseReduce)
        ws._check_arguments(
            W,
            max_tokens=T_MAX,
            num_heads=H,
            head_dim=D_V,
            dtype=F16,
            num_ubatches=2,
            lse_base=math.e,
            return_lse=False,
            timeout_ms=300.0,
        )
    rec = mod.Recorder()
    return mod.stub_workspace(ws, mod._cpu_stream(), rec, rank=RANK, world_size=W), rec


def _as_cupy(x):
    """A CuPy array with the description of the ``Dev`` ``x`` (anything else, or a description
    CuPy cannot hold, as it is): the ops' hot path keys CuPy arrays by their own fields."""
    if not isinstance(x, Dev):
        return x
    import cupy

    cai = x.__cuda_array_interface__
    try:
        mem = cupy.cuda.UnownedMemory(cai["data"][0], 1 << 32, None, int(x._dcpkit_device))
        return cupy.ndarray(
            cai["shape"],
            np.dtype(cai["typestr"]),
            cupy.cuda.MemoryPointer(mem, 0),
            strides=cai["strides"],
        )
    except Exception:  # noqa: BLE001 - a description only a Dev can carry
        return x


def _warm_up_calls(kind, bad, mode, convert=lambda x: x):
    """The good calls made before the bad one (every array through ``convert``)."""
    args = dict(bad.args)
    for name in bad.bad:
        if name in GOOD[kind]:
            shape, dt = GOOD[kind][name]
            old = args[name]
            ptr = (
                (old.ptr // 16 * 16)
                if mode == "reused addresses" and isinstance(old, Dev)
                else None
            )
            args[name] = convert(Dev(shape, dt, ptr=ptr))
        else:
            args.pop(name)  # a bad scalar (ubatch, return_padded): the default
    if kind == "lse" and "seq_lens" in args and "query_start_loc" not in args:
        args["query_start_loc"] = Dev((4,), I32)
    args = {k: convert(v) for k, v in args.items()}
    pos = [args.pop(k) for k in bad.positional]
    calls = [lambda ws: ws(*pos, **args)]
    if "out" not in args:  # also the out= form
        shape, dt = GOOD[kind]["out"]
        out = convert(Dev(shape, dt))
        calls.append(lambda ws: ws(*pos, out=out, **args))
    return calls


@pytest.mark.parametrize("arrays", ["interface objects", "cupy arrays"])
@pytest.mark.parametrize("mode", ["same arrays", "reused addresses"])
@pytest.mark.parametrize(
    "kind,change,bad,exc,fragment", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_bad_call_after_warm_up_raises_before_launch(
    kind, change, bad, exc, fragment, mode, arrays
):
    """``arrays``: the table's ``__cuda_array_interface__`` objects (keyed in full), or CuPy
    arrays of the same descriptions (the hot path's flat key)."""
    ws, rec = make_callable(kind)
    convert = _as_cupy if arrays == "cupy arrays" else (lambda x: x)
    warm = _warm_up_calls(kind, bad, mode, convert)
    if arrays == "cupy arrays":
        bad.args.update({k: _as_cupy(v) for k, v in bad.args.items()})
    for _ in range(3):
        for call in warm:
            call(ws)
    assert rec.count == 3 * len(warm), "the warm-up calls did not launch"
    assert ws._plans.hits >= 2 * len(warm), "the warm-up calls did not fill the plan cache"
    if change is not None:
        ws = change(ws)
    calls, launches = list(ws._calls), rec.count
    with pytest.raises(exc) as info:
        bad(ws)
    assert fragment in str(info.value), f"{str(info.value)!r} lacks {fragment!r}"
    assert ws._calls == calls and rec.count == launches, "the rejected call counted or launched"
    if change is None:
        warm[0](ws)  # still usable
        assert rec.count == launches + 1
