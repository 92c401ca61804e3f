"""TorchOps' call plans on CPU (the ops and DCPComm stubbed as in scripts/host_path_cpu.py, the
launch recorded): a plan is memoised per tensor description, so a tensor re-strided in place
under the same pointer gets a new plan (and its checks), a bad layout raises on every call, a
bool ubatch is never served by an int's plan, and the custom ops' kernels take the same path."""

from __future__ import annotations

import pytest
from _scripts import load_script

pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

from dcpkit.errors import ClosedError, InvalidArgument, InvalidType  # noqa: E402


@pytest.fixture
def env():
    mod = load_script("host_path_cpu")
    rec, stream = mod.Recorder(), mod._cpu_stream()
    with mod.torch_on_cpu(stream) as dt:
        dcp = mod.build_dcpcomm(mod.build_ops(stream, rec, return_lse=True), stream)
        ops = dt.TorchOps(dcp)
        qg = dt.TorchOps(mod.build_ops(stream, rec)[0])  # a direct op: no copies
        yield mod, rec, dcp, ops, qg
        ops.close()
        qg.close()


def _params(rec):
    kind, _grid, params, _ = rec.last
    assert kind == "launcher"
    return [params[i] for i in range(len(params))]


@pytest.mark.parametrize("target", ["DCPComm", "QGather"])
def test_a_tensor_restrided_in_place_gets_a_new_plan(env, target):
    mod, rec, dcp, ops, qg = env
    if target == "QGather":
        ops = qg
    row = mod.H_R * mod.D_Q
    big = torch.zeros(4 * (row + 64), dtype=torch.bfloat16)
    q = big[: 2 * row].view(2, mod.H_R, mod.D_Q)
    ops.q_gather(q)
    p = _params(rec)
    assert p[20] == q.data_ptr() and p[21] == row * 2  # q, token stride in bytes
    plans = len(ops._plans)
    q.as_strided_((2, mod.H_R, mod.D_Q), (row + 64, mod.D_Q, 1))  # same pointer, padded rows
    ops.q_gather(q)
    p = _params(rec)
    assert p[20] == q.data_ptr() and p[21] == (row + 64) * 2 and len(ops._plans) == plans + 1
    if target == "QGather":  # DCPComm would copy such rows to a contiguous array
        n = rec.count
        q.as_strided_((2, mod.H_R, mod.D_Q), (row + 4, mod.D_Q, 1))  # rows not 16-byte aligned
        for _ in range(2):
            with pytest.raises(InvalidArgument, match="token stride"):
                ops.q_gather(q)
        assert rec.count == n


def test_a_bool_ubatch_is_never_served_by_an_int_plan(env):
    mod, rec, dcp, ops, _ = env
    q = torch.zeros((mod.T, mod.H_R, mod.D_Q), dtype=torch.bfloat16)
    out = torch.zeros((mod.T, mod.H, mod.D_Q), dtype=torch.bfloat16)
    ops.q_gather(q, ubatch=0)
    n = rec.count
    with pytest.raises(InvalidType, match="ubatch must be an int"):
        ops.q_gather(q, ubatch=False)
    assert rec.count == n
    v = out._version
    assert ops.q_gather(q, out=out) is out and out._version == v + 1
    assert _params(rec)[25] == out.data_ptr()


def test_lse_reduce_and_the_custom_ops_launch_with_the_callers_tensors(env):
    mod, rec, dcp, ops, _ = env
    xo = torch.zeros((mod.T, mod.H, mod.D_V), dtype=torch.bfloat16)
    lse = torch.zeros((mod.T, mod.H), dtype=torch.float32)
    o = torch.zeros((mod.T, mod.H_R, mod.D_V), dtype=torch.bfloat16)
    ol = torch.zeros((mod.T, mod.H_R), dtype=torch.float32)
    for _ in range(2):
        v = o._version, ol._version
        r = ops.lse_reduce(xo, lse, out=o, out_lse=ol)
        assert r[0] is o and r[1] is ol and (o._version, ol._version) == (v[0] + 1, v[1] + 1)
        p = _params(rec)
        assert p[21] == xo.data_ptr() and p[24] == lse.data_ptr()
        assert (p[31], p[32]) == (o.data_ptr(), ol.data_ptr())
    torch.ops.dcpkit.lse_reduce(ops.handle, xo, lse, None, None, o, ol, 0)
    assert (_params(rec)[31], _params(rec)[32]) == (o.data_ptr(), ol.data_ptr())
    q = torch.zeros((mod.T, mod.H_R, mod.D_Q), dtype=torch.bfloat16)
    qo = torch.zeros((mod.T, mod.H, mod.D_Q), dtype=torch.bfloat16)
    torch.ops.dcpkit.q_gather(ops.handle, q, qo, 0)
    p = _params(rec)
    assert p[20] == q.data_ptr() and p[25] == qo.data_ptr()
    assert dcp.counters["q_gather"][dcp.last_path] >= 1


