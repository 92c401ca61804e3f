"""CPU tests of QGather and KVGather: every argument check (exception class and message), that
a rejected call launches nothing and does not count, the data-slot ring and result routing,
and the NVRTC compile of every kernel variant. No GPU needed: workspaces are built with
``__new__`` and the attributes a call reads; arrays are CuPy arrays over made-up addresses (no
allocation) or small objects exposing ``__cuda_array_interface__``."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from dcpkit import jit
from dcpkit.comm import Communicator
from dcpkit.errors import ClosedError, CollectiveTimeout, DcpkitError, InvalidArgument, InvalidType
from dcpkit.ops._gather import DATA_SLOTS, ZERO_COPY_MIN_BYTES
from dcpkit.ops._workspace import OP_IDS
from dcpkit.ops.kv_gather import KVGather
from dcpkit.ops.q_gather import QGather
from dcpkit.reference import resolve_dtype

BASE = 1 << 32  # made-up device address of the arrays (16-byte aligned)
OUT = 1 << 33  # made-up address of an out= array (away from BASE: outputs may share no memory)


class FakeArray:
    """A GPU array as far as dcpkit can tell: ``__cuda_array_interface__`` plus the device."""

    def __init__(self, shape, dtype, strides=None, ptr=BASE, device=0):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": dt.str,
            "data": (ptr, False),
            "strides": None if strides is None else tuple(strides),
            "version": 3,
        }
        self._dcpkit_device = device


def cupy_array(shape, dtype, strides=None, ptr=BASE, device=0):
    """A CuPy array over a made-up address (CuPy allocates nothing for it)."""
    import cupy

    dt = resolve_dtype(dtype)
    if strides is None:
        strides, acc = [], dt.itemsize
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
    mem = cupy.cuda.UnownedMemory(ptr, 1 << 30, None, device)
    return cupy.ndarray(
        tuple(shape), dtype=dt, memptr=cupy.cuda.MemoryPointer(mem, 0), strides=tuple(strides)
    )


class FakeStream:
    def __init__(self, capturing=False):
        self.capturing = capturing

    def is_capturing(self):
        return self.capturing


def _workspace_state(ws, *, world_size, num_ubatches=2):
    ws.rank = 0
    ws.world_size = world_size
    ws.num_ubatches = num_ubatches
    ws.device = 0
    ws.timeout_ms = 5000.0
    ws._closed = False
    ws._rec = np.zeros(8, dtype=np.uint32)
    ws._calls = [0] * num_ubatches
    ws._captured = [False] * num_ubatches
    ws._debug = False
    return ws


def make_q(
    *,
    world_size=2,
    max_tokens=8,
    heads_per_rank=4,
    head_dim=64,
    dtype="float16",
    padded_num_heads=None,
):
    ws = _workspace_state(QGather.__new__(QGather), world_size=world_size)
    ws._init_geometry(world_size, max_tokens, heads_per_rank, head_dim, dtype, padded_num_heads)
    return ws


def make_kv(*, world_size=2, max_tokens=8, row_dim=64, dtype="float16", algorithm="push"):
    ws = _workspace_state(KVGather.__new__(KVGather), world_size=world_size)
    ws._init_geometry(world_size, max_tokens, row_dim, dtype, algorithm)
    ws.data_slot_bytes = world_size * max_tokens * ws.row_bytes
    return ws


def raises(exc, fragment, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert fragment in str(info.value), f"message {str(info.value)!r} lacks {fragment!r}"
    return info.value


def rejected_without_counting(ws, exc, fragment, *args, **kwargs):
    """The public call raises ``exc`` and neither launches nor advances the call count."""
    before = list(ws._calls)
    ws._kernel = None  # a launch attempt would fail with another error
    raises(exc, fragment, ws, *args, **kwargs)
    assert ws._calls == before


# ----------------------------------------------------------------------------- q_gather
def test_q_gather_accepts_contiguous_padded_and_strided_inputs():
    ws = make_q()  # T_max 8, H_r 4, D 64, fp16, W 2
    for q in (
        cupy_array((5, 4, 64), "float16"),
        cupy_array((5, 6, 64), "float16")[:, 1:5],  # padded head storage
        cupy_array((10, 4, 64), "float16")[::2],  # token-strided
        FakeArray((8, 4, 64), "float16"),
        FakeArray((1, 4, 64), "float16", strides=(4, 128, 2)),
    ):  # T = 1: any token stride
        T, ubatch, qi, oi = ws._validate(q, 1, None, False)
        assert (T, ubatch, oi) == (qi.shape[0], 1, None) and qi.shape[1:] == (4, 64)
        assert T in (1, 5, 8)
    out = FakeArray((5, 8, 64), "float16", strides=(10 * 128, 128, 2), ptr=OUT)  # token-padded
    assert ws._validate(cupy_array((5, 4, 64), "float16"), 0, out, False)[3] is not None


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "bfloat16", "uint8", "int8", "float8_e4m3fn"]
)
def test_q_gather_any_dtype(dtype):
    ws = make_q(dtype=dtype, head_dim=64)
    assert ws.dtype == resolve_dtype(dtype)
    assert ws.row_bytes == 4 * 64 * ws.dtype.itemsize
    q = cupy_array((3, 4, 64), dtype)
    assert ws._validate(q, 0, None, False)[0] == 3


def test_q_gather_host_array():
    ws = make_q()
    raises(
        InvalidType,
        "q_gather: q must be a GPU array (got host numpy.ndarray",
        ws._validate,
        np.zeros((2, 4, 64), np.float16),
        0,
        None,
        False,
    )
    raises(InvalidType, "q_gather: q must be a GPU array", ws._validate, None, 0, None, False)
    raises(
        InvalidType,
        "q_gather: out must be a GPU array",
        ws._validate,
        cupy_array((2, 4, 64), "float16"),
        0,
        np.zeros((2, 8, 64), np.float16),
        False,
    )


def test_q_gather_shape_dtype_device():
    ws = make_q()
    raises(
        InvalidArgument,
        "q_gather: q must have 3 dimensions [T, H_r, D] (got shape (2, 256))",
        ws._validate,
        cupy_array((2, 256), "float16"),
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: q shape must be [*, 4, 64] for [T, H_r, D] (got (2, 8, 64))",
        ws._validate,
        cupy_array((2, 8, 64), "float16"),
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q shape must be [*, 4, 64]",
        ws._validate,
        cupy_array((2, 4, 32), "float16"),
        0,
        None,
        False,
    )
    raises(
        InvalidType,
        "q_gather: q dtype must be one of [float16] (got bfloat16)",
        ws._validate,
        cupy_array((2, 4, 64), "bfloat16"),
        0,
        None,
        False,
    )
    raises(
        InvalidType,
        "q_gather: q dtype must be one of [float16] (got float32)",
        ws._validate,
        FakeArray((2, 4, 64), "float32"),
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: q device must be the workspace's GPU 0 (got GPU 1)",
        ws._validate,
        cupy_array((2, 4, 64), "float16", device=1),
        0,
        None,
        False,
    )


def test_q_gather_tokens():
    ws = make_q(max_tokens=8)
    raises(
        InvalidArgument,
        "q_gather: q tokens T must be <= max_tokens 8 (got 9)",
        ws._validate,
        cupy_array((9, 4, 64), "float16"),
        0,
        None,
        False,
    )
    assert ws._validate(cupy_array((0, 4, 64), "float16"), 0, None, False)[0] == 0


def test_q_gather_layout():
    ws = make_q()
    base = cupy_array((4, 4, 128), "float16")
    raises(
        InvalidArgument,
        "q_gather: q head_dim stride must be one element (2 bytes) (got 4 bytes)",
        ws._validate,
        base[:, :, ::2],
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: q head stride must be head_dim elements (128 bytes) (got 256 bytes)",
        ws._validate,
        cupy_array((4, 8, 64), "float16")[:, ::2],
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: q head_dim stride must be one element (2 bytes) (got 8 bytes)",
        ws._validate,
        cupy_array((4, 64, 4), "float16").transpose(0, 2, 1),
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: q token stride must be >= 512 bytes and a multiple of 16 bytes (got 520 bytes)",
        ws._validate,
        FakeArray((3, 4, 64), "float16", strides=(520, 128, 2)),
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: q token stride must be >= 512 bytes",
        ws._validate,
        FakeArray((3, 4, 64), "float16", strides=(256, 128, 2)),
        0,
        None,
        False,
    )
    raises(
        InvalidArgument,
        f"q_gather: q data pointer must be a multiple of 16 bytes (got {BASE + 8})",
        ws._validate,
        cupy_array((3, 4, 64), "float16", ptr=BASE + 8),
        0,
        None,
        False,
    )


def test_q_gather_out_checks():
    ws = make_q()
    q = cupy_array((3, 4, 64), "float16")
    raises(
        InvalidArgument,
        "q_gather: out shape must be [3, 8, 64] for [T, H, D] (got (3, 4, 64))",
        ws._validate,
        q,
        0,
        cupy_array((3, 4, 64), "float16"),
        False,
    )
    raises(
        InvalidType,
        "q_gather: out dtype must be one of [float16] (got float32)",
        ws._validate,
        q,
        0,
        cupy_array((3, 8, 64), "float32"),
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: out device must be the workspace's GPU 0 (got GPU 2)",
        ws._validate,
        q,
        0,
        cupy_array((3, 8, 64), "float16", device=2),
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: out token stride must be >= 1024 bytes",
        ws._validate,
        q,
        0,
        FakeArray((3, 8, 64), "float16", strides=(1000, 128, 2)),
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: out data pointer must be a multiple of 16 bytes",
        ws._validate,
        q,
        0,
        cupy_array((3, 8, 64), "float16", ptr=BASE + 2),
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: return_padded must be False when out= is given",
        ws._validate,
        q,
        0,
        cupy_array((3, 8, 64), "float16"),
        True,
    )


def test_q_gather_ubatch_closed_poisoned():
    ws = make_q()
    q = cupy_array((3, 4, 64), "float16")
    raises(
        InvalidArgument,
        "q_gather: ubatch must lie in [0, 2) (got 2)",
        ws._validate,
        q,
        2,
        None,
        False,
    )
    raises(
        InvalidArgument,
        "q_gather: ubatch must lie in [0, 2) (got -1)",
        ws._validate,
        q,
        -1,
        None,
        False,
    )
    raises(
        InvalidType,
        "q_gather: ubatch must be an int (got True)",
        ws._validate,
        q,
        True,
        None,
        False,
    )
    ws._rec[:] = [2, OP_IDS["q_gather"], 0, 1, 7, 6, 1, 0]
    e = raises(CollectiveTimeout, "q_gather: rank 0 timed out", ws._validate, q, 0, None, False)
    assert (e.peer, e.expected_epoch, e.observed_epoch, e.ubatch) == (1, 7, 6, 1)
    ws._rec[:] = 0
    ws._closed = True
    raises(ClosedError, "q_gather: the workspace is closed", ws._validate, q, 0, None, False)


def test_q_gather_rejected_call_does_not_count():
    ws = make_q()
    rejected_without_counting(
        ws, InvalidArgument, "max_tokens 8 (got 9)", cupy_array((9, 4, 64), "float16"), ubatch=1
    )
    rejected_without_counting(
        ws, InvalidType, "dtype must be one of", cupy_array((2, 4, 64), "float32")
    )
    rejected_without_counting(
        ws, InvalidType, "must be a GPU array", np.zeros((2, 4, 64), np.float16)
    )
    rejected_without_counting(
        ws, InvalidArgument, "ubatch must lie in", cupy_array((2, 4, 64), "float16"), ubatch=3
    )
    ws._closed = True
    rejected_without_counting(ws, ClosedError, "closed", cupy_array((2, 4, 64), "float16"))


class _Heap:
    local_ptr = 1 << 40


def _with_slots(ws):
    """The attributes local_slot_ptr / output_ptr read."""
    ws.heap = _Heap()
    ws._base = 0
    ws._sig_bytes = 256
    ws.data_slot_bytes = 1 << 20
    ws.slot_bytes = -(-DATA_SLOTS * ws.data_slot_bytes // 2)
    ws._ubatch_stride = ws._sig_bytes + 2 * ws.slot_bytes
    ws._out_bytes = ws._pool_stride = 4096
    ws.multicast = False
    ws._pool_in_region = ws._symmetric_graph_outputs()
    ws._graph_base = 1 << 36
    ws.graph_outputs = 3
    ws._graph_next = 0
    return ws


def test_q_gather_empty_call_launches_nothing():
    ws = _with_slots(make_q(padded_num_heads=12))
    ws._kernel = None
    r = ws(cupy_array((0, 4, 64), "float16"), ubatch=1)
    assert r.shape == (0, 8, 64) and r.dtype == np.float16
    assert ws(cupy_array((0, 4, 64), "float16"), return_padded=True).shape == (0, 12, 64)
    out = cupy_array((0, 8, 64), "float16")
    assert ws(cupy_array((0, 4, 64), "float16"), out=out) is out
    assert ws._calls == [0, 0]


def test_gather_data_slot_ring_and_routing():
    """Eager calls of a never-captured ubatch return data slot (call count % 3), the slot the
    device picks (epoch % 3); a capturing call goes to the graph output, which the peers store
    into (the kernel's out with bit 0 set: zero copy); out= wins."""
    ws = _with_slots(make_q())
    seen = []
    for n in range(1, 8):
        kout, res = ws._destination(0, FakeStream(), (), 0, 8)
        assert kout == 0 and ws._calls[0] == n
        assert res == ws.data_slot_ptr(0, n % DATA_SLOTS)
        seen.append(res)
    assert seen[0] == seen[3] and len({seen[0], seen[1], seen[2]}) == 3
    # data slots stay inside the two base slots of ubatch 0, ubatch 1 starts after them
    assert ws.data_slot_ptr(0, DATA_SLOTS - 1) + ws.data_slot_bytes <= ws.local_slot_ptr(1, 0)
    kout, res = ws._destination(1, FakeStream(), (), 1234, 8)
    assert (kout, res) == (1234, 1234)
    kout, res = ws._destination(1, FakeStream(capturing=True), (), 0, 32)
    assert res == (1 << 36) and kout == res | 1  # the first graph output buffer, zero copy
    assert ws._captured == [False, True]
    # every captured call gets storage of its own, whatever its ubatch ...
    got = [ws._destination(u, FakeStream(capturing=True), (), 0, 32)[1] for u in (1, 0)]
    assert got == [(1 << 36) + ws._out_bytes, (1 << 36) + 2 * ws._out_bytes]
    # ... until the pool is exhausted: a clear error, before the call counts
    before = list(ws._calls)
    raises(
        DcpkitError, "graph_outputs=3", ws._destination, 0, FakeStream(capturing=True), (), 0, 32
    )
    assert ws._calls == before and ws._graph_next == 3
    # ... or until the caller gives them back (its graphs are gone): the pool starts over
    ws.release_graph_outputs()
    assert ws._destination(0, FakeStream(capturing=True), (), 0, 32) == ((1 << 36) | 1, 1 << 36)
    ws._closed = True
    raises(ClosedError, "closed", ws.release_graph_outputs)


@pytest.mark.parametrize(
    "build, zero_copy",
    [
        (lambda: make_q(), True),
        (lambda: make_kv(), True),
        (lambda: make_kv(algorithm="pull"), False),  # pull copies into its graph outputs
        (lambda: make_q(world_size=65), False),  # beyond the kernel's destination table
    ],
    ids=["q_gather", "kv_gather-push", "kv_gather-pull", "world-65"],
)
def test_graph_outputs_zero_copy_only_where_the_kernel_does_it(build, zero_copy):
    ws = _with_slots(build())
    ws.max_ctas, ws.ranks_on_gpu = 64, 1
    ws._calls[0] = 1  # not the first call
    T = -(-ZERO_COPY_MIN_BYTES // ws.row_bytes)  # the smallest zero-copy call
    kout, res = ws._destination(0, FakeStream(capturing=True), (), 0, T)
    assert res == 1 << 36 and kout == (res | 1 if zero_copy else res)
    assert ws.ctas_for(T, graph_view=True) == (
        ws._grid_graph_view(T) if zero_copy else ws.ctas_for(T, copy_out=True)
    )
    # one token less copies out (cheaper than the credit wait for a few rows)
    kout, res = ws._destination(0, FakeStream(capturing=True), (), 0, T - 1)
    assert kout == res == (1 << 36) + ws._pool_stride
    assert ws.ctas_for(T - 1, graph_view=True) == ws.ctas_for(T - 1, copy_out=True)
    ws.multicast = True  # a multicast heap: the kernel stores through the multicast address
    kout, res = ws._destination(0, FakeStream(capturing=True), (), 0, T)
    assert kout == res == (1 << 36) + 2 * ws._pool_stride
    # a captured call with out= needs no buffer
    assert ws._destination(0, FakeStream(capturing=True), (), 99, T) == (99, 99)
    # every CTA of a zero-copy graph call waits for credits: at most half the SM share
    assert ws._grid_graph_view(10**6) == ws.max_ctas // 2


def test_q_gather_result_view_geometry():
    ws = _with_slots(make_q(padded_num_heads=12))  # H 8, H_pad 12, D 64, fp16
    v = ws._result_view(ws.data_slot_ptr(0, 2), 5, False)
    assert v.shape == (5, 8, 64) and v.strides == (12 * 128, 128, 2)
    assert v.data.ptr == ws.data_slot_ptr(0, 2)
    p = ws._result_view(ws.data_slot_ptr(0, 2), 5, True)
    assert p.shape == (5, 12, 64) and p.strides == v.strides


def test_q_gather_constructor_checks():
    comm = Communicator.single()
    kw = dict(max_tokens=4, heads_per_rank=4, head_dim=64, dtype="float16")
    raises(
        InvalidArgument,
        "q_gather: heads_per_rank*head_dim*itemsize must be a multiple of 16 bytes (got 1*3*2 = 6)",
        QGather,
        comm,
        **dict(kw, heads_per_rank=1, head_dim=3),
    )
    raises(
        InvalidArgument,
        "q_gather: padded_num_heads must be >= 4 (got 3)",
        QGather,
        comm,
        **dict(kw, padded_num_heads=3),
    )
    raises(
        InvalidArgument,
        "q_gather: padded_num_heads*head_dim*itemsize must be a multiple of "
        "16 bytes (got 5*4*1 = 20)",
        QGather,
        comm,
        **dict(kw, heads_per_rank=4, head_dim=4, dtype="uint8", padded_num_heads=5),
    )
    raises(
        InvalidArgument,
        "q_gather: max_tokens must be >= 1 (got 0)",
        QGather,
        comm,
        **dict(kw, max_tokens=0),
    )
    raises(
        InvalidType,
        "q_gather: head_dim must be an int (got float 64.0)",
        QGather,
        comm,
        **dict(kw, head_dim=64.0),
    )
    raises(
        InvalidType,
        "q_gather: dtype must be a NumPy dtype or dtype name (got 'nosuchtype')",
        QGather,
        comm,
        **dict(kw, dtype="nosuchtype"),
    )
    raises(
        InvalidType,
        "q_gather: dtype must be a fixed-size data type (got object)",
        QGather,
        comm,
        **dict(kw, dtype=object),
    )
    raises(
        InvalidType,
        "q_gather: comm must be a dcpkit.Communicator (got NoneType)",
        QGather,
        None,
        **kw,
    )


def test_q_gather_attributes():
    assert QGather.launches_per_call == 1 and QGather.op_name == "q_gather"
    ws = make_q(world_size=4, heads_per_rank=8, head_dim=576, dtype="bfloat16")
    assert (ws.num_heads, ws.padded_num_heads, ws.row_bytes, ws.slot_token_bytes) == (
        32,
        32,
        8 * 576 * 2,
        32 * 576 * 2,
    )


# ----------------------------------------------------------------------------- kv_gather
def test_kv_gather_accepts_contiguous():
    ws = make_kv()
    for kv in (
        cupy_array((5, 64), "float16"),
        FakeArray((8, 64), "float16"),
        cupy_array((4, 64), "float16")[1:2],
    ):
        T, _, ki, _ = ws._validate(kv, 0, None)
        assert T == ki.shape[0] and T in (1, 5, 8)
    out = cupy_array((10, 64), "float16", ptr=OUT)
    assert ws._validate(cupy_array((5, 64), "float16"), 1, out)[3] is not None


def test_kv_gather_bad_inputs():
    ws = make_kv()  # W 2, T_max 8, D_kv 64, fp16
    kv = cupy_array((5, 64), "float16")
    raises(
        InvalidType,
        "kv_gather: kv must be a GPU array (got host numpy.ndarray",
        ws._validate,
        np.zeros((5, 64), np.float16),
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv must have 2 dimensions [T, D_kv] (got shape (5,))",
        ws._validate,
        cupy_array((5,), "float16"),
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv shape must be [*, 64] for [T, D_kv] (got (5, 32))",
        ws._validate,
        cupy_array((5, 32), "float16"),
        0,
        None,
    )
    raises(
        InvalidType,
        "kv_gather: kv dtype must be one of [float16] (got bfloat16)",
        ws._validate,
        cupy_array((5, 64), "bfloat16"),
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv device must be the workspace's GPU 0 (got GPU 3)",
        ws._validate,
        cupy_array((5, 64), "float16", device=3),
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv tokens T must be <= max_tokens 8 (got 9)",
        ws._validate,
        cupy_array((9, 64), "float16"),
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv must be C-contiguous with strides (128, 2) bytes (got strides (256, 2)",
        ws._validate,
        cupy_array((5, 128), "float16")[:, :64],
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv must be C-contiguous",
        ws._validate,
        cupy_array((64, 5), "float16").T,
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv must be C-contiguous",
        ws._validate,
        cupy_array((10, 64), "float16")[::2],
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: kv data pointer must be a multiple of 16 bytes",
        ws._validate,
        cupy_array((5, 64), "float16", ptr=BASE + 4),
        0,
        None,
    )
    raises(
        InvalidArgument,
        "kv_gather: out shape must be [10, 64] for [world_size*T, D_kv] (got (5, 64))",
        ws._validate,
        kv,
        0,
        cupy_array((5, 64), "float16"),
    )
    raises(
        InvalidType,
        "kv_gather: out dtype must be one of [float16] (got uint8)",
        ws._validate,
        kv,
        0,
        cupy_array((10, 64), "uint8"),
    )
    raises(
        InvalidArgument,
        "kv_gather: out device must be the workspace's GPU 0 (got GPU 1)",
        ws._validate,
        kv,
        0,
        cupy_array((10, 64), "float16", device=1),
    )
    raises(
        InvalidArgument,
        "kv_gather: out must be C-contiguous",
        ws._validate,
        kv,
        0,
        cupy_array((10, 128), "float16")[:, 64:],
    )
    raises(
        InvalidType,
        "kv_gather: out must be a GPU array",
        ws._validate,
        kv,
        0,
        np.zeros((10, 64), np.float16),
    )
    raises(
        InvalidArgument, "kv_gather: ubatch must lie in [0, 2) (got 5)", ws._validate, kv, 5, None
    )


def test_kv_gather_capacity():
    ws = make_kv(max_tokens=8)
    ws.data_slot_bytes = 2 * 4 * ws.row_bytes  # a slot that holds T <= 4 only
    raises(
        InvalidArgument,
        "kv_gather: world_size*T*row bytes must be <= the slot capacity 1024 "
        "bytes (got 2*5*128 = 1280)",
        ws._validate,
        cupy_array((5, 64), "float16"),
        0,
        None,
    )
    assert ws._validate(cupy_array((4, 64), "float16"), 0, None)[0] == 4


def test_kv_gather_closed_poisoned_and_not_counted():
    ws = make_kv()
    kv = cupy_array((5, 64), "float16")
    rejected_without_counting(
        ws, InvalidArgument, "C-contiguous", cupy_array((5, 128), "float16")[:, :64]
    )
    rejected_without_counting(
        ws, InvalidArgument, "max_tokens 8 (got 9)", cupy_array((9, 64), "float16"), ubatch=1
    )
    ws._rec[:] = [2, OP_IDS["kv_gather"], 0, 1, 3, 2, 0, 0]
    rejected_without_counting(ws, CollectiveTimeout, "kv_gather: rank 0 timed out", kv)
    ws._rec[:] = 0
    ws._closed = True
    rejected_without_counting(ws, ClosedError, "kv_gather: the workspace is closed", kv)


def test_kv_gather_empty_call_launches_nothing():
    ws = _with_slots(make_kv())
    ws._kernel = None
    r = ws(cupy_array((0, 64), "float16"))
    assert r.shape == (0, 64) and ws._calls == [0, 0]


def test_kv_gather_result_view_geometry():
    ws = _with_slots(make_kv(world_size=4, row_dim=32, dtype="float32"))
    v = ws._result_view(ws.data_slot_ptr(1, 1), 7)
    assert v.shape == (28, 32) and v.strides == (128, 4) and v.flags.c_contiguous


def test_kv_gather_constructor_checks():
    comm = Communicator.single()
    kw = dict(max_tokens=4, row_dim=64, dtype="float16")
    raises(
        InvalidArgument,
        "kv_gather: row bytes (row_dim*itemsize) must be a multiple of 16 "
        "(pad D_kv to a multiple of 16 bytes) (got 3*2 = 6 bytes)",
        KVGather,
        comm,
        **dict(kw, row_dim=3),
    )
    raises(
        InvalidArgument,
        "kv_gather: algorithm must be one of ['push', 'pull'] (got 'ring')",
        KVGather,
        comm,
        **dict(kw, algorithm="ring"),
    )
    raises(
        InvalidArgument,
        "kv_gather: row_dim must be >= 1 (got 0)",
        KVGather,
        comm,
        **dict(kw, row_dim=0),
    )
    raises(
        InvalidType,
        "kv_gather: max_tokens must be an int (got bool True)",
        KVGather,
        comm,
        **dict(kw, max_tokens=True),
    )
    raises(
        InvalidArgument,
        "kv_gather: world_size*max_tokens*row_dim*itemsize must be < 32 GiB",
        KVGather,
        comm,
        **dict(kw, max_tokens=2**30),
    )
    raises(InvalidType, "kv_gather: comm must be a dcpkit.Communicator", KVGather, object(), **kw)


def test_kv_gather_attributes():
    assert KVGather.launches_per_call == 1 and KVGather.op_name == "kv_gather"
    for algorithm in ("push", "pull"):
        assert make_kv(algorithm=algorithm).algorithm == algorithm


# ----------------------------------------------------------------------------- kernels
def test_gather_kernel_variants_registered():
    assert jit.VARIANTS["q_gather.cu"] == [
        "dcpkit::q_gather_kernel<dcpkit::Transport::Unicast>",
        "dcpkit::q_gather_kernel<dcpkit::Transport::Multicast>",
    ]
    assert set(jit.VARIANTS["kv_gather.cu"]) == {
        "dcpkit::kv_gather_push_kernel<dcpkit::Transport::Unicast>",
        "dcpkit::kv_gather_push_kernel<dcpkit::Transport::Multicast>",
        "dcpkit::kv_gather_pull_kernel",
    }


def test_gather_kernels_compile_for_sm90():
    """Every variant, unicast and multicast, compiles with NVRTC without warnings."""
    try:
        res = jit.compile_only(["q_gather.cu", "kv_gather.cu"])
    except Exception as e:
        if type(e).__name__ == "MissingDependency":
            pytest.skip(f"NVRTC not available: {e}")
        raise
    assert res["q_gather.cu"]["variants"] == 2 and res["kv_gather.cu"]["variants"] == 3
    assert all(r["cubin_bytes"] > 0 for r in res.values())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("file", ["q_gather.cu", "kv_gather.cu"])
def test_gather_kernels_no_spills_and_16_byte_stores(tmp_path, file):
    """ptxas: no stack frame, no spills in any variant; PTX: the payload stores are 16 bytes
    (st.global.v4) and no narrower global store of payload exists."""
    src = tmp_path / file
    src.write_text(jit.source(file))
    r = subprocess.run(
        [
            "nvcc",
            "-arch=sm_90",
            "-std=c++17",
            "-Xptxas",
            "-v",
            "-cubin",
            "-o",
            str(tmp_path / "k.cubin"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    props = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
        r"loads",
        r.stderr,
    )
    assert len(props) == len(jit.VARIANTS[file]), r.stderr
    assert all(p == ("0", "0", "0") for p in props), r.stderr
    r = subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(tmp_path / "k.ptx"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    assert "st.global.v4.u32" in ptx and "ld.global.nc.v4.u32" in ptx
    assert ".local" not in ptx
    narrow = re.findall(r"\bst\.global\.(?:u8|u16|b8|b16|v2)", ptx)
    assert not narrow, narrow
