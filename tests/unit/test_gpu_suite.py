"""scripts/gpu_suite.sh on a machine without GPUs (and with one, faked): it must fail loudly
instead of dropping every GPU stage and exiting 0.

``nvidia-smi`` is replaced by a script of the test's own on PATH, and ``CUDA_VISIBLE_DEVICES``
is empty so that CuPy's count is 0 too; only the info stage runs (no GPU work anywhere).
"""

import os
import shutil
import stat
import sys

import pytest


def _fake_nvidia_smi(bindir, gpus: int):
    bindir.mkdir(exist_ok=True)
    lines = "".join(f"GPU {i}: Fake GPU (UUID: GPU-{i})\\n" for i in range(gpus))
    p = bindir / "nvidia-smi"
    p.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def run_suite(repo_root, run_cmd, tmp_path):
    script = repo_root / "scripts" / "gpu_suite.sh"
    if not script.is_file() or shutil.which("bash") is None:
        pytest.skip("no scripts/gpu_suite.sh in this checkout, or no bash")

    def run(gpus: int, stages: str):
        _fake_nvidia_smi(tmp_path / "bin", gpus)
        out = tmp_path / f"out{gpus}"
        env = {
            "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "CUDA_VISIBLE_DEVICES": "",
            "OUT": str(out),
            "PYTHON": sys.executable,
            "TMPDIR": str(tmp_path),
            "DCPKIT_SUITE_STAGES": stages,
        }
        proc = run_cmd(["bash", str(script)], timeout=300, env=env)
        summary = (out / "summary.txt").read_text() if (out / "summary.txt").is_file() else ""
        return proc, summary

    return run


def test_no_gpu_exits_2_after_info(run_suite):
    proc, summary = run_suite(0, "info,tests,demo,bench")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{text}"
    assert "no GPU found on this machine" in text, text
    assert "stages after info not run" in text
    assert "info - 0" in summary, summary  # the info stage ran, and passed
    assert "gpus - 2 0 no GPU found" in summary, summary
    for stage in ("mpitests", "gputests", "demo", "bench"):
        assert f"{stage} N=" not in text, f"{stage} ran without a GPU:\n{text}"


def test_stages_without_a_world_size_fail(run_suite):
    """One GPU, default world sizes 2 and 4: the mpirun stages cannot run; say so, exit 1."""
    proc, summary = run_suite(1, "info,mpitests")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit {proc.returncode}\n{text}"
    assert "stage mpitests not run: no world size of '2 4' fits 1 GPU(s)" in text, text
    assert "mpitests - 1 0 not run" in summary, summary


def test_help_prints_usage_and_runs_nothing(repo_root, run_cmd, tmp_path):
    script = repo_root / "scripts" / "gpu_suite.sh"
    out = tmp_path / "out"
    for flag in ("--help", "-h"):
        proc = run_cmd(["bash", str(script), flag], timeout=60, env={"OUT": str(out)})
        assert proc.returncode == 0, proc.stderr
        for word in (
            "Settings (environment):",
            "DCPKIT_SUITE_STAGES",
            "DCPKIT_SUITE_BASELINE",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "DCPKIT_SUITE_MAX_FILES files (default 8)",
            "(default 570)",
        ):
            assert word in proc.stdout, proc.stdout
        assert "[suite" not in proc.stdout and not out.exists()
    proc = run_cmd(["bash", str(script), "--bogus"], timeout=60, env={"OUT": str(out)})
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr
    assert not out.exists()


GUARD_VARS = (
    "NCCL_NVLS_ENABLE",
    "NVSHMEM_DISABLE_NVLS",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "DCPKIT_DISABLE_MULTICAST",
)


