"""The benchmark harness on the CPU: statistics, bandwidth formulas, floor, targets, tables,
BENCHMARKS.md and plots on synthetic timings, and the whole sweep (stages, agreement across
ranks, error rows, wrong-result counts, JSON) on a fake device with ranks as threads.

No GPU: the fake device keeps arrays in NumPy and times with the host clock; the fake ops
return the reference (or a corrupted copy, or raise on one rank) so every branch of the harness
runs here. What only the GPU can show (kernels, events, NCCL) runs in ``scripts/gpu_suite.sh``.
"""

import json
import math
import time

import ml_dtypes
import numpy as np
import pytest

from dcpkit import _report, _stats, bench
from dcpkit.bench import StageFailed, _Ctx, _stage

from _threadgroup import run_group

KiB, MiB = 1024, 1024 * 1024


# ----------------------------------------------------------------------------- statistics
def test_median_and_percentile():
    assert _stats.median([3.0, 1.0, 2.0]) == 2.0
    assert _stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert _stats.median([]) is None
    assert _stats.median([float("nan"), 5.0, None]) == 5.0
    xs = list(range(1, 101))
    assert _stats.percentile(xs, 95) == 95
    assert _stats.percentile(xs, 100) == 100
    assert _stats.percentile([7.0], 95) == 7.0
    # nearest rank: 20 samples -> the 19th smallest
    assert _stats.percentile(list(range(20)), 95) == 18
    with pytest.raises(ValueError, match="q must lie in"):
        _stats.percentile(xs, 0)


def test_summarize():
    s = _stats.summarize([2.0, 4.0, 3.0, 100.0])
    assert s == {"median_us": 3.5, "p95_us": 100.0, "min_us": 2.0, "max_us": 100.0,
                 "mean_us": 27.25, "samples": 4}
    assert _stats.summarize([])["median_us"] is None


def test_max_over_ranks_takes_the_slowest_rank_per_iteration():
    per_rank = [[1.0, 5.0, 3.0], [2.0, 4.0, 6.0], None]   # rank 2 took no part
    assert _stats.max_over_ranks(per_rank) == [2.0, 5.0, 6.0]
    assert _stats.max_over_ranks([None, None]) == []
    with pytest.raises(ValueError, match="same number of samples"):
        _stats.max_over_ranks([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="not a finite number"):
        _stats.max_over_ranks([[1.0], [float("inf")]])


def test_median_of_max_differs_from_max_of_medians():
    # Iteration times are max over ranks per iteration; the median of those is what is reported.
    per_rank = [[1.0, 10.0, 1.0], [10.0, 1.0, 1.0]]
    it = _stats.max_over_ranks(per_rank)
    assert it == [10.0, 10.0, 1.0]
    assert _stats.median(it) == 10.0
    assert max(_stats.median(p) for p in per_rank) == 1.0


# ----------------------------------------------------------------------------- bytes, rates, floor
def test_geometry_bytes_match_the_dcp_geometry():
    g = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "itemsize": 2}
    # MEASURED.md: q all_gather bytes per rank 36,864 (W=4, T=1), 294,912 (T=8), 73,728 (W=2)
    assert _stats.geometry_bytes("q_gather", dict(g, T=1), 4)["bytes_per_rank"] == 36864
    assert _stats.geometry_bytes("q_gather", dict(g, T=8), 4)["bytes_per_rank"] == 294912
    assert _stats.geometry_bytes("q_gather", dict(g, T=1), 2)["bytes_per_rank"] == 73728
    q = _stats.geometry_bytes("q_gather", dict(g, T=1), 4)
    assert q["egress_bytes"] == 3 * 36864 and q["exchanges"] == 1
    # all_to_all of output + lse packed: 131,584 bytes per rank (T=1), 1,052,672 (T=8)
    lse = _stats.geometry_bytes("lse_reduce", dict(g, T=1), 4)
    assert lse["bytes_per_rank"] == 131584
    assert lse["egress_bytes"] == 3 * 131584 // 4
    assert _stats.geometry_bytes("lse_reduce", dict(g, T=8), 4)["bytes_per_rank"] == 1052672
    kv = _stats.geometry_bytes("kv_gather", dict(g, T=100), 4)
    assert kv == {"bytes_per_rank": 100 * 1152, "egress_bytes": 3 * 100 * 1152, "exchanges": 1}
    dl = _stats.geometry_bytes("decode_layer", dict(g, T=8), 4)
    assert dl["exchanges"] == 2
    assert dl["bytes_per_rank"] == 294912 + 1052672
    with pytest.raises(ValueError, match="op must be one of"):
        _stats.geometry_bytes("all_reduce", dict(g, T=1), 4)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_busbw_equals_nccl_tests_definitions(W):
    g = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "itemsize": 2, "T": 8}
    t_us = 17.0
    for op, coll in (("q_gather", "all_gather"), ("kv_gather", "all_gather"),
                     ("lse_reduce", "all_to_all")):
        b = _stats.geometry_bytes(op, g, W)
        # nccl-tests' size: total gathered bytes (all_gather) or bytes sent per rank (all_to_all)
        size = W * b["bytes_per_rank"] if coll == "all_gather" else b["bytes_per_rank"]
        want = _stats.nccl_tests_busbw_GBps(coll, size, W, t_us)
        assert math.isclose(_stats.busbw_GBps(b["egress_bytes"], t_us), want, rel_tol=1e-12), op
    assert _stats.algbw_GBps(1e9, 1e6) == 1.0     # 1 GB in 1 s
    assert _stats.algbw_GBps(1.0, None) is None


