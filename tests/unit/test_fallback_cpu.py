"""The NCCL fallback ops' host-side logic on CPU: the strided-copy plans (head reorder of
q_gather, pack of the lse_reduce all_to_all) executed by a NumPy emulation of
``fallback_copy_kernel``, the buffer layouts and the math of the all-gather-lse algorithms
emulated with the kernels' formulas against ``lse_reduce_reference``, the kernel compile, and
the error that names the extra when NCCL is missing."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from dcpkit import fallback, reference
from dcpkit.comm import Communicator
from dcpkit.errors import InvalidArgument, MissingDependency
from dcpkit.fallback import (
    CopyPlan,
    copy_plan,
    heads_to_owner_plan,
    lse_layout,
    owner_to_heads_plan,
)


# ----------------------------------------------------------------------------- emulation
def run_copy(plan: CopyPlan, dst: np.ndarray, dst_off: int, src: np.ndarray, src_off: int):
    """What fallback_copy_kernel does, on uint8 host buffers: every element of
    ``plan.elem_bytes`` bytes at element index (i0, i1, i2, i3)."""
    eb = plan.elem_bytes
    idx = np.indices(plan.shape).reshape(4, -1).astype(np.int64)
    d = (idx * np.array(plan.dst_strides, np.int64)[:, None]).sum(0) * eb + dst_off
    s = (idx * np.array(plan.src_strides, np.int64)[:, None]).sum(0) * eb + src_off
    for b in range(eb):
        dst[d + b] = src[s + b]


def as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


# ----------------------------------------------------------------------------- copy_plan
def test_copy_plan_vectorises_contiguous_runs():
    p = copy_plan(
        (4, 3, 2, 64), (384 * 2, 128 * 2, 64 * 2, 2), (384 * 2, 128 * 2, 64 * 2, 2), 2, 0, 256
    )
    assert p == CopyPlan(16, (4, 3, 2, 8), (48, 16, 8, 1), (48, 16, 8, 1))
    # a pointer 8 bytes off 16: 8-byte elements
    p = copy_plan((2, 64), (128, 2), (128, 2), 2, 8, 0)
    assert p.elem_bytes == 8 and p.shape == (1, 1, 2, 16) and p.dst_strides == (0, 0, 16, 1)
    # a run of 10 bytes: 2-byte elements
    assert copy_plan((3, 5), (10, 2), (10, 2), 2, 0, 0).elem_bytes == 2


def test_copy_plan_strided_innermost_and_errors():
    p = copy_plan((3, 4), (8, 2), (32, 8), 2, 0, 0)  # src inner stride 8 bytes
    assert p == CopyPlan(2, (1, 1, 3, 4), (0, 0, 4, 1), (0, 0, 16, 4))
    with pytest.raises(InvalidArgument, match="at most 4 dimensions"):
        copy_plan((1, 1, 1, 1, 2), (2,) * 5, (2,) * 5, 2, 0, 0)
    with pytest.raises(InvalidArgument, match="itemsize of 1, 2, 4, 8 or 16 bytes"):
        copy_plan((3, 4), (12, 3), (24, 6), 3, 0, 0)
    # extent-1 dimensions never constrain the element width
    p = copy_plan((1, 32), (7, 2), (9, 2), 2, 0, 0)
    assert p.elem_bytes == 16


@pytest.mark.parametrize(
    "W,T,H_r,D,dtype",
    [
        (2, 5, 3, 8, "bfloat16"),
        (4, 1, 2, 16, "float32"),
        (3, 17, 1, 7, "float16"),
        (2, 3, 2, 5, "uint8"),
    ],
)
@pytest.mark.parametrize("layout", ["contiguous", "padded", "misaligned"])
def test_q_gather_reorder_plan_is_all_gather_dim1(W, T, H_r, D, dtype, layout):
    """The NCCL q_gather: the all-gather result [W, T, H_r, D] put in [T, H, D] order by one
    strided copy equals all_gather(q, dim=1), bit for bit, for any destination layout."""
    rng = np.random.default_rng(0)
    dt = reference.resolve_dtype(dtype)
    isz = dt.itemsize
    qs = [reference.random_array(rng, (T, H_r, D), dt) for _ in range(W)]
    gathered = np.concatenate([as_bytes(q) for q in qs])  # [W, T, H_r, D] contiguous
    H = W * H_r
    H_pad = H + (2 if layout == "padded" else 0)
    off = 2 * isz if layout == "misaligned" else 0
    out_strides = (H_pad * D * isz, D * isz, isz)
    dst = np.full(off + T * H_pad * D * isz + 64, 0xAB, np.uint8)
    src = np.concatenate([np.zeros(16, np.uint8), gathered])
    p = owner_to_heads_plan(W, T, H_r, D, isz, out_strides, 4096 + off, 4096 + 16)
    run_copy(p, dst, off, src, 16)
    got = np.ndarray((T, H, D), dtype=dt, buffer=dst, offset=off, strides=out_strides)
    want = reference.q_gather_reference(qs)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
        f"first mismatch at {np.argwhere(got.view(np.uint8) != want.view(np.uint8))[:1]}"
    )
    if layout == "padded":  # pad heads never written
        pad = np.ndarray(
            (T, 2, D * isz),
            np.uint8,
            buffer=dst,
            offset=off + H * D * isz,
            strides=(H_pad * D * isz, D * isz, 1),
        )
        assert (pad == 0xAB).all()
    if T == 1:  # the layouts coincide: NCCL may gather straight into out
        assert np.array_equal(gathered, as_bytes(want))


@pytest.mark.parametrize("W,T,H_r,D", [(2, 4, 3, 16), (4, 1, 1, 8), (3, 6, 2, 5)])
def test_lse_pack_plan_is_owner_slices(W, T, H_r, D):
    """The all_to_all pack: x[t, s*H_r + j, d] of a strided out_partial into the per-owner
    contiguous blocks [W, T, H_r, D]."""
    rng = np.random.default_rng(1)
    H = W * H_r
    big = rng.standard_normal((T, H + 1, D + 3)).astype(np.float16)  # padded storage
    x = big[:, :H, :D]
    src = as_bytes(big)
    dst = np.zeros(W * T * H_r * D * 2, np.uint8)
    p = heads_to_owner_plan(W, T, H_r, D, 2, x.strides, 0, 0)
    run_copy(p, dst, 0, src, 0)
    got = dst.view(np.float16).reshape(W, T, H_r, D)
    want = np.stack([x[:, s * H_r : (s + 1) * H_r] for s in range(W)])
    assert np.array_equal(got, want)


# ----------------------------------------------------------------------------- lse math
def row_masked(t, qsl, seq_lens):
    """kernels/lse_rows.cuh rows_masked for one row, line by line (called with a
    query_start_loc): the branchless upper-bound search."""
    S = len(qsl) - 1
    end = qsl[S]
    base = 0
    if seq_lens is not None:
        n = S + 1
        while n > 1:
            half = n >> 1
            if qsl[base + half] <= t:
                base += half
            n -= half
        if qsl[base] <= t:
            base += 1
    if t >= end:
        return True
    if seq_lens is None:
        return False
    return base > 0 and seq_lens[base - 1] == 0


def test_row_masked_matches_its_definition_on_every_small_case():
    """The header's binary search against the definition: padding at or past qsl[S], else the
    row of request i (qsl[i] <= t < qsl[i+1]) is empty when seq_lens[i] == 0; rows before
    qsl[0] belong to no request."""
    rng = np.random.default_rng(5)
    cases = 0
    for S in range(5):
        for _ in range(40):
            qsl = np.sort(rng.integers(0, 8, size=S + 1))
            seq = rng.integers(0, 2, size=S)
            for t in range(10):
                inside = [i for i in range(S) if qsl[i] <= t < qsl[i + 1]]
                want_seq = t >= qsl[S] or (bool(inside) and seq[inside[-1]] == 0)
                assert row_masked(t, qsl, seq) == want_seq, (t, qsl, seq)
                assert row_masked(t, qsl, None) == (t >= qsl[S])
                cases += 1
    assert cases == 5 * 40 * 10


def mask_kernel(lse, scale, qsl, seq_lens, dst, off, ss, st, H_r):
    """fallback_lse_mask_kernel: dst[off + s*ss + t*st + j] = masked lse[t, s*H_r + j]."""
    T, H = lse.shape
    for t in range(T):
        for h in range(H):
            v = np.float32(lse[t, h])
            if not v < np.inf:
                v = np.float32(-np.inf)
            v = np.float32(v * scale)
            if qsl is not None and row_masked(t, qsl, seq_lens):
                v = np.float32(-np.inf)
            s, j = divmod(h, H_r)
            dst[off + s * ss + t * st + j] = v


def weight_kernel(lse_all, x, y, lay, W, rank, T, H, H_r, D, lse_out):
    """fallback_lse_weight_kernel, vectorised over the rows."""
    la = lse_all.reshape(W, T, H)
    with np.errstate(invalid="ignore", over="ignore"):
        m = la.max(0)
        e = np.exp(la - np.where(np.isneginf(m), 0, m)[None]).astype(np.float32)
        e[:, np.isneginf(m)] = 0
        ssum = e.sum(0)
        w = np.where(np.isneginf(m), 0, e[rank] / np.where(ssum > 0, ssum, 1))
    for t in range(T):
        for h in range(H):
            s, j = divmod(h, H_r)
            base = s * lay.y_ss + t * lay.y_st + j * D
            if w[t, h] > 0:
                y[base : base + D] = w[t, h] * x[t, h].astype(np.float32)
            else:
                y[base : base + D] = 0.0
            if lay.lse_h0 <= h < lay.lse_h1:
                lse_out[t, h - lay.lse_h0] = (
                    m[t, h] + np.log(ssum[t, h]) if not np.isneginf(m[t, h]) else -np.inf
                )


@pytest.mark.parametrize("algorithm", ["allgather_reduce_scatter", "allgather_all_reduce"])
@pytest.mark.parametrize("lse_base", [math.e, 2.0])
@pytest.mark.parametrize("num_requests", [0, 3])
def test_allgather_algorithms_match_reference(algorithm, lse_base, num_requests):
    """Mask, all-gather, weight, sum over ranks (the reduce), with the buffer layouts of
    lse_layout(): equals lse_reduce_reference for every rank, NaN payloads of empty sources
    never leaking, out_lse included."""
    W, T, H, D, seed = 3, 7, 6, 4, 11
    H_r = H // W
    ins = [
        reference.make_inputs(
            r,
            W,
            seed,
            op="lse_reduce",
            tokens=T,
            num_heads=H,
            head_dim=D,
            dtype="float32",
            lse_base=lse_base,
            num_requests=num_requests,
            empty_fraction=0.2,
            nonfinite_fraction=0.1,
        )
        for r in range(W)
    ]
    qsl = ins[0]["query_start_loc"]
    ref_out, ref_lse = reference.lse_reduce_reference(
        [i["out_partial"] for i in ins],
        [i["lse_partial"] for i in ins],
        lse_base=lse_base,
        seq_lens=None if qsl is None else [i["seq_lens"] for i in ins],
        query_start_loc=qsl,
    )
    scale = np.float32(1.0 if lse_base == math.e else math.log(2.0))
    lse_all = np.full(W * T * H, np.nan, np.float32)
    for r in range(W):  # every rank masks its own lse into its slot (the all-gather)
        lay = lse_layout(algorithm, r, W, T, H, D)
        mask_kernel(
            ins[r]["lse_partial"],
            scale,
            qsl,
            ins[r]["seq_lens"],
            lse_all,
            lay.mask_offset,
            lay.mask_ss,
            lay.mask_st,
            H_r,
        )
    assert not np.isnan(lse_all).any()
    ys, lses = [], []
    for r in range(W):
        lay = lse_layout(algorithm, r, W, T, H, D)
        y = np.full(T * H * D, np.nan, np.float32)
        lo = np.full((T, lay.lse_h1 - lay.lse_h0), np.nan, np.float32)
        weight_kernel(lse_all, ins[r]["out_partial"], y, lay, W, r, T, H, H_r, D, lo)
        ys.append(y)
        lses.append(lo)
    total = np.sum(ys, axis=0)  # the fp32 sum NCCL performs
    tol = reference.lse_reduce_tolerance("float32")
    for r in range(W):
        if algorithm == "allgather_all_reduce":
            got, want = total.reshape(T, H, D), ref_out
            want_lse = ref_lse
        else:  # reduce-scatter: block r of the owner-major buffer
            got = total.reshape(W, T, H_r, D)[r]
            want = ref_out[:, r * H_r : (r + 1) * H_r]
            want_lse = ref_lse[:, r * H_r : (r + 1) * H_r]
        assert np.isfinite(got).all(), f"rank {r}: non-finite output"
        err = np.abs(got - want).max()
        assert err <= tol, f"rank {r}: max error {err} > {tol}"
        fin = np.isfinite(want_lse)
        assert np.array_equal(np.isneginf(lses[r]), np.isneginf(want_lse)), f"rank {r}"
        assert np.abs(lses[r][fin] - want_lse[fin]).max(initial=0) <= 1e-5, f"rank {r}"


def test_all_to_all_mask_layout_is_owner_order():
    W, T, H, D = 4, 3, 8, 2
    H_r = H // W
    lay = lse_layout("all_to_all", 1, W, T, H, D)
    lse = np.arange(T * H, dtype=np.float32).reshape(T, H)
    dst = np.zeros(W * T * H_r, np.float32)
    mask_kernel(lse, 1.0, None, None, dst, lay.mask_offset, lay.mask_ss, lay.mask_st, H_r)
    want = np.stack([lse[:, s * H_r : (s + 1) * H_r] for s in range(W)])  # [W, T, H_r]
    assert np.array_equal(dst.reshape(W, T, H_r), want)


def test_row_masked_matches_reference_rows():
    rng = np.random.default_rng(5)
    for trial in range(50):
        T = int(rng.integers(1, 20))
        S = int(rng.integers(0, 5))
        cuts = np.sort(rng.integers(0, T + 1, size=S + 1)).astype(np.int32)
        sl = rng.integers(0, 3, size=S).astype(np.int32)
        want = ~reference._valid_rows(T, sl if S else None, cuts)
        got = np.array([row_masked(t, cuts, sl if S else None) for t in range(T)])
        assert np.array_equal(got, want), f"trial {trial}: qsl={cuts} seq_lens={sl}"


# ----------------------------------------------------------------------------- compile, deps
def test_fallback_kernels_compile_for_sm90():
    jit = pytest.importorskip("dcpkit.jit")
    try:
        res = jit.compile_only(["fallback.cu"])
    except MissingDependency as e:
        pytest.skip(f"NVRTC is not installed here: {e}")
    assert res["fallback.cu"]["variants"] == len(jit.VARIANTS["fallback.cu"]) == 15


def test_missing_nccl_names_the_extra(monkeypatch):
    nccl = pytest.importorskip("cupy.cuda.nccl")
    monkeypatch.setattr(nccl, "available", False)
    with pytest.raises(MissingDependency) as ei:
        fallback.nccl_module()
    assert ei.value.extra in ("cuda12", "cuda13")
    assert f"pip install 'dcpkit[{ei.value.extra}]'" in str(ei.value)
    comm = Communicator.single()
    with pytest.raises(MissingDependency, match=r"dcpkit\[cuda1[23]\]"):
        fallback.NcclGroup(comm)
    with pytest.raises(MissingDependency, match=r"dcpkit\[cuda1[23]\]"):
        fallback.NcclQGather(comm, max_tokens=4, heads_per_rank=2, head_dim=8, dtype="bfloat16")
    with pytest.raises(MissingDependency, match=r"dcpkit\[cuda1[23]\]"):
        fallback.NcclLseReduce(
            comm,
            max_tokens=4,
            num_heads=2,
            head_dim=8,
            dtype="float32",
            algorithm="allgather_reduce_scatter",
        )


def test_missing_cupy_nccl_module_names_the_extra(monkeypatch):
    cuda = pytest.importorskip("cupy.cuda")
    monkeypatch.delattr(cuda, "nccl", raising=False)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)  # import fails
    with pytest.raises(MissingDependency, match=r"dcpkit\[cuda1[23]\]"):
        fallback.nccl_module()


def test_bad_constructor_arguments_before_any_gpu_work():
    comm = Communicator.single()
    with pytest.raises(InvalidArgument, match="algorithm must be one of"):
        fallback.NcclLseReduce(
            comm, max_tokens=4, num_heads=2, head_dim=8, dtype="float32", algorithm="ring"
        )
    with pytest.raises(
        InvalidArgument,
        match="head_dim \\* itemsize must be a multiple of 16 bytes for algorithm 'all_to_all'",
    ):
        fallback.NcclLseReduce(comm, max_tokens=4, num_heads=2, head_dim=3, dtype="float32")
    with pytest.raises(InvalidArgument, match="lse_base must be math.e or 2"):
        fallback.NcclLseReduce(
            comm, max_tokens=4, num_heads=2, head_dim=8, dtype="float32", lse_base=10
        )
    with pytest.raises(InvalidArgument, match="algorithm must be 'push' or 'pull'"):
        fallback.NcclKVGather(comm, max_tokens=4, row_dim=8, dtype="bfloat16", algorithm="ring")
    with pytest.raises(InvalidArgument, match="max_tokens must be >= 1"):
        fallback.NcclQGather(comm, max_tokens=0, heads_per_rank=2, head_dim=8, dtype="bfloat16")
