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

from dcpkit.errors import InvalidArgument
from dcpkit.reference import (_valid_rows, lse_reduce_reference, lse_reduce_tolerance,
                              make_inputs, resolve_dtype)

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
    l = np.stack([np.asarray(x).astype(np.float32) * scale for x in lses])   # [W, T, H]
    l[~(l < np.float32(np.inf))] = NINF                                      # NaN, +inf
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
    np.testing.assert_allclose(out, 8.0, rtol=0, atol=1e-12)   # (2*0 + 8*10) / 10
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
    np.testing.assert_array_equal(out, x)          # weight exactly 1, NaN never touched
    np.testing.assert_array_equal(lse, 2.5)
    kout, _ = kernel_model(outs, lses, out_dtype=np.float32)
    np.testing.assert_array_equal(kout, x.astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_plus_inf_lse_count_as_empty(bad):
    x = np.full((1, 1, 4), 3.0)
    outs = [np.full((1, 1, 4), 1e6), x]            # the invalid source's payload is finite junk
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
    np.testing.assert_allclose(out, 5.0, rtol=0, atol=1e-80)   # weight of a: exp(-200)
    np.testing.assert_allclose(lse, 200.0, rtol=0, atol=1e-12)
    # In fp32 exp(-200) underflows to 0: the kernel never reads a at all.
    kout, klse = kernel_model([np.full((1, 1, 4), np.nan), b],
                              [np.array([[0.0]]), np.array([[200.0]])], out_dtype=np.float32)
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
    np.testing.assert_allclose(m_2, m_e, rtol=0, atol=1e-12)   # merged lse is natural log
    k_e = kernel_model(outs, lse_e, out_dtype=np.float32)
    k_2 = kernel_model(outs, lse_2, out_dtype=np.float32, lse_base=2)
    np.testing.assert_allclose(k_2[0], k_e[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(k_2[1], k_e[1], rtol=0, atol=1e-5)


def test_masks_empty_requests_and_padding():
    T, H, D = 6, 2, 4
    outs = [np.full((T, H, D), 1.0), np.full((T, H, D), 2.0)]
    lses = [np.zeros((T, H)), np.zeros((T, H))]
    qsl = np.array([0, 2, 5], dtype=np.int32)          # requests [0, 2), [2, 5); row 5: padding
    seq_lens = [np.array([0, 10], np.int32), np.array([4, 4], np.int32)]  # rank 0 empty on req 0
    out, lse = ref(outs, lses, seq_lens=seq_lens, query_start_loc=qsl)
    np.testing.assert_allclose(out[0:2], 2.0)           # only rank 1 holds request 0
    np.testing.assert_allclose(out[2:5], 1.5)           # both ranks, equal lse
    np.testing.assert_array_equal(out[5], 0.0)          # padding: empty everywhere
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
        cuts = np.sort(rng.integers(0, T + 3, size=S + 1))     # duplicates, past-T ends
        cuts[0] = int(rng.integers(0, 2))                       # rows before qsl[0] sometimes
        qsl = np.maximum.accumulate(cuts).astype(np.int32)
        sl = rng.integers(0, 3, size=S).astype(np.int32)        # zeros often
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
def test_kernel_arithmetic_is_within_the_gpu_test_tolerance(dtype, lse_dtype, lse_base,
                                                            num_requests):
    W, T, H, D = 4, 9, 8, 64
    ins = [make_inputs(s, W, 1234, op="lse_reduce", tokens=T, num_heads=H, head_dim=D,
                       dtype=dtype, lse_dtype=lse_dtype, lse_base=lse_base,
                       num_requests=num_requests) for s in range(W)]
    outs = [i["out_partial"] for i in ins]
    lses = [i["lse_partial"] for i in ins]
    seq = None if num_requests == 0 else [i["seq_lens"] for i in ins]
    qsl = ins[0]["query_start_loc"]
    r_out, r_lse = lse_reduce_reference(outs, lses, lse_base=lse_base, seq_lens=seq,
                                        query_start_loc=qsl)
    k_out, k_lse = kernel_model(outs, lses, out_dtype=resolve_dtype(dtype), lse_base=lse_base,
                                seq_lens=seq, qsl=qsl)
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
    g = dict(op="lse_reduce", tokens=11, num_heads=8, head_dim=16, dtype="bfloat16",
             num_requests=4)
    a0, b0 = make_inputs(0, 2, 99, **g), make_inputs(0, 2, 99, **g)
    a1 = make_inputs(1, 2, 99, **g)
    for k in ("out_partial", "lse_partial", "seq_lens", "query_start_loc"):
        np.testing.assert_array_equal(a0[k].view(np.uint8) if a0[k].dtype == BF16 else a0[k],
                                      b0[k].view(np.uint8) if b0[k].dtype == BF16 else b0[k])
    np.testing.assert_array_equal(a0["query_start_loc"], a1["query_start_loc"])
    assert a0["out_partial"].shape == (11, 8, 16) and a0["out_partial"].dtype == BF16
    assert a0["lse_partial"].shape == (11, 8) and a0["lse_partial"].dtype == np.float32
    assert a0["seq_lens"].dtype == np.int32 and a0["seq_lens"].shape == (4,)
    q = a0["query_start_loc"]
    assert q.dtype == np.int32 and q.shape == (5,) and q[0] == 0 and (np.diff(q) >= 0).all()
    assert q[-1] <= 11
    other = make_inputs(0, 2, 100, **g)["lse_partial"]
    assert not np.array_equal(other, a0["lse_partial"])
