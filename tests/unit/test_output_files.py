"""The files a command writes: an output that is also an input or another output is refused
when the arguments are parsed (one line, exit status 2, nothing written), and an output that
cannot be written at the end of a run is one line naming the path and the OS error and a
non-zero status, never a traceback."""

from __future__ import annotations

import json
import os

import pytest
from _scripts import ROOT, load_file

from dcpkit import bench
from dcpkit.cli import file_clash, write_output

BENCH_JSON = '{"schema": "dcpkit-bench/2", "meta": {"world_size": 2}, "rows": []}'


def _script(name: str):
    path = ROOT / "scripts" / f"{name}.py"
    if not path.is_file():
        pytest.skip(f"no {path} (tests run from an installed copy without the checkout)")
    return load_file(path, f"_output_files_{name}")


def _usage_error(capsys, parse) -> str:
    """The one line of a usage error raised by ``parse()`` (exit status 2)."""
    with pytest.raises(SystemExit) as ei:
        parse()
    err = capsys.readouterr().err
    assert ei.value.code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- same file
@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--render-md", "{j}", "--md-out", "{j}"],
            "argument --md-out: must not be the same file as --render-md {j}",
        ),
        (
            ["--render-md", "{k}", "--baseline", "{j}", "--md-out", "{j}"],
            "argument --md-out: must not be the same file as --baseline {j}",
        ),
        (
            ["--render-md", "{k}", "--notes", "{j}", "--md-out", "{j}"],
            "argument --md-out: must not be the same file as --notes {j}",
        ),
        (
            ["--render-md", "{k}", "--host-overhead", "{j}", "--md-out", "{j}"],
            "argument --md-out: must not be the same file as --host-overhead {j}",
        ),
        # another spelling of the same path, and a symbolic link to it
        (
            ["--render-md", "{j}", "--md-out", "{d}/./sub/../a.json"],
            "argument --md-out: must not be the same file as --render-md {j}",
        ),
        (
            ["--render-md", "{j}", "--md-out", "{d}/link.json"],
            "argument --md-out: must not be the same file as --render-md {j}",
        ),
        (
            ["--plot", "{d}/p.png", "--json", "{d}/p.png"],
            "argument --plot: must not be the same file as --json {d}/p.png",
        ),
    ],
)
def test_bench_refuses_an_output_that_is_one_of_its_inputs(tmp_path, capsys, argv, says):
    (tmp_path / "sub").mkdir()
    j, k = tmp_path / "a.json", tmp_path / "b.json"
    j.write_text(BENCH_JSON)
    k.write_text(BENCH_JSON.replace('"world_size": 2', '"world_size": 4'))
    os.symlink(j, tmp_path / "link.json")
    fill = {"j": str(j), "k": str(k), "d": str(tmp_path)}
    err = _usage_error(capsys, lambda: bench.main([a.format(**fill) for a in argv]))
    assert err.startswith("dcpkit bench: " + says.format(**fill)), err
    assert j.read_text() == BENCH_JSON  # the input is left as it was
    assert not (tmp_path / "p.png").exists()


def test_bench_writes_an_md_out_beside_its_input(tmp_path, capsys):
    j = tmp_path / "a.json"
    j.write_text(BENCH_JSON)
    assert bench.main(["--render-md", str(j), "--md-out", str(tmp_path / "a.md")]) == 0
    assert (tmp_path / "a.md").read_text().startswith("# dcpkit benchmarks")