def test_every_call_runs_on_torchs_current_stream(env, monkeypatch):
    """The stream is read on every call, plan or no plan: a call after torch's current stream
    changed (``torch.cuda.set_stream``, ``with torch.cuda.stream(s)``) launches on the new one,
    whether CuPy's current stream is that stream already or not."""
    import warnings

    mod, rec, dcp, ops, qg = env
    dt = mod._torch_module()
    stream_type = type(mod._cpu_stream())

    def wrap(ptr, device):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return stream_type(ptr)

    monkeypatch.setattr(dt, "_wrap_stream", wrap)
    current = [0]
    q = torch.zeros((mod.T, mod.H_R, mod.D_Q), dtype=torch.bfloat16)
    qo = torch.zeros((mod.T, mod.H, mod.D_Q), dtype=torch.bfloat16)
    xo = torch.zeros((mod.T, mod.H, mod.D_V), dtype=torch.bfloat16)
    lse = torch.zeros((mod.T, mod.H), dtype=torch.float32)
    o = torch.zeros((mod.T, mod.H_R, mod.D_V), dtype=torch.bfloat16)
    calls = {
        "view": lambda t: t.q_gather(q),
        "out=": lambda t: t.q_gather(q, out=qo),
        "lse out=": lambda t: t.lse_reduce(xo, lse, out=o),
        "custom q_gather": lambda t: torch.ops.dcpkit.q_gather(t.handle, q, qo, 0),
        "custom lse_reduce": lambda t: torch.ops.dcpkit.lse_reduce(
            t.handle, xo, lse, None, None, o, None, 0
        ),
    }
    for t in (ops, qg):
        monkeypatch.setattr(t, "_raw_stream", lambda device: current[0])
        for name, call in calls.items():
            if name.startswith(("lse", "custom lse")) and t is qg:
                continue
            for handle in (0, 0x1000, 0x2000, 0x1000, 0):  # 0: CuPy's current stream too
                current[0] = handle
                call(t)
                assert rec.last[3] == handle, (name, handle)


def test_a_plan_is_keyed_on_the_whole_description_never_the_tensor(env):
    """Tensors over one data pointer that differ in shape, strides, storage offset, dtype or
    class each get their own plan (and their own checks), and a new tensor of a described
    layout (memory freed and reused) is served by that layout's plan."""
    mod, rec, dcp, ops, qg = env
    row = mod.H_R * mod.D_Q
    storage = torch.zeros(4 * row + 64, dtype=torch.bfloat16)

    def at(offset, size, stride, dtype=torch.bfloat16):
        base = storage if dtype is torch.bfloat16 else storage.view(dtype)
        return base.as_strided(size, stride, offset)

    q1 = at(0, (1, mod.H_R, mod.D_Q), (row, mod.D_Q, 1))
    q2 = at(0, (2, mod.H_R, mod.D_Q), (row, mod.D_Q, 1))  # same pointer, other shape
    q3 = at(0, (2, mod.H_R, mod.D_Q), (row + 8, mod.D_Q, 1))  # other token stride
    seen = set()
    for q in (q1, q2, q3):
        qg.q_gather(q)
        p = _params(rec)
        assert p[20] == q.data_ptr() and p[21] == q.stride(0) * 2
        seen.add(len(qg._plans))
    assert len(seen) == 3
    # storage offset: the same data pointer reached through another storage is its own key
    import numpy as np

    buf = np.zeros(4 * row * 2, dtype=np.uint8)
    whole = torch.from_numpy(buf).view(torch.bfloat16)
    a = whole[row : 2 * row].view(1, mod.H_R, mod.D_Q)  # storage offset row
    b = torch.from_numpy(buf[2 * row :]).view(torch.bfloat16)[:row].view(1, mod.H_R, mod.D_Q)
    assert a.data_ptr() == b.data_ptr() and (a.storage_offset(), b.storage_offset()) == (row, 0)
    n = len(qg._plans)
    qg.q_gather(a)
    qg.q_gather(b)
    assert len(qg._plans) == n + 2 and _params(rec)[20] == b.data_ptr()
    # dtype: the same bytes as float16 are refused by the bf16 op on every call
    n = rec.count
    for _ in range(2):
        with pytest.raises((InvalidArgument, InvalidType), match="dtype"):
            qg.q_gather(q1.view(torch.float16))
    assert rec.count == n
    # class: a subclass is its own key (and an out= call with it goes through the custom op)

    class Sub(torch.Tensor):
        pass

    s = q1.as_subclass(Sub)
    keys = set(qg._plans)
    qg.q_gather(s)
    new = set(qg._plans) - keys
    assert len(new) == 1 and Sub in next(iter(new))
    # a fresh tensor object of a described layout: no new plan, the right pointer
    n = len(qg._plans)
    again = at(0, (1, mod.H_R, mod.D_Q), (row, mod.D_Q, 1))
    assert again is not q1
    qg.q_gather(again)
    assert len(qg._plans) == n and _params(rec)[20] == again.data_ptr()


