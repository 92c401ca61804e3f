"""The command-line tools before anything is launched: the wait deadline (``--timeout-ms``,
``DCPKIT_TIMEOUT_MS``), the lines printed once per MPI job, and the examples' ``--help``.

Every tool that takes ``--timeout-ms`` (``dcpkit demo``, ``dcpkit bench``, ``scripts/soak.py``)
defaults it to ``DCPKIT_TIMEOUT_MS``, as the ops do; a bad variable is one line naming it and its
range, exit status 2, before MPI or a GPU is touched (so also on a machine without a GPU). Under
``mpirun -np N`` a line that speaks for the job (a usage error, no GPU, no MPI) comes once.
"""

from __future__ import annotations

import os
import sys

import pytest

from dcpkit import info
from dcpkit.bench import args as bench_args
from dcpkit.bench import command as bench_command
from dcpkit.demo import cli as demo_cli

BAD_VALUES = ["abc", "0", "-5", "1e-300", "inf", "nan", "1_000"]
RANGE = "[0.001, 3600000]"
EXAMPLES = ["cupy_decode_step", "dcpcomm_step", "torch_cuda_graph", "vllm_api"]


def _no_gpu():
    if info.collect()["gpu_count"] > 0:
        pytest.skip("this machine has a GPU: the no-GPU lines are not printed here")


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# ----------------------------------------------------------------------------- the deadline
PARSERS = {
    "dcpkit demo": (demo_cli.parser, 5000.0),
    "dcpkit bench": (bench_args.build_parser, bench_args.BENCH_TIMEOUT_MS),
}


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_timeout_default_is_the_variable_and_the_option_overrides_it(prog, monkeypatch):
    build, fallback = PARSERS[prog]
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)
    a = build().parse_args([])
    assert (a.timeout_ms, a.timeout_source) == (fallback, "default")
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "250")
    a = build().parse_args([])
    assert (a.timeout_ms, a.timeout_source) == (250.0, "DCPKIT_TIMEOUT_MS")
    a = build().parse_args(["--timeout-ms", "7.5"])
    assert (a.timeout_ms, a.timeout_source) == (7.5, "--timeout-ms")
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "")  # empty: unset, as the ops read it
    assert build().parse_args([]).timeout_ms == fallback


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_help_says_the_variable_sets_the_default(prog, capsys, monkeypatch):
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)
    with pytest.raises(SystemExit) as e:
        PARSERS[prog][0]().parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    fallback = f"{PARSERS[prog][1]:g}"
    assert f"in {RANGE} ms (default: DCPKIT_TIMEOUT_MS if set, else {fallback})" in text, text
    assert "not read" not in text


