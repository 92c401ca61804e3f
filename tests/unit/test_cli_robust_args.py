"""Inputs a new user gave that ended in a traceback or were taken silently: sizes too large for
a float, digits of other scripts, a ``--hang-s`` too short to be a hang, an ``--egress-bytes``
the kernel would round down, duplicate or unmatched ``--host-overhead`` files, a bad
``DCPKIT_TIMEOUT_MS`` where no op runs (and where the script did not check it), and
``--render-md`` under a launcher (once per job)."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest
from _bench_rows import synthetic_result
from _scripts import load_script

from dcpkit import bench
from dcpkit.bench import args as bench_args
from dcpkit.bench import meta
from dcpkit.bench.common import jsonable

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in _RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)


def _refused(capsys, argv) -> str:
    """The one line ``dcpkit bench`` refuses ``argv`` with (exit status 2, before any MPI)."""
    with pytest.raises(SystemExit) as ei:
        bench.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dcpkit bench: "), err
    assert "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- sizes
def test_a_size_too_large_for_a_float_is_a_usage_line(capsys):
    """'9' * 400 overflowed to inf and raised OverflowError in parse_size."""
    with pytest.raises(argparse.ArgumentTypeError, match="at most 40 digits"):
        bench_args.parse_size("9" * 400)
    err = _refused(capsys, ["--max-bytes", "9" * 400])
    assert "argument --max-bytes: must be a size of at most 40 digits (got 400 digits)" in err
    err = _refused(capsys, ["--max-bytes", "9" * 32])
    assert f"argument --max-bytes: must lie in [1, 1G] (got '{'9' * 32}')" in err


def test_a_size_is_read_exactly():
    """Not through a float: 2**53 + 1 bytes is that many, and a fraction of a byte is refused
    however small."""
    assert bench_args.parse_size(str(2**53 + 1)) == 2**53 + 1
    assert bench_args.parse_size("1.5K") == 1536
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes"):
        bench_args.parse_size("4096.0000000000000001")


@pytest.mark.parametrize(
    "text",
    [
        "\u0665\u0660",  # Arabic-Indic 50
        "\u0665\u0660K",
        "\uff14K",  # fullwidth 4
        "\u0664.5K",
        "4\u212a",  # KELVIN SIGN, which a Unicode case-insensitive match reads as k
    ],
)
def test_a_size_takes_ascii_digits_only(text, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a size like 4096"):
        bench_args.parse_size(text)
    err = _refused(capsys, ["--max-bytes", text])
    assert (
        f"argument --max-bytes: must be a size like 4096, 4K, 4KiB, 256M or 1G (got {text!r})"
        in err
    )


def test_the_driver_version_takes_ascii_digits_only(monkeypatch):
    def proc(text):
        monkeypatch.setattr(meta, "open", lambda *a, **k: io.StringIO(text), raising=False)

    def no_smi(*a, **k):
        raise OSError("no nvidia-smi")

    monkeypatch.setattr(meta.subprocess, "run", no_smi)
    proc("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n")
    assert meta.driver_version() == "550.54.15"
    proc("NVRM version: NVIDIA UNIX x86_64 Kernel Module  \u0665\u0665\u0660.54.15  Tue\n")
    assert meta.driver_version() is None


# ----------------------------------------------------------------------------- --hang-s, --egress-bytes
@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["--hang-s", "1e-9"],
            "argument --hang-s: must be a number of seconds in [1, 86400] (got '1e-9')",
        ),
        (
            ["--hang-s", "0.5"],
            "argument --hang-s: must be a number of seconds in [1, 86400] (got '0.5')",
        ),
        # a host abort before the device deadline: a stuck op would never be recorded as one
        (
            ["--hang-s", "5"],
            "argument --hang-s: must be longer than the device deadline, 10000 ms from the "
            "default, so that a stuck op times out before the job is aborted (got 5)",
        ),
        (
            ["--hang-s", "30", "--timeout-ms", "30000"],
            "argument --hang-s: must be longer than the device deadline, 30000 ms from "
            "--timeout-ms, so that a stuck op times out before the job is aborted (got 30)",
        ),
        (
            ["--egress-bytes", "16385"],
            "argument --egress-bytes: must be a multiple of 16 bytes (the egress kernel moves "
            "16-byte vectors) (got '16385')",
        ),
        (["--egress-bytes", "100001"], "argument --egress-bytes: must be a multiple of 16 bytes"),
    ],
)
def test_a_run_setting_the_bench_would_not_honour_is_refused(argv, line, capsys, monkeypatch):
    from dcpkit import comm as comm_mod

    def no_mpi(cls):
        raise AssertionError("MPI was started for arguments that must be refused first")

    monkeypatch.setattr(comm_mod.Communicator, "from_mpi", classmethod(no_mpi))
    assert line in _refused(capsys, argv)


def test_the_deadline_from_the_environment_is_checked_against_hang_s(capsys, monkeypatch):
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "200000")
    err = _refused(capsys, ["--hang-s", "150"])
    assert "device deadline, 200000 ms from DCPKIT_TIMEOUT_MS" in err, err


def test_hang_s_defaults_to_twice_a_long_deadline():
    p = bench.build_parser()
    assert bench.resolve_config(p.parse_args([]))["hang_s"] == 120.0
    assert bench.resolve_config(p.parse_args(["--timeout-ms", "100000"]))["hang_s"] == 200.0
    assert bench.resolve_config(p.parse_args(["--hang-s", "11"]))["hang_s"] == 11.0


def test_an_egress_slice_on_the_unit_is_taken_as_given():
    p = bench.build_parser()
    cfg = bench.resolve_config(p.parse_args(["--egress-bytes", "16400"]))
    assert cfg["egress_slice_bytes"] == 16400


# ----------------------------------------------------------------------------- --render-md
def _bench_json(tmp_path, W=2) -> str:
    path = tmp_path / f"bench_{W}.json"
    path.write_text(json.dumps(jsonable(synthetic_result(W, True))))
    return str(path)


def _host_json(tmp_path, name, W) -> str:
    path = tmp_path / name
    doc = {"meta": {"world_size": W}, "host": {}, "back_to_back_device_us": {}}
    path.write_text(json.dumps(doc))
    return str(path)


def test_render_md_refuses_two_host_overhead_runs_of_one_world_size(tmp_path, capsys):
    j2 = _bench_json(tmp_path)
    a, b = _host_json(tmp_path, "a.json", 2), _host_json(tmp_path, "b.json", 2)
    assert bench.main(["--render-md", j2, "--host-overhead", a, b]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"dcpkit bench: --render-md: --host-overhead {b} and {a} are both runs at world size 2 "
        f"(one JSON per world size)\n"
    ), err
    assert bench.main(["--render-md", j2, "--host-overhead", a, a]) == 2
    assert "are both runs at world size 2" in capsys.readouterr().err


def test_render_md_refuses_a_host_overhead_run_at_a_world_size_no_run_has(tmp_path, capsys):
    j2 = _bench_json(tmp_path)
    h4 = _host_json(tmp_path, "h4.json", 4)
    assert bench.main(["--render-md", j2, "--host-overhead", h4]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"dcpkit bench: --render-md: --host-overhead {h4} is a run at world size 4, which no "
        f"--render-md JSON has (world sizes [2])\n"
    ), err
    h2 = _host_json(tmp_path, "h2.json", 2)
    assert bench.main(["--render-md", j2, "--host-overhead", h2]) == 0  # one per world size
    assert capsys.readouterr().out.count("## Host time per call") == 1


@pytest.mark.parametrize("value", ["abc", "0", "1_000"])
def test_render_md_reads_no_op_setting(value, tmp_path, capsys, monkeypatch):
    """Rendering runs no op: a DCPKIT_TIMEOUT_MS that every op would refuse is not read."""
    j2 = _bench_json(tmp_path)
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", value)
    assert bench.main(["--render-md", j2]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# ") and err == "", err
    # --timeout-ms itself is still an option of a run, not of the rendering
    err = _refused(capsys, ["--render-md", j2, "--timeout-ms", "5"])
    assert "argument --timeout-ms: not used with --render-md" in err, err


@pytest.mark.parametrize("var", _RANK_VARS)
def test_render_md_writes_once_per_job(var, tmp_path, capsys, monkeypatch):
    """Under a launcher every rank reads and checks the files; rank 0 alone prints or writes."""
    j2 = _bench_json(tmp_path)
    md = tmp_path / "B.md"
    assert bench.main(["--render-md", j2]) == 0
    alone = capsys.readouterr()
    monkeypatch.setenv(var, "1")
    assert bench.main(["--render-md", j2]) == 0
    assert bench.main(["--render-md", j2, "--md-out", str(md)]) == 0
    assert capsys.readouterr() == ("", "") and not md.exists()
    assert bench.main(["--render-md", j2, str(tmp_path / "missing.json")]) == 2  # same status
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv(var, "0")
    assert bench.main(["--render-md", j2]) == 0
    assert capsys.readouterr() == alone
    assert bench.main(["--render-md", j2, "--md-out", str(md)]) == 0
    assert md.read_text() and capsys.readouterr().out == f"dcpkit bench: wrote {md} from 1 run(s)\n"


def test_render_md_under_mpiexec_prints_one_document(tmp_path, mpi_launcher, run_cmd, run_python):
    j2 = _bench_json(tmp_path)
    alone = run_python(["-m", "dcpkit.bench", "--render-md", j2])
    assert alone.returncode == 0, alone.stderr
    proc = run_cmd(
        mpi_launcher.command(2, sys.executable, "-m", "dcpkit.bench", "--render-md", j2),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == alone.stdout


# ----------------------------------------------------------------------------- the scripts
def test_host_path_cpu_refuses_a_bad_deadline_in_one_line(capsys, monkeypatch):
    """DCPComm is built without timeout_ms: a bad DCPKIT_TIMEOUT_MS was an InvalidArgument
    traceback from its constructor."""
    mod = load_script("host_path_cpu")
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "abc")
    with pytest.raises(SystemExit) as ei:
        mod.main(["--calls", "1"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "scripts/host_path_cpu.py: environment variable DCPKIT_TIMEOUT_MS: must be a number of "
        "milliseconds in [0.001, 3600000] (got 'abc') (see scripts/host_path_cpu.py --help)\n"
    ), err


def test_host_overhead_refuses_a_bad_deadline_before_the_gpu_check(capsys, monkeypatch):
    mod = load_script("host_overhead")
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "abc")
    with pytest.raises(SystemExit) as ei:
        mod.main([])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "scripts/host_overhead.py: environment variable DCPKIT_TIMEOUT_MS: must be a number"
    ), err
    assert err.count("\n") == 1 and "GPU" not in err, err


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda d: d["meta"].update(world_size=3), "row 0 is at world size 2, the run's meta at 3"),
        (lambda d: d["rows"][1].update(T=-5), "row 1: T must be an int in [0, 65536] or null"),
        (lambda d: d["rows"][0].update(T=1.5), "row 0: T must be an int in [0, 65536] or null"),
        (lambda d: d["rows"][0].update(T=True), "row 0: T must be an int in [0, 65536] or null"),
        (lambda d: d["rows"][0].update(T=10**30), "row 0: T must be an int in [0, 65536] or null"),
        (lambda d: d["rows"][0].update(world_size=2.0), "row 0 is at world size 2.0, the run's"),
        (lambda d: d["rows"][0].update(op=5), "row 0: op must be a str (got 5)"),
        (lambda d: d.update(rows={"a": 1}), "rows must be a list of objects"),
    ],
)
def test_render_md_refuses_rows_that_contradict_their_run(tmp_path, capsys, edit, why):
    """A run whose rows contradict its meta (another world size) or hold an impossible T is
    refused, not rendered under a header its rows contradict."""
    path = tmp_path / "bench_2.json"
    doc = jsonable(synthetic_result(2, True))
    edit(doc)
    path.write_text(json.dumps(doc))
    assert bench.main(["--render-md", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is a malformed dcpkit-bench/2 JSON ({why}" in err, err