def test_a_closed_front_end_refuses_every_call_after_its_plans_were_made(env):
    mod, rec, dcp, ops, _ = env
    q = torch.zeros((mod.T, mod.H_R, mod.D_Q), dtype=torch.bfloat16)
    qo = torch.zeros((mod.T, mod.H, mod.D_Q), dtype=torch.bfloat16)
    xo = torch.zeros((mod.T, mod.H, mod.D_V), dtype=torch.bfloat16)
    lse = torch.zeros((mod.T, mod.H), dtype=torch.float32)
    o = torch.zeros((mod.T, mod.H_R, mod.D_V), dtype=torch.bfloat16)
    ops.q_gather(q)
    ops.q_gather(q, out=qo)
    ops.lse_reduce(xo, lse, out=o)
    h = ops.handle
    ops.close()
    n = rec.count
    for call in (
        lambda: ops.q_gather(q),
        lambda: ops.q_gather(q, out=qo),
        lambda: ops.lse_reduce(xo, lse, out=o),
        lambda: torch.ops.dcpkit.q_gather(h, q, qo, 0),
        lambda: torch.ops.dcpkit.lse_reduce(h, xo, lse, None, None, o, None, 0),
    ):
        with pytest.raises(ClosedError):
            call()
    assert rec.count == n


def test_an_eager_out_call_returns_the_callers_tensors_and_bumps_only_them(env):
    """``lse_reduce(out=)`` without ``out_lse``: ``out`` itself (whatever the target returns
    beside it), its version bumped once per call, the input's never."""
    mod, rec, dcp, ops, _ = env
    xo = torch.zeros((mod.T, mod.H, mod.D_V), dtype=torch.bfloat16)
    lse = torch.zeros((mod.T, mod.H), dtype=torch.float32)
    o = torch.zeros((mod.T, mod.H_R, mod.D_V), dtype=torch.bfloat16)
    v, vx = o._version, xo._version
    for i in range(1, 3):
        assert ops.lse_reduce(xo, lse, out=o) is o
        assert o._version == v + i and xo._version == vx
    torch.ops.dcpkit.lse_reduce(ops.handle, xo, lse, None, None, o, None, 0)
    assert o._version == v + 3 and xo._version == vx


def test_a_view_result_is_a_fresh_alias_of_the_cupy_result(env, monkeypatch):
    """A view result crosses back once per result array, as a tensor of the array's shape and
    strides; every call hands out a fresh alias (a caller that re-strides it in place changes
    its own alias only); an array reshaped in place is crossed again."""
    mod, rec, dcp, ops, qg = env
    dt = mod._torch_module()
    made = {}  # storage pointer of a crossed tensor -> the CuPy array it stands for

    def from_cupy(a):
        isz = a.dtype.itemsize
        t = torch.empty_strided(a.shape, [s // isz for s in a.strides], dtype=torch.bfloat16)
        made[t.untyped_storage().data_ptr()] = a
        return t

    monkeypatch.setattr(dt, "from_cupy", from_cupy)
    q = torch.zeros((mod.T, mod.H_R, mod.D_Q), dtype=torch.bfloat16)
    got = [ops.q_gather(q) for _ in range(7)]
    assert len({id(r) for r in got}) == 7  # a fresh alias per call
    assert 1 <= len(made) <= 3  # one crossing per result array (the data slots)
    for r in got:
        a = made[r.untyped_storage().data_ptr()]
        assert tuple(r.shape) == a.shape == (mod.T, mod.H, mod.D_Q)
        assert tuple(s * 2 for s in r.stride()) == a.strides
    got[-1].as_strided_((1,), (1,))  # the caller's own alias only
    r = ops.q_gather(q)
    assert tuple(r.shape) == (mod.T, mod.H, mod.D_Q)
    # the CuPy result array reshaped in place: a new crossing, of the new layout
    arr = next(iter(made.values()))
    ent = ops._results[id(arr)]
    assert ent[0] is arr and ent[3].untyped_storage().data_ptr() in made
    n = len(made)
    arr.shape = (mod.H, mod.T, mod.D_Q)
    t = ops._to_torch(arr)
    assert len(made) == n + 1 and tuple(t.shape) == (mod.H, mod.T, mod.D_Q)
    assert tuple(s * 2 for s in t.stride()) == arr.strides
    arr.shape = (mod.T, mod.H, mod.D_Q)