def _fake_tools(bindir, calls):
    """nvidia-smi with one GPU, an MPS control that starts, a ``python`` (the interpreter the
    suite is given) and an Open MPI mpirun that records its arguments and the environment it
    passes on (the multicast variables included), and writes the --json file it is given. Every
    call of any of them is also written to ``bindir/started.txt``."""
    _fake_nvidia_smi(bindir, 1)
    started = bindir / "started.txt"
    log = f'echo "$(basename "$0") $*" >>"{started}"\n'
    smi = bindir / "nvidia-smi"
    smi.write_text(smi.read_text().replace("#!/bin/sh\n", "#!/bin/sh\n" + log, 1))
    (bindir / "nvidia-cuda-mps-control").write_text(
        "#!/bin/sh\n" + log + "cat >/dev/null 2>&1 &\nexit 0\n"
    )
    (bindir / "python").write_text(f'#!/bin/sh\n{log}exec "{sys.executable}" "$@"\n')
    guard = "|".join(f"{v}=${{{v}-unset}}" for v in GUARD_VARS)
    record = (
        'echo "PWD=$PWD|PYTHONPATH=$PYTHONPATH|PCT=${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE-unset}|'
        f'COMMIT=$DCPKIT_COMMIT|{guard}|ARGS=$*" >>{calls}\n'
    )
    (bindir / "mpirun").write_text(
        "#!/bin/bash\n"
        + log
        + "if [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 4.1.6'; exit 0; fi\n"
        + record
        + 'prev=\'\'; for a in "$@"; do [ "$prev" = --json ] && echo \'{}\' >"$a"; prev=$a; '
        "done; exit 0\n"
    )
    for name in ("nvidia-cuda-mps-control", "mpirun", "python"):
        p = bindir / name
        p.chmod(p.stat().st_mode | stat.S_IEXEC)


def _suite_env(bindir, out, tmp_path, python=sys.executable, **settings):
    """The environment of a suite run with the fake tools of ``bindir`` first on PATH, plus
    ``settings`` (DCPKIT_SUITE_* and the like)."""
    return {
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OUT": str(out),
        "PYTHON": str(python),
        "TMPDIR": str(tmp_path),
        **settings,
    }


def _suite_with_fake_tools(repo_root, tmp_path):
    """(the suite script, the fake tools' folder, the fake mpirun's call log, $OUT)."""
    bindir, calls, out = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "out"
    _fake_tools(bindir, calls)
    return repo_root / "scripts" / "gpu_suite.sh", bindir, calls, out


def _fake_baseline(tmp_path):
    """A folder that passes for another checkout of dcpkit (DCPKIT_SUITE_BASELINE)."""
    base = tmp_path / "base"
    (base / "dcpkit").mkdir(parents=True)
    (base / "dcpkit" / "__init__.py").write_text("")
    return base


def _run_ok(run_cmd, script, env, calls, needle):
    """Run the suite, check it passed; returns its output and the fake mpirun's recorded calls
    whose line holds ``needle``."""
    proc = run_cmd(["bash", str(script)], timeout=300, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    return text, [ln for ln in calls.read_text().splitlines() if needle in ln]


def test_bench_stage_shares_the_gpu_and_runs_the_baseline_first(repo_root, run_cmd, tmp_path):
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    base = _fake_baseline(tmp_path)
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        DCPKIT_SUITE_STAGES="bench",
        DCPKIT_SUITE_NP="2 4",
        DCPKIT_SUITE_SHARED_GPU="1",
        DCPKIT_SUITE_MPS="1",
        DCPKIT_SUITE_BASELINE=str(base),
        DCPKIT_SUITE_BASELINE_COMMIT="9965d55",
        DCPKIT_COMMIT="cafe",
    )
    text, lines = _run_ok(run_cmd, script, env, calls, "dcpkit bench")
    assert len(lines) == 4, lines
    for n, pct in ((2, 50), (4, 25)):
        b = next(ln for ln in lines if f"bench_base_{n}.json" in ln)
        c = next(ln for ln in lines if f"bench_{n}.json" in ln)
        assert lines.index(b) + 1 == lines.index(c)  # baseline right before
        assert f"PWD={base}|PYTHONPATH={base}" in b and "COMMIT=9965d55" in b and "--quick" in b
        assert f"PYTHONPATH={repo_root}" in c and "COMMIT=cafe" in c
        for ln in (b, c):
            assert f"PCT={pct}|" in ln and "-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in ln, ln
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {
        "summary.txt",
        "logs.tar.gz",
        "bench_2.json",
        "bench_4.json",
        "bench_base_2.json",
        "bench_base_4.json",
    } <= set(files), files


