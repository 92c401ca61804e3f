"""``dcpkit <command>``: a dcpkit error a subcommand does not handle itself ends as one line and
exit status 2 (the README's promise), never a traceback and exit 1."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("var", ["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
@pytest.mark.parametrize("command", ["bench", "demo"])
def test_a_launcher_mismatch_is_one_line_and_exit_2(command, var, run_python):
    """``PMI_SIZE=2 dcpkit bench`` (or demo, or Open MPI's variable) outside mpirun: the error
    of Communicator.from_mpi in one line, exit 2."""
    pytest.importorskip("mpi4py")
    res = run_python(["-m", "dcpkit", command], env={var: "2"})
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(
        f"dcpkit {command}: Communicator.from_mpi: the launcher started 2 processes ({var}=2)"
    ), res.stderr


def test_an_unhandled_dcpkit_error_of_a_subcommand_is_one_line(monkeypatch, capsys):
    import types

    from dcpkit import cli
    from dcpkit.errors import ConfigMismatch

    def main(args):
        raise ConfigMismatch("demo arguments", [1, 2])

    monkeypatch.setattr(
        cli.importlib, "import_module", lambda name: types.SimpleNamespace(main=main)
    )
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("dcpkit demo: demo arguments must be equal on every rank")
        and err.count("\n") == 1
    ), err


@pytest.mark.parametrize("module", ["dcpkit", "dcpkit.info"])
def test_a_bad_info_option_is_one_line_and_exit_2(module, run_python):
    """``dcpkit info --bogus`` (or ``python -m dcpkit.info --bogus``) says so in one line, as
    ``dcpkit demo`` and ``dcpkit bench`` do: no usage block."""
    args = ["-m", module] + (["info"] if module == "dcpkit" else []) + ["--bogus"]
    res = run_python(args)
    assert res.returncode == 2, res.stderr
    assert res.stderr == (
        "dcpkit info: unrecognized arguments: --bogus (see dcpkit info --help)\n"
    ), res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--tokens", "-1,8"], "(got '-1,8', read as an option: write --tokens=-1,8)"),
        (["--tokens", "-2,-4"], "(got '-2,-4', read as an option: write --tokens=-2,-4)"),
        (["--tokens"], None),  # nothing after it: no hint
        (["--tokens", "--quick"], None),  # the next word really is an option
    ],
)
def test_a_value_that_starts_with_a_dash_gets_a_hint(argv, hint, capsys):
    from dcpkit.cli import CommandParser

    p = CommandParser(prog="dcpkit bench")
    p.add_argument("--tokens")
    p.add_argument("--quick", action="store_true")
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dcpkit bench: argument --tokens: expected one argument")
    assert err.rstrip().endswith("(see dcpkit bench --help)") and err.count("\n") == 1
    if hint is None:
        assert "read as an option" not in err
    else:
        assert hint in err
