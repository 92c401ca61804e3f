"""The register merge of kernels/lse_reduce.cu gives the bits of the warp merge, on one GPU.

Run as one process (one GPU, no MPI)::

    python -m pytest tests/gpu/test_register_combine.py -p no:cacheprovider

``LseReduce`` builds its kernels with ``-DDCPKIT_LSE_REG_SOURCES=4`` for worlds up to 4
(``LseReduce.REG_SOURCES``): there ``combine_rows`` merges W <= 4 sources in registers instead of
through the warp's shuffles and shared memory. ``lse_combine_kernel`` (the local merge) runs the
same ``combine_rows`` as the small instance of ``lse_reduce_kernel``; compiled in both builds, it
merges the same inputs, and every output bit must agree:

* W = 1, 2, 3, 4 sources, T in {1, 3, 8} tokens of H_r = 5 heads, bf16 / fp16 / fp32 rows of 9,
  64 and 130 16-byte vectors (part of one pass of the lanes, one pass, three passes);
* lse values per item of every kind the merge treats apart: -inf, NaN and +inf sources, rows
  where every source is empty, ties, +0 and -0, spreads whose weights are denormal or underflow
  to 0, large magnitudes; NaN in the whole payload row of every source whose weight is 0 (it
  must not reach the output);
* grid (1,) (every warp loops over several items), one CTA per 8 items, and more CTAs than
  items; outputs apart from the input, and in place over source 0 (out = src_out[0], out_lse =
  src_lse[0]).

The warp build's result is also checked against the float64 reference, so that two equally wrong
builds cannot pass. Inputs are fresh every run (``DCPKIT_TEST_SEED`` replays one); failures name
the seed and the case.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _gpus import NUM_GPUS

from dcpkit.reference import (
    lse_reduce_reference,
    lse_reduce_tolerance,
    merged_lse_matches,
    resolve_dtype,
)

pytestmark = pytest.mark.skipif(NUM_GPUS < 1, reason=f"needs 1 GPU (have {NUM_GPUS})")

REG_OPTION = "-DDCPKIT_LSE_REG_SOURCES=4"
BUILDS = {"warp": (), "register": (REG_OPTION,)}
H_R = 5
ROW_VECS = (9, 64, 130)  # 16-byte vectors per row
DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_ZERO_GAP = 120.0  # l <= max - 120: exp underflows to 0 in fp32, the weight is 0


@pytest.fixture(scope="module")
def seed():
    s = os.environ.get("DCPKIT_TEST_SEED")
    s = int(s) if s else int(np.random.SeedSequence().entropy % (2**31))
    print(f"\n[dcpkit tests] seed = {s} (replay with DCPKIT_TEST_SEED={s})")
    return s


@pytest.fixture(scope="module")
def kernels():
    """dtype -> build -> the loaded lse_combine_kernel of that build."""
    import cupy

    from dcpkit import jit
    from dcpkit.ops._lse_checks import FILE, combine_variant

    cupy.cuda.Device(0).use()
    out = {}
    for name in DTYPES:
        dt = resolve_dtype(name)
        out[name] = {b: jit.get_kernel(FILE, combine_variant(dt), o) for b, o in BUILDS.items()}
    # Two modules, one per build (the options key jit's module cache and CuPy's disk cache).
    mods = {o: jit._MODULES.get((FILE, jit.DEFAULT_OPTIONS + o, 0)) for o in BUILDS.values()}
    assert None not in mods.values() and len({id(m) for m in mods.values()}) == 2, mods
    return out


def _uint(dt):
    return {2: np.uint16, 4: np.uint32}[np.dtype(dt).itemsize]


def make_lse(rng, W, T) -> np.ndarray:
    """float32 [W, T, H_r]: every item one of the kinds of the module docstring."""
    lse = rng.normal(0.0, 2.0, size=(W, T, H_R)).astype(np.float32)
    bad = np.array([-np.inf, np.nan, np.inf], dtype=np.float32)
    for t in range(T):
        for h in range(H_R):
            kind = rng.integers(8)
            col = lse[:, t, h]
            if kind == 1:  # one empty or invalid source
                col[rng.integers(W)] = rng.choice(bad)
            elif kind == 2:  # every source empty or invalid
                col[:] = rng.choice(bad, size=W)
            elif kind == 3:  # ties
                col[:] = np.float32(rng.normal())
            elif kind == 4:  # zeros of both signs
                col[:] = rng.choice(np.array([0.0, -0.0, 0.5], dtype=np.float32), size=W)
            elif kind == 5:  # weights that are denormal (gaps 88-103) or 0 (gaps >= 104)
                gaps = rng.choice([0.0, 88.0, 95.0, 101.0, 103.0, 110.0, 150.0, 1e30], size=W)
                gaps[rng.integers(W)] = 0.0
                col[:] = (np.float32(rng.normal()) - gaps).astype(np.float32)
            elif kind == 6:  # large magnitudes
                col[:] = np.float32(1e4) + rng.normal(0.0, 3.0, size=W).astype(np.float32)
    return lse


def make_payload(rng, lse, D, dtype) -> np.ndarray:
    """[W, T, H_r, D] of ``dtype``, about N(0, 1); NaN in every row whose weight is 0."""
    W, T, _ = lse.shape
    x = rng.normal(0.0, 1.0, size=(W, T, H_R, D)).astype(np.float32).astype(dtype)
    ls = np.where(np.isnan(lse) | (lse == np.inf), -np.inf, lse)
    zero = np.isneginf(ls) | (ls <= ls.max(axis=0, initial=-np.inf)[None] - WEIGHT_ZERO_GAP)
    x[zero] = np.array(np.nan, dtype=np.float32).astype(dtype)
    return x


def run(cupy, kernel, src_out, src_lse, grid, in_place):
    """Launch one build on device copies of the inputs; (out bits, out_lse bits) on the host."""
    W, T, _, D = src_out.shape
    u = _uint(src_out.dtype)
    so = cupy.asarray(np.ascontiguousarray(src_out).view(u))
    sl = cupy.asarray(np.ascontiguousarray(src_lse))
    if in_place:
        out, out_lse = so[0], sl[0]
    else:
        out = cupy.full((T, H_R, D), np.iinfo(u).max, dtype=u)  # NaN in every float dtype
        out_lse = cupy.full((T, H_R), np.iinfo(np.uint32).max, dtype=np.uint32).view(np.float32)
    args = (
        so.data.ptr,
        sl.data.ptr,
        out.data.ptr,
        out_lse.data.ptr,
        np.int32(W),
        np.int32(T),
        np.int32(H_R),
        np.int32(D),
    )
    kernel((grid,), (256,), args)
    cupy.cuda.Device().synchronize()
    return cupy.asnumpy(out), cupy.asnumpy(out_lse.view(np.uint32))


def first_diff(a, b) -> str:
    bad = np.argwhere(a != b)
    i = tuple(int(v) for v in bad[0])
    return f"{len(bad)} of {a.size} differ, first at {i}: {a[i]:#x} vs {b[i]:#x}"


def check_reference(src_out, src_lse, out_bits, lse_bits, dtype) -> str:
    """'' when the warp build's result matches the float64 reference, else what differs."""
    clean = np.nan_to_num(src_out.astype(np.float64), nan=0.0)  # weight-0 rows hold NaN
    ref, ref_lse = lse_reduce_reference(list(clean), list(src_lse))
    got = out_bits.view(dtype).astype(np.float64)
    tol = lse_reduce_tolerance(dtype)
    bad = ~(np.abs(got - ref) <= tol)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        return f"out {int(bad.sum())} off the reference, first {i}: {got[i]!r} vs {ref[i]!r}"
    gl = lse_bits.view(np.float32)
    ok = merged_lse_matches(gl, ref_lse)
    if not ok.all():
        i = tuple(int(v) for v in np.argwhere(~ok)[0])
        return f"out_lse off the reference at {i}: {gl[i]!r} vs {ref_lse[i]!r}"
    return ""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_register_merge_gives_the_bits_of_the_warp_merge(kernels, seed, W, dtype):
    import cupy

    dt = resolve_dtype(dtype)
    k = kernels[dtype]
    rng = np.random.default_rng([seed, W, DTYPES.index(dtype)])
    errors = []
    for T in (1, 3, 8):
        items = T * H_R
        for vecs in ROW_VECS:
            D = vecs * 16 // dt.itemsize
            src_lse = make_lse(rng, W, T)
            src_out = make_payload(rng, src_lse, D, dt)
            what = f"seed {seed}, W={W} T={T} D_v={D} {dtype}"
            warp = run(cupy, k["warp"], src_out, src_lse, 1, False)
            msg = check_reference(src_out, src_lse, *warp, dt)
            if msg:
                errors.append(f"{what}, warp build: {msg}")
            per_cta = -(-items // 8)
            for grid in (1, per_cta, per_cta + 3):
                for in_place in (False, True):
                    for build in ("warp", "register"):
                        if (build, grid, in_place) == ("warp", 1, False):
                            continue  # the result compared against
                        got = run(cupy, k[build], src_out, src_lse, grid, in_place)
                        where = f"{what}, {build} build, grid ({grid},)"
                        where += ", in place" if in_place else ""
                        for name, a, b in (("out", got[0], warp[0]), ("out_lse", got[1], warp[1])):
                            if not np.array_equal(a, b):
                                errors.append(f"{where}: {name} {first_diff(a, b)}")
    assert not errors, "\n".join(errors[:10]) + (
        f"\n... {len(errors) - 10} more" if len(errors) > 10 else ""
    )