def test_programmatic_stage_runs_its_script_with_the_mps_share(repo_root, run_cmd, tmp_path):
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        DCPKIT_SUITE_STAGES="programmatic",
        DCPKIT_SUITE_SHARED_GPU="1",
        DCPKIT_SUITE_MPS="1",
        DCPKIT_SUITE_PROGRAMMATIC_NP="2 4",
    )
    text, lines = _run_ok(run_cmd, script, env, calls, "programmatic_launch.py")
    assert len(lines) == 2, lines
    for ln, (n, pct) in zip(lines, ((2, 50), (4, 25))):
        assert f"-np {n}" in ln and f"programmatic_{n}.json" in ln, ln
        assert f"PCT={pct}|" in ln and "-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in ln, ln
    summary = (out / "summary.txt").read_text()
    assert "programmatic 2 0" in summary and "programmatic 4 0" in summary, summary


def test_probe_stage_runs_its_script_with_the_mps_share(repo_root, run_cmd, tmp_path):
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        DCPKIT_SUITE_STAGES="probe",
        DCPKIT_SUITE_SHARED_GPU="1",
        DCPKIT_SUITE_MPS="1",
        DCPKIT_SUITE_PROBE_NP="2 4",
    )
    text, lines = _run_ok(run_cmd, script, env, calls, "protocol_probe.py")
    assert len(lines) == 2, lines
    for ln, (n, pct) in zip(lines, ((2, 50), (4, 25))):
        assert f"-np {n}" in ln and f"probe_{n}.json" in ln and "--tokens 1,4,8" in ln, ln
        assert f"PCT={pct}|" in ln and "-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in ln, ln
    summary = (out / "summary.txt").read_text()
    assert "probe 2 0" in summary and "probe 4 0" in summary, summary