def test_file_clash_compares_files_not_strings(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("{}")
    os.link(a, tmp_path / "hard.json")
    assert file_clash([("--out", str(tmp_path / "hard.json"))], [("--in", str(a))]) == (
        f"argument --out: must not be the same file as --in {a} (got '{tmp_path}/hard.json')"
    )
    # a file that does not exist yet: its resolved path
    new = str(tmp_path / "new.json")
    assert file_clash([("--x", new), ("--y", f"{tmp_path}/../{tmp_path.name}/new.json")])
    assert (
        file_clash([("--x", new), ("--y", str(tmp_path / "other.json"))], [("--in", str(a))])
        is None
    )


def test_host_path_cpu_refuses_the_same_profile_and_json(tmp_path, capsys):
    mod = _script("host_path_cpu")
    p = str(tmp_path / "p.txt")
    err = _usage_error(capsys, lambda: mod.parser().parse_args(["--profile", p, "--json", p]))
    assert err.startswith(
        f"scripts/host_path_cpu.py: argument --json: must not be the same file as --profile {p}"
    ), err


def test_two_jobs_check_refuses_waiting_for_its_own_ready_file(tmp_path, capsys):
    mod = _script("two_jobs_check")
    f = str(tmp_path / "ready")
    err = _usage_error(
        capsys, lambda: mod.parser().parse_args(["--ready-file", f, "--wait-file", f])
    )
    assert "argument --ready-file: must not be the same file as --wait-file" in err, err


# ----------------------------------------------------------------------------- write time
def _one_write_error(capsys, prog: str, path) -> None:
    err = capsys.readouterr().err
    assert err == f"{prog}: could not write {path}: No such file or directory\n", err


def test_write_output_is_one_line_naming_the_path_and_the_os_error(tmp_path, capsys):
    path = tmp_path / "missing" / "x.json"
    line = write_output(str(path), lambda f: f.write("{}"), prog="dcpkit demo")
    assert line == f"could not write {path}: No such file or directory"
    _one_write_error(capsys, "dcpkit demo", path)
    ok = tmp_path / "x.json"
    assert write_output(str(ok), lambda f: f.write("{}"), prog="p", atomic=True) is None
    assert ok.read_text() == "{}" and os.listdir(tmp_path) == ["x.json"]  # no temporary file


def test_host_path_cpu_write_error_is_one_line_and_status_1(tmp_path, capsys):
    mod = _script("host_path_cpu")
    rows = {"row": {"median_us": 1.0, "profile": "table", "input_ptr": 1}}
    bad = tmp_path / "missing" / "x.json"
    prog = "scripts/host_path_cpu.py"
    assert mod.write_files(rows, profile=None, json_path=str(bad), prog=prog) == 1
    _one_write_error(capsys, prog, bad)
    good = tmp_path / "x.json"
    assert mod.write_files(rows, profile=str(bad), json_path=str(good), prog=prog) == 1
    _one_write_error(capsys, prog, bad)
    assert json.loads(good.read_text()) == {"row": {"median_us": 1.0}}  # the other file is written


@pytest.mark.parametrize("name", ["host_overhead", "kernel_timeline", "programmatic_launch"])
def test_mpi_scripts_write_error_is_one_line_and_status_1(tmp_path, capsys, name):
    mod = _script(name)
    bad = tmp_path / "missing" / "x.json"
    assert mod.write_json(str(bad), {"a": 1}, prog=f"scripts/{name}.py") == 1
    _one_write_error(capsys, f"scripts/{name}.py", bad)
    good = tmp_path / "x.json"
    assert mod.write_json(str(good), {"a": 1}, prog=f"scripts/{name}.py") == 0
    assert json.loads(good.read_text()) == {"a": 1}


def test_soak_write_error_is_one_line_and_status_1(tmp_path, capsys):
    mod = _script("soak")
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "s.json"  # below a file: no folder can be made there
    assert mod.write_json(str(bad), {"a": 1}, prog=mod.PROG) == 1
    err = capsys.readouterr().err
    assert err == f"scripts/soak.py: could not write {bad}: Not a directory\n", err
    made = tmp_path / "new" / "s.json"  # a missing folder is made
    assert mod.write_json(str(made), {"a": 1}, prog=mod.PROG) == 0
    assert json.loads(made.read_text()) == {"a": 1}


class _Rank0:
    rank, world_size = 0, 2


def test_bench_json_write_error_is_said_once_and_never_raises(tmp_path, capsys):
    from dcpkit.bench.stages import Ctx

    bad = tmp_path / "missing" / "b.json"
    (tmp_path / "missing").write_text("")  # a file where the folder would be made
    ctx = Ctx({"json": str(bad)}, _Rank0(), None, [])
    ctx.save()
    ctx.save()  # the next checkpoint: said once
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"dcpkit bench: could not write {bad}: "), err
    assert ctx.json_error is not None
    assert os.listdir(tmp_path) == ["missing"]  # no temporary file left
