"""The command line of ``dcpkit bench`` on the CPU: sizes, defaults, and every argument the
benchmark cannot honour refused when the arguments are parsed (one line, exit status 2, before
any MPI or GPU work), the launcher mismatch, the recorded command, cases and host inputs."""

import os
import sys

import numpy as np
import pytest

from dcpkit import bench
from dcpkit.bench import cases, meta, sweep

KiB, MiB = 1024, 1024 * 1024


def test_parse_size():
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("4K") == 4 * KiB
    assert bench.parse_size("4KiB") == 4 * KiB
    assert bench.parse_size("256M") == 256 * MiB
    assert bench.parse_size("1g") == 1024 * MiB
    assert bench.parse_size("1.5K") == 1536
    with pytest.raises(Exception, match="must be a size like"):
        bench.parse_size("lots")
    with pytest.raises(Exception, match="whole number of bytes"):
        bench.parse_size("0.1")
    with pytest.raises(Exception, match="at least 1 byte"):
        bench.parse_size("0")


@pytest.mark.parametrize(
    "text, shown",
    [
        ("1.0000001K", "= 1024.0001024 bytes"),  # never rounded to the whole number it is not
        ("1.5", "= 1.5 bytes"),
        ("1.000000000000001K", "= between 1024 and 1025 bytes"),
        ("0.3333333333333333333K", "= between 341 and 342 bytes"),
    ],
)
def test_a_fractional_size_is_shown_as_it_is(text, shown):
    with pytest.raises(Exception, match="whole number of bytes") as e:
        bench.parse_size(text)
    assert f"(got {text!r} {shown})" in str(e.value)


def test_resolve_config_default_and_quick():
    p = bench.build_parser()
    cfg = bench.resolve_config(p.parse_args([]))
    assert cfg["kv_sizes"] == [4 * KiB * 4**i for i in range(9)]
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
    assert bench.resolve_config(p.parse_args(["--round-trips", "1"]))["round_trips"] == 1


@pytest.mark.parametrize("dim", [2048, 4096, 65536])
def test_the_default_min_bytes_is_at_least_one_row(dim):
    """Without --min-bytes the sweep starts at one kv_gather row where --kv-row-dim makes a row
    larger than the 4K default: a smaller size ran as one row under another name, and several
    such sizes as one case (--min-bytes 4K given explicitly is refused there)."""
    from dcpkit.bench import args as bench_args

    p = bench.build_parser()
    args = p.parse_args(["--quick", "--kv-row-dim", str(dim)])
    bench_args.check_args(args, p)  # accepted
    cfg = bench.resolve_config(args)
    sizes = cfg["kv_sizes"]
    row = 2 * dim
    assert sizes[0] == max(4 * KiB, row) and all(s >= row for s in sizes)
    T = [c["T"] for c in cases.cases_for("kv_gather", cfg, 2)]
    assert len(T) == len(set(T)) == len(sizes)  # one case per size, none named twice


def test_the_default_egress_slice_keeps_to_the_documented_minimum(capsys):
    """--egress-bytes must be >= 16K; the default slice, min(64M, --max-bytes), never goes
    below that either, and --help says so."""
    p = bench.build_parser()
    for max_bytes, slice_ in (("4K", 16 * KiB), ("16K", 16 * KiB), ("1M", MiB), ("1G", 64 * MiB)):
        cfg = bench.resolve_config(p.parse_args(["--max-bytes", max_bytes]))
        assert cfg["egress_slice_bytes"] == slice_, max_bytes
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    want = (
        "egress ceiling slice per rank, >= 16K, a multiple of 16 bytes (default "
        "max(16K, min(64M, --max-bytes)))"
    )
    assert want in text, text
    assert "also caps the default egress slice (64M), never below 16K" in text, text


def test_plan_bounds_calls_and_samples():
    cfg = bench.resolve_config(bench.build_parser().parse_args([]))
    small = sweep.plan(4.0, cfg, graph=True)
    assert small["graph_calls"] == 20 and 1 <= small["replays"] <= 10
    assert small["samples"] == cfg["iters"]
    big = sweep.plan(2500.0, cfg, graph=True)
    assert 2 <= big["graph_calls"] < 20 and big["replays"] == 1
    assert 5 <= big["samples"] <= cfg["iters"]
    e = sweep.plan(15.0, cfg, graph=False)
    assert 2 <= e["calls"] <= 50
    assert sweep.plan(10000.0, cfg, graph=False)["calls"] == 2


