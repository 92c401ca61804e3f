"""The attention reference of the demo: fp32 attention over latent KV, bfloat16 by bits, the
tolerance and the agreed verdict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def is_bf16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def to_float32(x, xp=np):
    """``x`` as float32 (exact). bfloat16 is widened by bits (``u16 << 16``), so this needs no
    bfloat16 arithmetic from the array library."""
    if is_bf16(x.dtype):
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)


def from_float32(x, dtype, xp=np):
    """float32 ``x`` rounded to ``dtype`` (round to nearest even). bfloat16 is rounded by bits;
    NaN and infinities are kept."""
    from .._checks import resolve_dtype

    dt = resolve_dtype(dtype)
    if is_bf16(dt):
        u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        nan = xp.isnan(x)
        r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
        r = xp.where(nan, xp.uint16(0x7FC0), r)
        return r.view(dt)
    return x.astype(dt)


def attention(q, kv, scale: float, v_dim: int, xp=np) -> tuple[Any, Any]:
    """Attention of ``H`` query heads over one sequence's latent KV, in float32.

    Naive equivalent::

        s   = (q @ kv.T) * scale                     # [H, L]
        out = softmax(s, axis=1) @ kv[:, :v_dim]     # [H, D_v]
        lse = log(sum(exp(s), axis=1))               # [H], natural log

    Parameters
    ----------
    q : float32 [H, D_qk]
    kv : float32 [L, D_qk]
        Latent KV rows; values are the first ``v_dim`` columns. ``L = 0`` is allowed.
    scale : float
        Softmax scale.
    v_dim : int
        D_v.
    xp : module
        ``numpy`` or ``cupy``.

    Returns
    -------
    out : float32 [H, D_v]
        NaN everywhere when ``L == 0`` (an output that must never be read).
    lse : float32 [H]
        ``-inf`` when ``L == 0``.
    """
    H = q.shape[0]
    if kv.shape[0] == 0:
        return (
            xp.full((H, v_dim), np.nan, dtype=xp.float32),
            xp.full((H,), -np.inf, dtype=xp.float32),
        )
    s = (q @ kv.T) * xp.float32(scale)
    m = s.max(axis=1, keepdims=True)
    p = xp.exp(s - m)
    denom = p.sum(axis=1)
    out = (p @ kv[:, :v_dim]) / denom[:, None]
    lse = m[:, 0] + xp.log(denom)
    return out.astype(xp.float32), lse.astype(xp.float32)


def unit_roundoff(dtype) -> float:
    """Unit roundoff ``u`` of a float dtype: ``|fl(x) - x| <= u |x|`` (bf16 2^-8, fp16 2^-11,
    fp32 2^-24)."""
    from .._checks import resolve_dtype

    dt = resolve_dtype(dtype)
    if is_bf16(dt):
        return 2.0**-8
    return float(np.finfo(dt).eps) / 2.0


def tolerance(dtype, v_max: float) -> float:
    """Max abs error allowed between the demo's output and the fp32 reference.

    Every output and every partial output is a convex combination of value rows, so its
    magnitude is at most ``v_max = max |V|``. The result is rounded to ``dtype`` twice (each
    partial output, then the merged output), each rounding off by at most ``u * v_max``;
    the fp32 sums add far less than ``1e-3``. Hence ``2 * u * v_max + 1e-3``.
    """
    return 2.0 * unit_roundoff(dtype) * float(v_max) + 1e-3


def local_stats(out, ref, rank: int, heads_per_rank: int) -> dict[str, Any]:
    """Errors of this rank's output ``[B, H_r, D_v]`` against its reference (float32)."""
    xp = array_module(out)
    got = to_float32(out, xp)
    nonfinite = int((~xp.isfinite(got)).sum())
    diff = xp.abs(got - ref)
    diff = xp.where(xp.isfinite(diff), diff, xp.float32(np.inf))
    flat = int(diff.argmax())
    b, h, c = np.unravel_index(flat, diff.shape)
    return {
        "max_abs": float(diff.reshape(-1)[flat]),
        "ref_max": float(xp.abs(ref).max()),
        "nonfinite": nonfinite,
        "worst": [int(b), int(rank * heads_per_rank + h), int(c)],
    }


def array_module(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


def verdict(stats: Sequence[dict[str, Any]], dtype) -> dict[str, Any]:
    """The agreed check from every rank's statistics (``stats[r]`` from rank ``r``): max abs
    error, max relative error (max abs error / max |reference|), tolerance, PASS/FAIL."""
    W = len(stats)
    v_max = max(s["v_max"] for s in stats)
    tol = tolerance(dtype, v_max)
    worst_rank = max(range(W), key=lambda r: stats[r]["max_abs"])
    max_abs = stats[worst_rank]["max_abs"]
    ref_max = max(s["ref_max"] for s in stats)
    max_rel = max_abs / ref_max if ref_max > 0 else float("inf")
    nonfinite = sum(s["nonfinite"] for s in stats)
    q_exact = all(s["q_gather_exact"] for s in stats)
    kv_exact = all(s["kv_gather_exact"] for s in stats)
    ok = nonfinite == 0 and max_abs <= tol and q_exact and kv_exact
    w = stats[worst_rank]["worst"]
    return {
        "max_abs_error": max_abs,
        "max_rel_error": max_rel,
        "max_rel_error_definition": "max abs error / max |reference|",
        "tolerance_abs": tol,
        "tolerance_definition": "2 * u * max|V| + 1e-3, u = unit roundoff of the dtype",
        "v_max": v_max,
        "nonfinite_outputs": nonfinite,
        "q_gather_bit_exact": q_exact,
        "kv_gather_bit_exact": kv_exact,
        "worst": {"rank": worst_rank, "sequence": w[0], "head": w[1], "column": w[2]},
        "per_rank_max_abs_error": [s["max_abs"] for s in stats],
        "verdict": "PASS" if ok else "FAIL",
    }
