"""BENCHMARKS.md's host-time section, from scripts/host_overhead.py's JSON (no GPU)."""

import json

import pytest
from _bench_rows import synthetic_result

from dcpkit import bench
from dcpkit.bench.common import jsonable
from dcpkit.bench.host_md import check_host_overhead, host_overhead_md


def _run(W=2, q_view=7.5, b2b_q=12.0):
    return {
        "meta": {
            "world_size": W,
            "calls": 10000,
            "commit": "abc1234",
            "gpu": "GPU",
            "empty_launch_us": 6.0,
            "launch_backend": "bindings",
        },
        "host": {
            "empty RawKernel launch (cupy)": {
                "kind": "base",
                "median_us": [6.0, 5.5],
                "p90_us": [7.0, 6.0],
            },
            "q_gather view": {
                "kind": "op",
                "median_us": [q_view, 6.9],
                "p90_us": [9.0, 8.0],
                "target": "<= empty + 2 us",
                "limit_us": 8.0,
            },
            "DCPComm.q_gather": {
                "kind": "dcp",
                "median_us": [9.5, 9.9],
                "p90_us": [11.0, 12.0],
                "target": "<= empty + 3 us",
                "limit_us": 9.0,
            },
            "q_gather view, 4 live workspaces in turn": {
                "kind": "growth",
                "median_us": [7.7, 7.0],
                "p90_us": [9.0, 9.0],
                "target": "within 0.5 us or 10 % of q_gather view",
                "limit_us": 8.25,
            },
        },
        "back_to_back_device_us": {"empty kernel": [6.1, 6.2], "q_gather view": [b2b_q, 11.0]},
        "targets_met": {},
    }


def _write_bench(tmp_path):
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    (d / "bench_2.json").write_text(json.dumps(jsonable(synthetic_result(2, True))))


def _bench(W=2, peer_us=17.7):
    row = {"op": "q_gather", "path": "nvshmem_fcollect", "mode": "eager", "T": 1}
    return {"meta": {"world_size": W}, "rows": [dict(row, median_us=peer_us)]}


def test_rows_are_the_max_over_ranks_judged_against_their_limit():
    md = "\n".join(host_overhead_md([_run()], [_bench()]))
    assert (
        "### W = 2 (commit `abc1234`, GPU, 10000 calls per row, ops launch through bindings)" in md
    )
    assert "| q_gather view | 7.50 | 9.00 | <= empty + 2 us | 8.00 | met |" in md
    assert "| DCPComm.q_gather | 9.90 | 12.00 | <= empty + 3 us | 9.00 | MISSED |" in md
    assert "| q_gather view, 4 live workspaces in turn | 7.70 | 9.00 |" in md
    assert md.count("no growth") == 1
    assert "| empty RawKernel launch (cupy) | 6.00 | 7.00 | - | - | - |" in md


def test_back_to_back_rows_beside_the_nvshmem_peer_of_the_same_world_size():
    md = "\n".join(host_overhead_md([_run(b2b_q=12.0)], [_bench(peer_us=17.7)]))
    assert "| q_gather view | 12.00 | 17.70 | yes (1.47x) |" in md
    md = "\n".join(host_overhead_md([_run(b2b_q=20.0)], [_bench(peer_us=17.7)]))
    assert "| q_gather view | 20.00 | 17.70 | NO (0.89x) |" in md
    md = "\n".join(host_overhead_md([_run()], [_bench(W=4)]))  # no peer row at this W
    assert "| q_gather view | 12.00 | - | no NVSHMEM row |" in md
    assert "| empty kernel | 6.20 | - | - |" in md


def test_no_runs_no_section():
    assert host_overhead_md([]) == []


@pytest.mark.parametrize(
    "bad", [[], {"meta": {}}, {"meta": {"world_size": 2}, "host": {}}, {"meta": 1, "host": {}}]
)
def test_check_refuses_other_json(bad):
    with pytest.raises(ValueError):
        check_host_overhead(bad)


def test_render_md_with_host_overhead(tmp_path, capsys):
    _write_bench(tmp_path)
    (tmp_path / "h2.json").write_text(json.dumps(_run()))
    argv = ["--render-md", str(tmp_path / "docs" / "bench_2.json")]
    assert bench.main(argv + ["--host-overhead", str(tmp_path / "h2.json")]) == 0
    out = capsys.readouterr().out
    assert "## Host time per call" in out and "| q_gather view | 7.50 |" in out
    assert "--host-overhead" in out.splitlines()[2]  # the Generated-by line regenerates it


def test_render_md_refuses_a_foreign_host_overhead_json(tmp_path, capsys):
    _write_bench(tmp_path)
    (tmp_path / "h.json").write_text(json.dumps({"schema": "dcpkit-bench/2"}))
    argv = ["--render-md", str(tmp_path / "docs" / "bench_2.json")]
    assert bench.main(argv + ["--host-overhead", str(tmp_path / "h.json")]) == 2
    err = capsys.readouterr().err
    assert "is not a scripts/host_overhead.py JSON" in err and err.count("\n") == 1


def test_host_overhead_needs_render_md(capsys):
    with pytest.raises(SystemExit) as ei:
        bench.main(["--host-overhead", "h.json"])
    assert ei.value.code == 2
    assert "argument --host-overhead: needs --render-md" in capsys.readouterr().err


def test_render_md_refuses_two_runs_of_one_world_size_and_a_baseline_of_none(tmp_path, capsys):
    """The same world size twice would print every section twice; a baseline at a world size
    no run has would drop the before/after table silently: both are one-line errors."""
    _write_bench(tmp_path)
    j2 = str(tmp_path / "docs" / "bench_2.json")
    (tmp_path / "b4.json").write_text(json.dumps(jsonable(synthetic_result(4, True))))
    assert bench.main(["--render-md", j2, j2]) == 2
    err = capsys.readouterr().err
    assert "are both runs at world size 2 (one JSON per world size)" in err
    assert err.count("\n") == 1
    assert bench.main(["--render-md", j2, "--baseline", str(tmp_path / "b4.json")]) == 2
    err = capsys.readouterr().err
    assert "is a run at world size 4, which no --render-md JSON has (world sizes [2])" in err
    assert bench.main(["--render-md", j2, "--baseline", j2]) == 0  # same world size: fine
