"""The ops' host fast path on CPU (plan cache + packed-parameter launch, dcpkit._plan and
dcpkit._launch): every kernel variant's parameter list matches the type list its op packs (width
and float-ness of every parameter, read from the PTX NVRTC emits); a call packs the values the
kernel must get; a warm plan never hides an error, a poisoned or failed workspace raises at the
next call; a new layout under the same pointer gets a new plan. The launch is recorded, not
run."""

from __future__ import annotations

import numpy as np
import pytest
from _scripts import load_script

from dcpkit import jit
from dcpkit._launch import check_params_match
from dcpkit.errors import CollectiveTimeout, CudaError, DcpkitError, InvalidArgument, InvalidType
from dcpkit.ops._workspace import OP_IDS, PROTO_PARAM_TYPES
from dcpkit.ops.kv_gather import KV_GATHER_PULL_PARAM_TYPES, KV_GATHER_PUSH_PARAM_TYPES
from dcpkit.ops.lse_reduce import LSE_REDUCE_PARAM_TYPES
from dcpkit.ops.q_gather import Q_GATHER_PARAM_TYPES

cupy = pytest.importorskip("cupy")

#: Every variant an op launches through its plan -> the type list the op packs for it.
_LAUNCHED = {
    "q_gather.cu": dict.fromkeys(jit.VARIANTS["q_gather.cu"], Q_GATHER_PARAM_TYPES),
    "kv_gather.cu": {
        v: KV_GATHER_PULL_PARAM_TYPES if "pull" in v else KV_GATHER_PUSH_PARAM_TYPES
        for v in jit.VARIANTS["kv_gather.cu"]
    },
    "lse_reduce.cu": {
        v: LSE_REDUCE_PARAM_TYPES for v in jit.VARIANTS["lse_reduce.cu"] if "lse_reduce_kernel" in v
    },
}


