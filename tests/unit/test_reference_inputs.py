"""What the NumPy references (dcpkit/reference.py) refuse, and the tolerance table.

Every case here was taken before, or refused with a message that named no argument: a
``query_start_loc`` past ``T``, a uint64 value 2**63 shown as a negative number, string and
object arrays in the gather references, a dict where a sequence or an array belongs (its keys
were read as the data, or a bare ``KeyError: 0`` came out), and a float64, integer or fp8
``lse_reduce_tolerance``.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpkit._checks import FLOAT_DTYPE_NAMES
from dcpkit.errors import InvalidArgument, InvalidType
from dcpkit.reference import (
    kv_gather_reference,
    lse_reduce_reference,
    lse_reduce_tolerance,
    make_inputs,
    q_gather_reference,
)

OP = "lse_reduce_reference"
T, H, D = 4, 2, 3


def _lse(W=2):
    return [np.zeros((T, H, D)) for _ in range(W)], [np.zeros((T, H)) for _ in range(W)]


def _refuses(exc, start, **kw):
    outs, lses = kw.pop("outs", None), kw.pop("lses", None)
    o, l = _lse()
    with pytest.raises(exc) as e:
        lse_reduce_reference(o if outs is None else outs, l if lses is None else lses, **kw)
    assert str(e.value).startswith(f"{OP}: {start}"), str(e.value)
    return str(e.value)


# ----------------------------------------------------------------------------- query_start_loc
@pytest.mark.parametrize("qsl", [[0, 2, 5], [0, T + 1], [9], [0, 2**40]])
def test_query_start_loc_past_T_is_refused(qsl):
    msg = _refuses(InvalidArgument, "query_start_loc values must be <= T = 4", query_start_loc=qsl)
    assert f"(got {qsl})" in msg


def test_query_start_loc_up_to_T_is_taken():
    for qsl in ([0, T], [0, 1, 1, T], [T], [0, 2], np.array([0, T], np.uint64), (0, 3)):
        out, lse = lse_reduce_reference(*_lse(), query_start_loc=qsl)
        assert out.shape == (T, H, D)


def test_uint64_values_are_shown_as_they_are():
    big = np.array([0, 2**63], np.uint64)
    msg = _refuses(InvalidArgument, "query_start_loc values must be <=", query_start_loc=big)
    assert str(2**63) in msg and "-9223372036854775808" not in msg, msg
    seq = [np.array([2**63], np.uint64), np.array([1], np.uint64)]
    msg = _refuses(
        InvalidArgument, "seq_lens[0] values must be < 2**63", query_start_loc=[0, 2], seq_lens=seq
    )
    assert str(2**63) in msg and "-9223372036854775808" not in msg, msg


def test_a_long_index_array_is_shown_by_its_ends():
    msg = _refuses(InvalidArgument, "query_start_loc values", query_start_loc=np.arange(40))
    assert "[0, 1, 2, 3, 4, 5, 6, 7, ..., 36, 37, 38, 39] (40 values)" in msg, msg


@pytest.mark.parametrize(
    "qsl, exc, fragment",
    [
        ({"a": 0, "b": 2}, InvalidType, "query_start_loc must be a 1-D integer array [S+1] (got dict)"),
        ({0, 2}, InvalidType, "query_start_loc must be a 1-D integer array [S+1] (got set)"),
        ("02", InvalidType, "query_start_loc must be a 1-D integer array [S+1] (got str)"),
        (b"\x00\x02", InvalidType, "query_start_loc must be a 1-D integer array [S+1] (got bytes)"),
        (np.array(["0", "2"]), InvalidType, "query_start_loc dtype must be an integer dtype (got <U1)"),
        ([0, True], InvalidType, "query_start_loc must be a 1-D integer array [S+1] (got a list"),
        ([[0], [1, 2]], InvalidArgument, "query_start_loc must be a 1-D integer array [S+1] (got list"),
    ],
)  # fmt: skip
def test_query_start_loc_that_is_no_integer_array(qsl, exc, fragment):
    msg = _refuses(exc, "query_start_loc", query_start_loc=qsl)
    assert fragment in msg, msg


# ----------------------------------------------------------------------------- seq_lens
@pytest.mark.parametrize(
    "seq, exc, fragment",
    [
        ({"a": [1], "b": [1]}, InvalidType, "seq_lens must be a sequence of int arrays [S], one per rank (got dict)"),
        ([{"a": 1}, [1]], InvalidType, "seq_lens[0] must be a 1-D integer array [S] (got dict)"),
        ([[1], "1"], InvalidType, "seq_lens[1] must be a 1-D integer array [S] (got str)"),
        ([[1], np.array(["1"])], InvalidType, "seq_lens[1] dtype must be an integer dtype (got <U1)"),
        ([[False], [1]], InvalidType, "seq_lens[0] must be a 1-D integer array [S] (got a list holding bools)"),
    ],
)  # fmt: skip
def test_seq_lens_that_are_no_integer_arrays(seq, exc, fragment):
    msg = _refuses(exc, "seq_lens", query_start_loc=[0, 2], seq_lens=seq)
    assert fragment in msg, msg


# ----------------------------------------------------------------------------- partials
def test_partials_given_as_a_dict_or_set_are_refused():
    o, l = _lse()
    for bad in ({0: o[0], 1: o[1]}, {"rank0": o[0]}):
        _refuses(
            InvalidType,
            "out_partials must be a sequence of arrays, one per rank (got dict)",
            outs=bad,
        )
    _refuses(
        InvalidType,
        "lse_partials must be a sequence of arrays, one per rank (got set)",
        lses={1, 2},
    )
    msg = _refuses(InvalidType, "out_partials[1] must be an array (got dict)", outs=[o[0], {}])
    assert "dict" in msg


def test_complex_partials_are_refused():
    o, l = _lse()
    _refuses(
        InvalidType,
        "out_partials[0] dtype must be a real numeric dtype (got complex128)",
        outs=[x.astype(complex) for x in o],
    )


# ----------------------------------------------------------------------------- gathers
@pytest.mark.parametrize(
    "fn, name, shape", [(q_gather_reference, "qs", (2, 1, 3)), (kv_gather_reference, "kvs", (2, 3))]
)
def test_gather_references_refuse_what_is_no_numeric_array(fn, name, shape):
    op = fn.__name__
    a = np.zeros(shape, np.float32)
    cases = [
        ([np.full(shape, "x"), np.full(shape, "y")], InvalidType, f"{name}[0] dtype must be a numeric dtype (got <U1)"),
        ([np.zeros(shape, object)] * 2, InvalidType, f"{name}[0] dtype must be a numeric dtype (got object)"),
        ([a, np.full(shape, b"x")], InvalidType, f"{name}[1] dtype must be a numeric dtype (got |S1)"),
        ({0: a, 1: a}, InvalidType, f"{name} must be a sequence of arrays, one per rank (got dict)"),
        ({"a"}, InvalidType, f"{name} must be a sequence of arrays, one per rank (got set)"),
        (["abc", "def"], InvalidType, f"{name}[0] must be an array (got str)"),
        ([a, None], InvalidType, f"{name}[1] must be an array (got NoneType)"),
        ([a, {"x": 1}], InvalidType, f"{name}[1] must be an array (got dict)"),
    ]  # fmt: skip
    for arg, exc, fragment in cases:
        with pytest.raises(exc) as e:
            fn(arg)
        assert str(e.value).startswith(f"{op}: {fragment}"), str(e.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "uint64", "bool", "complex64"])
def test_gather_references_move_every_numeric_dtype(dtype):
    ins = [make_inputs(r, 2, 5, op="kv_gather", tokens=3, row_dim=4, dtype=dtype) for r in range(2)]
    got = kv_gather_reference([i["kv"] for i in ins])
    assert got.dtype == ins[0]["kv"].dtype and got.shape == (6, 4)
    assert got.tobytes() == ins[0]["kv"].tobytes() + ins[1]["kv"].tobytes()


# ----------------------------------------------------------------------------- tolerance
def test_every_output_dtype_of_the_ops_has_a_tolerance():
    want = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5}
    assert set(FLOAT_DTYPE_NAMES) == set(want)
    for name in FLOAT_DTYPE_NAMES:
        assert lse_reduce_tolerance(name) == want[name]


def test_float64_tolerance_is_tight():
    """A float64 computation in another order (ranks reversed) stays within it; the float32
    rounding of the same result does not (the 2e-2 it had let every float32 result pass)."""
    tol = lse_reduce_tolerance("float64")
    assert tol == lse_reduce_tolerance(np.float64) <= 1e-12
    W = 4
    ins = [
        make_inputs(s, W, 7, op="lse_reduce", tokens=9, num_heads=8, head_dim=16, dtype="float32")
        for s in range(W)
    ]
    outs = [i["out_partial"].astype(np.float64) for i in ins]
    lses = [i["lse_partial"].astype(np.float64) for i in ins]
    out, _ = lse_reduce_reference(outs, lses)
    out_rev, _ = lse_reduce_reference(outs[::-1], lses[::-1])
    assert np.abs(out_rev - out).max() <= tol
    assert np.abs(out.astype(np.float32).astype(np.float64) - out).max() > tol


@pytest.mark.parametrize(
    "dtype, shown",
    [
        ("int8", "int8"),
        ("int32", "int32"),
        (np.uint16, "uint16"),
        ("bool", "bool"),
        ("fp8", "float8_e4m3fn"),
        ("e5m2", "float8_e5m2"),
        ("complex64", "complex64"),
        ("U4", "<U4"),
        (np.longdouble, np.dtype(np.longdouble).name),
    ],
)
def test_tolerance_refuses_dtypes_no_lse_reduce_output_has(dtype, shown):
    with pytest.raises(InvalidType) as e:
        lse_reduce_tolerance(dtype)
    assert str(e.value) == (
        "lse_reduce_tolerance: dtype must be one of [bfloat16, float16, float32, float64] "
        f"(got {shown})"
    )


def test_tolerance_names_itself_for_an_unknown_dtype():
    with pytest.raises(InvalidType, match=r"^lse_reduce_tolerance: dtype must be a NumPy dtype"):
        lse_reduce_tolerance("nope")
