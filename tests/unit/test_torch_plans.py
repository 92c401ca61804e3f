"""TorchOps' call plans on CPU (the ops and DCPComm stubbed as in scripts/host_path_cpu.py, the
launch recorded): a plan is memoised per tensor description, so a tensor re-strided in place
under the same pointer gets a new plan (and its checks), a bad layout raises on every call, a
bool ubatch is never served by an int's plan, and the custom ops' kernels take the same path."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

from dcpkit.errors import InvalidArgument, InvalidType  # noqa: E402

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "host_path_cpu.py")


@pytest.fixture
def env():
    spec = importlib.util.spec_from_file_location("host_path_cpu", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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
