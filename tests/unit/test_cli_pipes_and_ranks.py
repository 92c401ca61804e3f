"""The top-level ``dcpkit`` command: output piped into a reader that stops early ends quietly;
usage, errors and ``--version`` come once per MPI job; extra arguments after ``--version`` /
``--help`` are a usage error; the help texts and README say what the code does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dcpkit
from dcpkit import cli
from dcpkit.bench import args as bench_args
from dcpkit.demo import cli as demo_cli

_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_")


def _env(unbuffered: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    root = str(Path(dcpkit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def _id(v):
    return (" ".join(v) or "(none)") if isinstance(v, list) else str(v)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# ----------------------------------------------------------------------------- closed pipes
PRINTING = [
    ["-m", "dcpkit", "--help"],
    ["-m", "dcpkit", "--version"],
    ["-m", "dcpkit", "info"],
    ["-m", "dcpkit", "info", "--json"],
    ["-m", "dcpkit", "demo", "--help"],
    ["-m", "dcpkit", "bench", "--help"],
    ["-m", "dcpkit.info"],
    ["-m", "dcpkit.demo", "--help"],
    ["-m", "dcpkit.bench", "--help"],
]


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", PRINTING, ids=" ".join)
def test_a_closed_stdout_pipe_ends_quietly(argv, unbuffered, tmp_path):
    """``dcpkit info | grep -q CuPy``: the reader has gone before the command writes (the read
    end is closed before it starts, so every run sees it): no traceback, status 128 + SIGPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(
            [sys.executable, *argv],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=_env(unbuffered),
            timeout=120,
        )
    finally:
        os.close(w)
    assert p.stderr == "", p.stderr
    assert p.returncode == cli.EXIT_BROKEN_PIPE == 141, p.returncode


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--version", "x"]], ids=lambda v: _id(v))
def test_a_closed_stderr_pipe_ends_quietly(argv, tmp_path):
    """``dcpkit bogus 2>&1 | head -0``: the usage line has nowhere to go: no traceback either."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "dcpkit", *argv],
            stdout=subprocess.PIPE,
            stderr=w,
            text=True,
            cwd=tmp_path,
            env=_env(False),
            timeout=120,
        )
    finally:
        os.close(w)
    assert p.stdout == "" and p.returncode == 141, (p.returncode, p.stdout)


def test_pipe_safe_passes_status_and_system_exit_through():
    assert cli.pipe_safe(lambda: 3) == 3
    with pytest.raises(SystemExit) as e:
        cli.pipe_safe(sys.exit, 2)
    assert e.value.code == 2


def test_pipe_safe_lets_another_broken_pipe_through():
    """A peer's socket that broke is an error to report, not the output's reader going away."""

    def peer_gone():
        raise BrokenPipeError(32, "Broken pipe (a peer's socket)")

    with pytest.raises(BrokenPipeError, match="a peer's socket"):
        cli.pipe_safe(peer_gone)


# ----------------------------------------------------------------------------- once per job
TOP_LEVEL = [
    ([], 2),
    (["--help"], 0),
    (["-h"], 0),
    (["--version"], 0),
    (["-V"], 0),
    (["bogus"], 2),
    (["--bogus"], 2),
    (["--version", "extra"], 2),
    (["--help", "extra"], 2),
]


@pytest.mark.parametrize("argv,status", TOP_LEVEL, ids=_id)
@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])
def test_other_launcher_ranks_print_nothing_and_exit_the_same(
    argv, status, var, capsys, monkeypatch
):
    for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(v, raising=False)
    assert cli.main(list(argv)) == status
    alone = capsys.readouterr()
    assert alone.out or alone.err
    monkeypatch.setenv(var, "1")
    assert cli.main(list(argv)) == status
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv(var, "0")
    assert cli.main(list(argv)) == status
    assert capsys.readouterr() == alone


@pytest.mark.parametrize("argv,status", [([], 2), (["--version"], 0), (["bogus"], 2)], ids=_id)
def test_under_mpirun_the_top_level_prints_once(argv, status, mpi_launcher, run_cmd, run_python):
    alone = run_python(["-m", "dcpkit", *argv])
    proc = run_cmd(mpi_launcher.command(2, sys.executable, "-m", "dcpkit", *argv), timeout=180)
    assert proc.returncode == status == alone.returncode, (proc.returncode, proc.stderr)
    assert _lines(proc.stdout + proc.stderr) == _lines(alone.stdout + alone.stderr)


# ----------------------------------------------------------------------------- extra arguments
@pytest.mark.parametrize("flag", ["--version", "-V", "--help", "-h"])
def test_arguments_after_version_or_help_are_one_line_and_exit_2(flag, capsys):
    assert cli.main([flag, "extra", "more"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    want = f"dcpkit: {flag} takes no arguments (got 'extra more') (see dcpkit --help)\n"
    assert err == want, err


def test_an_unknown_option_is_called_an_option(capsys):
    assert cli.main(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dcpkit: unknown option '--bogus'") and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- wording
def test_the_demo_summary_says_it_checks_and_times(capsys):
    assert cli.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    iters = demo_cli.parser().get_default("iters")
    assert "check it against a reference" in text and "against NCCL" in text, text
    assert f"--iters, default {iters};" in text, text
    assert "once and check them" not in text


def test_demo_help_says_what_sharing_a_gpu_does(capsys):
    with pytest.raises(SystemExit):
        demo_cli.parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "under an MPS daemon the ranks' kernels run concurrently" in text, text
    assert "without one they time-slice the GPU" in text, text


def _readme(repo_root: Path) -> str:
    path = repo_root / "README.md"
    if not path.is_file():
        pytest.skip(f"no README at {repo_root} (tests run from an installed copy)")
    return path.read_text()


def test_readme_states_the_deadline_defaults_the_parsers_use(repo_root, run_python):
    text = " ".join(_readme(repo_root).split())
    demo = demo_cli.parser()._timeout_fallback_ms
    bench = bench_args.build_parser()._timeout_fallback_ms
    soak = repo_root / "scripts" / "soak.py"
    h = run_python([str(soak), "--help"], env={"DCPKIT_TIMEOUT_MS": ""})
    m = re.search(r"DCPKIT_TIMEOUT_MS if set, else ([0-9.]+)\)", " ".join(h.stdout.split()))
    assert m, h.stdout
    assert float(m.group(1)) == demo, (m.group(1), demo)
    sentence = (
        f"its default is `DCPKIT_TIMEOUT_MS` when set, otherwise {demo:g} ms for the demo and "
        f"the soak and {bench:g} ms for the bench."
    )
    assert sentence in text
    assert "with the same default" not in text


def test_readme_communicator_snippet_runs(repo_root, run_python, skip_or_fail):
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        skip_or_fail("mpi4py is not installed: pip install 'dcpkit[mpi]'")
    readme = _readme(repo_root)
    section = readme.split("### Communicator", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["0", "1"], r.stdout  # rank 0 of a one-rank group
