"""The CPU micro-benchmark of the host path (scripts/host_path_cpu.py) runs as a report: with few
calls it produces every row, and every row's stubbed launch ran once per call with the call's
own input pointer and T. Never a timing threshold."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("cupy")
from _scripts import load_script

from dcpkit.ops.kv_gather import KV_GATHER_PUSH_PARAM_TYPES
from dcpkit.ops.lse_reduce import LSE_REDUCE_PARAM_TYPES
from dcpkit.ops.q_gather import Q_GATHER_PARAM_TYPES

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "host_path_cpu.py")


def _load(name: str = "host_path_cpu"):
    """scripts/<name>.py as a module."""
    return load_script(name)


def test_every_row_is_reported_and_every_call_launched_with_its_arguments(capsys):
    mod = _load()
    rows = mod.run(calls=30)
    try:
        import torch  # noqa: F401

        expected = set(mod.ROWS + mod.PROBE_ROWS)
    except ImportError:
        expected = {r for r in mod.ROWS if "torch" not in r.lower()}
    assert set(rows) == expected
    for name in mod.PROBE_ROWS:
        if name in rows:  # torch's dispatcher alone: nothing launched
            assert rows.pop(name)["launches"] == 0, name
    for name, r in rows.items():
        assert r["calls"] == 30 and r["launches"] == 30, (name, r["launches"])
        assert r["median_us"] > 0 and r["p90_us"] >= r["median_us"], name
        kind, grid, args, _stream = r["last_launch"]
        assert kind == "launcher", name  # every path: the op's packed-parameter launch
        args = [args[i] for i in range(len(args))]
        assert r["input_ptr"] in args, f"{name}: the launch lacks the input pointer"
        T = mod.T
        if "lse_reduce" in name:
            assert len(args) == len(LSE_REDUCE_PARAM_TYPES), name
            assert args[-4:] == [T, mod.H, mod.H_R, mod.D_V], name  # T, H, H_r, D_v
        elif "kv_gather" in name:
            assert len(args) == len(KV_GATHER_PUSH_PARAM_TYPES), name
            assert args[-2] == T and args[-3] == T * mod.D_Q * 2 // 16, name  # tokens, vectors
        else:
            assert len(args) == len(Q_GATHER_PARAM_TYPES), name
            assert args[-3] == T and args[-5] == mod.H_R * mod.D_Q * 2 // 16, name
    text = mod.table(rows)
    for name in rows:
        assert name in text


def test_main_prints_the_table(tmp_path, capsys):
    mod = _load()
    out = tmp_path / "rows.json"
    assert mod.main(["--calls", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "q_gather view" in printed and "median us" in printed
    assert out.exists() and "lse_reduce out=" in out.read_text()


def test_gpu_script_fails_with_one_clear_line_without_a_gpu():
    import subprocess
    import sys

    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is visible here: the script would run")
    except Exception:  # noqa: BLE001 - no driver: what this test needs
        pass
    script = os.path.join(os.path.dirname(_SCRIPT), "host_overhead.py")
    res = subprocess.run(
        [sys.executable, script, "--calls", "10"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2, res
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("scripts/host_overhead.py: needs"), res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_report_without_torch_has_every_other_row(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    mod = _load()
    rows = mod.run(calls=5)
    assert set(rows) == {r for r in mod.ROWS if "torch" not in r.lower()}


def test_growth_rows_and_their_references_call_through_the_same_turn():
    mod = _load("host_overhead")
    seen = []
    calls = [lambda i=i: seen.append(i) or i for i in range(3)]
    turn = mod.in_turn(calls)
    assert [turn() for _ in range(7)] == [1, 2, 0, 1, 2, 0, 1]
    assert seen == [1, 2, 0, 1, 2, 0, 1]
    growth, refs = zip(*mod.GROWTH_ROWS)
    assert len(set(growth + refs)) == 2 * len(growth)  # one reference row per growth row
