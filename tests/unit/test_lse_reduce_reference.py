"""The lse_reduce math on the CPU: the float64 reference, every edge case of the merge, and a
float32 model of the kernel's arithmetic checked against the reference with the tolerance the
GPU tests use.

The model follows kernels/lse_reduce.cu step by step (lse scaled in fp32, NaN / +inf -> -inf,
the sender's row mask, max, exp, fp32 weights, zero-weight sources skipped, fp32 accumulation,
one rounding), so a tolerance that is too tight, or a masking rule that differs from the
reference, shows up here before any GPU run.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dcpkit.errors import InvalidArgument, InvalidType
from dcpkit.reference import (
    _valid_rows,
    kv_gather_reference,
    lse_reduce_reference,
    lse_reduce_tolerance,
    make_inputs,
    q_gather_reference,
    resolve_dtype,
)

BF16 = resolve_dtype("bfloat16")
NINF = -np.inf


def ref(outs, lses, **kw):
    return lse_reduce_reference([np.asarray(o) for o in outs], [np.asarray(x) for x in lses], **kw)


# ----------------------------------------------------------------------------- the kernel model
def kernel_row_masked(t, seq_lens, qsl):
    """The sender's mask rule of kernels/lse_reduce.cu (row_masked), written the same way."""
    if qsl is None:
        return False
    S = len(qsl) - 1
    if t >= qsl[S]:
        return True
    if seq_lens is None:
        return False
    lo, hi = 0, S  # first index in [0, S] with qsl[index] > t
    while lo < hi:
        mid = (lo + hi) >> 1
        if qsl[mid] > t:
            hi = mid
        else:
            lo = mid + 1
    return lo > 0 and seq_lens[lo - 1] == 0


def kernel_model(outs, lses, *, out_dtype, lse_base=math.e, seq_lens=None, qsl=None):
    """fp32 model of one lse_reduce call: returns (out in out_dtype, merged lse float32)."""
    W = len(outs)
    T, H, D = outs[0].shape
    scale = np.float32(1.0 if lse_base == math.e else math.log(2.0))
    l = np.stack([np.asarray(x).astype(np.float32) * scale for x in lses])  # [W, T, H]
    l[~(l < np.float32(np.inf))] = NINF  # NaN, +inf
    for s in range(W):
        for t in range(T):
            if kernel_row_masked(t, None if seq_lens is None else seq_lens[s], qsl):
                l[s, t, :] = NINF
    m = l.max(axis=0)
    empty = m == NINF
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(l - np.where(empty, np.float32(0), m)[None]).astype(np.float32)
    p[:, empty] = 0
    total = p.sum(axis=0, dtype=np.float32)
    w = np.divide(p, total[None], out=np.zeros_like(p), where=~empty[None])
    acc = np.zeros((T, H, D), dtype=np.float32)
    with np.errstate(invalid="ignore"):
        for s in range(W):
            x = np.asarray(outs[s]).astype(np.float32)
            acc = np.where((w[s] > 0)[..., None], acc + w[s][..., None] * x, acc)  # skip w == 0
    with np.errstate(divide="ignore"):
        lse = np.where(empty, np.float32(NINF), m + np.log(np.where(empty, 1, total)))
    return acc.astype(out_dtype), lse.astype(np.float32)


# ----------------------------------------------------------------------------- edge cases
def test_worked_value_ln2_ln8_outputs_0_and_10_give_8():
    outs = [np.zeros((1, 1, 4)), np.full((1, 1, 4), 10.0)]
    lses = [np.array([[math.log(2)]]), np.array([[math.log(8)]])]
    out, lse = ref(outs, lses)
    np.testing.assert_allclose(out, 8.0, rtol=0, atol=1e-12)  # (2*0 + 8*10) / 10
    np.testing.assert_allclose(lse, math.log(10), rtol=0, atol=1e-12)
    kout, klse = kernel_model(outs, lses, out_dtype=np.float32)
    np.testing.assert_allclose(kout, 8.0, rtol=2e-7)
    np.testing.assert_allclose(klse, math.log(10), rtol=2e-7)


