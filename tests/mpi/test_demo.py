"""``python -m dcpkit demo`` end to end on GPUs, at a small size (dcpkit/demo/).

    mpirun -np N python -m pytest tests/mpi/test_demo.py -p no:cacheprovider     # N = 2 or 4

Every rank calls ``demo.main`` with the same arguments (the demo is collective); rank 0 writes
the JSON report, which every rank then reads. The demo checks its own output (reference
attention over the whole KV, q_gather and kv_gather bit for bit); these tests assert its
verdict, the exit status on every rank, and the path that served each op: at this size
q_gather and lse_reduce must run on the direct path (a silent NCCL fallback fails here).

Where ranks share a GPU (``--allow-shared-gpu``), NCCL cannot start (one GPU per rank): the
demo must still check and pass on the direct path, say ``NCCL path: unavailable (...)`` and skip
the NCCL timings. Where every rank has a GPU of its own (``nccl_expected``), the NCCL path must
be available and timed.
"""

import json
import os

import pytest

from dcpkit import demo
from dcpkit.demo.torch_side import torch_problem


def all_ranks_ok(comm, ok, what):
    """True only if ``ok`` holds on every rank (collective; call before asserting)."""
    bad = [r for r, v in enumerate(comm.allgather(bool(ok))) if not v]
    return not bad, f"{what} failed on ranks {bad}"


