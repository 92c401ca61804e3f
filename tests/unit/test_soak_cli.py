"""scripts/soak.py's command line: every option says what it does, and a value the soak cannot
honour is one line naming the option and exit status 2, before any MPI or GPU work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SOAK = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "soak.py")


def _soak(*argv):
    return subprocess.run(
        [sys.executable, SOAK, *argv], capture_output=True, text=True, timeout=120
    )


def test_help_describes_every_option():
    r = _soak("--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("-h, --help"))
    options = [i for i, line in enumerate(lines) if i > start and line.lstrip().startswith("--")]
    assert options, r.stdout
    for i in options:
        # argparse puts the help on the option's line or, for long ones, on the next line
        parts = lines[i].split("  ")
        described = len([p for p in parts if p.strip()]) > 1 or (
            i + 1 < len(lines)
            and lines[i + 1].startswith(" " * 10)
            and not lines[i + 1].lstrip().startswith("-")
        )
        assert described, f"option without a description: {lines[i].strip()!r}\n{r.stdout}"
    assert "mpirun" in r.stdout  # how to run it


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--calls", "0"], "--calls"),
        (["--calls", "1e5"], "--calls"),
        (["--check-every", "-1"], "--check-every"),
        (["--seed", "-3"], "--seed"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--dtype", "int7"], "--dtype"),
        (["--timeout-ms", "nan"], "--timeout-ms"),
        (["--timeout-ms", "-1"], "--timeout-ms"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(argv, option):
    r = _soak(*argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr
    assert err.count("\n") == 1 and "usage:" not in err and "Traceback" not in err, err
    assert option in err and "--help" in err, err