def test_floor():
    # one-way 1.24 us + 3 * 36864 bytes at 345 GB/s
    f = _stats.floor_us(3 * 36864, 1.24, 345.0)
    assert math.isclose(f, 1.24 + 3 * 36864 / 345e3, rel_tol=1e-12)
    assert math.isclose(_stats.floor_us(1000, 1.0, 100.0, exchanges=2), 2.01)
    assert _stats.floor_us(1000, None, 100.0) is None
    assert _stats.floor_us(1000, 1.0, None) is None


def _row(op, path, mode, T, times, nominal=None, W=4, wrong=0, error=None):
    g = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "itemsize": 2, "T": T}
    b = _stats.geometry_bytes(op, g, W)
    return {"op": op, "path": path, "mode": mode, "T": T,
            "nominal_bytes": nominal if nominal is not None else b["bytes_per_rank"],
            "geometry": g, "times_us": list(times), "wrong": wrong, "error": error,
            "launches_per_call": 1 if path.startswith("direct") else None, **b}


CEIL = {"one_way_latency_us": 1.25, "egress_GBps": 350.0, "launch_eager_us": 5.0,
        "launch_graph_us": 0.9, "egress_slice_bytes": 64 * MiB, "round_trips": 20000}


def test_annotate_fills_derived_fields_and_picks_the_fastest_nccl_path():
    rows = [_row("q_gather", "direct", "graph", 1, [3.0, 3.2, 2.9]),
            _row("q_gather", "nccl", "graph", 1, [15.0, 14.0, 16.0]),
            _row("q_gather", "torch", "graph", 1, [12.0, 12.0, 12.0]),
            _row("q_gather", "direct", "eager", 1, [10.0] * 3),
            _row("q_gather", "nccl", "eager", 1, [40.0] * 3, error="boom"),
            _row("q_gather", "torch", "eager", 1, [30.0] * 3, wrong=5)]
    _stats.annotate(rows, CEIL)
    d = rows[0]
    assert d["median_us"] == 3.0 and d["p95_us"] == 3.2
    assert math.isclose(d["floor_us"], 1.25 + 3 * 36864 / 350e3)
    assert math.isclose(d["x_floor"], 3.0 / d["floor_us"])
    assert math.isclose(d["busbw_GBps"], 3 * 36864 / 3e3)
    assert math.isclose(d["algbw_GBps"], 36864 / 3e3)
    assert math.isclose(d["busbw_frac"], d["busbw_GBps"] / 350.0)
    assert d["baseline_path"] == "torch" and d["speedup_vs_nccl"] == 4.0
    # a failed or wrong NCCL row is never a baseline
    assert rows[3]["speedup_vs_nccl"] is None and rows[3]["baseline_path"] is None
    # missing ceilings: no floor
    r = _stats.annotate([_row("q_gather", "direct", "graph", 1, [3.0])], {})[0]
    assert r["floor_us"] is None and r["x_floor"] is None


# ----------------------------------------------------------------------------- targets
def _by(items, target, **kw):
    out = [i for i in items if i["target"] == target
           and all(i.get(k) == v for k, v in kw.items())]
    assert out, f"no item {target} {kw} in {[(i['target'], i['T']) for i in items]}"
    return out


def test_targets_met_missed_and_not_measured():
    rows = [_row("q_gather", "direct", "graph", 1, [3.5] * 5),          # <= 4 us: met
            _row("q_gather", "nccl", "graph", 1, [14.0] * 5),           # 4x: met
            _row("q_gather", "direct", "graph", 8, [7.0] * 5),          # > floor + 2.5: missed
            _row("q_gather", "nccl", "graph", 8, [21.0] * 5),           # 3.0x: met (>=)
            _row("q_gather", "direct", "graph", 128, [60.0] * 5),        # > 1.15x floor
            _row("q_gather", "direct", "eager", 8, [14.0] * 5),         # <= 15: met
            _row("lse_reduce", "direct", "graph", 1, [4.0] * 5, wrong=3),
            _row("kv_gather", "direct", "graph", 20000, [200.0] * 5, nominal=16 * MiB),
            _row("kv_gather", "nccl", "graph", 20000, [230.0] * 5, nominal=16 * MiB)]
    _stats.annotate(rows, CEIL)
    items = _stats.evaluate_targets(rows)
    assert _by(items, "q_gather.t1", T=1)[0]["met"] is True
    assert _by(items, "q_gather.nccl_small", T=1)[0]["met"] is True
    t8 = _by(items, "q_gather.floor_small", T=8)[0]
    assert t8["met"] is False
    assert math.isclose(t8["limit"], rows[2]["floor_us"] + 2.5)
    assert _by(items, "q_gather.nccl_small", T=8)[0]["met"] is True
    assert _by(items, "q_gather.floor_large", T=128)[0]["met"] is False
    n128 = _by(items, "q_gather.nccl_128", T=128)[0]
    assert n128["met"] is None and "no NCCL baseline" in n128["note"]
    assert _by(items, "eager.t8", op="q_gather")[0]["met"] is True
    # fast but wrong never meets a target
    lse = _by(items, "lse_reduce.t1", T=1)[0]
    assert lse["met"] is False and "3 wrong" in lse["note"]
    # kv 16 MiB: busbw = 3 * 20000 * 1152 B / 200 us = 345.6 GB/s = 98.7% of 350: met; 1.15x: met
    ceil = _by(items, "kv_gather.ceiling_large", mode="graph")[0]
    assert ceil["met"] is True and math.isclose(ceil["value"], 3 * 20000 * 1152 / 200e3 / 350)
    assert _by(items, "kv_gather.nccl_large", mode="graph")[0]["met"] is True
    # no decode_layer row: one "not measured" item
    dl = _by(items, "decode_layer.graph")
    assert len(dl) == 1 and dl[0]["met"] is None and "not measured" in dl[0]["note"]
    # baselines are never judged
    assert all(i["path"] in (None,) + _stats.DIRECT_PATHS for i in items)
    s = _stats.target_summary(items)
    assert s["met"] + s["missed"] + s["not_measured"] == len(items)


