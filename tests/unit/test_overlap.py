"""Outputs that share memory with an input or with the other output are refused before anything
is launched or counted, by every op and path (direct ops, lse_combine, the NCCL ops, DCPComm),
cold and after warm-up calls whose plans hold the same addresses; disjoint layouts that
interleave in one buffer are accepted. No GPU: made-up device addresses, never dereferenced."""

from __future__ import annotations

import types

import numpy as np
import pytest
from test_bad_input_table import (
    BASE,
    D_KV,
    D_V,
    F16,
    F32,
    H_R,
    I32,
    RANK,
    D,
    Dev,
    H,
    T,
    W,
    _as_cupy,
    good_call,
    make,
    make_callable,
)
from test_nccl_construct_cpu import stubbed  # noqa: F401 - a fixture

from dcpkit._arrays import array_info
from dcpkit._overlap import check_disjoint, shares_memory
from dcpkit.errors import InvalidArgument
from dcpkit.reference import resolve_dtype

REGION = BASE + (1 << 34)  # made-up addresses of their own, away from the table's


def _info(shape, dtype, strides_el=None, *, at):
    return array_info(Dev(shape, dtype, strides_el, ptr=at), "t", "a")


# ----------------------------------------------------------------------------- the test itself
def test_exact_overlap_test():
    isz = 2
    out = _info((T, H, D), F16, at=REGION)
    # The own heads of out (the layout of an in-place gather): bytes in common.
    own = _info((T, H_R, D), F16, (H * D, D, 1), at=REGION + RANK * H_R * D * isz)
    assert shares_memory(out, own) and shares_memory(own, out)
    # The same bytes but one element: still overlapping.
    last = _info((1,), F16, at=REGION + (T * H * D - 1) * isz)
    assert shares_memory(out, last)
    # Right after out, and right before: adjacent, no byte in common.
    after = _info((T, H_R, D), F16, at=REGION + T * H * D * isz)
    before = _info((4,), F16, at=REGION - 4 * isz)
    assert not shares_memory(out, after) and not shares_memory(before, out)
    # Two column slices of one [T, 2*H_R*D] buffer interleave without a byte in common.
    left = _info((T, H_R, D), F16, (2 * H_R * D, D, 1), at=REGION)
    right = _info((T, H_R, D), F16, (2 * H_R * D, D, 1), at=REGION + H_R * D * isz)
    assert not shares_memory(left, right)
    # Empty arrays have no bytes, whatever their address.
    empty = _info((0, H_R, D), F16, at=REGION)
    assert not shares_memory(empty, out) and not shares_memory(out, empty)
    # A broadcast (stride 0) array over one element of out.
    bcast = _info((T, H_R, D), F16, (0, 0, 0), at=REGION + 10 * isz)
    assert shares_memory(out, bcast)
    # Different itemsizes: a float32 array over the last two float16 elements of out.
    f32 = _info((1,), F32, at=REGION + (T * H * D - 2) * isz)
    assert shares_memory(f32, out)


def test_check_disjoint_names_both_arrays_and_skips_absent_ones():
    out = _info((T, H, D), F16, at=REGION)
    q = _info((T, H_R, D), F16, at=REGION + 64)
    with pytest.raises(InvalidArgument) as e:
        check_disjoint("q_gather", (("out", out),), (("q", q),))
    msg = str(e.value)
    assert msg.startswith("q_gather: out must not share memory with q"), msg
    assert msg.endswith("give out memory of its own"), msg
    # Outputs are compared with each other too.
    with pytest.raises(InvalidArgument, match="out must not share memory with out_lse"):
        check_disjoint("x", (("out", out), ("out_lse", q)), ())
    check_disjoint("x", (("out", out), ("out_lse", None)), (("q", None),))  # nothing to compare
    far = _info((T, H_R, D), F16, at=REGION + (1 << 24))
    check_disjoint("x", (("out", out),), (("q", far),))  # disjoint: no error