@pytest.mark.parametrize("prog", sorted(PARSERS))
@pytest.mark.parametrize("raw", BAD_VALUES)
@pytest.mark.parametrize("argv", [[], ["--timeout-ms", "100"]])
def test_a_bad_variable_is_a_usage_error_naming_it(prog, raw, argv, capsys, monkeypatch):
    """Also with --timeout-ms: any op built without a deadline would refuse the variable, and
    the line then says so (the option does not make the variable acceptable)."""
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", raw)
    with pytest.raises(SystemExit) as e:
        PARSERS[prog][0]().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    why = ""
    if argv:
        why = (
            "; the variable itself is invalid, also with --timeout-ms given: an op built "
            "without timeout_ms reads it, so fix or unset DCPKIT_TIMEOUT_MS"
        )
    assert err == (
        f"{prog}: environment variable DCPKIT_TIMEOUT_MS: must be a number of milliseconds "
        f"in {RANGE} (got {raw!r}){why} (see {prog} --help)\n"
    ), err


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "dcpkit", "demo"],
        ["-m", "dcpkit", "bench", "--quick"],
        ["-m", "dcpkit.bench"],
        ["scripts/soak.py"],
        *[[f"examples/{name}.py"] for name in EXAMPLES],
    ],
    ids=lambda a: " ".join(a),
)
def test_a_bad_variable_is_refused_before_anything_is_launched(argv, run_python, repo_root):
    """No MPI, no GPU probe: the one line names the variable, never "no GPU" or a traceback."""
    argv = [str(repo_root / argv[0]) if argv[0].endswith(".py") else argv[0], *argv[1:]]
    if argv[0].endswith(".py") and not os.path.exists(argv[0]):
        pytest.skip(f"no {argv[0]} (tests run from an installed copy without the checkout)")
    r = run_python(argv, env={"DCPKIT_TIMEOUT_MS": "-5"}, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = _lines(r.stdout + r.stderr)
    assert len(lines) == 1, lines
    assert "environment variable DCPKIT_TIMEOUT_MS: must be a number of milliseconds" in lines[0]
    assert f"in {RANGE} (got '-5')" in lines[0], lines[0]


def _check_timeout_warning(text: str) -> None:
    """``dcpkit info``'s text for DCPKIT_TIMEOUT_MS=inf: the settings line, and the one
    ``warning:`` line that names the variable, wherever it is among the warnings (a mixed CUDA
    stack or an MPI launcher mismatch puts theirs first)."""
    assert "wait deadline invalid DCPKIT_TIMEOUT_MS='inf'" in text, text
    found = [
        ln for ln in text.splitlines() if ln.startswith("warning:") and "DCPKIT_TIMEOUT_MS" in ln
    ]
    assert len(found) == 1, text
    warning = found[0]
    assert f"DCPKIT_TIMEOUT_MS must be a number of milliseconds in {RANGE} (got 'inf')" in warning
    assert "ops built without timeout_ms refuse to build" in warning, warning
    assert "an explicit timeout_ms= does not read the variable" in warning, warning
    assert "every op" not in warning, warning
    assert "dcpkit demo, dcpkit bench and scripts/soak.py refuse to start" in warning, warning


def test_info_reports_a_bad_variable_by_name(run_python):
    r = run_python(["-m", "dcpkit", "info"], env={"DCPKIT_TIMEOUT_MS": "inf"})
    assert r.returncode == 0, r.stderr
    _check_timeout_warning(r.stdout)


def test_info_reports_a_bad_variable_by_name_after_a_stack_warning(monkeypatch, capsys):
    """An environment with cuda-bindings 13 next to the cuda12 extra's CUDA 12 runtime and NVRTC
    (what torch from PyPI installs there): its warning comes first, the variable's after it."""
    real_versions = info._versions

    def mixed_stack():
        v = real_versions()
        v.update(cuda_bindings="13.0.3", cuda_runtime="12.9", nvrtc="12.9")
        return v

    monkeypatch.setattr(info, "_versions", mixed_stack)
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "inf")
    assert info.main([]) == 0
    out = capsys.readouterr().out
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert len(warnings) >= 2 and "mixed CUDA majors: cuda-bindings 13.0.3" in warnings[0], out
    _check_timeout_warning(out)