def test_all_sources_empty_gives_exact_zero_and_minus_inf_without_nan():
    outs = [np.full((2, 3, 4), np.nan) for _ in range(3)]
    lses = [np.full((2, 3), NINF), np.full((2, 3), np.nan), np.full((2, 3), np.inf)]
    out, lse = ref(outs, lses)
    assert not np.isnan(out).any() and (out == 0).all()
    assert np.isneginf(lse).all()
    kout, klse = kernel_model(outs, lses, out_dtype=np.float16)
    assert not np.isnan(kout.astype(np.float32)).any() and (kout == 0).all()
    assert np.isneginf(klse).all()


def test_one_empty_source_with_nan_payload_is_never_read():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 8))
    outs = [np.full((3, 2, 8), np.nan), x]
    lses = [np.full((3, 2), NINF), np.full((3, 2), 2.5)]
    out, lse = ref(outs, lses)
    np.testing.assert_array_equal(out, x)  # weight exactly 1, NaN never touched
    np.testing.assert_array_equal(lse, 2.5)
    kout, _ = kernel_model(outs, lses, out_dtype=np.float32)
    np.testing.assert_array_equal(kout, x.astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_plus_inf_lse_count_as_empty(bad):
    x = np.full((1, 1, 4), 3.0)
    outs = [np.full((1, 1, 4), 1e6), x]  # the invalid source's payload is finite junk
    lses = [np.array([[bad]]), np.array([[0.5]])]
    out, lse = ref(outs, lses)
    np.testing.assert_array_equal(out, 3.0)
    np.testing.assert_array_equal(lse, 0.5)
    kout, klse = kernel_model(outs, lses, out_dtype=np.float32)
    np.testing.assert_array_equal(kout, 3.0)
    np.testing.assert_array_equal(klse, np.float32(0.5))


def test_one_source_dominating():
    a, b = np.full((1, 1, 4), -7.0), np.full((1, 1, 4), 5.0)
    out, lse = ref([a, b], [np.array([[0.0]]), np.array([[200.0]])])
    np.testing.assert_allclose(out, 5.0, rtol=0, atol=1e-80)  # weight of a: exp(-200)
    np.testing.assert_allclose(lse, 200.0, rtol=0, atol=1e-12)
    # In fp32 exp(-200) underflows to 0: the kernel never reads a at all.
    kout, klse = kernel_model(
        [np.full((1, 1, 4), np.nan), b],
        [np.array([[0.0]]), np.array([[200.0]])],
        out_dtype=np.float32,
    )
    np.testing.assert_array_equal(kout, 5.0)
    np.testing.assert_array_equal(klse, np.float32(200.0))


def test_equal_lse_averages():
    outs = [np.full((1, 1, 2), float(v)) for v in (1, 2, 3, 6)]
    out, lse = ref(outs, [np.array([[1.0]])] * 4)
    np.testing.assert_allclose(out, 3.0, atol=1e-12)
    np.testing.assert_allclose(lse, 1.0 + math.log(4), atol=1e-12)


def test_base2_input_equals_base_e_input():
    rng = np.random.default_rng(7)
    outs = [rng.standard_normal((5, 4, 8)) for _ in range(3)]
    lse_e = [rng.normal(3.0, 2.0, (5, 4)) for _ in range(3)]
    lse_e[1][2, 1] = NINF
    lse_2 = [x / math.log(2) for x in lse_e]
    out_e, m_e = ref(outs, lse_e)
    out_2, m_2 = ref(outs, lse_2, lse_base=2)
    np.testing.assert_allclose(out_2, out_e, rtol=0, atol=1e-12)
    np.testing.assert_allclose(m_2, m_e, rtol=0, atol=1e-12)  # merged lse is natural log
    k_e = kernel_model(outs, lse_e, out_dtype=np.float32)
    k_2 = kernel_model(outs, lse_2, out_dtype=np.float32, lse_base=2)
    np.testing.assert_allclose(k_2[0], k_e[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(k_2[1], k_e[1], rtol=0, atol=1e-5)


def test_masks_empty_requests_and_padding():
    T, H, D = 6, 2, 4
    outs = [np.full((T, H, D), 1.0), np.full((T, H, D), 2.0)]
    lses = [np.zeros((T, H)), np.zeros((T, H))]
    qsl = np.array([0, 2, 5], dtype=np.int32)  # requests [0, 2), [2, 5); row 5: padding
    seq_lens = [np.array([0, 10], np.int32), np.array([4, 4], np.int32)]  # rank 0 empty on req 0
    out, lse = ref(outs, lses, seq_lens=seq_lens, query_start_loc=qsl)
    np.testing.assert_allclose(out[0:2], 2.0)  # only rank 1 holds request 0
    np.testing.assert_allclose(out[2:5], 1.5)  # both ranks, equal lse
    np.testing.assert_array_equal(out[5], 0.0)  # padding: empty everywhere
    assert np.isneginf(lse[5]).all()
    np.testing.assert_allclose(lse[0:2], 0.0)
    np.testing.assert_allclose(lse[2:5], math.log(2))
    # query_start_loc alone: padding only
    out_q, lse_q = ref(outs, lses, query_start_loc=qsl)
    np.testing.assert_allclose(out_q[0:5], 1.5)
    np.testing.assert_array_equal(out_q[5], 0.0)
    kout, klse = kernel_model(outs, lses, out_dtype=np.float32, seq_lens=seq_lens, qsl=qsl)
    np.testing.assert_allclose(kout, out, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(klse), np.isneginf(lse))


def test_kernel_mask_rule_equals_the_reference_rule():
    rng = np.random.default_rng(3)
    for _ in range(300):
        T = int(rng.integers(1, 12))
        S = int(rng.integers(0, 6))
        cuts = np.sort(rng.integers(0, T + 3, size=S + 1))  # duplicates, past-T ends
        cuts[0] = int(rng.integers(0, 2))  # rows before qsl[0] sometimes
        qsl = np.maximum.accumulate(cuts).astype(np.int32)
        sl = rng.integers(0, 3, size=S).astype(np.int32)  # zeros often
        for seq in (sl, None):
            want = ~_valid_rows(T, seq, qsl)
            got = np.array([kernel_row_masked(t, seq, qsl) for t in range(T)])
            assert (got == want).all(), (T, qsl.tolist(), None if seq is None else seq.tolist())


def test_reference_argument_errors():
    o, l = np.zeros((1, 1, 1)), np.zeros((1, 1))
    with pytest.raises(InvalidArgument, match="one lse_partial per rank"):
        lse_reduce_reference([o, o], [l])
    with pytest.raises(InvalidArgument, match="seq_lens needs query_start_loc"):
        lse_reduce_reference([o], [l], seq_lens=[np.zeros(1, np.int32)])


# ----------------------------------------------------------------------------- tolerance
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("lse_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lse_base,num_requests", [(math.e, 0), (2.0, 3)])
def test_kernel_arithmetic_is_within_the_gpu_test_tolerance(
    dtype, lse_dtype, lse_base, num_requests
):
    W, T, H, D = 4, 9, 8, 64
    ins = [
        make_inputs(
            s,
            W,
            1234,
            op="lse_reduce",
            tokens=T,
            num_heads=H,
            head_dim=D,
            dtype=dtype,
            lse_dtype=lse_dtype,
            lse_base=lse_base,
            num_requests=num_requests,
        )
        for s in range(W)
    ]
    outs = [i["out_partial"] for i in ins]
    lses = [i["lse_partial"] for i in ins]
    seq = None if num_requests == 0 else [i["seq_lens"] for i in ins]
    qsl = ins[0]["query_start_loc"]
    r_out, r_lse = lse_reduce_reference(
        outs, lses, lse_base=lse_base, seq_lens=seq, query_start_loc=qsl
    )
    k_out, k_lse = kernel_model(
        outs, lses, out_dtype=resolve_dtype(dtype), lse_base=lse_base, seq_lens=seq, qsl=qsl
    )
    got = k_out.astype(np.float64)
    tol = lse_reduce_tolerance(dtype)
    err = np.abs(got - r_out)
    assert not np.isnan(got).any()
    assert err.max() <= tol, f"max error {err.max()} > {tol}"
    assert np.array_equal(np.isneginf(k_lse), np.isneginf(r_lse))
    fin = np.isfinite(r_lse)
    assert np.abs(k_lse[fin] - r_lse[fin]).max() <= 1e-4


# ----------------------------------------------------------------------------- make_inputs
def test_make_inputs_is_reproducible_and_shares_query_start_loc():
    g = dict(op="lse_reduce", tokens=11, num_heads=8, head_dim=16, dtype="bfloat16", num_requests=4)
    a0, b0 = make_inputs(0, 2, 99, **g), make_inputs(0, 2, 99, **g)
    a1 = make_inputs(1, 2, 99, **g)
    for k in ("out_partial", "lse_partial", "seq_lens", "query_start_loc"):
        np.testing.assert_array_equal(
            a0[k].view(np.uint8) if a0[k].dtype == BF16 else a0[k],
            b0[k].view(np.uint8) if b0[k].dtype == BF16 else b0[k],
        )
    np.testing.assert_array_equal(a0["query_start_loc"], a1["query_start_loc"])
    assert a0["out_partial"].shape == (11, 8, 16) and a0["out_partial"].dtype == BF16
    assert a0["lse_partial"].shape == (11, 8) and a0["lse_partial"].dtype == np.float32
    assert a0["seq_lens"].dtype == np.int32 and a0["seq_lens"].shape == (4,)
    q = a0["query_start_loc"]
    assert q.dtype == np.int32 and q.shape == (5,) and q[0] == 0 and (np.diff(q) >= 0).all()
    assert q[-1] <= 11
    other = make_inputs(0, 2, 100, **g)["lse_partial"]
    assert not np.array_equal(other, a0["lse_partial"])


# ----------------------------------------------------------------------------- resolve_dtype
# NumPy's one-character codes are case-sensitive: lowercasing them changed their meaning
# ('B' uint8 -> int8, 'F' complex64 -> float32, ...). Only the aliases are case-insensitive.
@pytest.mark.parametrize(
    "code,expected",
    [
        ("b", np.int8),
        ("B", np.uint8),
        ("h", np.int16),
        ("H", np.uint16),
        ("i", np.int32),
        ("I", np.uint32),
        ("l", np.int64),
        ("L", np.uint64),
        ("q", np.int64),
        ("Q", np.uint64),
        ("e", np.float16),
        ("f", np.float32),
        ("d", np.float64),
        ("F", np.complex64),
        ("D", np.complex128),
        ("?", np.bool_),
        ("U4", np.dtype("<U4")),
        ("S4", np.dtype("S4")),
        ("u4", np.uint32),
        ("i2", np.int16),
        (">i2", np.dtype(">i2")),
        ("f8", np.float64),
        ("c8", np.complex64),
        ("int8", np.int8),
        ("uint8", np.uint8),
    ],
)
def test_resolve_dtype_keeps_numpy_codes(code, expected):
    assert resolve_dtype(code) == np.dtype(expected), code


@pytest.mark.parametrize(
    "name,expected",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("bfloat16", "bfloat16"),
        ("BFloat16", "bfloat16"),
        ("fp16", "float16"),
        ("half", "float16"),
        ("Half", "float16"),
        ("fp32", "float32"),
        ("FP32", "float32"),
        ("float", "float32"),
        ("Float32", "float32"),
        ("fp8", "float8_e4m3fn"),
        ("e4m3", "float8_e4m3fn"),
        ("E4M3", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e5m2"),
        ("FLOAT8_E5M2", "float8_e5m2"),
    ],
)
def test_resolve_dtype_aliases_are_case_insensitive(name, expected):
    import ml_dtypes

    want = np.dtype(getattr(ml_dtypes, expected, None) or expected)
    assert resolve_dtype(name) == want, name


def test_resolve_dtype_passes_dtypes_and_types_through():
    assert resolve_dtype(np.float16) == np.float16
    assert resolve_dtype(np.dtype(np.uint8)) == np.uint8
    assert resolve_dtype(BF16) is BF16 or resolve_dtype(BF16) == BF16


@pytest.mark.parametrize("bad", [None, "nope", "float8_nope", "", object()])
def test_resolve_dtype_rejects_unknown(bad):
    with pytest.raises(InvalidType, match=r"resolve_dtype: dtype must be a .*dtype"):
        resolve_dtype(bad)
    with pytest.raises(InvalidType, match=r"^make_inputs: lse_dtype must be"):
        resolve_dtype(bad, op="make_inputs", name="lse_dtype")


# ----------------------------------------------------------------------------- reference input checks
def _lse_args(W=2, T=3, H=2, D=4):
    return ([np.zeros((T, H, D)) for _ in range(W)], [np.zeros((T, H)) for _ in range(W)])


@pytest.mark.parametrize(
    "change,exc,fragment",
    [
        (
            lambda o, l, kw: ([], [], kw),
            InvalidArgument,
            "out_partials must hold one array per rank (got an empty sequence)",
        ),
        (
            lambda o, l, kw: (o, [], kw),
            InvalidArgument,
            "lse_partials must hold one array per rank (got an empty sequence)",
        ),
        (lambda o, l, kw: (None, l, kw), InvalidType, "out_partials must be a sequence of arrays"),
        (lambda o, l, kw: (o, l[:1], kw), InvalidArgument, "one lse_partial per rank is needed"),
        (
            lambda o, l, kw: ([x[0] for x in o], l, kw),
            InvalidArgument,
            "out_partials[0] must have 3 dimensions [T, H, D_v] (got shape (2, 4))",
        ),
        (
            lambda o, l, kw: ([o[0], o[1][:, :1]], l, kw),
            InvalidArgument,
            "out_partials[1] shape must be (3, 2, 4) [T, H, D_v] (got (3, 1, 4))",
        ),
        (
            lambda o, l, kw: (o, [l[0], l[1][:2]], kw),
            InvalidArgument,
            "lse_partials[1] shape must be (3, 2) [T, H] (got (2, 2))",
        ),
        (
            lambda o, l, kw: (o, [l[0], np.zeros((3, 2, 1))], kw),
            InvalidArgument,
            "lse_partials[1] shape must be (3, 2)",
        ),
        (
            lambda o, l, kw: (o, [l[0], np.full((3, 2), "x")], kw),
            InvalidType,
            "lse_partials[1] dtype must be a real numeric dtype (got <U1)",
        ),
        (
            lambda o, l, kw: (o, l, {"lse_base": 10}),
            InvalidArgument,
            "lse_base must be math.e or 2 (got 10)",
        ),
        (lambda o, l, kw: (o, l, {"lse_base": 1}), InvalidArgument, "lse_base must be math.e or 2"),
        (lambda o, l, kw: (o, l, {"lse_base": 0}), InvalidArgument, "lse_base must be math.e or 2"),
        (lambda o, l, kw: (o, l, {"lse_base": -2.0}), InvalidArgument, "lse_base must be math.e"),
        (lambda o, l, kw: (o, l, {"lse_base": "2"}), InvalidType, "lse_base must be a real number"),
        (
            lambda o, l, kw: (o, l, {"lse_base": True}),
            InvalidType,
            "lse_base must be a real number",
        ),
        (
            lambda o, l, kw: (o, l, {"query_start_loc": np.zeros(0, np.int32)}),
            InvalidArgument,
            "query_start_loc length must be >= 1 for [S+1] (got 0)",
        ),
        (  # an empty list has no dtype of its own: the length, not a float64 dtype, is wrong
            lambda o, l, kw: (o, l, {"query_start_loc": []}),
            InvalidArgument,
            "query_start_loc length must be >= 1 for [S+1] (got 0)",
        ),
        (
            lambda o, l, kw: (o, l, {"query_start_loc": [0, 1], "seq_lens": []}),
            InvalidArgument,
            "seq_lens",
        ),
        (
            lambda o, l, kw: (o, l, {"query_start_loc": np.array([0, 3, 1], np.int32)}),
            InvalidArgument,
            "query_start_loc values must be non-decreasing (got [0, 3, 1])",
        ),
        (
            lambda o, l, kw: (o, l, {"query_start_loc": np.array([-1, 3], np.int32)}),
            InvalidArgument,
            "query_start_loc values must be >= 0 (got [-1, 3])",
        ),
        (
            lambda o, l, kw: (o, l, {"query_start_loc": np.array([0.0, 3.0])}),
            InvalidType,
            "query_start_loc dtype must be an integer dtype (got float64)",
        ),
        (
            lambda o, l, kw: (o, l, {"query_start_loc": np.array([[0, 3]], np.int32)}),
            InvalidArgument,
            "query_start_loc must have 1 dimension [S+1] (got shape (1, 2))",
        ),
        (
            lambda o, l, kw: (
                o,
                l,
                {
                    "query_start_loc": np.array([0, 3], np.int32),
                    "seq_lens": [np.array([1], np.int32)],
                },
            ),
            InvalidArgument,
            "seq_lens length must be world_size = 2, one array per rank (got 1)",
        ),
        (
            lambda o, l, kw: (
                o,
                l,
                {
                    "query_start_loc": np.array([0, 3], np.int32),
                    "seq_lens": [np.array([1], np.int32), np.array([1, 2], np.int32)],
                },
            ),
            InvalidArgument,
            "seq_lens[1] length must be len(query_start_loc) - 1 = 1 (got 2)",
        ),
        (
            lambda o, l, kw: (
                o,
                l,
                {
                    "query_start_loc": np.array([0, 3], np.int32),
                    "seq_lens": [np.array([1], np.int32), np.array([-1], np.int32)],
                },
            ),
            InvalidArgument,
            "seq_lens[1] values must be >= 0 (got [-1])",
        ),
    ],
)
def test_lse_reduce_reference_input_checks(change, exc, fragment):
    o, l = _lse_args()
    outs, lses, kw = change(o, l, {})
    with pytest.raises(exc) as ei:
        lse_reduce_reference(outs, lses, **kw)
    assert str(ei.value).startswith("lse_reduce_reference: "), str(ei.value)
    assert fragment in str(ei.value), str(ei.value)


def test_lse_reduce_reference_accepts_both_bases_and_a_one_row_qsl():
    o, l = _lse_args()
    for base in (math.e, 2, 2.0):
        out, lse = lse_reduce_reference(o, l, lse_base=base)
        assert out.shape == (3, 2, 4) and lse.shape == (3, 2)
    out, lse = lse_reduce_reference(o, l, query_start_loc=np.array([2], np.int32))  # S = 0
    assert np.isneginf(lse[2]).all() and np.isfinite(lse[:2]).all()


@pytest.mark.parametrize(
    "fn,name,ndim", [(q_gather_reference, "qs", 3), (kv_gather_reference, "kvs", 2)]
)
def test_gather_references_reject_mixed_inputs(fn, name, ndim):
    op = fn.__name__
    shape = (3, 2, 4)[:ndim]
    a = np.zeros(shape, np.float32)
    with pytest.raises(InvalidArgument, match=rf"^{op}: {name} must hold one array per rank"):
        fn([])
    with pytest.raises(InvalidType, match=rf"^{op}: {name} must be a sequence of arrays"):
        fn(None)
    with pytest.raises(
        InvalidType,
        match=rf"^{op}: {name}\[1\] dtype must equal {name}\[0\]'s "
        rf"float32 \(got float16\)",
    ):
        fn([a, a.astype(np.float16)])
    other = np.zeros((3, 5, 4)[:ndim], np.float32)
    with pytest.raises(InvalidArgument, match=rf"^{op}: {name}\[1\] shape must equal "):
        fn([a, other])
    with pytest.raises(InvalidArgument, match=rf"^{op}: {name}\[0\] must have {ndim} dimensions"):
        fn([np.zeros((2,) * (ndim + 1)), np.zeros((2,) * (ndim + 1))])
    got = fn([a, a + 1])
    assert got.shape == ((3, 4, 4) if ndim == 3 else (6, 2))


# ----------------------------------------------------------------------------- make_inputs checks
_GEOM = {
    "q_gather": dict(tokens=4, num_heads=4, head_dim=8),
    "kv_gather": dict(tokens=4, row_dim=8),
    "lse_reduce": dict(tokens=4, num_heads=4, head_dim=8),
}


@pytest.mark.parametrize("op", sorted(_GEOM))
def test_make_inputs_names_a_missing_keyword(op):
    for key in _GEOM[op]:
        g = {k: v for k, v in _GEOM[op].items() if k != key}
        with pytest.raises(
            InvalidArgument,
            match=rf"make_inputs: op='{op}' needs the keyword "
            rf"arguments .* \(missing \['{key}'\]\)",
        ):
            make_inputs(0, 2, 1, op=op, **g)


@pytest.mark.parametrize(
    "op,typo",
    [
        ("lse_reduce", "num_request"),
        ("q_gather", "row_dim"),
        ("kv_gather", "num_heads"),
        ("lse_reduce", "lse_bse"),
        ("q_gather", "world"),
    ],
)
def test_make_inputs_rejects_unknown_keywords(op, typo):
    with pytest.raises(
        InvalidArgument,
        match=rf"make_inputs: keyword arguments for op='{op}' "
        rf"must be among \[.*\] \(got unknown \['{typo}'\]\)",
    ):
        make_inputs(0, 2, 1, op=op, **_GEOM[op], **{typo: 3})


@pytest.mark.parametrize(
    "args,kw,exc,fragment",
    [
        ((0, 0, 1), {}, InvalidArgument, "world_size must be >= 1 (got 0)"),
        ((0, -2, 1), {}, InvalidArgument, "world_size must be >= 1 (got -2)"),
        ((2, 2, 1), {}, InvalidArgument, "rank must lie in [0, 2) (got 2)"),
        ((-1, 2, 1), {}, InvalidArgument, "rank must be >= 0 (got -1)"),
        ((0, 2, -5), {}, InvalidArgument, "seed must be >= 0 (got -5)"),
        ((0, 2, 1.5), {}, InvalidType, "seed must be an int (got float 1.5)"),
        ((True, 2, 1), {}, InvalidType, "rank must be an int (got bool True)"),
        ((0, 2.0, 1), {}, InvalidType, "world_size must be an int (got float 2.0)"),
        ((0, 2, 1), {"tokens": 4.0}, InvalidType, "tokens must be an int (got float 4.0)"),
        ((0, 2, 1), {"tokens": True}, InvalidType, "tokens must be an int (got bool True)"),
        ((0, 2, 1), {"tokens": "4"}, InvalidType, "tokens must be an int (got str '4')"),
        ((0, 2, 1), {"tokens": -1}, InvalidArgument, "tokens must be >= 0 (got -1)"),
        ((0, 2, 1), {"num_heads": 0}, InvalidArgument, "num_heads must be >= 1 (got 0)"),
        ((0, 2, 1), {"head_dim": 2.5}, InvalidType, "head_dim must be an int"),
        ((0, 2, 1), {"num_requests": -1}, InvalidArgument, "num_requests must be >= 0 (got -1)"),
        (
            (0, 2, 1),
            {"empty_fraction": 1.5},
            InvalidArgument,
            "empty_fraction must lie in [0, 1] (got 1.5)",
        ),
        (
            (0, 2, 1),
            {"nonfinite_fraction": -0.1},
            InvalidArgument,
            "nonfinite_fraction must lie in [0, 1] (got -0.1)",
        ),
        (
            (0, 2, 1),
            {"empty_fraction": float("nan")},
            InvalidArgument,
            "empty_fraction must lie in [0, 1] (got nan)",
        ),
        ((0, 2, 1), {"empty_fraction": "0.1"}, InvalidType, "empty_fraction must be a real number"),
        ((0, 2, 1), {"lse_base": 10.0}, InvalidArgument, "lse_base must be math.e or 2 (got 10.0)"),
        ((0, 2, 1), {"dtype": None}, InvalidType, "dtype must be a NumPy dtype"),
        (
            (0, 2, 1),
            {"dtype": "int8"},
            InvalidType,
            "dtype must be a floating dtype for op='lse_reduce' (got int8)",
        ),
        (
            (0, 2, 1),
            {"lse_dtype": "B"},
            InvalidType,
            "lse_dtype must be a floating dtype for op='lse_reduce' (got uint8)",
        ),
    ],
)
def test_make_inputs_argument_checks(args, kw, exc, fragment):
    with pytest.raises(exc) as ei:
        make_inputs(*args, op="lse_reduce", **{**_GEOM["lse_reduce"], **kw})
    assert str(ei.value).startswith("make_inputs: "), str(ei.value)
    assert fragment in str(ei.value), str(ei.value)


def test_make_inputs_gather_checks():
    with pytest.raises(InvalidArgument, match=r"make_inputs: op must be one of"):
        make_inputs(0, 2, 1, op="all_reduce", tokens=1)
    with pytest.raises(InvalidArgument, match=r"make_inputs: op must be one of"):
        make_inputs(0, 2, 1, op=["q_gather"], tokens=1)
    with pytest.raises(
        InvalidArgument,
        match=r"num_heads must be a multiple of world_size 3 "
        r"\(got 4\)",
    ):
        make_inputs(0, 3, 1, op="q_gather", **_GEOM["q_gather"])
    with pytest.raises(
        InvalidType,
        match=r"make_inputs: dtype must be a numeric dtype "
        r"\(got <U4\)",
    ):
        make_inputs(0, 2, 1, op="kv_gather", **_GEOM["kv_gather"], dtype="U4")
    # NumPy codes keep their meaning here too ('B' is uint8, not int8)
    kv = make_inputs(0, 2, 1, op="kv_gather", **_GEOM["kv_gather"], dtype="B")["kv"]
    assert kv.dtype == np.uint8 and kv.shape == (4, 8)
    q = make_inputs(1, 2, 1, op="q_gather", **_GEOM["q_gather"], dtype=np.int64(0).dtype)["q"]
    assert q.shape == (4, 2, 8) and q.dtype == np.int64
    assert make_inputs(0, 1, 0, op="kv_gather", tokens=0, row_dim=3)["kv"].shape == (0, 3)


def test_merged_lse_matches_reads_empty_rows_exactly_and_the_rest_within_the_tolerance():
    from dcpkit.reference import MERGED_LSE_TOL, merged_lse_matches

    ref = np.array([-np.inf, 0.5, 1e4, -2.0, -np.inf, 3.0])
    tol = MERGED_LSE_TOL
    got = np.array([-np.inf, 0.5 + 0.5 * tol, 1e4 * (1 + 0.5 * tol), -2.0 - 3 * tol, 0.0, np.nan])
    assert merged_lse_matches(got.astype(np.float32), ref).tolist() == [
        True,  # empty where the reference is empty
        True,  # absolute below 1
        True,  # relative above 1
        False,  # off by more than the tolerance
        False,  # a value where every source was empty
        False,  # NaN never matches
    ]
    assert not merged_lse_matches(np.array([-np.inf]), np.array([0.0])).any()


@pytest.mark.parametrize(
    "got, ref",
    [
        ([1.0], [1.0, 1.0, 1.0]),  # one value against a row: broadcast, it "matched" everywhere
        ([[1.0]], [1.0, 2.0, 3.0]),
        ([1.0, 2.0], [[1.0, 2.0], [1.0, 2.0]]),
        (1.0, [1.0]),
    ],
)
def test_merged_lse_matches_refuses_another_shape(got, ref):
    from dcpkit.errors import InvalidArgument
    from dcpkit.reference import merged_lse_matches

    with pytest.raises(InvalidArgument, match="must have the same shape"):
        merged_lse_matches(np.array(got), np.array(ref))