# ----------------------------------------------------------------------------- every op
def _q_bad():
    """(q, out): q the own heads of out (an in-place gather)."""
    base = REGION + (1 << 26)
    out = Dev((T, H, D), ptr=base)
    q = Dev((T, H_R, D), strides_el=(H * D, D, 1), ptr=base + RANK * H_R * D * 2)
    return dict(q=q, out=out), "out must not share memory with q"


def _kv_bad():
    base = REGION + (2 << 26)
    out = Dev((W * T, D_KV), ptr=base)
    kv = Dev((T, D_KV), ptr=base + RANK * T * D_KV * 2)
    return dict(kv=kv, out=out), "out must not share memory with kv"


def _lse_arrays(base):
    return dict(
        out_partial=Dev((T, H, D_V), ptr=base),
        lse_partial=Dev((T, H), F32, ptr=base + (1 << 20)),
        seq_lens=Dev((3,), I32, ptr=base + (2 << 20)),
        query_start_loc=Dev((4,), I32, ptr=base + (3 << 20)),
        out=Dev((T, H_R, D_V), ptr=base + (4 << 20)),
        out_lse=Dev((T, H_R), F32, ptr=base + (5 << 20)),
    )


def _lse_bad(which):
    """lse_reduce's arrays with one output moved onto another array."""
    base = REGION + ((3 + len(which)) << 26)
    a = _lse_arrays(base)
    out_name, other = which
    other_ptr = a[other].ptr
    shape, dt = ((T, H_R, D_V), F16) if out_name == "out" else ((T, H_R), F32)
    a[out_name] = Dev(shape, dt, ptr=other_ptr)
    return a, f"{out_name} must not share memory with {other}"


LSE_CASES = [("out", "out_lse"), ("out", "query_start_loc"), ("out_lse", "seq_lens")]
#: lse_reduce's in-place calls: an output over its own partials (accepted: the kernels read the
#: whole input before they write an output).
LSE_IN_PLACE = [("out", "out_partial"), ("out_lse", "lse_partial"), ("out_lse", "out_partial")]


def _validate(kind, ws, a):
    if kind == "q":
        return ws._validate(a["q"], 0, a["out"], False)
    if kind == "kv":
        return ws._validate(a["kv"], 0, a["out"])
    return ws._validate(
        a["out_partial"],
        a["lse_partial"],
        a["seq_lens"],
        a["query_start_loc"],
        0,
        a["out"],
        a["out_lse"],
    )


CASES = [("q", _q_bad), ("kv", _kv_bad)] + [("lse", (lambda w=w: _lse_bad(w))) for w in LSE_CASES]
IDS = ["q_gather out over q", "kv_gather out over kv"] + [
    f"lse_reduce {o} over {i}" for o, i in LSE_CASES
]


@pytest.mark.parametrize("kind,bad", CASES, ids=IDS)
def test_validation_refuses_overlap_and_the_workspace_stays_usable(kind, bad):
    ws = make(kind)
    a, fragment = bad()
    with pytest.raises(InvalidArgument) as e:
        _validate(kind, ws, a)
    assert fragment in str(e.value), str(e.value)
    assert ws._calls == [0, 0]
    good_call(kind, ws)


def _call(kind, ws, a):
    if kind == "q":
        return ws(a["q"], out=a["out"])
    if kind == "kv":
        return ws(a["kv"], out=a["out"])
    return ws(
        a["out_partial"],
        a["lse_partial"],
        seq_lens=a["seq_lens"],
        query_start_loc=a["query_start_loc"],
        out=a["out"],
        out_lse=a["out_lse"],
    )


def _good(kind, base):
    """Good disjoint arrays of ``kind`` from ``base``."""
    if kind == "q":
        return dict(q=Dev((T, H_R, D), ptr=base), out=Dev((T, H, D), ptr=base + (1 << 20)))
    if kind == "kv":
        return dict(kv=Dev((T, D_KV), ptr=base), out=Dev((W * T, D_KV), ptr=base + (1 << 20)))
    return _lse_arrays(base)