def test_targets_of_rows_with_errors_are_not_measured():
    rows = [_row("q_gather", "direct", "graph", 1, [], error="StageFailed: boom")]
    _stats.annotate(rows, CEIL)
    it = _by(_stats.evaluate_targets(rows), "q_gather.t1")[0]
    assert it["met"] is None and it["note"].startswith("error")


def test_every_issue_target_is_defined():
    keys = {t.key for t in _stats.TARGETS}
    for op in ("q_gather", "lse_reduce"):
        assert {f"{op}.t1", f"{op}.floor_small", f"{op}.floor_large", f"{op}.nccl_small",
                f"{op}.nccl_128"} <= keys
    assert {"decode_layer.graph", "kv_gather.nccl_small", "kv_gather.ceiling_large",
            "kv_gather.nccl_large", "eager.t8"} <= keys


# ----------------------------------------------------------------------------- rendering
def _synthetic_result(W=4):
    rows = []
    for T, (d, n) in {1: (3.1, 14.0), 8: (4.0, 18.0), 32: (19.0, 40.0), 128: (55.0, 75.0)}.items():
        for op in ("q_gather", "lse_reduce"):
            rows += [_row(op, "direct", "graph", T, [d, d * 1.1, d * 0.95], W=W),
                     _row(op, "nccl", "graph", T, [n] * 3, W=W),
                     _row(op, "direct", "eager", T, [d + 9] * 3, W=W),
                     _row(op, "nccl", "eager", T, [n + 30] * 3, W=W)]
    rows.append(_row("decode_layer", "direct", "graph", 8, [8.5] * 3, W=W))
    rows.append(_row("kv_gather", "direct", "graph", 4, [3.0] * 3, nominal=4 * KiB, W=W))
    rows.append(_row("kv_gather", "nccl", "graph", 4, [12.0] * 3, nominal=4 * KiB, W=W))
    rows.append(_row("kv_gather", "direct-pull", "graph", 4, [], nominal=4 * KiB, W=W,
                     error="StageFailed: kv_gather pull: check failed on rank(s) [1]"))
    _stats.annotate(rows, CEIL)
    meta = {"world_size": W, "gpu": "NVIDIA H200", "driver": "580.65", "cuda_runtime": "13.0",
            "cupy": "cupy-cuda13x 14.2.0", "nccl": "2.28.9", "torch": "2.11.0",
            "commit": "0123456789abcdef", "date": "2026-12-01 10:00 UTC", "machine": "4x H200",
            "command": f"mpirun -np {W} python -m dcpkit bench"}
    return {"schema": bench.SCHEMA, "meta": meta, "config": {}, "ceilings": dict(CEIL),
            "rows": rows, "targets": _stats.evaluate_targets(rows), "errors": []}


def test_render_table():
    res = _synthetic_result()
    text = _report.render_table(res["rows"])
    lines = text.splitlines()
    for col in ("op", "size(B)", "median(us)", "p95(us)", "algbw(GB/s)", "busbw(GB/s)",
                "floor(us)", "x floor", "x NCCL", "#wrong"):
        assert col in lines[0]
    body = [ln for ln in lines if ln.startswith(" ")]
    assert len(body) == len(res["rows"])
    q1 = next(ln for ln in lines if ln.split()[:5] == ["q_gather", "36864", "1", "direct", "graph"])
    f = q1.split()
    assert f[5] == "3.10" and f[-2] == f"{14.0 / 3.1:.2f}" and f[-1] == "0"
    assert any("ERROR" in ln and "direct-pull" in ln for ln in lines)
    assert "# errors:" in text and "check failed on rank(s) [1]" in text


