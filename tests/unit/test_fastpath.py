"""dcpkit._fastpath on CPU: the q_gather plan's parameter list matches the kernel NVRTC builds
(width and float-ness of every parameter, read from the PTX), and a fast call packs exactly the
values the op's own launch passes, raises exactly what the op raises (also after warm-up and at
a reused address), and keeps the op's bookkeeping. The launch is recorded, not run."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from dcpkit import jit
from dcpkit._fastpath import Q_GATHER_PARAM_TYPES, FastQGather
from dcpkit._launch import check_params_match
from dcpkit.errors import CollectiveTimeout, InvalidArgument, InvalidType
from dcpkit.ops._workspace import OP_IDS

cupy = pytest.importorskip("cupy")
_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "host_path_cpu.py")


def _ptx(file: str, expr: str):
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(jit.source(file).encode(), file.encode(), 0, [], [])
    nvrtc.nvrtcAddNameExpression(prog, expr.encode())
    opts = [o.encode() for o in list(jit.DEFAULT_OPTIONS) + ["-arch=compute_90"]]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(res) != 0:
        pytest.skip(f"NVRTC cannot compile {file} here ({res})")
    _, name = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetPTX(prog, buf)
    return buf.decode().rstrip("\0 "), name.decode() if isinstance(name, bytes) else name


@pytest.mark.parametrize("tr", ["Unicast", "Multicast"])
def test_plan_parameters_match_the_kernel(tr):
    ptx, entry = _ptx("q_gather.cu", f"dcpkit::q_gather_kernel<dcpkit::Transport::{tr}>")
    check_params_match(Q_GATHER_PARAM_TYPES, ptx, entry, "q_gather")


class Launches:
    def __init__(self):
        self.calls = []

    def launch(self, grid, params, stream_ptr):
        self.calls.append((grid, [params[i] for i in range(len(params))], stream_ptr))


def _setup():
    spec = importlib.util.spec_from_file_location("host_path_cpu", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stream = mod._cpu_stream()
    rec = mod.Recorder()
    qg = mod.build_ops(stream, rec)[0]
    fast = FastQGather(qg)
    fast._launcher = Launches()
    fast._current_device = lambda: 0
    return mod, qg, fast, rec


def _as_ints(args):
    return [int(a) for a in args]


def test_fast_calls_launch_what_the_op_launches():
    mod, qg, fast, rec = _setup()
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    out = mod.array((mod.T, mod.H, mod.D_Q), "bfloat16")
    for kw in ({}, {"out": out}, {}, {"return_padded": True}):
        calls = list(qg._calls)
        ref = qg(q, **kw)
        _, grid, args, _ = rec.last
        qg._calls = calls               # the fast call repeats the same call
        res = fast(q, **kw)
        fgrid, fargs, sptr = fast._launcher.calls[-1]
        assert fgrid == grid and fargs == _as_ints(args) and sptr == 0, kw
        assert res is ref or (kw.get("out") is not None and res is out)
    assert fast.cache.misses == 3 and fast.cache.hits == 1   # view, out=, padded


def test_fast_calls_raise_what_the_op_raises():
    mod, qg, fast, rec = _setup()
    q = mod.array((mod.T, mod.H_R, mod.D_Q), "bfloat16")
    for _ in range(3):
        fast(q)
    n, calls = len(fast._launcher.calls), list(qg._calls)
    mem = cupy.cuda.UnownedMemory(q.data.ptr, 1 << 22, None, 0)
    same_ptr = cupy.ndarray((mod.T, mod.H_R, mod.D_Q), np.float32,
                            cupy.cuda.MemoryPointer(mem, 0))
    with pytest.raises(InvalidType, match="q dtype must be"):
        fast(same_ptr)
    padded = cupy.ndarray((2, mod.H_R, mod.D_Q), q.dtype, cupy.cuda.MemoryPointer(mem, 0),
                          strides=(mod.H_R * mod.D_Q * 2 + 8, mod.D_Q * 2, 2))
    with pytest.raises(InvalidArgument, match="token stride"):
        fast(padded)
    with pytest.raises(InvalidType, match="ubatch must be an int"):
        fast(q, ubatch=False)
    with pytest.raises(InvalidType, match="stream must be"):
        fast(q, stream="s")
    assert len(fast._launcher.calls) == n and qg._calls == calls
    qg._rec[:] = [2, OP_IDS["q_gather"], 0, 1, 7, 5, 0, 0]
    with pytest.raises(CollectiveTimeout, match="waiting for peer 1"):
        fast(q)                          # poisoned after warm-up: raises at the next call
    assert len(fast._launcher.calls) == n