@pytest.mark.parametrize("arrays", ["interface objects", "cupy arrays"])
@pytest.mark.parametrize("kind,bad", CASES, ids=IDS)
def test_full_calls_refuse_overlap_after_warm_up(kind, bad, arrays):
    """Warm-up calls whose plans hold the bad call's input addresses (and its output's, in
    another role), then the overlapping call: refused, nothing counted or launched."""
    ws, rec = make_callable(kind)
    convert = _as_cupy if arrays == "cupy arrays" else (lambda x: x)
    a, fragment = bad()
    good = _good(kind, REGION + (9 << 26))
    # Warm-up: every input of the bad call at its own address, disjoint good outputs.
    names_out = {"out", "out_lse"}
    warm = {k: (v if k not in names_out else good[k]) for k, v in a.items()}
    if kind == "lse" and warm["out_lse"].ptr == warm["out"].ptr:
        warm["out_lse"] = good["out_lse"]
    warm = {k: convert(v) for k, v in warm.items()}
    for _ in range(3):
        _call(kind, ws, warm)
    launches, calls = rec.count, list(ws._calls)
    assert launches == 3 and ws._plans.hits >= 2
    bad_arrays = {k: convert(v) for k, v in a.items()}
    with pytest.raises(InvalidArgument) as e:
        _call(kind, ws, bad_arrays)
    assert fragment in str(e.value), str(e.value)
    assert rec.count == launches and ws._calls == calls, "the refused call counted or launched"
    _call(kind, ws, warm)  # still usable
    assert rec.count == launches + 1


@pytest.mark.parametrize("which", LSE_IN_PLACE, ids=[f"{o} over {i}" for o, i in LSE_IN_PLACE])
def test_lse_reduce_in_place_calls_are_accepted(which):
    """lse_reduce's out= / out_lse= over its own partials: validated and launched."""
    ws = make("lse")
    a, _ = _lse_bad(which)
    _validate("lse", ws, a)
    ws, rec = make_callable("lse")
    _call("lse", ws, {k: _as_cupy(v) for k, v in a.items()})
    assert rec.count == 1


def test_disjoint_interleaved_outputs_are_accepted():
    """lse_reduce: out and out_lse carved from one buffer without a byte in common, and a q
    and an out that are two column slices of one buffer (rows interleaved): accepted."""
    ws = make("lse")
    a = _lse_arrays(REGION + (12 << 26))
    a["out_lse"] = Dev((T, H_R), F32, ptr=a["out"].ptr + T * H_R * D_V * 2)  # right after out
    _validate("lse", ws, a)
    ws = make("q")
    base = REGION + (13 << 26)
    row = (H + H_R) * D  # one buffer row holds a token of out, then a token of q
    out = Dev((T, H, D), strides_el=(row, D, 1), ptr=base)
    q = Dev((T, H_R, D), strides_el=(row, D, 1), ptr=base + H * D * 2)
    _validate("q", ws, dict(q=q, out=out))


def test_lse_combine_refuses_overlap():
    cupy = pytest.importorskip("cupy")
    from dcpkit.ops._lse_checks import validate_combine

    del cupy
    base = REGION + (14 << 26)
    src_out = Dev((W, T, H_R, D_V), ptr=base)
    src_lse = Dev((W, T, H_R), F32, ptr=base + (1 << 20))
    with pytest.raises(InvalidArgument, match="out must not share memory with src_out"):
        validate_combine(src_out, src_lse, Dev((T, H_R, D_V), ptr=base + 4096), None)
    with pytest.raises(InvalidArgument, match="out_lse must not share memory with src_lse"):
        validate_combine(
            src_out,
            src_lse,
            Dev((T, H_R, D_V), ptr=base + (2 << 20)),
            Dev((T, H_R), F32, ptr=base + (1 << 20) + 64),
        )
    plan = validate_combine(
        src_out,
        src_lse,
        Dev((T, H_R, D_V), ptr=base + (2 << 20)),
        Dev((T, H_R), F32, ptr=base + (3 << 20)),
    )
    assert plan.W == W and np.int64(plan.T) == T


