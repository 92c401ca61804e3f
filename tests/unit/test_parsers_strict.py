"""Numbers read from settings and command lines: ASCII decimal digits only.

``float()`` and ``int()`` also take digit separators (``1_000``), the digits of other scripts
(Arabic-Indic five and zero read as 50) and non-ASCII spaces; a shell script or another tool
that reads the same setting would not, so dcpkit's readers refuse them. Each case below was
taken before (``DCPKIT_TIMEOUT_MS`` in Arabic-Indic digits was a 50 ms deadline).
"""

import argparse

import pytest

from dcpkit import _checks
from dcpkit._checks import decimal_float, decimal_int, default_timeout_ms
from dcpkit._sm_share import mps_thread_percentage
from dcpkit.comm import launcher_world_size
from dcpkit.errors import InvalidArgument

AR_50 = "\u0665\u0660"  # Arabic-Indic digits five and zero
FULLWIDTH_50 = "\uff15\uff10"
DEVANAGARI_2 = "\u0968"
NBSP = "\xa0"
EM_SPACE = "\u2003"

NOT_ASCII_NUMBERS = [
    AR_50,
    FULLWIDTH_50,
    DEVANAGARI_2,
    f"5{AR_50}",
    f"{NBSP}50",
    f"50{EM_SPACE}",
    "1_000",
    "1_0.5",
]


@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS + ["inf", "-inf", "nan", "Infinity", "1e"])
def test_decimal_float_refuses(text):
    with pytest.raises(ValueError):
        decimal_float(text)


@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS + ["1.0", "1e3", "0x10", "", " "])
def test_decimal_int_refuses(text):
    with pytest.raises(ValueError):
        decimal_int(text)


@pytest.mark.parametrize(
    "text, want",
    [("250", 250.0), (" 0.5 ", 0.5), ("1e3", 1000.0), ("-.5", -0.5), ("+2E-3", 0.002), ("7.", 7.0)],
)
def test_decimal_float_reads_decimal_numbers(text, want):
    assert decimal_float(text) == want


@pytest.mark.parametrize("text, want", [("42", 42), (" 7\t", 7), ("-3", -3), ("+8", 8)])
def test_decimal_int_reads_decimal_integers(text, want):
    assert decimal_int(text) == want


@pytest.mark.parametrize("raw", NOT_ASCII_NUMBERS)
def test_timeout_variable_in_other_digits_is_an_error(monkeypatch, raw):
    monkeypatch.setenv(_checks.TIMEOUT_ENV, raw)
    with pytest.raises(InvalidArgument) as e:
        default_timeout_ms("LseReduce")
    assert str(e.value).startswith("LseReduce: DCPKIT_TIMEOUT_MS must be") and repr(raw) in str(
        e.value
    )


def test_timeout_variable_in_ascii_digits_is_read(monkeypatch):
    monkeypatch.setenv(_checks.TIMEOUT_ENV, " 50 ")
    assert default_timeout_ms() == 50.0


def test_command_line_milliseconds_refuse_other_digits():
    from dcpkit.cli import milliseconds

    with pytest.raises(argparse.ArgumentTypeError, match="milliseconds"):
        milliseconds(AR_50)
    assert milliseconds("50") == 50.0


@pytest.mark.parametrize("raw", [AR_50, FULLWIDTH_50, "5_0"])
def test_mps_percentage_in_other_digits_is_not_assumed(raw):
    assert mps_thread_percentage({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": raw}) is None
    assert mps_thread_percentage({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}) == 50.0


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
@pytest.mark.parametrize("raw", [DEVANAGARI_2, FULLWIDTH_50, "1_6", f"{NBSP}4"])
def test_launcher_size_in_other_digits_is_no_launcher(var, raw):
    assert launcher_world_size({var: raw}) is None
    assert launcher_world_size({var: " 4 "}) == (var, 4)