def test_cases_and_host_inputs():
    cfg = bench.resolve_config(bench.build_parser().parse_args(["--max-bytes", "64K"]))
    kv = cases.cases_for("kv_gather", cfg, 2)
    assert [c["nominal_bytes"] for c in kv] == [4 * KiB, 16 * KiB, 64 * KiB]
    assert kv[0]["T"] == round(4096 / 1152)
    dl = cases.cases_for("decode_layer", cfg, 4)
    assert len(dl) == 1 and dl[0]["T"] == 8 and dl[0]["exchanges"] == 2
    g = {"H": 8, "D": 16, "D_v": 16, "D_kv": 24, "itemsize": 2, "T": 3}
    W, seed = 2, 123
    locs = [cases.host_inputs("q_gather", g, r, W, seed, True) for r in range(W)]
    ref = locs[0][1][0][1]
    assert ref.shape == (3, 8, 16) and ref.dtype == np.uint16
    for r in range(W):
        np.testing.assert_array_equal(locs[r][0]["q"].view(np.uint16), ref[:, 4 * r : 4 * (r + 1)])
    kv0, kv1 = (cases.host_inputs("kv_gather", g, r, W, seed, True) for r in range(W))
    np.testing.assert_array_equal(kv1[0]["kv"].view(np.uint16), kv0[1][0][1][3:6])
    loc, refs = cases.host_inputs("lse_reduce", g, 1, W, seed, False)
    assert refs[0][0] == "close" and refs[0][1].shape == (3, 4, 16) and refs[0][2] > 0
    assert loc["lse_partial"].dtype == np.float32
    _, refs_f = cases.host_inputs("lse_reduce", g, 1, W, seed, True)
    assert np.isfinite(refs_f[0][1]).all()
    loc, refs = cases.host_inputs("decode_layer", g, 0, W, seed, True)
    assert set(loc) == {"q", "out_partial", "lse_partial"} and len(refs) == 2