# ----------------------------------------------------------------------------- DCPComm
def _dcpcomm():
    """scripts/host_path_cpu.py's DCPComm: its direct ops' launches recorded, no GPU."""
    pytest.importorskip("cupy")
    from test_bad_input_table import _stubs

    mod = _stubs()
    stream, rec = mod._cpu_stream(), mod.Recorder()
    return mod, mod.build_dcpcomm(mod.build_ops(stream, rec, return_lse=True), stream), rec


def test_dcpcomm_refuses_overlap_on_every_route():
    """In place (the direct op's own entry) or through DCPComm's copies (a layout the direct
    op cannot take), an output over an input is refused by DCPComm before any copy or launch;
    a disjoint call of the same shapes launches."""
    mod, dcp, rec = _dcpcomm()
    H2, HR2, DQ, DV, T2 = mod.H, mod.H_R, mod.D_Q, mod.D_V, mod.T
    buf = mod.array((4, H2 + HR2, DQ), "bfloat16")  # room for an interleaved q
    out = buf[:T2, :H2]
    direct = dcp.direct_ops["q_gather"]
    every_other_head = buf[:T2, : 2 * HR2 : 2]  # head stride 2*D: DCPComm would copy it first
    assert not direct.accepts_layout(q=every_other_head)
    for q, route in ((buf[:T2, :HR2], "in place"), (every_other_head, "copied")):
        assert direct.accepts_layout(q=q) == (route == "in place")
        with pytest.raises(InvalidArgument, match="DCPComm.q_gather: out must not share memory"):
            dcp.q_gather(q, out=out)
        assert rec.count == 0, route
    with pytest.raises(InvalidArgument, match="must not share memory with kv"):
        kv_out = mod.array((mod.W * T2, DQ), "bfloat16")
        dcp.kv_gather(kv_out[:T2], out=kv_out)
    x = mod.array((T2, H2, DV), "bfloat16")
    lse = mod.array((T2, H2), "float32")
    both = mod.array((T2 * HR2 * DV * 2,), "uint8")  # out and out_lse over the same bytes
    out_b = both.view(resolve_dtype("bfloat16")).reshape(T2, HR2, DV)
    lse_b = both[: T2 * HR2 * 4].view(np.float32).reshape(T2, HR2)
    with pytest.raises(InvalidArgument, match="DCPComm.lse_reduce: out must not share memory"):
        dcp.lse_reduce(x, lse, out=out_b, out_lse=lse_b)
    masks = mod.array((64,), "int32")
    qsl, lse_m = masks[:2], masks.view(np.float32)[: T2 * HR2].reshape(T2, HR2)
    with pytest.raises(InvalidArgument, match="out_lse must not share memory with query_start"):
        dcp.lse_reduce(x, lse, query_start_loc=qsl, out_lse=lse_m)
    assert rec.count == 0, "a refused call launched"
    # An in-place lse_reduce (out= over the first bytes of out_partial): accepted.
    over_x = x.reshape(-1)[: T2 * HR2 * DV].reshape(T2, HR2, DV)
    res, _ = dcp.lse_reduce(x, lse, out=over_x)  # this DCPComm returns the merged lse too
    assert res is over_x
    assert rec.count == 1
    dcp.q_gather(mod.array((T2, HR2, DQ), "bfloat16"), out=mod.array((T2, H2, DQ), "bfloat16"))
    assert rec.count == 2