def _shared_gpu_args(comm):
    """``--allow-shared-gpu`` when this host has fewer GPUs than ranks (a functional run of the
    suite with several ranks per GPU); never otherwise."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    few = comm.allgather(comm.local_world_size > n)
    return ["--allow-shared-gpu"] if any(few) else []


def _run(comm, tmp_path, seed, *argv):
    path = comm.broadcast(str(tmp_path / "demo.json"), root=0)
    rc = demo.main([*argv, *_shared_gpu_args(comm), "--seed", str(seed), "--json", path], comm=comm)
    rcs = comm.allgather(rc)
    report = None
    if os.path.isfile(path):
        with open(path) as f:
            report = json.load(f)
    return rcs, report


def _describe(rcs, report):
    if report is None:
        return f"exit status per rank {rcs}; no JSON report was written"
    c = report.get("check", {})
    keys = (
        "verdict",
        "max_abs_error",
        "tolerance_abs",
        "nonfinite_outputs",
        "q_gather_bit_exact",
        "kv_gather_bit_exact",
        "worst",
        "per_rank_max_abs_error",
    )
    return (
        f"exit status per rank {rcs}; paths {report.get('paths')}; NCCL path "
        f"{report.get('nccl_path')}; check { {k: c.get(k) for k in keys} }"
    )


def _check_nccl_status(report, nccl_expected, why):
    """The NCCL path is available (one GPU per rank), or unavailable because ranks share a
    GPU, and the report says which."""
    if nccl_expected:
        assert report["nccl_path"] == "available", why
        assert report["nccl_unavailable_reason"] is None, why
    else:
        assert report["nccl_path"].startswith("unavailable (NCCL needs one GPU per rank: "), why
        assert report["nccl_unavailable_reason"].startswith("NCCL needs one GPU per rank"), why


def _skip_unless_heads_split(comm, heads=(128, 64)):
    """The demo's presets have 128 (DeepSeek-V3) and 64 (Kimi-K2) heads; other world sizes are
    refused by the demo itself (tested by test_demo_refuses_a_world_size_that_does_not_split)."""
    if any(h % comm.world_size for h in heads):
        pytest.skip(
            f"the demo presets' heads {heads} do not split over world_size {comm.world_size}"
        )


def test_demo_refuses_a_world_size_that_does_not_split(comm, seed, tmp_path):
    """World sizes that do not divide the heads (e.g. 3): exit 2 on every rank, no hang."""
    if 128 % comm.world_size == 0:
        pytest.skip(f"world_size {comm.world_size} splits 128 heads")
    rcs, report = _run(comm, tmp_path, seed, "--batch", "2", "--context", "64", "--iters", "0")
    assert rcs == [2] * comm.world_size, _describe(rcs, report)
    assert report is None, report


def test_demo_small_passes_on_the_direct_path(comm, seed, tmp_path, nccl_expected):
    _skip_unless_heads_split(comm, (128,))
    rcs, report = _run(comm, tmp_path, seed, "--batch", "2", "--context", "256", "--iters", "5")
    ok, msg = all_ranks_ok(comm, report is not None, "reading the JSON report")
    assert ok, msg + "; " + _describe(rcs, report)
    why = _describe(rcs, report)
    assert rcs == [0] * comm.world_size, why
    assert report["check"]["verdict"] == "PASS", why
    assert report["check"]["nonfinite_outputs"] == 0, why
    assert report["check"]["q_gather_bit_exact"] and report["check"]["kv_gather_bit_exact"], why
    # "direct-unicast" (or "direct-multicast" where multicast is allowed), never "nccl"
    assert report["paths"]["q_gather"].startswith("direct"), why
    assert report["paths"]["lse_reduce"].startswith("direct"), why
    assert report["paths"]["kv_gather"].startswith("direct"), why
    assert report["paths_agree"], why
    assert report["world_size"] == comm.world_size
    assert report["context_lengths"][-1] == comm.world_size - 1  # some ranks hold no KV
    _check_nccl_status(report, nccl_expected, why)
    # the timings ran on the path they claim, eager and in a graph
    t = report["timing"]
    assert all(p.startswith("direct") for p in t["direct"]["paths"].values()), t["direct"]
    for mode in ("eager", "graph"):
        for step in ("q_gather", "lse_reduce", "layer"):
            entry = t["direct"][mode][step]
            assert entry.get("median_us", 0) > 0, f"direct {mode} {step}: {entry}"
    if nccl_expected:
        assert "error" not in t["nccl"] and "skipped" not in t["nccl"], t["nccl"]
        assert t["nccl"]["paths"] == {"q_gather": "nccl", "lse_reduce": "nccl"}, t["nccl"]
        for mode in ("eager", "graph"):
            for step in ("q_gather", "lse_reduce", "layer"):
                entry = t["nccl"][mode][step]
                assert entry.get("median_us", 0) > 0, f"nccl {mode} {step}: {entry}"
    else:
        assert t["nccl"] == {"skipped": f"NCCL unavailable: {report['nccl_unavailable_reason']}"}, (
            t["nccl"]
        )


def test_demo_kimi_k2_float16(comm, seed, tmp_path, nccl_expected):
    """The other preset and dtype, odd batch and context, no timings."""
    _skip_unless_heads_split(comm, (64,))
    rcs, report = _run(
        comm,
        tmp_path,
        seed,
        "--model",
        "kimi-k2",
        "--dtype",
        "float16",
        "--batch",
        "3",
        "--context",
        "101",
        "--iters",
        "0",
        "--timeout-ms",
        "20000",
    )
    ok, msg = all_ranks_ok(comm, report is not None, "reading the JSON report")
    assert ok, msg + "; " + _describe(rcs, report)
    why = _describe(rcs, report)
    assert rcs == [0] * comm.world_size, why
    assert report["check"]["verdict"] == "PASS", why
    assert (report["num_heads"], report["dtype"]) == (64, "float16"), why
    assert report["paths"]["q_gather"].startswith("direct"), why
    assert report["paths"]["lse_reduce"].startswith("direct"), why
    _check_nccl_status(report, nccl_expected, why)


def test_demo_torch(comm, seed, tmp_path, nccl_expected):
    """``--torch``: the same layer with torch tensors, checked against
    ``scaled_dot_product_attention``."""
    _skip_unless_heads_split(comm, (128,))
    missing = torch_problem()
    if all(p is not None for p in comm.allgather(missing)):
        pytest.skip(missing)
    rcs, report = _run(
        comm, tmp_path, seed, "--torch", "--batch", "2", "--context", "256", "--iters", "3"
    )
    ok, msg = all_ranks_ok(comm, report is not None, "reading the JSON report")
    assert ok, msg + "; " + _describe(rcs, report)
    why = _describe(rcs, report)
    assert rcs == [0] * comm.world_size, why
    assert report["tensors"] == "torch", why
    assert report["check"]["verdict"] == "PASS", why
    assert report["paths"]["q_gather"].startswith("direct"), why
    assert report["paths"]["lse_reduce"].startswith("direct"), why
    _check_nccl_status(report, nccl_expected, why)