def _ptx(file: str, exprs):
    """The PTX of ``file`` with every name expression in ``exprs``; their lowered names."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(jit.source(file).encode(), file.encode(), 0, [], [])
    for e in exprs:
        nvrtc.nvrtcAddNameExpression(prog, e.encode())
    opts = [o.encode() for o in list(jit.DEFAULT_OPTIONS) + ["-arch=compute_90"]]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(res) != 0:
        pytest.skip(f"NVRTC cannot compile {file} here ({res})")
    names = {}
    for e in exprs:
        _, name = nvrtc.nvrtcGetLoweredName(prog, e.encode())
        names[e] = name.decode() if isinstance(name, bytes) else name
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    buf = bytearray(n)
    nvrtc.nvrtcGetPTX(prog, buf)
    return buf.decode().rstrip("\0 "), names


@pytest.mark.parametrize("file", sorted(_LAUNCHED))
def test_plan_parameters_match_every_kernel_variant(file):
    variants = _LAUNCHED[file]
    assert variants, file
    ptx, names = _ptx(file, list(variants))
    for expr, types in variants.items():
        assert types[: len(PROTO_PARAM_TYPES)] == PROTO_PARAM_TYPES
        check_params_match(types, ptx, names[expr], expr)


def _mod():
    return load_script("host_path_cpu")


def _setup():
    mod = _mod()
    stream = mod._cpu_stream()
    rec = mod.Recorder()
    return (mod, rec) + tuple(mod.build_ops(stream, rec))


def _params(rec):
    kind, grid, params, _ = rec.last
    assert kind == "launcher"
    return grid, [params[i] for i in range(len(params))]


def _op_and_args(mod, qg, kg, lr, which: str):
    """The op ``which`` ("q", "kv", "lse") of :func:`_setup` and the arrays of one call."""
    if which == "q":
        return qg, (mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16"),)
    if which == "kv":
        return kg, (mod.array((mod.T, mod.D_Q), "bfloat16"),)
    return lr, (
        mod.array((mod.T, mod.H, mod.D_V), "bfloat16"),
        mod.array((mod.T, mod.H), "float32"),
    )


def _proto(ws, u):
    return [int(v) for v in ws._make_proto(u)]


def test_q_gather_calls_pack_what_the_kernel_takes():
    mod, rec, qg, _, _ = _setup()
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    out = mod.array((mod.T, mod.H, mod.D_Q), "bfloat16")
    row_vecs = mod.H_R * mod.D_Q * 2 // 16
    views = []
    for kw in ({}, {"out": out}, {}, {"return_padded": True}, {"out": out}):
        res = qg(q, **kw)
        grid, p = _params(rec)
        assert p[:17] == _proto(qg, 0)
        assert p[17:20] == [int(qg.peer_data_ptr(0)), qg.data_slot_bytes, 0]
        assert p[20:25] == [q.data.ptr, qg.row_bytes, row_vecs, qg.slot_token_bytes, mod.T]
        if "out" in kw:
            assert res is out and p[25] == out.data.ptr and p[26] == mod.H * mod.D_Q * 2
            assert grid == qg.ctas_for(mod.T, copy_out=True)
        else:  # zero copy: the result is the own data slot of this call
            assert p[25] == 0 and grid == qg.ctas_for(mod.T)
            slot = qg.data_slot_ptr(0, qg._calls[0] % 3)
            assert res.data.ptr == slot and res.shape[1] == (
                qg.padded_num_heads if kw else qg.num_heads
            )
            views.append(res)
    assert qg._plans.misses == 3 and qg._plans.hits == 2  # view, out=, padded
    assert rec.count == 5 and qg._calls == [5]


def test_kv_gather_and_lse_reduce_calls_pack_what_the_kernel_takes():
    mod, rec, _, kg, lr = _setup()
    kv = mod.array((mod.T, mod.D_Q), "bfloat16")
    kv_out = mod.array((mod.W * mod.T, mod.D_Q), "bfloat16")
    for kw in ({}, {"out": kv_out}, {}):
        res = kg(kv, **kw)
        _, p = _params(rec)
        assert len(p) == len(KV_GATHER_PUSH_PARAM_TYPES) and p[:17] == _proto(kg, 0)
        assert p[20:23] == [kv.data.ptr, mod.T * mod.D_Q * 2 // 16, mod.T]
        assert p[23] == (kv_out.data.ptr if kw else 0)
        assert (res is kv_out) if kw else res.shape == (mod.W * mod.T, mod.D_Q)
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    o = mod.array((mod.T, mod.H_R, mod.D_V), "bfloat16")
    results = []
    for kw in ({}, {"out": o}, {}, {}):
        res = lr(xo, lse, **kw)
        _, p = _params(rec)
        assert len(p) == len(LSE_REDUCE_PARAM_TYPES) and p[:17] == _proto(lr, 0)
        assert p[21] == xo.data.ptr and p[24] == lse.data.ptr and p[30] == 0  # no requests
        assert p[31] == res.data.ptr and p[32] == 0 and p[33:] == [mod.T, mod.H, mod.H_R, mod.D_V]
        if kw:
            assert res is o
        else:
            results.append(res)
    # calls 1, 3, 4: two eager output buffers alternate per call; a view is memoised
    assert results[0] is results[1] and results[2].data.ptr != results[0].data.ptr
    assert kg._plans.hits == 1 and lr._plans.hits == 2


def test_a_new_layout_under_the_same_pointer_gets_a_new_plan():
    mod, rec, qg, _, _ = _setup()
    q = mod.array((2, mod.H_R, mod.D_Q), "bfloat16")
    qg(q)
    n = rec.count
    mem = cupy.cuda.UnownedMemory(q.data.ptr, 1 << 22, None, 0)
    row = mod.H_R * mod.D_Q * 2
    padded = cupy.ndarray(
        (2, mod.H_R, mod.D_Q),
        q.dtype,
        cupy.cuda.MemoryPointer(mem, 0),
        strides=(row + 16, mod.D_Q * 2, 2),
    )
    qg(padded)  # same pointer, other token stride: validated, packed
    _, p = _params(rec)
    assert p[20] == q.data.ptr and p[21] == row + 16 and qg._plans.misses == 2
    bad = cupy.ndarray(
        (2, mod.H_R, mod.D_Q),
        q.dtype,
        cupy.cuda.MemoryPointer(mem, 0),
        strides=(row + 8, mod.D_Q * 2, 2),
    )
    with pytest.raises(InvalidArgument, match="token stride"):
        qg(bad)  # same pointer and shape, a stride the check rejects
    assert rec.count == n + 1 and len(qg._plans) == 2


def test_warm_plans_never_hide_an_error():
    mod, rec, qg, _, lr = _setup()
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    for _ in range(3):
        qg(q)
    n, calls = rec.count, list(qg._calls)
    mem = cupy.cuda.UnownedMemory(q.data.ptr, 1 << 22, None, 0)
    same_ptr = cupy.ndarray((mod.T, mod.H_R, mod.D_Q), np.float32, cupy.cuda.MemoryPointer(mem, 0))
    with pytest.raises(InvalidType, match="q dtype must be"):
        qg(same_ptr)
    with pytest.raises(InvalidType, match="ubatch must be an int"):
        qg(q, ubatch=False)  # False == 0, but not the same key
    with pytest.raises(InvalidType, match="return_padded must be a bool"):
        qg(q, return_padded=0)
    with pytest.raises(InvalidType, match="stream must be"):
        qg(q, stream="s")  # checked after the plan, on every call
    assert rec.count == n and qg._calls == calls
    qg._rec[:] = [2, OP_IDS["q_gather"], 0, 1, 7, 5, 0, 0]
    assert qg.poisoned
    with pytest.raises(CollectiveTimeout, match="waiting for peer 1"):
        qg(q)  # poisoned after warm-up: raises at the next call
    assert rec.count == n and qg._calls == calls
    qg._closed = True
    with pytest.raises(DcpkitError, match="closed"):
        qg(q)
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    lr(xo, lse)
    with pytest.raises(InvalidArgument, match="seq_lens requires query_start_loc"):
        lr(xo, lse, seq_lens=mod.array((3,), "int32"))


class _Failing:
    def launch(self, grid, params, stream_ptr):
        raise CudaError("cuLaunchKernel", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")


@pytest.mark.parametrize("which", ["q", "kv", "lse"])
def test_a_launch_that_raises_leaves_the_workspace_unusable(which):
    """The call was counted before the launch (the epoch's host shadow advanced): after a
    failed launch every later call raises, and ``poisoned`` tells it without a device sync."""
    mod, rec, qg, kg, lr = _setup()
    ws, args = _op_and_args(mod, qg, kg, lr, which)
    ws(*args)
    good = ws._launchers
    ws._launchers = mod._EveryKernel(_Failing())
    with pytest.raises(CudaError, match="CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        ws(*args)
    assert ws.poisoned
    ws._launchers = good
    n = rec.count
    for _ in range(2):
        with pytest.raises(DcpkitError, match="unusable: a kernel launch failed"):
            ws(*args)
    with pytest.raises(DcpkitError, match="unusable"):
        ws.check()
    assert rec.count == n


def test_host_work_does_not_grow_with_calls_or_ubatches():
    """One plan per distinct call, whatever the number of calls; a ubatch is its own key."""
    mod = _mod()
    stream = mod._cpu_stream()
    rec = mod.Recorder()
    from dcpkit.ops.q_gather import QGather

    qg = QGather.__new__(QGather)
    qg._check_arguments(
        mod.W,
        max_tokens=mod.T_MAX,
        heads_per_rank=mod.H_R,
        head_dim=mod.D_Q,
        dtype="bfloat16",
        num_ubatches=4,
        timeout_ms=5000.0,
    )
    mod.stub_workspace(qg, stream, rec)
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    for _ in range(50):
        for u in range(4):
            qg(q, ubatch=u)
    assert len(qg._plans) == 4 and qg._plans.misses == 4 and qg._calls == [50] * 4
    _, p = _params(rec)
    assert p[:17] == _proto(qg, 3)
    assert len(qg.__dict__.get("_view_cache", {})) <= 4 * 3


def test_dcpcomm_routes_are_memoised_and_never_hide_an_error():
    """DCPComm's own checks run once per call key (then the op's plan cache serves the call);
    a bad call after warm-up still raises DCPComm's error, launches nothing."""
    import warnings

    mod = _mod()
    stream = mod._cpu_stream()
    rec = mod.Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        dcp = mod.build_dcpcomm(mod.build_ops(stream, rec, return_lse=True), stream)
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    o = mod.array((mod.T, mod.H_R, mod.D_V), "bfloat16")
    for _ in range(5):
        dcp.q_gather(q)
        dcp.lse_reduce(xo, lse, out=o)
    routes = [dcp._routes(op) for op in ("q_gather", "lse_reduce")]
    assert [(r.misses, r.hits) for r in routes] == [(1, 4), (1, 4)] and rec.count == 10
    assert dcp.direct_ops["q_gather"]._plans.hits == 4
    assert dcp.counters["q_gather"][dcp.last_path] == 5
    n = rec.count
    with pytest.raises(InvalidArgument, match="DCPComm.q_gather: q"):
        dcp.q_gather(q.reshape(mod.T, mod.H_R * mod.D_Q))  # same pointer, 2-D
    with pytest.raises(InvalidArgument, match="no path can serve|max_tokens"):
        dcp.q_gather(mod.array((mod.T_MAX + 1, mod.H_R, mod.D_Q), "bfloat16"))
    with pytest.raises(InvalidType, match="stream must be"):
        dcp.q_gather(q, stream="s")
    with pytest.raises(InvalidArgument, match="lse_partial dtype must be one of"):
        dcp.lse_reduce(xo, mod.array((mod.T, mod.H), "int32"), out=o)
    assert rec.count == n