# ----------------------------------------------------------------------------- the NCCL ops
def test_nccl_ops_refuse_overlap(stubbed):  # noqa: F811 - the fixture imported above
    """The NCCL ops (the fallback path) refuse the same calls, before any stream or NCCL work."""
    from dcpkit.nccl import NcclKVGather, NcclLseReduce, NcclQGather

    comm = types.SimpleNamespace(rank=RANK, world_size=W)
    base = REGION + (15 << 26)
    qg = NcclQGather(comm, max_tokens=T, heads_per_rank=H_R, head_dim=D, dtype="float16")
    kg = NcclKVGather(comm, max_tokens=T, row_dim=D_KV, dtype="float16")
    lr = NcclLseReduce(comm, max_tokens=T, num_heads=H, head_dim=D_V, dtype="float16")
    for op in (qg, kg, lr):
        op.device = 0
        op.get_stream = lambda s: pytest.fail("the call reached its stream")
    a, fragment = _q_bad()
    with pytest.raises(InvalidArgument, match=f"q_gather: {fragment}"):
        qg(a["q"], out=a["out"])
    a, fragment = _kv_bad()
    with pytest.raises(InvalidArgument, match=f"kv_gather: {fragment}"):
        kg(a["kv"], out=a["out"])
    for which in LSE_CASES:
        a, fragment = _lse_bad(which)
        with pytest.raises(InvalidArgument, match=f"lse_reduce: {fragment}"):
            _call("lse", lr, a)
    # A disjoint call gets past the check (to its stream, which this test refuses).
    with pytest.raises(pytest.fail.Exception, match="reached its stream"):
        _call("lse", lr, _lse_arrays(base))


def test_strided_copy_refuses_overlap_but_not_a_copy_onto_itself():
    from dcpkit.fallback import strided_copy

    base = REGION + (16 << 26)
    dst = Dev((T, D_KV), ptr=base)
    with pytest.raises(InvalidArgument, match="strided_copy: dst must not share memory with src"):
        strided_copy(dst, Dev((T, D_KV), ptr=base + 64))
    # The very same elements: not refused for overlap (it fails later, at the stream check).
    with pytest.raises(Exception) as e:
        strided_copy(dst, Dev((T, D_KV), ptr=base), stream="x")
    assert "share memory" not in str(e.value) and "stream must be" in str(e.value)


# ----------------------------------------------------------------------------- the workspace
@pytest.mark.parametrize("kind", ["q", "kv", "lse"])
def test_an_output_in_the_workspace_region_is_refused(kind):
    """out= a view an earlier call returned (the gathers' zero-copy slot views), or any array
    over the op's symmetric region: refused before launch; the region's first byte after its
    end is fine."""
    ws, rec = make_callable(kind)
    good = {k: _as_cupy(v) for k, v in _good(kind, REGION + (17 << 26)).items()}
    region_lo = ws.heap.local_ptr + ws._base
    region_hi = region_lo + ws._region
    shape, dt = ((T, H, D), F16) if kind == "q" else ((W * T, D_KV), F16)
    if kind == "lse":
        shape = (T, H_R, D_V)
    inside = _as_cupy(Dev(shape, dt, ptr=region_lo + 4096))
    at_end = Dev(shape, dt, ptr=region_hi - 16)  # its first 16 bytes are the region's last
    after = _as_cupy(Dev(shape, dt, ptr=region_hi))
    targets = [("inside", inside), ("straddling the end", _as_cupy(at_end))]
    if kind != "lse":
        first = good["q" if kind == "q" else "kv"]
        view = ws(first)  # the view form: this call's data slot
        assert region_lo <= view.data.ptr < region_hi
        targets.append(("a returned view", view))
    for what, out in targets:
        launches = rec.count
        a = dict(good, out=out)
        with pytest.raises(InvalidArgument, match="out must not lie in the op's own workspace"):
            _call(kind, ws, a)
        assert rec.count == launches, what
    _call(kind, ws, dict(good, out=after))
    if kind == "lse":
        lse_inside = _as_cupy(Dev((T, H_R), F32, ptr=region_lo))
        a = dict(good, out_lse=lse_inside)
        with pytest.raises(InvalidArgument, match="out_lse must not lie in the op's own"):
            _call(kind, ws, a)


