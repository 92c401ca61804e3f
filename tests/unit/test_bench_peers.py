"""The NVSHMEM peer's host side on the CPU: the real NvshmemRunner through the real sweep, with
nvshmem4py replaced by an emulation of its on-stream fcollect / alltoall (every rank's buffers
exchanged through host memory at a rendezvous) and lse_combine by a NumPy merge, so that the
buffer layouts, reorders and element counts are checked against dcpkit's references; and the
refusal where NVSHMEM's collectives would abort the process."""

import ctypes
import json
import sys
import threading
import types

import numpy as np
import pytest
from test_bench_floor import FakeHeap, FloorDevice

from dcpkit import bench
from dcpkit.bench import factory as factory_mod
from dcpkit.bench.peers import mps_share_problem

from _threadgroup import run_group


class _Exchange:
    """What every rank passes to one collective call, met at a barrier."""

    def __init__(self, W):
        self.W = W
        self.barrier = threading.Barrier(W, timeout=30)
        self.calls = {}
        self.ranks = {}

    def rank_of(self):
        return self.ranks[threading.get_ident()]

    def run(self, kind, itemsize, dst, src, n):
        r = self.rank_of()
        self.calls[r] = (dst, src)
        self.barrier.wait()
        nbytes = n * itemsize
        for s in range(self.W):
            s_src = self.calls[s][1]
            if kind == "fcollect":  # dst[s] = src of rank s
                ctypes.memmove(dst + s * nbytes, s_src, nbytes)
            else:  # alltoall: dst[s] = block r of rank s's src
                ctypes.memmove(dst + s * nbytes, s_src + r * nbytes, nbytes)
        self.barrier.wait()
        return 0


def _fake_nvshmem(monkeypatch, ex):
    from dcpkit import _nvshmem

    core = types.SimpleNamespace(Teams=types.SimpleNamespace(TEAM_WORLD=0))
    bindings = types.ModuleType("nvshmem.bindings")
    for kind in ("fcollect", "alltoall"):
        for dt, size in (("bfloat16", 2), ("float", 4)):
            setattr(
                bindings,
                f"{dt}_{kind}_on_stream",
                lambda team, dst, src, n, stream, k=kind, s=size: ex.run(k, s, dst, src, n),
            )
    pkg = types.ModuleType("nvshmem")
    pkg.bindings = bindings
    monkeypatch.setitem(sys.modules, "nvshmem", pkg)
    monkeypatch.setitem(sys.modules, "nvshmem.bindings", bindings)
    monkeypatch.setattr(_nvshmem, "load", lambda: core)
    monkeypatch.setattr(_nvshmem, "is_initialized", lambda: False)


def _numpy_combine(src_out, src_lse, out, out_lse=None, stream=None):
    l = np.where(np.isnan(src_lse) | (src_lse == np.inf), -np.inf, src_lse).astype(np.float64)
    m = l.max(0)
    safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(np.isfinite(l), np.exp(l - safe), 0.0)
    w = e / np.where(e.sum(0) > 0, e.sum(0), 1.0)
    o = src_out.astype(np.float32).astype(np.float64)
    res = np.einsum("wth,wthd->thd", w, np.where(w[..., None] > 0, o, 0.0))
    out[...] = res.astype(np.float32).astype(out.dtype)
    return out


def _run(tmp_path, monkeypatch, W, ops):
    from dcpkit import symmetric
    from dcpkit.ops import lse_reduce

    ex = _Exchange(W)
    _fake_nvshmem(monkeypatch, ex)
    monkeypatch.setattr(symmetric, "SymmetricHeap", FakeHeap)
    monkeypatch.setattr(lse_reduce, "lse_combine", _numpy_combine)
    args = [
        "--quick",
        "--max-bytes",
        "16K",
        "--tokens",
        "1,8",
        "--paths",
        "nvshmem",
        "--ops",
        ops,
        "--json",
        str(tmp_path / "bench.json"),
        "--iters",
        "3",
    ]
    cfg = bench.resolve_config(bench.build_parser().parse_args(args))
    cfg["geometry"] = dict(cfg["geometry"], H=8, D=16, D_v=16, D_kv=24)

    def body(comm):
        ex.ranks[threading.get_ident()] = comm.rank
        return bench.run_bench(
            dict(cfg), comm, FloorDevice(comm), args, factory=factory_mod.make_runner
        )

    out = run_group(W, body, timeout_s=60.0)
    for r, (status, val) in enumerate(out):
        assert status == "ok", f"rank {r} raised {val!r}"
    return [v for _, v in out], json.loads((tmp_path / "bench.json").read_text())


@pytest.mark.parametrize("W", [2, 4])
def test_nvshmem_rows_match_the_references(tmp_path, monkeypatch, W):
    rcs, res = _run(tmp_path, monkeypatch, W, "q_gather,kv_gather,lse_reduce,decode_layer")
    assert rcs == [0] * W
    rows = res["rows"]
    assert {r["path"] for r in rows} == {"nvshmem"}
    assert {r["op"] for r in rows} == {"q_gather", "kv_gather", "lse_reduce", "decode_layer"}
    for r in rows:
        assert r["error"] is None and r["wrong"] == 0, (r["op"], r["T"], r["error"], r["checks"])
        assert r["samples"] == 3


def test_nvshmem_refuses_a_shared_gpu_without_an_mps_share():
    assert mps_share_problem(True, 4, {}).endswith(
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 for every rank"
    )
    assert "limited MPG" in mps_share_problem(True, 2, {})
    assert mps_share_problem(True, 2, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}) is None
    assert (
        mps_share_problem(True, 2, {"NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1"})
        is None
    )
    assert mps_share_problem(False, 2, {}) is None and mps_share_problem(None, 2, {}) is None