def test_cli_help_and_single_rank_refusal(run_python):
    h = run_python(["-m", "dcpkit", "bench", "--help"])
    assert h.returncode == 0, h.stderr
    for opt in (
        "--ops",
        "--min-bytes",
        "--max-bytes",
        "--iters",
        "--json",
        "--plot",
        "--quick",
        "--render-md",
    ):
        assert opt in h.stdout
    # outside mpirun: one rank (or no MPI at all): a clear refusal, exit status 2, no traceback
    r = run_python(["-m", "dcpkit", "bench", "--quick"], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dcpkit bench" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_recorded_command_drops_machine_paths():
    cmd = meta.command_line(4, ["--json", "/tmp/x/bench_4.json", "--plot=/tmp/x/b.png", "--quick"])
    assert cmd == "mpirun -np 4 python -m dcpkit bench --json bench_4.json --plot=b.png --quick"


# Every argument the benchmark cannot honour: refused at parse time, one line, exit status 2.
# (--min-bytes 0 / 0.1 looped forever with growing memory; --timeout-ms -1 / nan, --hang-s 0,
# --round-trips 0 were silently replaced by defaults; --iters was capped by a time budget.)
BAD_ARGS = [
    (["--min-bytes", "0"], "argument --min-bytes: must be at least 1 byte (got '0')"),
    (["--min-bytes", "0.1"], "argument --min-bytes: must be a whole number of bytes"),
    (["--max-bytes", "4G"], "argument --max-bytes: must lie in [1, 1G] (got '4G')"),
    (["--max-bytes", "x"], "argument --max-bytes: must be a size like 4096"),
    (["--min-bytes", "2M", "--max-bytes", "1M"], "argument --min-bytes: must be <= --max-bytes"),
    # below one kv_gather row (576 bf16 = 1152 bytes): every such size ran as the same T=1 case
    (
        ["--min-bytes", "3"],
        "argument --min-bytes: must be at least one kv_gather row, 1152 bytes at --kv-row-dim "
        "576 (got 3)",
    ),
    (
        ["--min-bytes", "1K", "--max-bytes", "1K"],
        "argument --min-bytes: must be at least one kv_gather row, 1152 bytes",
    ),
    (
        ["--min-bytes", "4K", "--kv-row-dim", "4096"],
        "argument --min-bytes: must be at least one kv_gather row, 8192 bytes at --kv-row-dim "
        "4096 (got 4096)",
    ),
    (["--egress-bytes", "1K"], "argument --egress-bytes: must lie in [16K, 1G] (got '1K')"),
    # --min-bytes not given: the line names the flag that was, and the default it is below
    (
        ["--max-bytes", "1"],
        "argument --max-bytes: must be >= the default --min-bytes 4096, or give a smaller "
        "--min-bytes too (got 1)",
    ),
    (["--max-bytes", "2K"], "argument --max-bytes: must be >= the default --min-bytes 4096"),
    (["--iters", "0"], "argument --iters: must be an integer in [1, 10000] (got '0')"),
    (["--iters", "1e9"], "argument --iters: must be an integer in [1, 10000] (got '1e9')"),
    (["--iters", "x"], "argument --iters: must be an integer in [1, 10000] (got 'x')"),
    # digit separators, which Python's int() and float() read, are not numbers here
    (["--iters", "1_0"], "argument --iters: must be an integer in [1, 10000] (got '1_0')"),
    (["--tokens", "1,1_6"], "argument --tokens: must be a comma list of integers in [1, 65536]"),
    (["--hang-s", "1_0"], "argument --hang-s: must be a number of seconds in [1, 86400]"),
    (["--timeout-ms", "1_000"], "argument --timeout-ms: must be a number of milliseconds in ["),
    (["--timeout-ms", "-1"], "argument --timeout-ms: must be a number of milliseconds in [0.001, "),
    (
        ["--timeout-ms", "nan"],
        "argument --timeout-ms: must be a number of milliseconds in [0.001, ",
    ),
    (
        ["--timeout-ms", "inf"],
        "argument --timeout-ms: must be a number of milliseconds in [0.001, ",
    ),
    # a positive deadline under 1 us would make every wait time out at once
    (["--timeout-ms", "1e-300"], "argument --timeout-ms: must be a number of milliseconds in [0."),
    (["--timeout-ms", "0.0009"], "argument --timeout-ms: must be a number of milliseconds in [0."),
    (["--hang-s", "0"], "argument --hang-s: must be a number of seconds in [1, 86400]"),
    (["--round-trips", "0"], "argument --round-trips: must be an integer in [1, 10000000]"),
    (["--tokens", "0,8"], "argument --tokens: must be a comma list of integers in [1, 65536]"),
    (["--kv-row-dim", "12"], "argument --kv-row-dim: must be a multiple of 8 elements"),
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 2147483647] (got '-1')"),
    (["--ops", "all_reduce"], "argument --ops: must be a comma list of q_gather"),
    (
        ["--json", "{missing}/b.json"],
        "argument --json: {missing}/b.json is in a folder that does not exist",
    ),
    (
        ["--plot", "{missing}/b.png"],
        "argument --plot: {missing}/b.png is in a folder that does not exist",
    ),
    (["--json", "{tmp}"], "argument --json: {tmp} is a directory"),
    # an empty path was taken as "no JSON" / "no plot": the run would end without its file
    (["--json", ""], "argument --json: must name a file (got '')"),
    (["--plot", ""], "argument --plot: must name a file (got '')"),
    (["--tokens", "1,,8"], "argument --tokens: must not have an empty item (got '1,,8')"),
    (["--tokens", "8,1,8"], "argument --tokens: must not repeat an item (got '8,1,8')"),
    (["--ops", "q_gather,q_gather"], "argument --ops: must not repeat an item (got 'q_gather,"),
    (["--ops", "q_gather,"], "argument --ops: must not have an empty item (got 'q_gather,')"),
    (["--modes", "graph,,eager"], "argument --modes: must not have an empty item"),
    (
        ["--timeout-ms", "0"],
        "argument --timeout-ms: must be a number of milliseconds in [0.001, 3600000] (got '0')",
    ),
    (["--plot", "{tmp}"], "argument --plot: {tmp} is a directory"),
    # --plot names the PNG file, not a folder to draw into
    (["--plot", "{missing}"], "argument --plot: must name a .png file (got '{missing}')"),
    (["--plot", "/etc/passwd"], "argument --plot: must name a .png file (got '/etc/passwd')"),
    (["--md-out", "B.md"], "argument --md-out: needs --render-md"),
    (["--notes", "n.md"], "argument --notes: needs --render-md"),
    (["--baseline", "b.json"], "argument --baseline: needs --render-md"),
    (
        ["--render-md", "a.json", "b.json", "--baseline", "c.json"],
        "argument --baseline: must name one JSON per --render-md JSON (2) (got 1)",
    ),
    # options of a run, given with --render-md, are refused rather than ignored
    (["--render-md", "a.json", "--quick"], "argument --quick: not used with --render-md"),
    (["--render-md", "a.json", "--iters", "3"], "argument --iters: not used with --render-md"),
    (["--render-md", "a.json", "--ops", "q_gather"], "argument --ops: not used with --render-md"),
]


@pytest.mark.parametrize("argv,fragment", BAD_ARGS)
def test_bad_arguments_are_one_line_errors_before_any_work(
    argv, fragment, tmp_path, capsys, monkeypatch
):
    from dcpkit import comm as comm_mod

    def no_mpi(cls):
        raise AssertionError("MPI was started for arguments that must be refused first")

    monkeypatch.setattr(comm_mod.Communicator, "from_mpi", classmethod(no_mpi))
    sub = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    argv = [a.format(**sub) for a in argv]
    with pytest.raises(SystemExit) as ei:
        bench.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("dcpkit bench: "), err
    assert fragment.format(**sub) in err, err
    assert "invalid" not in err and "Traceback" not in err, err


