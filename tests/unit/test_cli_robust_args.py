"""Sizes that ended in a traceback or were read wrongly: a size too large for a float, a size
rounded through a float, digits of other scripts (``\\d`` and ``int()`` read them)."""

from __future__ import annotations

import argparse
import io

import pytest

from dcpkit import bench
from dcpkit.bench import args as bench_args
from dcpkit.bench import meta

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in _RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)


def _refused(capsys, argv) -> str:
    """The one line ``dcpkit bench`` refuses ``argv`` with (exit status 2, before any MPI)."""
    with pytest.raises(SystemExit) as ei:
        bench.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dcpkit bench: "), err
    assert "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- sizes
def test_a_size_too_large_for_a_float_is_a_usage_line(capsys):
    """'9' * 400 overflowed to inf and raised OverflowError in parse_size."""
    with pytest.raises(argparse.ArgumentTypeError, match="at most 40 digits"):
        bench_args.parse_size("9" * 400)
    err = _refused(capsys, ["--max-bytes", "9" * 400])
    assert "argument --max-bytes: must be a size of at most 40 digits (got 400 digits)" in err
    err = _refused(capsys, ["--max-bytes", "9" * 32])
    assert f"argument --max-bytes: must lie in [1, 1G] (got '{'9' * 32}')" in err


def test_a_size_is_read_exactly():
    """Not through a float: 2**53 + 1 bytes is that many, and a fraction of a byte is refused
    however small."""
    assert bench_args.parse_size(str(2**53 + 1)) == 2**53 + 1
    assert bench_args.parse_size("1.5K") == 1536
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of bytes"):
        bench_args.parse_size("4096.0000000000000001")


@pytest.mark.parametrize(
    "text",
    [
        "\u0665\u0660",  # Arabic-Indic 50
        "\u0665\u0660K",
        "\uff14K",  # fullwidth 4
        "\u0664.5K",
        "4\u212a",  # KELVIN SIGN, which a Unicode case-insensitive match reads as k
    ],
)
def test_a_size_takes_ascii_digits_only(text, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a size like 4096"):
        bench_args.parse_size(text)
    err = _refused(capsys, ["--max-bytes", text])
    assert (
        f"argument --max-bytes: must be a size like 4096, 4K, 4KiB, 256M or 1G (got {text!r})"
        in err
    )


def test_the_driver_version_takes_ascii_digits_only(monkeypatch):
    def proc(text):
        monkeypatch.setattr(meta, "open", lambda *a, **k: io.StringIO(text), raising=False)

    def no_smi(*a, **k):
        raise OSError("no nvidia-smi")

    monkeypatch.setattr(meta.subprocess, "run", no_smi)
    proc("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n")
    assert meta.driver_version() == "550.54.15"
    proc("NVRM version: NVIDIA UNIX x86_64 Kernel Module  \u0665\u0665\u0660.54.15  Tue\n")
    assert meta.driver_version() is None
