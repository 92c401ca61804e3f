"""The command lines of scripts/ on a CPU machine: ``--help`` says what every option does, and
a bad value is one line naming it and exit status 2, before anything looks for a GPU."""

from __future__ import annotations

import os
import shutil

import pytest
from _scripts import load_file


def _script(repo_root, name):
    path = repo_root / "scripts" / name
    if not path.is_file():
        pytest.skip(f"no {path} (tests run from an installed copy without the checkout)")
    return path


def _load(path):
    return load_file(path, f"_script_{path.stem}")


@pytest.mark.parametrize(
    "name",
    [
        "host_overhead.py",
        "two_jobs_check.py",
        "soak.py",
        "host_path_cpu.py",
        "kernel_timeline.py",
        "programmatic_launch.py",
        "protocol_probe.py",
    ],
)
def test_every_option_has_a_help_text(repo_root, name):
    ap = _load(_script(repo_root, name)).parser()
    assert ap.prog == f"scripts/{name}", ap.prog
    missing = [a.option_strings for a in ap._actions if a.option_strings and not a.help]
    assert not missing, missing
    assert ap.description.rstrip().endswith("."), ap.description  # a whole sentence


@pytest.mark.parametrize(
    "name, argv, fragment",
    [
        ("host_overhead.py", ["--calls", "-5"], "argument --calls: must be an integer in [1, "),
        ("host_overhead.py", ["--calls", "x"], "argument --calls: must be an integer in [1, "),
        ("host_overhead.py", ["--calls", "1_0"], "argument --calls: must be an integer in [1, "),
        # every call's time is kept until the end: a bound, as host_path_cpu.py's
        ("host_overhead.py", ["--calls", "10000001"], "argument --calls: must be an integer in"),
        # a round times at least one call of every row
        (
            "host_overhead.py",
            ["--calls", "3", "--rounds", "5"],
            "argument --rounds: must be at most --calls 3 (every round times at least one call "
            "of every row) (got 5)",
        ),
        ("host_overhead.py", ["--json", ""], "argument --json: must name a file (got '')"),
        (
            "host_overhead.py",
            ["--json", "{missing}/h.json"],
            "argument --json: {missing}/h.json is in a folder that does not exist",
        ),
        ("two_jobs_check.py", ["--rounds", "0"], "argument --rounds: must be an integer >= 1"),
        ("two_jobs_check.py", ["--nbytes", "-1"], "argument --nbytes: must be an integer >= 1"),
        ("soak.py", ["--json", ""], "argument --json: must name a file (got '')"),
        ("soak.py", ["--json", "{tmp}"], "argument --json: {tmp} is a directory"),
        ("soak.py", ["--json", "{tmp}/"], "argument --json: {tmp}/ is a directory"),
        ("soak.py", ["--json", "{file}/s.json"], "argument --json: {file}/s.json is below a file"),
        ("host_path_cpu.py", ["--calls", "0"], "argument --calls: must be an integer in [1, "),
        ("host_path_cpu.py", ["--calls", "1e9"], "argument --calls: must be an integer in [1, "),
        ("host_path_cpu.py", ["--calls", "10000001"], "argument --calls: must be an integer in"),
        ("host_path_cpu.py", ["--json", "{tmp}"], "argument --json: {tmp} is a directory"),
        (
            "host_path_cpu.py",
            ["--json", "{missing}/h.json"],
            "argument --json: {missing}/h.json is in a folder that does not exist",
        ),
        ("host_path_cpu.py", ["--profile", "{tmp}"], "argument --profile: {tmp} is a directory"),
        ("host_path_cpu.py", ["--profile", ""], "argument --profile: must name a file (got '')"),
        ("kernel_timeline.py", ["--tokens", "0"], "argument --tokens: must be a comma list of"),
        ("kernel_timeline.py", ["--tokens", "65537"], "argument --tokens: must be a comma list"),
        ("kernel_timeline.py", ["--tokens", "1,1"], "argument --tokens: must not repeat an item"),
        ("kernel_timeline.py", ["--ops", "kv_gather"], "argument --ops: must be a comma list of"),
        ("kernel_timeline.py", ["--replays", "3"], "argument --replays: must be an integer in [4,"),
        ("kernel_timeline.py", ["--json", "{tmp}"], "argument --json: {tmp} is a directory"),
        ("programmatic_launch.py", ["--replays", "3"], "argument --replays: must be an integer"),
        ("programmatic_launch.py", ["--json", "{tmp}"], "argument --json: {tmp} is a directory"),
        ("protocol_probe.py", ["--tokens", "0"], "must be a comma list of integers in [1, 64]"),
        (
            "protocol_probe.py",
            ["--tokens", "99999999"],
            "must be a comma list of integers in [1, 64]",
        ),
        ("protocol_probe.py", ["--tokens", "65"], "argument --tokens: must be a comma list of"),
        ("protocol_probe.py", ["--tokens", "1,x"], "argument --tokens: must be a comma list of"),
        ("protocol_probe.py", ["--tokens", ""], "argument --tokens: must be a comma list of"),
        ("protocol_probe.py", ["--tokens", "1,1"], "argument --tokens: must not repeat an item"),
        ("protocol_probe.py", ["--replays", "3"], "argument --replays: must be an integer"),
        ("protocol_probe.py", ["--json", "{tmp}"], "argument --json: {tmp} is a directory"),
    ],
)
def test_a_bad_value_is_one_line_before_the_gpu_check(
    repo_root, run_python, tmp_path, name, argv, fragment
):
    path = _script(repo_root, name)
    (tmp_path / "a_file").write_text("")
    names = {"missing": tmp_path / "missing", "tmp": tmp_path, "file": tmp_path / "a_file"}
    argv = [a.format(**names) for a in argv]
    proc = run_python([str(path), *argv], timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"scripts/{name}: ") and "GPU" not in lines[0], lines[0]
    assert fragment.format(**names) in lines[0], lines[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_lint_help_prints_the_usage_even_without_ruff(repo_root, run_cmd, tmp_path, flag):
    script = _script(repo_root, "lint.sh")
    bindir = tmp_path / "bin"  # bash and the tools the script uses, but no ruff
    bindir.mkdir()
    for tool in ("bash", "dirname", "sed"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, bindir / tool)
    proc = run_cmd(["bash", str(script), flag], timeout=60, env={"PATH": str(bindir)})
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "bash scripts/lint.sh PATH..." in proc.stdout and "Exit status" in proc.stdout
    assert "lint: ruff is not installed" not in proc.stdout + proc.stderr


def test_lint_refuses_an_unknown_option(repo_root, run_cmd):
    proc = run_cmd(["bash", str(_script(repo_root, "lint.sh")), "--bogus"], timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("lint.sh: unknown option '--bogus'"), proc.stderr


def test_host_path_cpu_without_cupy_names_the_extra(repo_root, run_python, tmp_path):
    """The CPU script's stand-ins are CuPy objects: without CuPy, one line naming the extra."""
    from conftest import subprocess_env

    blocker = tmp_path / "no_cupy" / "cupy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError(\"No module named 'cupy'\", name='cupy')\n"
    )
    path = os.pathsep.join([str(blocker.parent), subprocess_env()["PYTHONPATH"]])
    script = _script(repo_root, "host_path_cpu.py")
    proc = run_python([str(script), "--calls", "5"], env={"PYTHONPATH": path})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("scripts/host_path_cpu.py: "), proc.stderr
    assert "dcpkit[cuda" in lines[0] and not proc.stdout, (proc.stdout, proc.stderr)


@pytest.mark.parametrize("argv, rc", [(["--help"], 0), (["-h"], 0), (["--bogus"], 2)])
def test_ci_run_reads_its_arguments_before_making_an_environment(repo_root, run_cmd, argv, rc):
    """``.ci/run --help`` prints what CI does and an unknown argument is refused, both before
    anything is installed (PYTHON=false: making the environment would fail at once)."""
    script = repo_root / ".ci" / "run"
    if not script.is_file():
        pytest.skip(f"no {script} (tests run from an installed copy without the checkout)")
    proc = run_cmd(["bash", str(script), *argv], timeout=60, env={"PYTHON": "false"})
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    assert "ci: fresh virtual environment" not in proc.stdout, proc.stdout
    if rc == 0:
        assert proc.stdout.startswith("CI of dcpkit") and "Usage: bash .ci/run" in proc.stdout
    else:
        assert proc.stderr.strip() == (
            "ci: unknown argument '--bogus' (.ci/run takes none; bash .ci/run --help says what "
            "it does)"
        ), proc.stderr
