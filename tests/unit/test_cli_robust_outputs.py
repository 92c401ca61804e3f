"""Output files and stdout that cannot be written: every file a command writes is replaced
whole or not at all (a full disk half-way leaves the old file and no temporary file), and stdout
on a full device (``> /dev/full``) is one line on stderr and status 1, never a traceback."""

from __future__ import annotations

import builtins
import errno
import json
import os
import stat
import sys
import threading
import types

import pytest
from _bench_rows import synthetic_result
from _scripts import load_script

from dcpkit import bench, cli
from dcpkit.bench import report
from dcpkit.bench.common import jsonable
from dcpkit.comm import Communicator
from dcpkit.demo import cli as demo_cli

OLD = "the file as it was before\n"
FULL = "No space left on device"


class _FullHalfway:
    """An open file whose first write stores half its data and then fails as a full disk does."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, FULL)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def disk_full_halfway(monkeypatch):
    """Every file the command-line writer opens fills the disk half-way through its first write."""
    real = builtins.open
    monkeypatch.setattr(cli, "open", lambda *a, **k: _FullHalfway(real(*a, **k)), raising=False)


def _old_file(tmp_path, name: str):
    path = tmp_path / name
    path.write_text(OLD)
    return path


def _left_as_it_was(path, *beside: str) -> None:
    """``path`` holds what it held before, and its folder no temporary file (only ``path`` and
    the files ``beside`` it)."""
    assert path.read_text() == OLD, path.read_text()
    assert sorted(os.listdir(path.parent)) == sorted([path.name, *beside])


# ----------------------------------------------------------------------------- the writer
def test_write_output_keeps_the_old_file_when_the_disk_fills(tmp_path, capsys, disk_full_halfway):
    path = _old_file(tmp_path, "x.json")
    line = cli.write_output(str(path), lambda f: json.dump({"a": 1}, f), prog="p")
    assert line == f"could not write {path}: {FULL}"
    assert capsys.readouterr().err == f"p: {line}\n"
    _left_as_it_was(path)


def test_write_json_keeps_the_old_file_when_the_disk_fills(tmp_path, capsys, disk_full_halfway):
    path = _old_file(tmp_path, "x.json")
    assert cli.write_json(str(path), {"a": list(range(100))}, prog="p") == 1
    _left_as_it_was(path)


def test_an_error_in_the_writer_leaves_the_old_file_and_propagates(tmp_path):
    """Not an OS error: a bug in ``write`` is raised as it is, after the temporary file is gone."""
    path = _old_file(tmp_path, "x.json")

    def write(f):
        f.write("half")
        raise TypeError("not JSON serialisable")

    with pytest.raises(TypeError, match="not JSON serialisable"):
        cli.write_output(str(path), write, prog="p")
    assert path.read_text() == OLD and os.listdir(tmp_path) == ["x.json"]


def test_a_symbolic_link_stays_a_link_to_the_new_file(tmp_path):
    target = _old_file(tmp_path, "target.md")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    assert cli.write_output(str(link), lambda f: f.write("new"), prog="p") is None
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link.md", "target.md"]


def test_the_replaced_file_keeps_its_permissions(tmp_path):
    path = _old_file(tmp_path, "x.json")
    path.chmod(0o640)
    assert cli.write_output(str(path), lambda f: f.write("{}"), prog="p") is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "{}"


def test_a_named_pipe_is_written_in_place(tmp_path):
    """No file to replace: the data goes into the pipe, and the pipe stays a pipe."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert cli.write_output(str(fifo), lambda f: f.write("through"), prog="p") is None
    reader.join(30)
    assert got == ["through"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["out.fifo"]


# ----------------------------------------------------------------------------- the commands
def test_render_md_keeps_the_old_md_out_when_the_disk_fills(tmp_path, capsys, disk_full_halfway):
    j2 = tmp_path / "bench_2.json"
    j2.write_text(json.dumps(jsonable(synthetic_result(2, True))))
    md = _old_file(tmp_path, "BENCHMARKS.md")
    assert bench.main(["--render-md", str(j2), "--md-out", str(md)]) == 2
    err = capsys.readouterr().err
    assert err == f"dcpkit bench: --render-md: could not write {md}: {FULL}\n", err
    _left_as_it_was(md, "bench_2.json")


def test_host_path_cpu_keeps_its_old_files_when_the_disk_fills(tmp_path, capsys, disk_full_halfway):
    mod = load_script("host_path_cpu")
    rows = {"row": {"median_us": 1.0, "profile": "table", "input_ptr": 1}}
    js, prof = _old_file(tmp_path, "h.json"), _old_file(tmp_path, "h.prof")
    prog = "scripts/host_path_cpu.py"
    assert mod.write_files(rows, profile=str(prof), json_path=str(js), prog=prog) == 1
    assert capsys.readouterr().err.count(FULL) == 2
    _left_as_it_was(js, "h.prof")
    _left_as_it_was(prof, "h.json")


def test_the_demo_keeps_the_old_json_when_the_disk_fills(
    tmp_path, capsys, monkeypatch, disk_full_halfway
):
    report_doc = {"check": {"verdict": "PASS"}}
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda d: types.SimpleNamespace(use=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(demo_cli.environment, "environment_problem", lambda *a: None)
    monkeypatch.setattr(demo_cli.environment, "gpu_count", lambda: (1, ""))
    monkeypatch.setattr(demo_cli, "run", lambda args, comm, say: dict(report_doc))
    monkeypatch.setattr(demo_cli, "format_report", lambda rep: "the report")
    path = _old_file(tmp_path, "demo.json")
    assert demo_cli.main(["--json", str(path)], comm=Communicator.single()) == 2
    assert f"dcpkit demo: could not write {path}: {FULL}" in capsys.readouterr().err
    _left_as_it_was(path)


def test_the_bench_plot_keeps_the_old_png_when_the_disk_fills(tmp_path, capsys, disk_full_halfway):
    pytest.importorskip("matplotlib")
    png = _old_file(tmp_path, "b.png")
    why = report.plot_results(synthetic_result(2, True), str(png))
    assert why == f"could not write {png}: {FULL}", why
    assert capsys.readouterr().err == f"dcpkit bench: {why}\n"
    _left_as_it_was(png)


def test_the_bench_plot_is_written_whole(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sub" / "b.png"  # its folder is made
    assert report.plot_results(synthetic_result(2, True), str(png)) is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(png.parent) == ["b.png"]


# ----------------------------------------------------------------------------- stdout
def _dev_full():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")


def _to_dev_full(run_cmd, *args):
    return run_cmd(["sh", "-c", 'exec "$0" "$@" > /dev/full', sys.executable, *args])


TO_STDOUT = [
    (["-m", "dcpkit.bench", "--help"], "dcpkit bench"),
    (["-m", "dcpkit", "bench", "--help"], "dcpkit"),
    (["-m", "dcpkit", "--help"], "dcpkit"),
    (["-m", "dcpkit", "--version"], "dcpkit"),
    (["-m", "dcpkit", "info"], "dcpkit"),
    (["-m", "dcpkit", "info", "--json"], "dcpkit"),
    (["{scripts}/host_path_cpu.py", "--help"], "scripts/host_path_cpu.py"),
    (["{scripts}/host_overhead.py", "--help"], "scripts/host_overhead.py"),
]


@pytest.mark.parametrize(
    "argv,prog", TO_STDOUT, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_stdout_on_a_full_device_is_one_line_and_status_1(argv, prog, run_cmd, repo_root):
    _dev_full()
    argv = [a.format(scripts=repo_root / "scripts") for a in argv]
    r = _to_dev_full(run_cmd, *argv)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr == f"{prog}: could not write to stdout: {FULL}\n", r.stderr


def test_render_md_to_a_full_stdout_is_one_line_and_status_1(tmp_path, run_cmd):
    _dev_full()
    j2 = tmp_path / "bench_2.json"
    j2.write_text(json.dumps(jsonable(synthetic_result(2, True))))
    r = _to_dev_full(run_cmd, "-m", "dcpkit.bench", "--render-md", str(j2))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr == f"dcpkit bench: could not write to stdout: {FULL}\n", r.stderr


def test_a_full_disk_of_another_file_is_not_called_stdout(run_python):
    """stdout can be written: the error is another file's, and reaches the caller as it is."""
    code = (
        "import errno, sys\n"
        "from dcpkit.cli import pipe_safe\n"
        "def run():\n"
        "    raise OSError(errno.ENOSPC, 'the disk of another file')\n"
        "sys.exit(pipe_safe(run))\n"
    )
    r = run_python(code)
    assert r.returncode == 1 and "Traceback" in r.stderr, r.stderr
    assert "OSError: [Errno 28] the disk of another file" in r.stderr, r.stderr
    assert "could not write to stdout" not in r.stderr
