"""The ranks of an MPI job agree on their command lines before any collective: a bad argument or
environment variable on some ranks only is one line and exit status 2 on every rank, not ranks
waiting for ever in a collective the others never enter (NOTE [dcpkit agreed parse] in
dcpkit/cli.py)."""

from __future__ import annotations

import sys

import pytest

from dcpkit._agreed import agreed_exit as _agreed_exit

PY = sys.executable


def _two_ranks(mpi_launcher, rank0, rank1):
    """An MPMD command line: one process running ``rank0``, one running ``rank1``."""
    return mpi_launcher.command(1, *rank0) + [":", "-n", "1", *rank1]


CASES = {
    # what rank 0 runs, what rank 1 runs, what the line must say
    "demo, a bad DCPKIT_TIMEOUT_MS on rank 1": (
        [PY, "-m", "dcpkit", "demo"],
        ["env", "DCPKIT_TIMEOUT_MS=abc", PY, "-m", "dcpkit", "demo"],
        "dcpkit demo: on rank(s) 1 of 2: environment variable DCPKIT_TIMEOUT_MS: must be",
    ),
    "demo, a bad option on rank 0": (
        [PY, "-m", "dcpkit", "demo", "--batch", "0"],
        [PY, "-m", "dcpkit", "demo"],
        "dcpkit demo: on rank(s) 0 of 2: argument --batch: must be",
    ),
    "demo, a check after parsing on rank 1": (
        [PY, "-m", "dcpkit", "demo"],
        [PY, "-m", "dcpkit", "demo", "--batch", "65536", "--context", "16777216"],
        "dcpkit demo: on rank(s) 1 of 2: argument --context: --batch x --context",
    ),
    "bench, a bad option on rank 1": (
        [PY, "-m", "dcpkit", "bench", "--quick"],
        [PY, "-m", "dcpkit", "bench", "--quick", "--tokens", "x"],
        "dcpkit bench: on rank(s) 1 of 2: argument --tokens: must be",
    ),
    "bench, a check of resolve_config on rank 0": (
        [PY, "-m", "dcpkit", "bench", "--max-bytes", "1K"],
        [PY, "-m", "dcpkit", "bench"],
        "dcpkit bench: on rank(s) 0 of 2: argument --max-bytes",
    ),
    "the dispatcher, an unknown command on rank 0": (
        [PY, "-m", "dcpkit", "demoo"],
        [PY, "-m", "dcpkit", "demo"],
        "dcpkit: on rank(s) 0 of 2: unknown command 'demoo'",
    ),
    "bench --check-args on one rank (it runs without a launcher)": (
        [PY, "-m", "dcpkit", "bench"],
        [PY, "-m", "dcpkit", "bench", "--check-args"],
        "dcpkit bench: on rank(s) 1 of 2: argument --check-args: runs without a launcher",
    ),
    "the dispatcher, no command on rank 1 (the usage's first line only)": (
        [PY, "-m", "dcpkit", "demo"],
        [PY, "-m", "dcpkit"],
        "dcpkit: on rank(s) 1 of 2: usage: dcpkit",
    ),
    "two commands, demo and bench": (
        [PY, "-m", "dcpkit", "demo"],
        [PY, "-m", "dcpkit", "bench"],
        "dcpkit: the ranks run different commands (rank(s) 0: demo; rank(s) 1: bench)",
    ),
    "two commands, demo and info (info joins a real launcher's job)": (
        [PY, "-m", "dcpkit", "demo"],
        [PY, "-m", "dcpkit", "info"],
        "dcpkit: the ranks run different commands (rank(s) 0: demo; rank(s) 1: info)",
    ),
    "info, a bad option on rank 1": (
        [PY, "-m", "dcpkit", "info"],
        [PY, "-m", "dcpkit", "info", "--bogus"],
        "dcpkit info: on rank(s) 1 of 2: unrecognized arguments: --bogus",
    ),
    "bench, a run and a rendering": (
        [PY, "-m", "dcpkit", "bench"],
        [PY, "-m", "dcpkit", "bench", "--render-md", "{bench_json}"],
        "dcpkit bench: the ranks ask for different things (rank(s) 0: a benchmark run; "
        "rank(s) 1: --render-md ",
    ),
    "bench, runs of different ops": (
        [PY, "-m", "dcpkit", "bench", "--quick", "--ops", "q_gather"],
        [PY, "-m", "dcpkit", "bench", "--quick", "--ops", "lse_reduce"],
        "dcpkit bench: the ranks ask for different things (rank(s) 0: a benchmark run with "
        "--ops q_gather; rank(s) 1: a benchmark run with --ops lse_reduce)",
    ),
    "bench, runs of different deadlines": (
        [PY, "-m", "dcpkit", "bench", "--timeout-ms", "100"],
        ["env", "DCPKIT_TIMEOUT_MS=200", PY, "-m", "dcpkit", "bench"],
        "dcpkit bench: the ranks ask for different things (rank(s) 0: a benchmark run with "
        "--timeout-ms 100.0; rank(s) 1: a benchmark run with --timeout-ms 200.0)",
    ),
    "bench, renderings of different files": (
        [PY, "-m", "dcpkit", "bench", "--render-md", "{bench_json}"],
        [PY, "-m", "dcpkit", "bench", "--render-md", "{bench_json_copy}"],
        "dcpkit bench: the ranks ask for different things (rank(s) 0: --render-md ",
    ),
    "demo, a bad --json on rank 1": (
        [PY, "-m", "dcpkit", "demo"],
        [PY, "-m", "dcpkit", "demo", "--json", "/nonexistent-folder/x.json"],
        "dcpkit demo: on rank(s) 1 of 2: argument --json /nonexistent-folder/x.json is in a "
        "folder that does not exist",
    ),
    "info through the dispatcher on one rank, its module on the other": (
        [PY, "-m", "dcpkit", "info"],
        [PY, "-m", "dcpkit.info"],
        "dcpkit: the ranks run different programs (rank(s) 0: dcpkit info; rank(s) 1: dcpkit "
        "info (started directly))",
    ),
    "two different scripts": (
        [PY, "{scripts}/protocol_probe.py"],
        [PY, "{scripts}/kernel_timeline.py"],
        "scripts/protocol_probe.py: the ranks run different programs (rank(s) 0: "
        "scripts/protocol_probe.py (started directly); rank(s) 1: scripts/kernel_timeline.py",
    ),
    "demo, runs of different seeds": (
        [PY, "-m", "dcpkit", "demo", "--seed", "1"],
        [PY, "-m", "dcpkit", "demo", "--seed", "2"],
        "dcpkit demo: the ranks ask for different things (rank(s) 0: a run with --seed 1; "
        "rank(s) 1: a run with --seed 2): give every rank the same command line",
    ),
    "demo, runs of different deadlines": (
        [PY, "-m", "dcpkit", "demo"],
        ["env", "DCPKIT_TIMEOUT_MS=200", PY, "-m", "dcpkit", "demo"],
        "dcpkit demo: the ranks ask for different things (rank(s) 0: a run with --timeout-ms ",
    ),
    "a script, runs of different sizes": (
        [PY, "{scripts}/protocol_probe.py", "--tokens", "1,8"],
        [PY, "{scripts}/protocol_probe.py", "--tokens", "1"],
        "scripts/protocol_probe.py: the ranks ask for different things (rank(s) 0: a run with "
        "--tokens 1,8; rank(s) 1: a run with --tokens 1)",
    ),
    "a script, runs of different lengths": (
        [PY, "{scripts}/soak.py", "--calls", "10"],
        [PY, "{scripts}/soak.py", "--calls", "20", "--seed", "3"],
        "scripts/soak.py: the ranks ask for different things (rank(s) 0: a run with --calls 10 "
        "--seed ",
    ),
    "demo, runs of different deadlines given as an option and as the variable": (
        [PY, "-m", "dcpkit", "demo", "--timeout-ms", "200"],
        ["env", "DCPKIT_TIMEOUT_MS=300", PY, "-m", "dcpkit", "demo"],
        "dcpkit demo: the ranks ask for different things (rank(s) 0: a run with --timeout-ms "
        "200.0; rank(s) 1: a run with --timeout-ms 300.0): give every rank the same command line",
    ),
    "bench, runs of different token lists (in the run's order)": (
        [PY, "-m", "dcpkit", "bench", "--quick", "--tokens", "8,1"],
        [PY, "-m", "dcpkit", "bench", "--quick", "--tokens", "1,8,16"],
        "dcpkit bench: the ranks ask for different things (rank(s) 0: a benchmark run with "
        "--tokens 1,8; rank(s) 1: a benchmark run with --tokens 1,8,16)",
    ),
    "--help on one rank only": (
        [PY, "-m", "dcpkit", "demo"],
        [PY, "-m", "dcpkit", "demo", "--help"],
        "dcpkit demo: --help or --version on rank(s) 1 of 2 only",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_command_line_on_one_rank_stops_every_rank(
    mpi_launcher, run_cmd, repo_root, tmp_path, case
):
    rank0, rank1, needle = CASES[case]
    src = repo_root / "docs" / "bench_2.json"
    names = {
        "bench_json": str(src),
        "bench_json_copy": str(tmp_path / "copy.json"),
        "scripts": str(repo_root / "scripts"),
    }
    if "{scripts}" in " ".join(rank0 + rank1) and not (repo_root / "scripts").is_dir():
        pytest.skip("no scripts/ (tests run from an installed copy without the checkout)")
    if "{bench_json" in " ".join(rank0 + rank1):
        if not src.is_file():
            pytest.skip(f"no {src} (tests run from an installed copy without the checkout)")
        (tmp_path / "copy.json").write_bytes(src.read_bytes())
    rank0 = [a.format(**names) for a in rank0]
    rank1 = [a.format(**names) for a in rank1]
    proc = run_cmd(_two_ranks(mpi_launcher, rank0, rank1), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(needle), proc.stderr
    assert "Traceback" not in proc.stderr


SAME_RUN = {
    # the same run, written differently on the two ranks: past the agreement (to the no-GPU
    # line here, or the run on a GPU machine)
    "demo, one deadline from --timeout-ms and from DCPKIT_TIMEOUT_MS": (
        [PY, "-m", "dcpkit", "demo", "--timeout-ms", "5000"],
        ["env", "DCPKIT_TIMEOUT_MS=5000", PY, "-m", "dcpkit", "demo"],
    ),
    "demo, the default deadline given on one rank": (
        [PY, "-m", "dcpkit", "demo", "--seed", "0", "--timeout-ms", "5000"],
        [PY, "-m", "dcpkit", "demo"],
    ),
    "bench, token lists in another order": (
        [PY, "-m", "dcpkit", "bench", "--quick", "--tokens", "8,1", "--ops", "q_gather,lse_reduce"],
        [PY, "-m", "dcpkit", "bench", "--quick", "--tokens", "1,8", "--ops", "lse_reduce,q_gather"],
    ),
    "bench, the default tokens and modes given on one rank": (
        [PY, "-m", "dcpkit", "bench", "--tokens", "1,8,32,128", "--modes", "graph,eager"],
        [PY, "-m", "dcpkit", "bench"],
    ),
}


@pytest.mark.parametrize("case", sorted(SAME_RUN))
def test_one_run_written_differently_is_one_run(mpi_launcher, run_cmd, case):
    rank0, rank1 = SAME_RUN[case]
    proc = run_cmd(_two_ranks(mpi_launcher, rank0, rank1), timeout=120)
    assert "ask for different things" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode != 0:  # no GPU here: the command's own one line
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "GPU" in lines[0] and "the ranks" not in lines[0], proc.stderr


def test_the_bench_compares_every_run_option():
    """The bench's run mode names real options (the line shows them as --name), every option
    of a run but the outputs, the seed (broadcast) and --verbose."""
    from dcpkit.bench.args import resolve_config
    from dcpkit.bench.command import _mode, build_parser

    parser = build_parser()
    args = parser.parse_args(["--quick", "--tokens", "8,1"])
    label, run = _mode(args, resolve_config(args))
    dests = {a.dest for a in parser._actions} - {"help", "version"}
    assert label == "a benchmark run" and set(run) <= dests
    # not compared: rank 0's outputs and seed, --verbose, and the rendering's options (a
    # rendering or --check-args is a mode of its own)
    assert dests - set(run) == {
        "json", "plot", "seed", "verbose", "render_md", "check_args", "baseline", "notes",
        "host_overhead", "md_out",
    }  # fmt: skip
    assert run["tokens"] == [1, 8] and run["iters"] is None


def test_output_files_may_differ_between_ranks(mpi_launcher, run_cmd, repo_root, tmp_path):
    """The options rank 0 alone acts on (output files) are not compared: ranks that differ only
    in --json go past the agreement (here to the script's own no-GPU line, or its run)."""
    probe = str(repo_root / "scripts" / "protocol_probe.py")
    cmd = _two_ranks(
        mpi_launcher,
        [PY, probe, "--tokens", "1", "--json", str(tmp_path / "a.json")],
        [PY, probe, "--tokens", "1", "--json", str(tmp_path / "b.json")],
    )
    proc = run_cmd(cmd, timeout=120)
    assert "ask for different things" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode != 0:  # no GPU here: the script's own line, from rank 0
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("scripts/protocol_probe.py: "), proc.stderr


def test_a_script_agrees_as_well(mpi_launcher, run_cmd, repo_root):
    soak = str(repo_root / "scripts" / "soak.py")
    proc = run_cmd(_two_ranks(mpi_launcher, [PY, soak, "--calls", "x"], [PY, soak]), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "on rank(s) 0 of 2: argument --calls" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "rank1_env, rank1_args, needle",
    [
        (["DCPKIT_TIMEOUT_MS=-5"], [], "environment variable DCPKIT_TIMEOUT_MS"),
        ([], ["--calls", "3", "--rounds", "5"], "argument --rounds"),
        ([], ["--json", "/nonexistent/x.json"], "argument --json"),
    ],
)
def test_host_overhead_agrees_on_its_checks_after_parsing(
    mpi_launcher, run_cmd, repo_root, rank1_env, rank1_args, needle
):
    script = str(repo_root / "scripts" / "host_overhead.py")
    proc = run_cmd(
        _two_ranks(mpi_launcher, [PY, script], ["env", *rank1_env, PY, script, *rank1_args]),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"on rank(s) 1 of 2: {needle}" in lines[0], proc.stderr


def test_the_same_error_on_every_rank_is_the_usual_line(mpi_launcher, run_cmd):
    proc = run_cmd(
        mpi_launcher.command(2, PY, "-m", "dcpkit", "bench", "--tokens", "x"), timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dcpkit bench: argument --tokens"), lines


def test_agreed_exit_rules():
    line = "prog: argument --x: bad (see prog --help)"
    assert _agreed_exit("prog", [None, None]) == (None, None)
    assert _agreed_exit("prog", [(2, line), (2, line)]) == (line, 2)
    assert _agreed_exit("prog", [None, (2, line), None]) == (
        "prog: on rank(s) 1 of 3: argument --x: bad (see prog --help)",
        2,
    )
    other = "prog: argument --y: bad (see prog --help)"
    got, status = _agreed_exit("prog", [(2, line), (2, other), None])
    assert status == 2 and got.startswith("prog: on rank(s) 0 of 3: argument --x")
    assert got.endswith("(and 1 other rank(s) with another error)")
    assert _agreed_exit("prog", [(0, None), (0, None)]) == (None, 0)  # --help everywhere
    got, status = _agreed_exit("prog", [(0, None), None])
    assert status == 2 and "--help or --version on rank(s) 0 of 2 only" in got
    # an error beats a --help elsewhere
    got, status = _agreed_exit("prog", [(0, None), (2, line)])
    assert status == 2 and got.startswith("prog: on rank(s) 1 of 2:")


def test_short_and_long_version_flags_are_one_command(mpi_launcher, run_cmd):
    """``-V`` on one rank and ``--version`` on another ask for the same thing: printed once."""
    proc = run_cmd(
        _two_ranks(mpi_launcher, [PY, "-m", "dcpkit", "-V"], [PY, "-m", "dcpkit", "--version"]),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("dcpkit ") == 1 and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_info_with_a_stale_pmi_descriptor_runs_alone(run_python):
    """Leftover PMI variables that name a descriptor that is not open: info does not start MPI
    (whose initialisation would abort) and reports as usual."""
    r = run_python(
        ["-m", "dcpkit", "info"],
        timeout=120,
        env={"PMI_FD": "987", "PMI_SIZE": "2", "PMI_RANK": "0"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dcpkit" in r.stdout and "Abort" not in r.stderr, r.stdout + r.stderr


def test_shown_modes_show_only_the_options_that_differ():
    from dcpkit._agreed import shown_modes

    run = ("a run", {"ops": ["q"], "iters": 5, "seedless": None})
    other = ("a run", {"ops": ["q", "l"], "iters": 5, "seedless": None})
    assert shown_modes([run, other]) == ["a run with --ops q", "a run with --ops q,l"]
    assert shown_modes([run, run]) == ["a run", "a run"]
    assert shown_modes([run, "--render-md x.json"]) == ["a run", "--render-md x.json"]


def _sleeper():
    import subprocess

    return subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])


def test_the_start_watchdog_ends_a_rank_that_waits_too_long(capfd):
    """NOTE [dcpkit start watchdog]: past its deadline the watchdog prints its one line (on the
    launcher's rank 0, here: no launcher) and ends the process it watches."""
    from dcpkit import _agreed

    sleeper = _sleeper()
    try:
        dog = _agreed._start_watchdog("dcpkit demo", 0, pid=sleeper.pid, seconds=1.0)
        assert dog is not None
        assert sleeper.wait(timeout=60) != 0  # ended by the watchdog's SIGTERM
        dog.wait(timeout=60)
    finally:
        sleeper.kill()
    err = capfd.readouterr().err
    assert err.strip() == (
        "dcpkit demo: not every rank of the job reached its start within 1 s (a rank runs "
        "another program, or stopped before it): ending the job"
    ), err


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_the_other_ranks_watchdogs_end_their_ranks_later(capfd, rank):
    """Not rank 0's: START_GRACE_S after the deadline (rank 0's line first) rank 1's prints the
    line that names rank 0 (the rank that did not end the job); the others, twice that after
    it, none (rank 1's line first)."""
    import time

    from dcpkit import _agreed

    sleeper = _sleeper()
    try:
        t0 = time.monotonic()
        dog = _agreed._start_watchdog("dcpkit demo", rank, pid=sleeper.pid, seconds=1.0)
        assert sleeper.wait(timeout=60) != 0
        assert time.monotonic() - t0 >= 1.0 + (1 if rank == 1 else 2) * _agreed.START_GRACE_S
        dog.wait(timeout=60)
    finally:
        sleeper.kill()
    err = capfd.readouterr().err
    if rank == 1:
        assert err.strip() == (
            "dcpkit demo: rank 1: not every rank of the job reached its start within 1 s, and "
            "rank 0 did not end the job 5 s later (rank 0 runs another program, or stopped "
            "before it): ending the job"
        ), err
    else:
        assert err == ""


def test_the_start_watchdog_leaves_a_rank_that_got_there(capfd):
    """Its pipe closed before the deadline, the watchdog exits and ends nothing."""
    from dcpkit import _agreed

    sleeper = _sleeper()
    try:
        dog = _agreed._start_watchdog("dcpkit demo", None, pid=sleeper.pid, seconds=2.0)
        _agreed._stop_watchdog(dog)
        assert dog.wait(timeout=60) == 0
        assert sleeper.poll() is None  # still running, well past nothing
    finally:
        sleeper.kill()
        sleeper.wait()
    assert capfd.readouterr().err == ""


SHORT_START = (
    "import sys; import dcpkit._agreed as a; a.START_TIMEOUT_S = 3.0; "
    "from dcpkit.cli import main; sys.exit(main(['demo']))"
)


@pytest.mark.parametrize(
    "other",
    [
        [PY, "/nonexistent-folder/demo.py"],  # never starts MPI
        [PY, "-c", "import mpi4py.MPI"],  # starts MPI, then ends without the agreement
    ],
    ids=["a mistyped script", "MPI and gone"],
)
@pytest.mark.parametrize("ranks", [2, 4], ids=["2 ranks", "4 ranks"])
def test_a_rank_that_never_reaches_the_start_ends_the_job(mpi_launcher, run_cmd, other, ranks):
    """Without the watchdog the dcpkit ranks waited for ever (MPICH's Hydra does not end the
    job when the other rank exits): now the job ends after the start deadline, with rank 0's
    line (the other ranks' watchdogs wait START_GRACE_S longer, so it is not lost)."""
    cmd = _two_ranks(mpi_launcher, [PY, "-c", SHORT_START], other)
    for _ in range(ranks - 2):
        cmd += [":", "-n", "1", PY, "-c", SHORT_START]
    proc = run_cmd(cmd, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "dcpkit: not every rank of the job reached its start within 3 s" in proc.stderr, (
        proc.stderr
    )


@pytest.mark.parametrize("ranks", [2, 3, 4], ids=["2 ranks", "3 ranks", "4 ranks"])
def test_a_rank_0_that_never_reaches_the_start_ends_the_job_with_rank_1s_line(
    mpi_launcher, run_cmd, ranks
):
    """Rank 0 runs another program that keeps running (it starts MPI and sleeps): rank 0's
    watchdog is not there to print, so rank 1's does, once, START_GRACE_S after the deadline
    (the others' come later); the job ends instead of waiting for the sleeper."""
    sleeper = [PY, "-c", "import time, mpi4py.MPI; time.sleep(90)"]
    cmd = _two_ranks(mpi_launcher, sleeper, [PY, "-c", SHORT_START])
    for _ in range(ranks - 2):
        cmd += [":", "-n", "1", PY, "-c", SHORT_START]
    proc = run_cmd(cmd, timeout=80)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "reached its start" in ln]
    assert lines == [
        "dcpkit: rank 1: not every rank of the job reached its start within 3 s, and rank 0 "
        "did not end the job 5 s later (rank 0 runs another program, or stopped before it): "
        "ending the job"
    ], proc.stderr


FAULTY_CHECK = (
    "import sys; from dcpkit.cli import CommandParser; "
    "p = CommandParser(prog='faulty', alike_options=True); p.add_argument('--x', default='ok'); "
    "bad = lambda ns: (_ for _ in ()).throw(RuntimeError('check fault\\nsecond line')) "
    "if ns.x == 'boom' else None; "
    "p.parse_agreed(sys.argv[1:], check=bad); print('parsed')"
)


def test_a_fault_in_one_ranks_check_stops_every_rank(mpi_launcher, run_cmd):
    """An exception (not a usage error) in a check on one rank only: that rank still reaches
    the agreement, so every rank exits 2 with one line instead of the others waiting for it."""
    proc = run_cmd(
        _two_ranks(mpi_launcher, [PY, "-c", FAULTY_CHECK], [PY, "-c", FAULTY_CHECK, "--x", "boom"]),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["faulty: on rank(s) 1 of 2: RuntimeError: check fault"], proc.stderr
    assert "parsed" not in proc.stdout