def test_plans_hold_no_reference_to_the_callers_arrays():
    """A cached plan keeps addresses only: a freed array's memory is never kept alive by it,
    and a call returns the out= it was given (not an earlier call's object)."""
    import sys

    mod, rec, qg, kg, lr = _setup()
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    qo = mod.array((mod.T, mod.H, mod.D_Q), "bfloat16")
    kv = mod.array((mod.T, mod.D_Q), "bfloat16")
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    o = mod.array((mod.T, mod.H_R, mod.D_V), "bfloat16")
    empty = q[:0]  # T == 0: nothing launched, the plan still cached
    arrays = (q, qo, kv, xo, lse, o, empty)
    counts = [sys.getrefcount(a) for a in arrays]
    for _ in range(3):
        qg(q)
        qg(q, out=qo)
        kg(kv)
        lr(xo, lse)
        lr(xo, lse, out=o)
        qg(empty)
    assert [sys.getrefcount(a) for a in arrays] == counts
    twin = o[...]  # another object, same description: a plan hit
    assert twin is not o and lr(xo, lse, out=twin) is twin


class _Capturing:
    """A stream that says it is capturing (the op's capture path), with a made-up handle."""

    ptr = 0

    def __init__(self, capturing: bool):
        self._capturing = capturing

    def is_capturing(self):
        return self._capturing