def test_bad_min_bytes_returns_at_once_from_the_command_line(run_python):
    """The loop that never ended: now refused in well under the limit, with no traceback."""
    r = run_python(["-m", "dcpkit", "bench", "--min-bytes", "0.1"], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "must be a whole number of bytes" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("var", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_launcher_mismatch_outside_mpirun_is_one_line_and_exit_2(run_python, var):
    """A launcher variable saying 2 processes, but MPI sees one: one clear line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")}
    env[var] = "2"
    r = run_python(["-m", "dcpkit", "bench", "--quick"], timeout=120, env=env)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dcpkit bench: "), r.stderr
    assert f"{var}=2" in lines[0] and "1 rank" in lines[0], lines[0]


def test_launcher_mismatch_in_process_is_exit_2(monkeypatch, capsys):
    from dcpkit import comm as comm_mod
    from dcpkit.errors import DcpkitError

    def mismatch(cls):
        raise DcpkitError(
            "Communicator.from_mpi: the launcher started 2 processes "
            "(PMI_SIZE=2) but MPI.COMM_WORLD has 1 rank: ..."
        )

    monkeypatch.setattr(comm_mod.Communicator, "from_mpi", classmethod(mismatch))
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("dcpkit bench: Communicator.from_mpi: the launcher started 2 ")
        and err.count("\n") == 1
    ), err


def test_bench_without_driver_says_so(monkeypatch, capsys):
    """No libcuda: 'no CUDA driver found', not CuPy's cudaErrorInsufficientDriver."""
    from dcpkit import comm as comm_mod
    from dcpkit import info
    from dcpkit.bench import command

    class Two:
        rank, world_size = 0, 2

        def allgather(self, value):
            return [value, value]

    def no_device(comm, cfg):
        raise RuntimeError(
            "cudaErrorInsufficientDriver: CUDA driver version is insufficient "
            "for CUDA runtime version"
        )

    monkeypatch.setattr(comm_mod.Communicator, "from_mpi", classmethod(lambda cls: Two()))
    monkeypatch.setattr(command, "CupyDevice", no_device)
    monkeypatch.setattr(info, "no_driver_reason", lambda probe=None: "no CUDA driver found (x)")
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err
    want = "dcpkit bench: no usable GPU on any of the 2 ranks (no CUDA driver found (x))"
    assert want in err, err
    assert "InsufficientDriver" not in err
    monkeypatch.setattr(info, "no_driver_reason", lambda probe=None: None)
    assert bench.main(["--quick"]) == 2
    assert "RuntimeError: cudaErrorInsufficientDriver" in capsys.readouterr().err


def test_entry_points(run_python):
    for args in (
        ["-m", "dcpkit.bench", "--help"],
        ["-m", "dcpkit", "bench", "--help"],
        ["-c", "import sys, dcpkit.bench as b; sys.exit(b.main(['--help']))"],
    ):
        r = run_python(args)
        assert r.returncode == 0 and "--render-md" in r.stdout, r.stderr


def test_plot_help_names_a_png_file():
    text = " ".join(bench.build_parser().format_help().split())
    start = text.index("--plot PNG draw")
    assert "into this PNG file" in text[start : start + 200] and "plots here" not in text, text


def test_plot_without_matplotlib_is_refused_at_parse_time(tmp_path, capsys, monkeypatch):
    """Not at the end of a long run: one line naming the extra, exit status 2, before MPI."""
    import sys

    from dcpkit import comm as comm_mod

    def no_mpi(cls):
        raise AssertionError("MPI was started for arguments that must be refused first")

    monkeypatch.setattr(comm_mod.Communicator, "from_mpi", classmethod(no_mpi))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as ei:
        bench.main(["--plot", str(tmp_path / "b.png")])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("dcpkit bench: argument --plot: needs matplotlib"), err
    assert "pip install 'dcpkit[bench]'" in err, err


def test_check_args_with_render_md_reads_the_inputs_and_writes_nothing(tmp_path, repo_root):
    import subprocess

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = tmp_path / "out.md"
    base = [sys.executable, "-m", "dcpkit", "bench", "--check-args", "--render-md"]
    r = subprocess.run(base + [str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a dcpkit-bench" in r.stderr, r.stderr
    r = subprocess.run(base + [str(tmp_path / "none.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr
    good = str(repo_root / "docs" / "bench_2.json")
    r = subprocess.run(base + [good, "--md-out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr
    assert not out.exists()