def test_render_targets_and_ceilings():
    res = _synthetic_result(W=2)
    text = _report.render_targets(res["targets"], world_size=2)
    assert "defined for W = 4" in text
    assert " met" in text and "MISSED" in text
    assert text.splitlines()[-1].startswith("# targets: ")
    c = _report.render_ceilings(res["ceilings"])
    assert "1.250 us" in c and "350.0 GB/s" in c and "64 MiB" in c
    assert _report.render_ceilings({}) == "# ceilings: not measured"


def test_fmt_bytes():
    assert _report.fmt_bytes(4096) == "4 KiB"
    assert _report.fmt_bytes(256 * MiB) == "256 MiB"
    assert _report.fmt_bytes(1.5 * MiB) == "1.5 MiB"
    assert _report.fmt_bytes(100) == "100 B"
    assert _report.fmt_bytes(None) == "-"


def test_render_markdown_from_json(tmp_path):
    r2, r4 = _synthetic_result(2), _synthetic_result(4)
    for W, r in ((2, r2), (4, r4)):
        (tmp_path / f"bench_{W}.json").write_text(json.dumps(bench._jsonable(r)))
    (tmp_path / "bench_4.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "notes.md").write_text("Hand-written analysis goes here.")
    md_path = tmp_path / "BENCHMARKS.md"
    rc = bench.main(["--render-md", str(tmp_path / "bench_4.json"), str(tmp_path / "bench_2.json"),
                     "--md-out", str(md_path), "--notes", str(tmp_path / "notes.md")])
    assert rc == 0
    md = md_path.read_text()
    assert md.startswith("# dcpkit benchmarks")
    assert "do not edit by hand" in md
    for section in ("## Runs", "## Ceilings measured in each run", "## Targets (issue 8, judged "
                    "on W = 4)", "### Where the time goes", "## Notes", "## Results, W = 2",
                    "## Results, W = 4"):
        assert section in md, section
    assert md.index("## Results, W = 2") < md.index("## Results, W = 4")
    assert "![latency and bandwidth vs size, W = 4](bench_4.png)" in md
    assert "Hand-written analysis goes here." in md
    assert "`0123456789ab`" in md and "mpirun -np 4 python -m dcpkit bench" in md
    # a missed target gets an analysis against the ceilings
    missed = [i for i in r4["targets"] if i["met"] is False]
    assert missed
    assert "one-way latency" in md and "What would close it" in md
    assert "Targets at W = 2 (defined for W = 4" in md
    # regenerating gives the same text (no hand edits, deterministic)
    rc = bench.main(["--render-md", str(tmp_path / "bench_4.json"), str(tmp_path / "bench_2.json"),
                     "--md-out", str(md_path), "--notes", str(tmp_path / "notes.md")])
    assert md_path.read_text() == md


def test_render_md_rejects_foreign_json(tmp_path, capsys):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "something-else"}))
    assert bench.main(["--render-md", str(p)]) == 2
    assert "is not a dcpkit-bench/1 JSON" in capsys.readouterr().err


@pytest.fixture
def one_result(tmp_path):
    p = tmp_path / "bench_2.json"
    p.write_text(json.dumps(bench._jsonable(_synthetic_result(2))))
    return p