@pytest.mark.parametrize("which", ["q", "lse"])
def test_eager_calls_after_a_capture_copy_out_and_alternate(which, monkeypatch):
    """Once a ubatch was captured the host no longer knows the device parity: the eager hot path
    copies the result into the two workspace output buffers, alternating, never a data slot."""
    from dcpkit import _cuda

    mod, rec, qg, _, lr = _setup()
    monkeypatch.setattr(_cuda, "_STREAM_TYPES", _cuda.stream_types() + (_Capturing,))
    if which == "q":
        ws, args = qg, (mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16"),)
    else:
        ws = lr
        args = (
            mod.array((mod.T, mod.H, mod.D_V), "bfloat16"),
            mod.array((mod.T, mod.H), "float32"),
        )
    ws(*args)  # eager first call (a capture may not be the first)
    graph_res = ws(*args, stream=_Capturing(True))
    assert ws._captured[0] and ws._graph_next == 1
    assert graph_res.data.ptr == ws._graph_base  # the graph output buffer
    got = []
    for _ in range(4):
        res = ws(*args)
        grid, p = _params(rec)
        kout = p[25] if which == "q" else p[31]
        assert kout == res.data.ptr != 0  # the kernel copies out to the result
        got.append(res.data.ptr)
    buf = ws._eager_out[0].data.ptr
    assert got[0] == got[2] != got[1] == got[3]
    assert {got[0], got[1]} == {buf, buf + ws._out_bytes}
    if which == "q":
        assert grid == qg.ctas_for(mod.T, copy_out=True)
        assert not set(got) & {qg.data_slot_ptr(0, i) for i in range(3)}
    assert ws._calls == [6]


def test_lse_reduce_output_fields_are_right_on_every_path(monkeypatch):
    """The ``out`` / ``out_lse`` fields of a plan whose call names its own destinations are
    packed once: eager, captured and eager-after-capture calls all launch with the caller's
    pointers; a call that needs a workspace buffer patches them, alternating by parity, and the
    merged lse of a ``return_lse`` workspace lands after its output."""
    from dcpkit import _cuda

    mod, rec, _, _, lr = _setup()
    monkeypatch.setattr(_cuda, "_STREAM_TYPES", _cuda.stream_types() + (_Capturing,))
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    o = mod.array((mod.T, mod.H_R, mod.D_V), "bfloat16")
    ol = mod.array((mod.T, mod.H_R), "float32")
    seen = []
    for kw, stream in (
        ({"out": o}, None),
        ({"out": o, "out_lse": ol}, None),
        ({}, None),  # a workspace buffer: patched
        ({"out": o}, _Capturing(True)),  # the general path
        ({"out": o, "out_lse": ol}, _Capturing(True)),
        ({"out": o}, None),  # eager after the capture
        ({"out": o, "out_lse": ol}, None),
    ):
        res = lr(xo, lse, stream=stream, **kw)
        _, p = _params(rec)
        seen.append((p[31], p[32]))
        if kw:
            want = (o.data.ptr, ol.data.ptr if "out_lse" in kw else 0)
            assert (p[31], p[32]) == want, (kw, stream)
            assert (res[0] is o and res[1] is ol) if "out_lse" in kw else res is o
        else:
            assert p[31] == res.data.ptr and p[32] == 0
    mod2, rec2 = mod, mod.Recorder()
    lse_op = mod2.build_ops(mod2._cpu_stream(), rec2, return_lse=True)[2]
    bases = []
    for _ in range(3):
        r, rl = lse_op(xo, lse, out=o)  # the merged lse goes to the workspace buffer
        _, p = _params(rec2)
        assert p[31] == o.data.ptr and p[32] == rl.data.ptr != 0
        bases.append(p[32])
    assert bases[0] == bases[2] != bases[1]
    assert {b - lse_op._out_part_bytes for b in bases} <= {
        lse_op._eager_out[0].data.ptr + k * lse_op._out_bytes for k in (0, 1)
    }


def test_plans_are_read_only_records():
    """A cached plan is a pure function of its key: nothing may change it after the build (its
    fields are read-only slots, and it has no ``__dict__`` to take new ones)."""
    import dataclasses

    mod, rec, qg, kg, lr = _setup()
    qg(mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16"))
    kg(mod.array((mod.T, mod.D_Q), "bfloat16"))
    lr(mod.array((mod.T, mod.H, mod.D_V), "bfloat16"), mod.array((mod.T, mod.H), "float32"))
    for ws in (qg, kg, lr):
        (plan,) = ws._plans._plans.values()
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.T = 2
        with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):
            plan.extra = 1
        assert not hasattr(plan, "__dict__") and plan.T == mod.T


@pytest.mark.parametrize("which", ["q", "kv"])
def test_gather_out_field_is_right_on_every_path(which, monkeypatch):
    """NOTE [dcpkit gather out field]: the ``out`` parameter is packed once with what the plan's
    calls write (the caller's ``out=``, or 0 for zero copy) and patched only after a capture.
    Every path launches with the right value: zero copy 0 (the result the data slot of the
    call), ``out=`` its pointer (eager, captured, eager after a capture), a captured view the
    graph buffer, an eager view after the capture an eager buffer; a ubatch never captured stays
    zero copy while another one is captured, through the same op."""
    from dcpkit import _cuda
    from dcpkit.ops.kv_gather import KVGather
    from dcpkit.ops.q_gather import QGather

    mod = _mod()
    monkeypatch.setattr(_cuda, "_STREAM_TYPES", _cuda.stream_types() + (_Capturing,))
    rec = mod.Recorder()
    if which == "q":
        ws = QGather.__new__(QGather)
        ws._check_arguments(
            mod.W,
            max_tokens=mod.T_MAX,
            heads_per_rank=mod.H_R,
            head_dim=mod.D_Q,
            dtype="bfloat16",
            num_ubatches=2,
            timeout_ms=5000.0,
        )
        x = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
        out = mod.array((mod.T, mod.H, mod.D_Q), "bfloat16")
        field = 25
    else:
        ws = KVGather.__new__(KVGather)
        ws._check_arguments(
            mod.W,
            max_tokens=mod.T_MAX,
            row_dim=mod.D_Q,
            dtype="bfloat16",
            num_ubatches=2,
            timeout_ms=5000.0,
        )
        x = mod.array((mod.T, mod.D_Q), "bfloat16")
        out = mod.array((mod.W * mod.T, mod.D_Q), "bfloat16")
        field = len(KV_GATHER_PUSH_PARAM_TYPES) - 1
    mod.stub_workspace(ws, mod._cpu_stream(), rec)
    zero_copy = ws.ctas_for(mod.T)
    copy_out = ws.ctas_for(mod.T, copy_out=True)
    slots = [{ws.data_slot_ptr(u, i) for i in range(3)} for u in range(2)]
    eager = []
    for kw, stream, want in (
        ({}, None, "slot"),
        ({"out": out}, None, "out"),
        ({}, None, "slot"),
        ({"ubatch": 1}, None, "slot"),
        ({}, _Capturing(True), "graph"),
        ({"out": out}, _Capturing(True), "out"),
        ({"out": out}, None, "out"),  # eager after the capture
        ({}, None, "eager"),
        ({}, None, "eager"),
        ({"out": out}, None, "out"),
        ({"ubatch": 1}, None, "slot"),  # never captured: still zero copy
        ({"ubatch": 1, "out": out}, None, "out"),
        ({"ubatch": 1}, None, "slot"),
    ):
        res = ws(x, stream=stream, **kw)
        grid, p = _params(rec)
        ub = kw.get("ubatch", 0)
        if want == "slot":
            assert p[field] == 0 and grid == zero_copy, (kw, stream)
            assert res.data.ptr == ws.data_slot_ptr(ub, ws._calls[ub] % 3) in slots[ub]
        elif want == "out":
            assert p[field] == out.data.ptr and res is out and grid == copy_out, (kw, stream)
        elif want == "graph":  # the graph output buffer: zero copy (bit 0 set) or copy-out
            zc = ws._zero_copy_graph(mod.T)  # q_gather here: 72 KiB per rank; kv_gather 1 KiB
            assert zc == (which == "q")
            assert res.data.ptr == ws._graph_base, (kw, stream)
            assert p[field] == (res.data.ptr | 1 if zc else res.data.ptr), (kw, stream)
            assert grid == ws.ctas_for(mod.T, graph_view=True)
            assert grid == (ws._grid_graph_view(mod.T) if zc else copy_out)
        else:
            assert p[field] == res.data.ptr != 0 and grid == copy_out, (kw, stream)
            assert res.data.ptr not in slots[0] | slots[1]
            eager.append(res.data.ptr)
    buf = ws._eager_out[0].data.ptr
    assert eager[0] != eager[1] and set(eager) == {buf, buf + ws._out_bytes}
    assert ws._captured == [True, False] and ws._calls == [9, 4]


def test_lse_reduce_patches_only_the_fields_into_a_workspace_buffer():
    """The hot path patches a field only when it points into a workspace output buffer (by
    parity); a field that holds the caller's pointer, or 0, keeps its packed value. Each form
    of call, in turn through one op, launches with the right pair every time: ``out_lse=``
    alone (out patched, lse the caller's), nothing (out patched, lse 0 or, with
    ``return_lse``, patched too), ``out=`` alone (out the caller's, lse 0 or patched),
    ``out=`` and ``out_lse=`` (both the caller's). Five calls a round: a form's parity
    alternates from round to round, and so do its buffers."""
    mod = _mod()
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    o = mod.array((mod.T, mod.H_R, mod.D_V), "bfloat16")
    ol = mod.array((mod.T, mod.H_R), "float32")
    forms = (
        ("lse only", {"out_lse": ol}),
        ("nothing", {}),
        ("both", {"out": o, "out_lse": ol}),
        ("out only", {"out": o}),
        ("nothing again", {}),
    )
    for return_lse in (False, True):
        rec = mod.Recorder()
        lr = mod.build_ops(mod._cpu_stream(), rec, return_lse=return_lse)[2]
        buf = lr._eager_out[0].data.ptr
        bufs = {buf + k * lr._out_bytes for k in (0, 1)}
        seen = {form: [] for form, _ in forms}
        for _ in range(3):
            for form, kw in forms:
                res = lr(xo, lse, **kw)
                _, p = _params(rec)
                out_ptr, lse_ptr = p[31], p[32]
                pair = res if (return_lse or "out_lse" in kw) else (res, None)
                if "out" in kw:
                    assert out_ptr == o.data.ptr and pair[0] is o, form
                else:
                    assert out_ptr == pair[0].data.ptr and out_ptr in bufs, form
                if "out_lse" in kw:
                    assert lse_ptr == ol.data.ptr and pair[1] is ol, form
                elif return_lse:
                    assert lse_ptr == pair[1].data.ptr != 0, form
                    assert lse_ptr - lr._out_part_bytes in bufs, form
                else:
                    assert lse_ptr == 0 and pair[1] is None, form
                seen[form].append((out_ptr, lse_ptr))
        for form, pairs in seen.items():
            if form == "both" or (form == "out only" and not return_lse):
                assert len(set(pairs)) == 1, (return_lse, form)  # no workspace buffer
            else:
                assert pairs[0] == pairs[2] != pairs[1], (return_lse, form)


def test_every_lse_reduce_call_goes_to_its_own_classs_keyed_entry():
    """``lse_reduce`` is one function for the direct op, the NCCL op and DCPComm
    (:func:`dcpkit._lse_call.lse_reduce_method`); each instance's call reaches its own class's
    ``_lse_keyed`` with the flat key of its arrays (a subclass that overrides the entry gets
    its calls), and DCPComm's entry routes the call before the op's runs."""
    from dcpkit._lse_call import LseReduceCall
    from dcpkit._plan import arrays_key
    from dcpkit.manager import DCPComm
    from dcpkit.nccl.lse_reduce import NcclLseReduce
    from dcpkit.ops.lse_reduce import LseReduce

    assert LseReduce.__call__ is NcclLseReduce.__call__ is LseReduceCall.__call__
    assert DCPComm.lse_reduce.__code__ is LseReduceCall.__call__.__code__
    for cls in (LseReduce, NcclLseReduce, DCPComm):
        assert "_lse_keyed" in {n for k in cls.__mro__ for n in vars(k)}, cls
    mod, rec, _, _, lr = _setup()
    xo = mod.array((mod.T, mod.H, mod.D_V), "bfloat16")
    lse = mod.array((mod.T, mod.H), "float32")
    o = mod.array((mod.T, mod.H_R, mod.D_V), "bfloat16")
    seen = []

    class Recording(LseReduce):
        def _lse_keyed(self, key, arrays, ubatch, stream):
            seen.append((key, arrays, ubatch, stream))
            return super()._lse_keyed(key, arrays, ubatch, stream)

    lr.__class__ = Recording
    assert lr(xo, lse, out=o, ubatch=0) is o and rec.count == 1
    ((key, arrays, ubatch, stream),) = seen
    assert arrays == (xo, lse, None, None, o, None) and (ubatch, stream) == (0, None)
    assert key == arrays_key(arrays, 0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        stream = mod._cpu_stream()
        dcp = mod.build_dcpcomm(mod.build_ops(stream, rec, return_lse=True), stream)
    r, rl = dcp.lse_reduce(xo, lse, out=o)
    assert r is o and dcp._routes("lse_reduce").misses == 1
    assert dcp.counters["lse_reduce"][dcp.last_path] == 1


class _Tagged:
    """A launcher stand-in that records which kernel id it stands for."""

    def __init__(self, kid, seen):
        self.kid, self.seen = kid, seen

    def launch(self, grid, params, stream_ptr):
        self.seen.append(self.kid)


def test_lse_reduce_launches_the_kernel_of_its_lse_dtype_and_instance():
    """The plan names its kernel by a small int (no tuple with a dtype hashed per call): every
    (lse dtype, instance) pair has its own id, and a call, eager or through the general path
    (DCPKIT_DEBUG), launches the kernel of its own lse dtype and of the instance its ``T``
    takes."""
    from dcpkit.ops._lse_checks import float_dtypes

    mod, _, _, _, lr = _setup()
    kernels = {(d, large) for d in float_dtypes() for large in (False, True)}
    assert set(lr._kernel_ids) == kernels
    assert sorted(lr._kernel_ids.values()) == list(range(len(kernels)))
    seen: list[int] = []
    lr._launchers = {i: _Tagged(i, seen) for i in lr._kernel_ids.values()}
    from types import SimpleNamespace

    lr.comm = SimpleNamespace(agree=lambda what, value: None)
    # a launch table that names both instances at the decode geometry (T = 1: small, 2: large)
    lr._grids = [(g, T % 2 == 0) for T, (g, _) in enumerate(lr._grids)]
    large = {T: lr._grids[T][1] for T in (1, 2)}
    Ts = (1, 2)
    for debug in (False, True):
        lr._debug = debug
        for dt in ("float32", "float16", "bfloat16"):
            for T in Ts:
                xo = mod.array((T, mod.H, mod.D_V), "bfloat16")
                lse = mod.array((T, mod.H), dt)
                for _ in range(2):  # the miss, then the hit
                    lr(xo, lse)
                    want = lr._kernel_ids[lse.dtype, large[T]]
                    assert seen[-1] == want, (debug, dt, T)
    lr._debug = False


class _GpuStream:
    """A stream of GPU ``device_id`` (-1: the legacy default stream), with a made-up handle."""

    def __init__(self, ptr: int, device_id: int):
        self.ptr, self.device_id = ptr, device_id

    def is_capturing(self):
        return False


@pytest.mark.parametrize("which", ["q", "kv", "lse"])
def test_the_stream_is_of_the_ops_gpu_whichever_gpu_is_current(which, monkeypatch):
    """Without ``stream=`` a call runs on the current stream of the op's GPU, also while
    another GPU is current (then through the launch that makes the op's GPU current); a stream
    of another GPU is refused before anything is counted or launched (its launch would fail
    after the count and leave the workspace unusable); the legacy default stream passes."""
    from dcpkit import _cuda

    mod, rec, qg, kg, lr = _setup()
    monkeypatch.setattr(_cuda, "_STREAM_TYPES", _cuda.stream_types() + (_GpuStream,))
    ws, args = _op_and_args(mod, qg, kg, lr, which)
    streams = {0: _GpuStream(0x1000, 0), 1: _GpuStream(0x2000, 1)}
    asked = []
    ws._current_stream_fn = lambda device=-1: asked.append(device) or streams[device]
    switched = []
    ws._run = lambda key, grid, params, stream: switched.append(stream)
    current = {"gpu": 0}
    ws._get_device = lambda: current["gpu"]

    ws(*args)  # the op's GPU is current: the launcher, GPU 0's stream
    assert rec.last[3] == 0x1000 and asked == [0] and not switched
    current["gpu"] = 1
    ws(*args)  # another GPU is current: still GPU 0's stream, through the switching launch
    assert asked == [0, 0] and switched == [streams[0]]
    counted = list(ws._calls)
    with pytest.raises(InvalidArgument, match="stream is of GPU 1, the op runs on GPU 0"):
        ws(*args, stream=streams[1])
    current["gpu"] = 0
    with pytest.raises(InvalidArgument, match="stream is of GPU 1, the op runs on GPU 0"):
        ws(*args, stream=streams[1])
    assert ws._calls == counted and not ws.poisoned and ws._launch_failed is None
    ws(*args, stream=_GpuStream(0, -1))  # the legacy default stream: any GPU's
    assert rec.last[3] == 0 and ws._calls[0] == counted[0] + 1