# ----------------------------------------------------------------------------- once per job
@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["-m", "dcpkit", "bench"], {}, "no usable GPU on any of the 2 ranks"),
        (["-m", "dcpkit", "demo"], {}, "no CUDA GPU is visible on this host"),
        (["-m", "dcpkit", "bench", "--iters", "0"], {}, "argument --iters"),
        (["-m", "dcpkit", "demo", "--batch", "0"], {}, "argument --batch"),
        (["-m", "dcpkit", "bench"], {"DCPKIT_TIMEOUT_MS": "0"}, "DCPKIT_TIMEOUT_MS"),
        (["-m", "dcpkit", "demo"], {"DCPKIT_TIMEOUT_MS": "0"}, "DCPKIT_TIMEOUT_MS"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_under_mpirun_a_line_for_the_job_comes_once(argv, env, needle, mpi_launcher, run_cmd):
    """Two ranks: one line (from rank 0), exit status 2 on every rank, no MPI abort, no hang."""
    if "no " in needle:
        _no_gpu()
    proc = run_cmd(mpi_launcher.command(2, sys.executable, *argv), timeout=180, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = _lines(proc.stdout + proc.stderr)
    assert len(lines) == 1 and needle in lines[0], lines
    assert "rank 1" not in lines[0]


@pytest.mark.parametrize(
    "argv",
    [["-m", "dcpkit", "bench", "--quick"], ["-m", "dcpkit", "demo"], ["examples/dcpcomm_step.py"]],
    ids=lambda a: " ".join(a),
)
def test_launcher_mismatch_is_said_by_launcher_rank_0_only(
    argv, run_python, repo_root, skip_or_fail
):
    """Under the launcher of another MPI library every process is a world of one: only the
    process the launcher calls rank 0 prints the line; all exit with status 2."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        skip_or_fail("mpi4py is not installed: pip install 'dcpkit[mpi]'")
    if argv[0].endswith(".py"):
        argv = [str(repo_root / argv[0])]
    for rank, printed in (("0", 1), ("1", 0)):
        env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": rank}
        r = run_python(argv, env=env, timeout=120)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = _lines(r.stdout + r.stderr)
        assert len(lines) == printed, (rank, lines)
        if printed:
            assert "the launcher started 2 processes" in lines[0], lines


def test_help_on_other_ranks_prints_nothing(capsys, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    for build in (demo_cli.parser, bench_args.build_parser):
        with pytest.raises(SystemExit) as e:
            build().parse_args(["--help"])
        assert e.value.code == 0
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(SystemExit):
        bench_args.build_parser().parse_args(["--help"])
    assert "usage: dcpkit bench" in capsys.readouterr().out


class _Rank:
    """Rank ``rank`` of a 2-rank world whose allgather returns ``gathered``."""

    def __init__(self, rank, gathered):
        self.rank, self.world_size, self._gathered = rank, 2, gathered

    def allgather(self, value):
        assert value == self._gathered[self.rank]
        return list(self._gathered)


@pytest.mark.parametrize("rank", [0, 1])
def test_bench_ranks_agree_when_one_rank_has_no_gpu(rank, monkeypatch, capsys):
    """Rank 1 has no GPU: both ranks return 2 without starting the run (rank 0 would otherwise
    wait in the run's first collective for a rank that left), and rank 0 names rank 1."""
    from dcpkit import comm as comm_mod
    from dcpkit import info as info_mod

    gathered = [None, "no CUDA driver found (x)"]
    monkeypatch.setattr(
        comm_mod.Communicator, "from_mpi", classmethod(lambda cls: _Rank(rank, gathered))
    )

    def device(comm, cfg):
        if comm.rank == 1:
            raise RuntimeError("no device")
        return object()

    def run_bench(*a, **k):
        raise AssertionError("the run started although a rank has no GPU")

    monkeypatch.setattr(bench_command, "CupyDevice", device)
    monkeypatch.setattr(bench_command, "run_bench", run_bench)
    monkeypatch.setattr(info_mod, "no_driver_reason", lambda probe=None: gathered[1])
    assert bench_command.main(["--quick"]) == 2
    err = capsys.readouterr().err
    if rank == 0:
        assert err == (
            "dcpkit bench: no usable GPU on rank 1 (no CUDA driver found (x)); the benchmark "
            "needs a GPU on every rank\n"
        ), err
    else:
        assert err == ""


def test_no_gpu_problem_names_the_ranks():
    p = bench_command.no_gpu_problem
    assert p([None, None, None]) is None
    assert p(["a", "a"]).startswith("no usable GPU on any of the 2 ranks (a); ")
    assert p([None, "a", "b", "a"]).startswith(
        "no usable GPU on ranks 1, 3 (a); no usable GPU on rank 2 (b); "
    )


# ----------------------------------------------------------------------------- examples --help
@pytest.fixture(scope="module")
def examples_dir(repo_root):
    d = repo_root / "examples"
    if not d.is_dir():
        pytest.skip(f"no {d} (tests run from an installed copy without the checkout)")
    return d


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_help_says_what_it_does_and_how_to_launch_it(name, examples_dir, run_python):
    import ast

    path = examples_dir / f"{name}.py"
    r = run_python([str(path), "--help"], timeout=120)
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    out = r.stdout
    assert out.startswith(f"usage: mpirun -np N python examples/{name}.py [options]"), out
    summary = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
    assert summary.replace("``", "") in out, out
    assert f"mpirun -np 2 python examples/{name}.py" in out and "pip install 'dcpkit[" in out
    assert "Exit status" in out and "-h, --help" in out
    assert "run under mpirun with 2 or more ranks" not in out and "``" not in out


@pytest.mark.parametrize(
    "name,argv,fragment",
    [
        ("cupy_decode_step", ["--bogus"], "unrecognized arguments: --bogus"),
        ("vllm_api", ["--heads-per-rank", "0"], "argument --heads-per-rank: must be an integer"),
        ("vllm_api", ["--seed", "-1"], "argument --seed: must be an integer in [0, 2147483647]"),
        ("vllm_api", ["--max-num-tokens", "x"], "argument --max-num-tokens: must be an integer"),
    ],
)
def test_example_bad_option_is_one_line(name, argv, fragment, examples_dir, run_python):
    r = run_python([str(examples_dir / f"{name}.py"), *argv], timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"{name}: {fragment}"), r.stderr
    assert r.stderr.rstrip().endswith(f"(see python examples/{name}.py --help)"), r.stderr