# ----------------------------------------------------------------------------- more layouts
def test_an_array_over_itself():
    from dcpkit._overlap import overlaps_itself

    def ov(shape, strides_el, dtype=F16):
        return overlaps_itself(_info(shape, dtype, strides_el, at=REGION))

    assert not ov((4, 8), (8, 1))  # C order
    assert not ov((4, 8), (1, 4))  # F order
    assert not ov((4, 8), (16, 1))  # padded rows
    assert not ov((4, 4), (16, 2))  # every other column of wider rows
    assert not ov((1, 8), (0, 1)) and not ov((4, 1), (1, 0))  # a zero stride over extent 1
    assert ov((4, 8), (0, 1))  # broadcast rows
    assert ov((4, 4), (1, 1))  # rows one element apart
    assert ov((2, 3, 4), (4, 4, 1))  # heads over tokens
    assert not ov((0, 8), (0, 0))  # empty


def test_outputs_that_overlap_themselves_are_refused():
    from dcpkit.fallback import strided_copy

    base = REGION + (18 << 26)
    bcast = Dev((4, D_KV), F16, (0, 1), ptr=base)
    with pytest.raises(InvalidArgument, match="strided_copy: dst elements must not overlap"):
        strided_copy(bcast, Dev((4, D_KV), ptr=base + (1 << 20)))
    mod, dcp, rec = _dcpcomm()
    out = mod.array((mod.T, mod.H, mod.D_Q), "bfloat16")
    flat = out.reshape(-1)
    import cupy

    squashed = cupy.lib.stride_tricks.as_strided(flat, out.shape, (2, 2, 2))  # all over 1 row
    with pytest.raises(InvalidArgument, match="DCPComm.q_gather: out elements must not overlap"):
        dcp.q_gather(mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16"), out=squashed)
    assert rec.count == 0


def test_dcpcomm_refuses_an_output_in_any_of_its_workspaces():
    """An out= in the region of one of DCPComm's direct ops, in a layout DCPComm would copy
    into (so the op's own check never sees it): refused by DCPComm, on every op's region."""
    import cupy

    mod, dcp, rec = _dcpcomm()
    T2, H2, DQ, HR2 = mod.T, mod.H, mod.D_Q, mod.H_R
    for owner in ("q_gather", "kv_gather", "lse_reduce"):
        ws = dcp.direct_ops[owner]
        lo = ws.heap.local_ptr + ws._base
        mem = cupy.cuda.UnownedMemory(lo, 1 << 24, None, 0)
        raw = cupy.ndarray((1 << 22,), np.uint8, cupy.cuda.MemoryPointer(mem, 0))
        # heads of two elements' stride: not a layout the direct op takes in place
        out = raw[2 : 2 + 2 * T2 * H2 * DQ * 2].view(resolve_dtype("bfloat16"))
        out = out.reshape(T2, H2, 2 * DQ)[:, :, ::2]
        with pytest.raises(InvalidArgument, match="DCPComm.q_gather: out must not lie in the op"):
            dcp.q_gather(mod.array((T2, HR2, DQ), "bfloat16"), out=out)
    assert rec.count == 0


def test_the_workspace_test_is_exact_and_huge_layouts_do_not_crash():
    """An out whose tokens step over the whole region (nothing of it inside) is accepted; a
    layout too big for NumPy's solver counts as overlapping instead of raising ValueError."""
    ws, rec = make_callable("q")
    lo, hi = ws.heap.local_ptr + ws._base, ws.heap.local_ptr + ws._base + ws._region
    row = H * D * 2
    stride = (hi - lo) + 2 * row + 4096
    stride -= stride % 16
    out = Dev((2, H, D), F16, (stride // 2, D, 1), ptr=lo - row - 1024)
    assert (out.ptr + row) <= lo and out.ptr + stride >= hi  # straddles, touches nothing
    ws(_as_cupy(Dev((2, H_R, D), ptr=REGION + (19 << 26))), out=out)
    assert rec.count == 1
    from dcpkit.fallback import strided_copy

    with pytest.raises(InvalidArgument, match="dst must not share memory with src"):
        strided_copy(Dev((2**62,), F16, ptr=BASE), Dev((2**62,), F16, ptr=BASE + 64))