@pytest.mark.parametrize("setup,args,fragment", [
    (lambda d: None, lambda d, ok: [str(d / "missing.json")],
     "cannot read {d}/missing.json: No such file or directory"),
    (lambda d: (d / "x.json").write_text("not json {"), lambda d, ok: [str(d / "x.json")],
     "{d}/x.json is not JSON (Expecting value"),
    (lambda d: (d / "x.json").write_bytes(b"\xff\xfe\x00"), lambda d, ok: [str(d / "x.json")],
     "cannot read {d}/x.json: UnicodeDecodeError"),
    (lambda d: (d / "x.json").write_text("[1, 2]"), lambda d, ok: [str(d / "x.json")],
     "{d}/x.json must hold one dcpkit-bench/1 JSON object (got a JSON list)"),
    (lambda d: (d / "x.json").write_text('"text"'), lambda d, ok: [str(d / "x.json")],
     "{d}/x.json must hold one dcpkit-bench/1 JSON object (got a JSON str)"),
    (lambda d: None, lambda d, ok: [str(d)], "cannot read {d}: Is a directory"),
    (lambda d: (d / "x.json").write_text('{"schema": "dcpkit-bench/1", "rows": 5}'),
     lambda d, ok: [str(ok), str(d / "x.json")],
     "{d}/x.json is a malformed dcpkit-bench/1 JSON (TypeError"),
    (lambda d: None, lambda d, ok: [str(ok), "--md-out", str(d / "nodir" / "B.md")],
     "cannot write --md-out {d}/nodir/B.md: directory {d}/nodir does not exist"),
    (lambda d: None, lambda d, ok: [str(ok), "--md-out", str(d)],
     "cannot write --md-out {d}: it is a directory"),
    (lambda d: None, lambda d, ok: [str(ok), "--notes", str(d / "no_notes.md")],
     "cannot read --notes {d}/no_notes.md: No such file or directory"),
    (lambda d: None, lambda d, ok: [str(ok), "--notes", str(d)],
     "cannot read --notes {d}: Is a directory"),
])
def test_render_md_bad_inputs_are_one_line_errors(tmp_path, one_result, capsys, setup, args,
                                                  fragment):
    d = tmp_path / "in"
    d.mkdir()
    setup(d)
    rc = bench.main(["--render-md", *args(d, one_result)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("dcpkit bench: --render-md: "), err
    assert fragment.format(d=d) in err, err


def test_render_md_bad_inputs_exit_2_from_the_command_line(run_python, tmp_path):
    (tmp_path / "l.json").write_text("[]")
    proc = run_python(["-m", "dcpkit.bench", "--render-md", str(tmp_path / "l.json")])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "must hold one dcpkit-bench/1 JSON object (got a JSON list)" in proc.stderr


def test_bench_without_driver_says_so(monkeypatch, capsys):
    """No libcuda: 'no CUDA driver found', not CuPy's cudaErrorInsufficientDriver."""
    from dcpkit import comm as comm_mod, info

    class Two:
        rank, world_size = 0, 2

    def no_device(comm, cfg):
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                           "for CUDA runtime version")

    monkeypatch.setattr(comm_mod.Communicator, "from_mpi", classmethod(lambda cls: Two()))
    monkeypatch.setattr(bench, "CupyDevice", no_device)
    monkeypatch.setattr(info, "no_driver_reason", lambda probe=None: "no CUDA driver found (x)")
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "dcpkit bench: rank 0: no usable GPU (no CUDA driver found (x))" in err, err
    assert "InsufficientDriver" not in err
    monkeypatch.setattr(info, "no_driver_reason", lambda probe=None: None)
    assert bench.main(["--quick"]) == 2
    assert "RuntimeError: cudaErrorInsufficientDriver" in capsys.readouterr().err


def test_analyse_missed_names_the_dominant_term():
    row = _row("q_gather", "direct", "eager", 1, [20.0] * 3)
    _stats.annotate([row], CEIL)
    item = {"target": "eager.t8", "metric": "median_us", "value": 20.0, "limit": 15.0,
            "sense": "<=", "op": "q_gather", "T": 1, "nominal_bytes": row["nominal_bytes"]}
    text = _report.analyse_missed(item, row, CEIL)
    assert "launch 5.00 us" in text and "one-way latency 1.25 us" in text
    assert "What would close it:" in text
    big = _row("kv_gather", "direct", "graph", 58254, [1500.0] * 3, nominal=64 * MiB)
    _stats.annotate([big], CEIL)
    item = {"target": "kv_gather.ceiling_large", "metric": "busbw_frac", "value": big["busbw_frac"],
            "limit": 0.95, "sense": ">=", "op": "kv_gather", "T": big["T"],
            "nominal_bytes": 64 * MiB}
    text = _report.analyse_missed(item, big, CEIL)
    assert "bandwidth-bound" in text and "38% of the egress ceiling" in text


def test_plot_results_writes_a_small_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = _synthetic_result()
    path = tmp_path / "sub" / "bench.png"
    assert _report.plot_results(res, str(path)) is None
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG"
    assert len(data) < 400 * 1024
    assert _report.plot_results({"rows": []}, str(tmp_path / "none.png")) == \
        "no successful rows to plot"


# ----------------------------------------------------------------------------- arguments
def test_parse_size():
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("4K") == 4 * KiB
    assert bench.parse_size("4KiB") == 4 * KiB
    assert bench.parse_size("256M") == 256 * MiB
    assert bench.parse_size("1g") == 1024 * MiB
    with pytest.raises(Exception, match="size must look like"):
        bench.parse_size("lots")


def test_resolve_config_default_and_quick():
    p = bench.build_parser()
    cfg = bench.resolve_config(p.parse_args([]))
    assert cfg["kv_sizes"] == [4 * KiB * 4 ** i for i in range(9)]
    assert cfg["kv_sizes"][-1] == 256 * MiB
    assert cfg["tokens"] == [1, 8, 32, 128]
    assert cfg["ops"] == list(bench.ALL_OPS) and cfg["modes"] == ["eager", "graph"]
    assert cfg["egress_slice_bytes"] == 64 * MiB and cfg["round_trips"] == 20000
    assert cfg["graph_calls"] == 20
    q = bench.resolve_config(p.parse_args(["--quick", "--ops", "kv_gather,q_gather"]))
    assert q["ops"] == ["q_gather", "kv_gather"]
    assert q["kv_sizes"][-1] <= 16 * MiB and q["iters"] < cfg["iters"]
    small = bench.resolve_config(p.parse_args(["--max-bytes", "1M"]))
    assert small["egress_slice_bytes"] == 1 * MiB and small["kv_sizes"][-1] == 1 * MiB
    with pytest.raises(Exception, match="--min-bytes"):
        bench.resolve_config(p.parse_args(["--min-bytes", "2M", "--max-bytes", "1M"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--ops", "all_reduce"])


def test_plan_bounds_calls_and_samples():
    cfg = bench.resolve_config(bench.build_parser().parse_args([]))
    small = bench._plan(4.0, cfg, graph=True)
    assert small["graph_calls"] == 20 and 1 <= small["replays"] <= 10
    assert small["samples"] == cfg["iters"]
    big = bench._plan(2500.0, cfg, graph=True)
    assert 2 <= big["graph_calls"] < 20 and big["replays"] == 1
    assert 5 <= big["samples"] <= cfg["iters"]
    e = bench._plan(15.0, cfg, graph=False)
    assert 2 <= e["calls"] <= 50
    assert bench._plan(10000.0, cfg, graph=False)["calls"] == 2


def test_cases_and_host_inputs():
    cfg = bench.resolve_config(bench.build_parser().parse_args(["--max-bytes", "64K"]))
    kv = bench.cases_for("kv_gather", cfg, 2)
    assert [c["nominal_bytes"] for c in kv] == [4 * KiB, 16 * KiB, 64 * KiB]
    assert kv[0]["T"] == round(4096 / 1152)
    dl = bench.cases_for("decode_layer", cfg, 4)
    assert len(dl) == 1 and dl[0]["T"] == 8 and dl[0]["exchanges"] == 2
    g = {"H": 8, "D": 16, "D_v": 16, "D_kv": 24, "itemsize": 2, "T": 3}
    W, seed = 2, 123
    locs = [bench.host_inputs("q_gather", g, r, W, seed, True) for r in range(W)]
    ref = locs[0][1][0][1]
    assert ref.shape == (3, 8, 16) and ref.dtype == np.uint16
    for r in range(W):
        np.testing.assert_array_equal(locs[r][0]["q"].view(np.uint16), ref[:, 4 * r:4 * (r + 1)])
    kv0, kv1 = (bench.host_inputs("kv_gather", g, r, W, seed, True) for r in range(W))
    np.testing.assert_array_equal(kv1[0]["kv"].view(np.uint16), kv0[1][0][1][3:6])
    loc, refs = bench.host_inputs("lse_reduce", g, 1, W, seed, False)
    assert refs[0][0] == "close" and refs[0][1].shape == (3, 4, 16) and refs[0][2] > 0
    assert loc["lse_partial"].dtype == np.float32
    _, refs_f = bench.host_inputs("lse_reduce", g, 1, W, seed, True)
    assert np.isfinite(refs_f[0][1]).all()
    loc, refs = bench.host_inputs("decode_layer", g, 0, W, seed, True)
    assert set(loc) == {"q", "out_partial", "lse_partial"} and len(refs) == 2


# ----------------------------------------------------------------------------- fake-device sweeps
class FakeDevice(bench._DeviceBase):
    """NumPy arrays, host-clock timing, synthetic ceilings; counts its barriers."""

    xp = np

    def __init__(self, comm, delay_us=0.0):
        self.comm, self.rank, self.world = comm, comm.rank, comm.world_size
        self.device = comm.rank
        self.token = 0
        self.delay_us = delay_us
        self.egress = None

    def describe(self):
        return {"gpu": "Fake GPU", "gpu_count": self.world, "device": self.device,
                "cuda_runtime": "0.0", "driver": "fake", "nccl": None}

    def setup(self):
        pass

    def close(self):
        pass

    def wait_stream(self, stream, what=""):
        pass

    def barrier_token(self):
        return self.token

    def barrier_resync(self, token):
        self.token = token

    def sample(self, stream, enqueue):
        self.token += 1
        t0 = time.perf_counter()
        enqueue()
        return (time.perf_counter() - t0) * 1e6 + self.delay_us

    def capture(self, stream, fn, count):
        last = fn()
        return (lambda: [fn() for _ in range(count)]), last

    def pingpong(self, round_trips, repeats):
        if self.rank >= 2:
            return None
        return [{"event_us": 2.5 * round_trips + rep, "globaltimer_ns": 2490.0 * (round_trips - 10),
                 "warm": 10} for rep in range(repeats)]

    def egress_setup(self, slice_bytes):
        self.egress = slice_bytes

    def egress_run(self, samples):
        return [self.egress * (self.world - 1) / 345e3 * (1 + 0.01 * self.rank)] * samples

    def egress_check(self):
        return 0

    def egress_release(self):
        self.egress = None

    def launch_costs(self, samples):
        return {"launch_eager_us": 5.0, "launch_graph_us": 0.9}


class FakeRunner(bench.Runner):
    """Returns the reference (bits, or the merge rounded to bf16); behaviours for the tests."""

    family = "fake"

    def __init__(self, ctx, op, path, max_tokens, behaviour):
        super().__init__(ctx, op, path, max_tokens)
        self.behaviour = behaviour
        self.closed = 0

    def build(self):
        b = self.behaviour.get((self.op, self.path))
        if b == "build_fail":
            raise RuntimeError("injected build failure")
        self.launches_per_call = 1
        self.calls_made = 0

    def bind(self, inp, case, refs=None):
        super().bind(inp, case, refs)
        self.refs = refs
        self.graph_outs = self.check_outputs()

    def _fill(self, outs):
        for o, (kind, ref, tol) in zip(outs, self.refs):
            if kind == "bits":
                o.view(ref.dtype)[...] = ref
            else:
                o[...] = ref.astype(ml_dtypes.bfloat16)
        b = self.behaviour.get((self.op, self.path))
        if b == "wrong":
            outs[0].view(np.uint16).reshape(-1)[0] ^= 1
        if b == f"raise_rank{self.ctx.rank}_T{self.case['T']}":
            raise RuntimeError(f"injected failure on rank {self.ctx.rank}")
        return tuple(outs)

    def call(self, outs=None, graph=False):
        self.calls_made += 1
        if outs is not None:
            return self._fill(outs)
        if graph:
            return self._fill(self.graph_outs)
        return self._fill(self.check_outputs())

    def close(self):
        self.closed += 1


def _fake_run(tmp_path, W, behaviour, extra_args=(), delay_us=0.0, dev_cls=FakeDevice):
    args = ["--quick", "--max-bytes", "16K", "--tokens", "1,8", "--paths", "direct,nccl",
            "--json", str(tmp_path / "bench.json"), *extra_args]
    cfg = bench.resolve_config(bench.build_parser().parse_args(args))
    cfg["iters"] = 3
    cfg["geometry"] = dict(cfg["geometry"], H=8, D=16, D_v=16, D_kv=24)

    def factory(ctx, op, path, mt):
        mk = lambda c, o, p, m: FakeRunner(c, o, p, m, behaviour)  # noqa: E731
        if op == "decode_layer":
            return bench.DecodeRunner(ctx, op, path, mt, mk)
        return mk(ctx, op, path, mt)

    def body(comm):
        return bench.run_bench(dict(cfg), comm, dev_cls(comm, delay_us), args, factory=factory)

    out = run_group(W, body, timeout_s=60.0)
    for r, (status, val) in enumerate(out):
        assert status == "ok", f"rank {r} raised {val!r}"
    return [v for _, v in out], json.loads((tmp_path / "bench.json").read_text())


def test_fake_sweep_all_correct(tmp_path, capsys):
    rcs, res = _fake_run(tmp_path, 2, {}, delay_us=3.0)
    assert rcs == [0, 0]
    assert res["schema"] == bench.SCHEMA
    assert res["meta"]["world_size"] == 2 and res["meta"]["gpu"] == "Fake GPU"
    assert res["meta"]["commit"]
    c = res["ceilings"]
    assert math.isclose(c["one_way_latency_us"], (2.5 * 2000 + 1) / 4000)   # median repeat
    assert c["egress_GBps"] > 300 and c["egress_wrong"] == 0 and not c["errors"]
    rows = res["rows"]
    # q_gather (2 T) + lse_reduce (2 T) + decode (1) + kv (quick: x16 steps up to 16K -> 4K)
    ops = {(r["op"], r["T"], r["path"], r["mode"]) for r in rows}
    assert ("q_gather", 1, "direct", "graph") in ops and ("decode_layer", 8, "nccl", "eager") in ops
    assert ("kv_gather", round(4096 / (24 * 2)), "direct", "eager") in ops
    assert all(r["error"] is None and r["wrong"] == 0 for r in rows), \
        [(r["op"], r["error"]) for r in rows if r["error"] or r["wrong"]]
    for r in rows:
        assert len(r["times_us"]) == r["plan"]["samples"] and r["median_us"] > 0
        assert r["floor_us"] is not None and r["speedup_vs_nccl"] is not None
        stages = [ch["stage"] for ch in r["checks"]]
        assert stages[0] == "check"
        assert len(stages) == (2 if r["mode"] == "eager" else 3)
    assert res["targets"] and all("met" in t for t in res["targets"])
    out = capsys.readouterr().out
    assert "# ceilings measured in this run:" in out and "median(us)" in out
    assert out.rstrip().splitlines()[-1].startswith("# dcpkit bench: W=2")


def test_fake_sweep_records_wrong_results(tmp_path):
    rcs, res = _fake_run(tmp_path, 2, {("q_gather", "direct"): "wrong"},
                         ["--ops", "q_gather"])
    assert rcs == [1, 1]
    bad = [r for r in res["rows"] if r["path"] == "direct"]
    assert bad and all(r["wrong"] > 0 for r in bad)
    # one element per rank per check: 2 ranks x (check + eager) and x (check + 2 graph checks)
    assert sorted({r["wrong"] for r in bad}) == [4, 6]
    first = bad[0]["checks"][0]["first_bad_by_rank"]
    assert first == [[0], [0]]
    assert all(r["wrong"] == 0 for r in res["rows"] if r["path"] == "nccl")
    items = [i for i in res["targets"] if i["path"] == "direct"]
    assert items and all(i["met"] is not True for i in items)


def test_fake_sweep_survives_a_failure_on_one_rank(tmp_path):
    # rank 1 raises inside every call of q_gather direct at T=1: rows of that case are errors
    # on every rank, the runner is rebuilt, T=8 and the other paths are measured.
    rcs, res = _fake_run(tmp_path, 2, {("q_gather", "direct"): "raise_rank1_T1"},
                         ["--ops", "q_gather,lse_reduce"])
    assert rcs == [1, 1]
    rows = {(r["op"], r["T"], r["path"], r["mode"]): r for r in res["rows"]}
    for m in ("eager", "graph"):
        err = rows[("q_gather", 1, "direct", m)]["error"]
        assert err and "rank(s) [1]" in err and "injected failure on rank 1" in err
        assert rows[("q_gather", 8, "direct", m)]["error"] is None
        assert rows[("q_gather", 1, "nccl", m)]["error"] is None
    assert all(r["error"] is None for r in res["rows"] if r["op"] == "lse_reduce")


def test_fake_sweep_build_failure_gives_error_rows(tmp_path):
    rcs, res = _fake_run(tmp_path, 3, {("kv_gather", "nccl"): "build_fail"},
                         ["--ops", "kv_gather"])
    assert rcs == [1, 1, 1]
    nccl = [r for r in res["rows"] if r["path"] == "nccl"]
    assert nccl and all("injected build failure" in r["error"] for r in nccl)
    assert all(r["error"] is None for r in res["rows"] if r["path"] == "direct")
    table = _report.render_table(res["rows"])
    assert "ERROR" in table


def test_stage_agrees_on_failure_across_ranks():
    class Dev(bench._DeviceBase):
        def __init__(self, rank):
            self.token = 10 * rank

        def barrier_token(self):
            return self.token

        def barrier_resync(self, token):
            self.token = token

    def body(comm):
        cfg = {"verbose": False}
        ctx = _Ctx(cfg, comm, Dev(comm.rank), [])
        got = _stage(ctx, "ok stage", lambda: comm.rank * 2)
        try:
            _stage(ctx, "bad stage", lambda: 1 / (comm.rank - 1))
        except StageFailed as e:
            return got, e.errors, ctx.dev.token
        return got, None, ctx.dev.token

    out = run_group(3, body)
    for r, (status, val) in enumerate(out):
        assert status == "ok", val
        got, errors, token = val
        assert got == [0, 2, 4]
        assert list(errors) == [1] and "ZeroDivisionError" in errors[1], f"rank {r}: {errors}"
        assert token == 20   # every rank continues from the largest barrier count


# ----------------------------------------------------------------------------- command line
def test_cli_help_and_single_rank_refusal(run_python):
    h = run_python(["-m", "dcpkit", "bench", "--help"])
    assert h.returncode == 0, h.stderr
    for opt in ("--ops", "--min-bytes", "--max-bytes", "--iters", "--json", "--plot", "--quick",
                "--render-md"):
        assert opt in h.stdout
    # outside mpirun: one rank (or no MPI at all): a clear refusal, exit status 2, no traceback
    r = run_python(["-m", "dcpkit", "bench", "--quick"], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dcpkit bench" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_recorded_command_drops_machine_paths():
    cmd = bench._command(4, ["--json", "/tmp/x/bench_4.json", "--plot=/tmp/x/b.png", "--quick"])
    assert cmd == "mpirun -np 4 python -m dcpkit bench --json bench_4.json --plot=b.png --quick"


def test_fake_sweep_one_mode_one_path(tmp_path):
    rcs, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather", "--modes", "graph",
                                           "--paths", "direct"])
    assert rcs == [0, 0]
    assert {(r["path"], r["mode"]) for r in res["rows"]} == {("direct", "graph")}
    assert all(r["speedup_vs_nccl"] is None for r in res["rows"])
    vs = [i for i in res["targets"] if i["target"].startswith("q_gather.nccl")]
    assert vs and all(i["met"] is None for i in vs)


class SharedGpuDevice(FakeDevice):
    """Every rank on one GPU (a functional run with more ranks than GPUs)."""

    def pci_bus_id(self):
        return "0000:19:00.0"


class OwnGpuDevice(FakeDevice):
    def pci_bus_id(self):
        return f"0000:{0x19 + self.rank:02x}:00.0"


def test_fake_sweep_ranks_sharing_a_gpu_nccl_is_na_not_a_failure(tmp_path, capsys):
    """NCCL refuses two ranks on one GPU: the NCCL paths are n/a (recorded, not failed rows),
    the exit status is 0 when everything that ran is correct."""
    rcs, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather,kv_gather"],
                         dev_cls=SharedGpuDevice)
    assert rcs == [0, 0]
    assert {r["path"] for r in res["rows"]} == {"direct"}
    assert all(r["error"] is None and r["wrong"] == 0 for r in res["rows"])
    why = "NCCL needs one GPU per rank: ranks [0, 1] share GPU 0000:19:00.0"
    assert res["meta"]["paths_not_available"] == {"nccl": f"n/a (NCCL unavailable: {why})"}
    assert not res["errors"]
    vs = [i for i in res["targets"] if ".nccl" in i["target"]]
    assert vs and all(i["met"] is None for i in vs)
    out = capsys.readouterr().out
    assert f"paths not run here: nccl: n/a (NCCL unavailable: {why})" in out, out
    assert f"# path nccl: n/a (NCCL unavailable: {why})" in out, out


def test_fake_sweep_one_gpu_per_rank_runs_nccl(tmp_path):
    rcs, res = _fake_run(tmp_path, 2, {}, ["--ops", "q_gather"], dev_cls=OwnGpuDevice)
    assert rcs == [0, 0]
    assert {r["path"] for r in res["rows"]} == {"direct", "nccl"}
    assert "paths_not_available" not in res["meta"]