@pytest.mark.parametrize(
    "name, value",
    [
        ("DCPKIT_SUITE_MAX_FILES", "1"),
        ("DCPKIT_SUITE_MAX_FILES", "x"),
        ("DCPKIT_SUITE_MAX_FILES", "08"),  # a leading zero: octal in bash arithmetic
        ("DCPKIT_SUITE_BUDGET_S", "0"),
        ("DCPKIT_SUITE_BUDGET_S", "30"),  # every stage would be skipped, and the run pass
        ("DCPKIT_SUITE_BUDGET_S", "99999999999999999999"),  # past bash's 64-bit integers
        ("DCPKIT_SUITE_BUDGET_S", "\uff15\uff17\uff10"),  # fullwidth digits: not ASCII
        ("DCPKIT_SUITE_TEST_TIMEOUT_S", "abc"),
        ("DCPKIT_SUITE_TEST_TIMEOUT_S", "0"),
        ("DCPKIT_SUITE_TEST_TIMEOUT_S", "1e3"),
        ("DCPKIT_SUITE_SOAK_CALLS", "abc"),
        ("DCPKIT_SUITE_SOAK_CALLS", "0"),
        ("DCPKIT_SUITE_SOAK_CALLS", "-5"),
        ("DCPKIT_SUITE_MPI_CAP_S", "10"),  # a stage limited below 20 s is always skipped
        ("DCPKIT_SUITE_SOAK_CAP_S", "x"),
        ("DCPKIT_SUITE_MPS", "yes"),
        ("DCPKIT_SUITE_MPS", "2"),
        ("DCPKIT_SUITE_SHARED_GPU", "yes"),
        ("DCPKIT_SUITE_SHARED_GPU", "true"),
        ("DCPKIT_SUITE_MPI_XFLAG", "-y"),
        ("DCPKIT_SUITE_MPI_XFLAG", "x"),
        ("DCPKIT_SUITE_NP", "0"),
        ("DCPKIT_SUITE_NP", "2,4"),
        ("DCPKIT_SUITE_NP", "2 -1"),
        ("DCPKIT_SUITE_NP", "2 2"),
        ("DCPKIT_SUITE_NP", " "),
        ("DCPKIT_SUITE_NP", "2\n4"),
        ("DCPKIT_SUITE_NP", "*"),
        ("DCPKIT_SUITE_NP", "2000"),
        ("DCPKIT_SUITE_DEMO_NP", "x"),
        ("DCPKIT_SUITE_BENCH_NP", "2.5"),
        ("DCPKIT_SUITE_BENCH_NP", "4 2 4"),
        ("DCPKIT_SUITE_OVERHEAD_NP", "0"),
        ("DCPKIT_SUITE_SOAK_NP", "four"),
        ("DCPKIT_SUITE_PROGRAMMATIC_NP", "1.5"),
        ("DCPKIT_SUITE_PROBE_NP", "0"),
        ("DCPKIT_SUITE_STAGES", "info,bogus"),
        ("DCPKIT_SUITE_STAGES", "info tests"),
        ("DCPKIT_SUITE_STAGES", "info,"),
        ("DCPKIT_SUITE_STAGES", "info,info"),
        ("DCPKIT_SUITE_STAGES", ",info"),
        ("DCPKIT_SUITE_STAGES", "info,,bench"),
        ("DCPKIT_SUITE_BASELINE", "/nonexistent/dcpkit-baseline"),
        ("DCPKIT_SUITE_BASELINE_COMMIT", "not a commit"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(repo_root, run_cmd, tmp_path, name, value):
    """Checked before anything starts: with a GPU (faked) and every tool there, none of them
    (nvidia-smi, python, the MPS control, mpirun) is called, and $OUT is not made."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    settings = {
        "DCPKIT_SUITE_STAGES": "info,tests,demo,bench",
        "DCPKIT_SUITE_SHARED_GPU": "1",
        "DCPKIT_SUITE_MPS": "1",
        name: value,
    }
    env = _suite_env(bindir, out, tmp_path, python=bindir / "python", **settings)
    proc = run_cmd(["bash", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr.startswith(f"gpu_suite.sh: {name} must ") and f"(got '{value}')" in proc.stderr
    ), proc.stderr
    assert proc.stderr.count("\n") == 1 + value.count("\n") and proc.stdout == "", proc.stderr
    assert not out.exists() and not (bindir / "started.txt").exists(), proc.stderr


@pytest.mark.parametrize("kind", ["missing", "empty_folder", "a_file"])
def test_a_baseline_that_is_no_checkout_is_refused_up_front(repo_root, run_cmd, tmp_path, kind):
    """Not at the bench stage, after the tests have run for minutes: before anything starts."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    base = tmp_path / "base"
    if kind == "empty_folder":
        base.mkdir()
    elif kind == "a_file":
        base.write_text("")
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        python=bindir / "python",
        DCPKIT_SUITE_STAGES="bench",
        DCPKIT_SUITE_BASELINE=str(base),
    )
    proc = run_cmd(["bash", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("gpu_suite.sh: DCPKIT_SUITE_BASELINE must be a folder")
    assert f"(got '{base}')" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not out.exists() and not (bindir / "started.txt").exists()


def test_an_unknown_setting_is_refused(repo_root, run_cmd, tmp_path):
    """A misspelt DCPKIT_SUITE_* name would otherwise be ignored and its default used."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(bindir, out, tmp_path, python=bindir / "python", DCPKIT_SUITE_NPS="2")
    proc = run_cmd(["bash", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "gpu_suite.sh: DCPKIT_SUITE_NPS is not a setting of this script (got '2');"
    ), proc.stderr
    assert "DCPKIT_SUITE_NP," in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not out.exists() and not (bindir / "started.txt").exists()


def test_good_settings_reach_the_commands(repo_root, run_cmd, tmp_path):
    """The values the checks accept are used: DCPKIT_SUITE_MPI_XFLAG="" drops -x, and the
    per-test timeout and the soak's call count are passed on; empty values are the defaults."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        DCPKIT_SUITE_STAGES="mpitests,soak",
        DCPKIT_SUITE_NP="2",
        DCPKIT_SUITE_SOAK_NP="",
        DCPKIT_SUITE_SHARED_GPU="1",
        DCPKIT_SUITE_MPS="0",
        DCPKIT_SUITE_MPI_XFLAG="",
        DCPKIT_SUITE_TEST_TIMEOUT_S="120",
        DCPKIT_SUITE_SOAK_CALLS="500",
        DCPKIT_SUITE_BUDGET_S="",
    )
    text, lines = _run_ok(run_cmd, script, env, calls, "-np ")
    tests = [ln for ln in lines if "tests/mpi" in ln]
    soak = [ln for ln in lines if "soak.py" in ln]
    assert len(tests) == 1 and len(soak) == 1, lines
    assert "--timeout=120" in tests[0] and " -q -rfEs " in tests[0], tests[0]
    assert "-np 4" in soak[0] and "--calls 500" in soak[0], soak[0]  # the default soak size
    env.pop("DCPKIT_SUITE_MPI_XFLAG")
    calls.unlink()
    text, lines = _run_ok(run_cmd, script, env, calls, "tests/mpi")
    assert len(lines) == 1 and " -q -x -rfEs " in lines[0], lines


def test_the_multicast_variables_reach_every_rank_unchanged(repo_root, run_cmd, tmp_path):
    """NCCL_NVLS_ENABLE, NVSHMEM_DISABLE_NVLS and TORCH_SYMM_MEM_DISABLE_MULTICAST are what every
    mpirun of the suite sees, the baseline's (started with an environment of its own) and the
    MPS probe's included: set to values of the test's own, then as this process has them (set
    or unset; this process's environment is never changed)."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    base = _fake_baseline(tmp_path)
    for given in ({"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}, {}):  # fmt: skip
        env = _suite_env(
            bindir,
            out,
            tmp_path,
            DCPKIT_SUITE_STAGES="tests,programmatic,bench",
            DCPKIT_SUITE_NP="2",
            DCPKIT_SUITE_SHARED_GPU="1",
            DCPKIT_SUITE_MPS="1",
            DCPKIT_SUITE_BASELINE=str(base),
            **given,
        )
        text, lines = _run_ok(run_cmd, script, env, calls, "-np ")
        want = "|".join(
            f"{var}={given.get(var, os.environ.get(var, 'unset'))}" for var in GUARD_VARS
        )
        # the MPS probe, mpitests, programmatic, the baseline's bench and the bench
        assert len(lines) == 5, lines
        assert all(f"|{want}|" in ln for ln in lines), (want, lines)
        assert any("bench_base_2.json" in ln for ln in lines), lines
        calls.unlink()


@pytest.mark.parametrize("max_files", [None, "4"])
def test_at_most_max_files_land_in_out(repo_root, run_cmd, tmp_path, max_files):
    """W = 2, 3, 4 and a baseline give 6 JSON files: those beyond DCPKIT_SUITE_MAX_FILES (default
    8, summary.txt and logs.tar.gz included) only in logs.tar.gz."""
    import tarfile

    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    base = _fake_baseline(tmp_path)
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        DCPKIT_SUITE_STAGES="bench",
        DCPKIT_SUITE_NP="2 3 4",
        DCPKIT_SUITE_SHARED_GPU="1",
        DCPKIT_SUITE_BASELINE=str(base),
    )
    if max_files is not None:
        env["DCPKIT_SUITE_MAX_FILES"] = max_files
    proc = run_cmd(["bash", str(script)], timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == int(max_files or 8), files
    assert {"summary.txt", "logs.tar.gz"} <= set(files), files
    with tarfile.open(out / "logs.tar.gz") as t:
        names = {os.path.basename(n) for n in t.getnames() if "/results/" in n}
    assert {f"bench_{n}.json" for n in (2, 3, 4)} | {
        f"bench_base_{n}.json" for n in (2, 3, 4)
    } <= names
    # no MPS asked for: no share set
    assert all("PCT=unset|" in ln for ln in calls.read_text().splitlines() if "bench" in ln)


@pytest.mark.parametrize("with_matplotlib", [False, True])
def test_bench_stage_asks_for_plots_only_where_matplotlib_imports(
    repo_root, run_cmd, tmp_path, with_matplotlib
):
    """dcpkit bench refuses --plot without matplotlib, so the suite passes it only where it
    imports (and says so where it does not): the tables and JSON are still made."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    fake = tmp_path / "site"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("")
    blocker = tmp_path / "block"  # a matplotlib that fails to import, whatever is installed
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')\n")
    py = bindir / "python"  # the suite sets PYTHONPATH itself: put the fake in front here
    first = fake if with_matplotlib else blocker
    py.write_text(f'#!/bin/sh\nPYTHONPATH="{first}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    env = _suite_env(
        bindir,
        out,
        tmp_path,
        python=py,
        DCPKIT_SUITE_STAGES="bench",
        DCPKIT_SUITE_NP="2",
        DCPKIT_SUITE_SHARED_GPU="1",
    )
    text, lines = _run_ok(run_cmd, script, env, calls, "dcpkit bench")
    assert len(lines) == 1, lines
    assert ("--plot" in lines[0]) == with_matplotlib, lines[0]
    assert ("matplotlib is not installed" in text) != with_matplotlib, text


@pytest.mark.parametrize("kind", ["file", "below_a_file"])
def test_out_that_cannot_be_a_directory_is_refused(repo_root, run_cmd, tmp_path, kind):
    script = repo_root / "scripts" / "gpu_suite.sh"
    f = tmp_path / "a_file"
    f.write_text("keep")
    out = f if kind == "file" else f / "out"
    proc = run_cmd(["bash", str(script)], timeout=60, env={"OUT": str(out)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("gpu_suite.sh: OUT must be ") and f"(got '{out}'" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert f.read_text() == "keep"


def test_no_nvidia_smi_and_no_python_are_named(repo_root, run_cmd, tmp_path):
    """Without nvidia-smi and with a PYTHON that cannot run: the summary says so, and does not
    blame a missing GPU or carry the shell's "command not found" lines."""
    script = repo_root / "scripts" / "gpu_suite.sh"
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    bindir = tmp_path / "bin"  # the tools the suite uses, without nvidia-smi or mpirun
    bindir.mkdir()
    for tool in (
        "bash", "sed", "grep", "date", "mktemp", "mkdir", "cp", "tar", "gzip", "ls", "tr",
        "head", "tail", "cut", "cat", "id", "hostname", "uname", "timeout", "git", "dirname",
        "basename", "rm", "sleep", "env",
    ):  # fmt: skip
        found = shutil.which(tool)
        if found:
            os.symlink(found, bindir / tool)
    out = tmp_path / "out"
    env = {
        "PATH": str(bindir),
        "OUT": str(out),
        "PYTHON": str(tmp_path / "no_python"),
        "TMPDIR": str(tmp_path),
        "DCPKIT_SUITE_STAGES": "info,tests",
    }
    proc = run_cmd(["bash", str(script)], timeout=120, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    summary = (out / "summary.txt").read_text()
    assert "command not found" not in summary.replace("cannot run: command not found", ""), summary
    assert "nvidia-smi: not installed on this machine" in summary, summary
    assert f"info - 127 0 '{tmp_path / 'no_python'}' cannot run: command not found" in summary
    assert "no GPU found" not in text + summary, text + summary
    assert "cannot run (set PYTHON" in text, text


@pytest.mark.parametrize(
    "args, why",
    [
        ("--tokens 1,x", "argument --tokens: must be a comma list"),
        ("--max-bytes 1.5", "argument --max-bytes: must be a whole number of bytes"),
        ("--no-such-flag", "unrecognized arguments: --no-such-flag"),
        ("--js /tmp/x.json", "unrecognized arguments: --js"),  # no abbreviations
        ("--he", "unrecognized arguments: --he"),
    ],
)
def test_bench_args_the_bench_refuses_stop_the_suite_before_it_starts(
    repo_root, run_cmd, tmp_path, args, why
):
    """The bench's own parser reads DCPKIT_BENCH_ARGS before anything starts: one line, exit 2,
    no $OUT, no GPU tool and no mpirun called (not after the tests have run for minutes)."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir, out, tmp_path, python=bindir / "python",
        DCPKIT_SUITE_STAGES="tests,bench", DCPKIT_SUITE_SHARED_GPU="1", DCPKIT_SUITE_MPS="1",
        DCPKIT_BENCH_ARGS=args,
    )  # fmt: skip
    proc = run_cmd(["bash", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("gpu_suite.sh: DCPKIT_BENCH_ARGS must be arguments"), proc.stderr
    assert f"(got '{args}')" in proc.stderr and why in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr
    assert not out.exists() and not calls.exists()
    started = (bindir / "started.txt").read_text().splitlines()
    assert started and all(ln.startswith("python -m dcpkit bench --check-args") for ln in started)


@pytest.mark.parametrize(
    "args", ["--json /tmp/x.json", "--plot=x.png", "--render-md docs/bench_2.json", "--help"]
)
def test_bench_args_that_replace_the_stages_output_are_refused(repo_root, run_cmd, tmp_path, args):
    """--json / --plot are the suite's own; --render-md, --help and the like run no benchmark
    (the stage would "pass" with no bench JSON)."""
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir, out, tmp_path, python=bindir / "python",
        DCPKIT_SUITE_STAGES="bench", DCPKIT_SUITE_SHARED_GPU="1", DCPKIT_SUITE_MPS="1",
        DCPKIT_BENCH_ARGS=args,
    )  # fmt: skip
    proc = run_cmd(["bash", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("gpu_suite.sh: DCPKIT_BENCH_ARGS must be options of a benchmark")
    assert f"(got '{args}')" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not out.exists() and not (bindir / "started.txt").exists()


def test_a_bad_timeout_variable_stops_the_suite_before_the_tests(repo_root, run_cmd, tmp_path):
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir, out, tmp_path, python=bindir / "python",
        DCPKIT_SUITE_STAGES="tests,bench", DCPKIT_SUITE_SHARED_GPU="1", DCPKIT_SUITE_MPS="1",
        DCPKIT_TIMEOUT_MS="abc",
    )  # fmt: skip
    proc = run_cmd(["bash", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(
        "gpu_suite.sh: the bench stage would stop: dcpkit bench: environment variable "
        "DCPKIT_TIMEOUT_MS"
    ), proc.stderr
    assert proc.stderr.count("\n") == 1 and not out.exists() and not calls.exists()


def test_bench_args_the_bench_accepts_pass_the_check(repo_root, run_cmd, tmp_path):
    script, bindir, calls, out = _suite_with_fake_tools(repo_root, tmp_path)
    env = _suite_env(
        bindir, out, tmp_path, python=bindir / "python",
        DCPKIT_SUITE_STAGES="bench", DCPKIT_SUITE_SHARED_GPU="1", DCPKIT_SUITE_MPS="1",
        DCPKIT_SUITE_NP="2", DCPKIT_BENCH_ARGS="--quick --tokens 1,8",
    )  # fmt: skip
    text, runs = _run_ok(run_cmd, script, env, calls, "dcpkit bench")
    assert len(runs) == 1 and runs[0].endswith("--quick --tokens 1,8"), runs
