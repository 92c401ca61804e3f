"""NumPy references of the three ops, and the per-rank seeded inputs every test, the demo and the
benchmark share.

Each rank can rebuild every peer's input with :func:`make_inputs` (same ``seed``, the peer's
``rank``), compute the reference locally and check only its own output. Data movement
(``q_gather``, ``kv_gather``) is checked bit for bit; ``lse_reduce`` is computed in float64 and
checked with a tolerance stated by the caller (:func:`lse_reduce_tolerance`).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .errors import InvalidArgument

__all__ = [
    "q_gather_reference", "kv_gather_reference", "lse_reduce_reference", "make_inputs",
    "lse_reduce_tolerance", "resolve_dtype", "random_array",
]

_OP_SEEDS = {"q_gather": 1, "kv_gather": 2, "lse_reduce": 3}


def resolve_dtype(dtype) -> np.dtype:
    """A NumPy dtype from a name or dtype; ``"bfloat16"``/``"bf16"`` map to ml_dtypes' bfloat16,
    ``"fp8"``/``"float8_e4m3fn"`` to ml_dtypes' float8_e4m3fn."""
    if isinstance(dtype, str):
        key = dtype.lower()
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                   "float": "float32", "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}
        key = aliases.get(key, key)
        if key in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            import ml_dtypes  # noqa: WPS433

            return np.dtype(getattr(ml_dtypes, key))
        return np.dtype(key)
    return np.dtype(dtype)


def random_array(rng: np.random.Generator, shape: Sequence[int], dtype) -> np.ndarray:
    """Random data of ``dtype``: normal values for floats, uniform bytes for 1-byte integers."""
    dt = resolve_dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=tuple(shape), dtype=dt, endpoint=True)
    return rng.standard_normal(size=tuple(shape), dtype=np.float32).astype(dt)


# ----------------------------------------------------------------------------- references
def q_gather_reference(qs: Sequence[np.ndarray]) -> np.ndarray:
    """``all_gather(q, dim=1)``: ``qs[s]`` is rank ``s``'s ``q [T, H_r, D]``; returns
    ``[T, H, D]`` with heads ``[s*H_r, (s+1)*H_r)`` from rank ``s``."""
    return np.concatenate([np.asarray(q) for q in qs], axis=1)


def kv_gather_reference(kvs: Sequence[np.ndarray]) -> np.ndarray:
    """``all_gather_into_tensor(kv)``: ``kvs[s]`` is rank ``s``'s ``kv [T, D_kv]``; returns
    ``[world_size*T, D_kv]`` with rows ``[s*T, (s+1)*T)`` from rank ``s``."""
    return np.concatenate([np.asarray(k) for k in kvs], axis=0)


def _valid_rows(T: int, seq_lens: Optional[np.ndarray], qsl: Optional[np.ndarray]) -> np.ndarray:
    """Rows [T] that are not masked: not padding, not a request whose local KV length is 0."""
    valid = np.ones(T, dtype=bool)
    if qsl is None:
        return valid
    qsl = np.asarray(qsl, dtype=np.int64)
    S = len(qsl) - 1
    valid[min(int(qsl[S]), T):] = False
    if seq_lens is not None:
        sl = np.asarray(seq_lens, dtype=np.int64)
        for i in range(S):
            if sl[i] == 0:
                valid[max(0, int(qsl[i])):min(T, int(qsl[i + 1]))] = False
    return valid


def lse_reduce_reference(out_partials: Sequence[np.ndarray], lse_partials: Sequence[np.ndarray],
                         *, lse_base: float = math.e,
                         seq_lens: Optional[Sequence[np.ndarray]] = None,
                         query_start_loc: Optional[np.ndarray] = None
                         ) -> Tuple[np.ndarray, np.ndarray]:
    """The exact LSE-weighted merge of every rank's partial attention, in float64.

    Parameters
    ----------
    out_partials : sequence of array [T, H, D_v]
        Rank ``s``'s partial output (attention of all heads over its KV shard).
    lse_partials : sequence of array [T, H]
        Rank ``s``'s partial log-sum-exp, base ``lse_base`` (e or 2). NaN and +inf count as
        -inf (an empty or invalid shard).
    seq_lens : sequence of int arrays [S], optional
        ``seq_lens[s]`` is rank ``s``'s local KV length per request; 0 masks the request's rows.
        Needs ``query_start_loc``.
    query_start_loc : int array [S+1], optional
        Row offsets of the requests; rows at or past ``query_start_loc[S]`` are padding, empty
        on every rank.

    Returns
    -------
    out : float64 [T, H, D_v]
        ``sum_s w_s * out_s`` with ``w_s = exp(l_s - m) / sum_j exp(l_j - m)``; sources with
        ``w_s == 0`` are never read (they may hold NaN); all-empty rows are 0.
    lse : float64 [T, H]
        Merged natural-log lse; ``-inf`` for all-empty rows.

    The rows of rank ``r`` are ``out[:, r*H_r:(r+1)*H_r]``.
    """
    W = len(out_partials)
    if len(lse_partials) != W:
        raise InvalidArgument("lse_reduce_reference: one lse_partial per rank is needed")
    if seq_lens is not None and query_start_loc is None:
        raise InvalidArgument("lse_reduce_reference: seq_lens needs query_start_loc")
    T, H, D = np.asarray(out_partials[0]).shape
    scale = 1.0 if lse_base == math.e else math.log(lse_base)
    lse = np.empty((W, T, H), dtype=np.float64)
    for s in range(W):
        ls = np.asarray(lse_partials[s]).astype(np.float64) * scale
        ls[~np.isfinite(ls) & ~np.isneginf(ls)] = -np.inf   # NaN, +inf -> -inf
        valid = _valid_rows(T, None if seq_lens is None else seq_lens[s], query_start_loc)
        ls[~valid, :] = -np.inf
        lse[s] = ls
    m = lse.max(axis=0)                                   # [T, H]
    empty = np.isneginf(m)
    m_safe = np.where(empty, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lse - m_safe[None])                    # [W, T, H], 0 for -inf sources
    p[:, empty] = 0.0
    denom = p.sum(axis=0)
    w = np.divide(p, denom[None], out=np.zeros_like(p), where=denom[None] > 0)
    out = np.zeros((T, H, D), dtype=np.float64)
    for s in range(W):
        ws = w[s]
        nz = ws > 0
        if nz.any():
            src = np.asarray(out_partials[s]).astype(np.float64)
            out[nz] += ws[nz][:, None] * src[nz]
    with np.errstate(divide="ignore"):
        merged = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, denom)))
    return out, merged


def lse_reduce_tolerance(dtype) -> float:
    """Max abs error allowed against :func:`lse_reduce_reference` for outputs of ``dtype``
    with inputs of magnitude about 1 (fp32 accumulation, one rounding to ``dtype``)."""
    dt = resolve_dtype(dtype)
    return {2: 2e-2, 4: 1e-5}.get(dt.itemsize, 2e-2) if dt != np.float16 else 4e-3


# ----------------------------------------------------------------------------- inputs
def _rng(seed: int, rank: int, op: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(rank), _OP_SEEDS[op]])


def make_inputs(rank: int, world_size: int, seed: int, *, op: str, **geometry) -> Dict:
    """Rank ``rank``'s inputs for ``op``, reproducible from ``(seed, rank)`` alone.

    ``op="q_gather"``: ``tokens`` (T), ``num_heads`` (H), ``head_dim`` (D), ``dtype``
    -> ``{"q": [T, H_r, D]}``.

    ``op="kv_gather"``: ``tokens``, ``row_dim`` (D_kv), ``dtype`` -> ``{"kv": [T, D_kv]}``.

    ``op="lse_reduce"``: ``tokens``, ``num_heads``, ``head_dim`` (D_v), ``dtype``,
    ``lse_dtype`` (default float32), ``lse_base`` (default e), ``num_requests`` (S, default 0:
    no mask), ``empty_fraction`` (share of (t, h) entries whose lse is -inf and payload NaN,
    default 0.05), ``nonfinite_fraction`` (share with NaN/+inf lse, default 0.01) ->
    ``{"out_partial": [T, H, D_v], "lse_partial": [T, H], "seq_lens": [S] int32 or None,
    "query_start_loc": [S+1] int32 or None}``. ``query_start_loc`` is equal on every rank;
    ``seq_lens`` differ per rank and contain zeros so that some requests are empty here.

    All arrays are host (NumPy) arrays.
    """
    if op not in _OP_SEEDS:
        raise InvalidArgument(f"make_inputs: op must be one of {sorted(_OP_SEEDS)} (got {op!r})")
    rng = _rng(seed, rank, op)
    T = int(geometry["tokens"])
    if op == "q_gather":
        H, D = int(geometry["num_heads"]), int(geometry["head_dim"])
        if H % world_size:
            raise InvalidArgument(f"make_inputs: num_heads {H} must divide by world_size "
                                  f"{world_size}")
        return {"q": random_array(rng, (T, H // world_size, D), geometry.get("dtype", "bfloat16"))}
    if op == "kv_gather":
        D = int(geometry["row_dim"])
        return {"kv": random_array(rng, (T, D), geometry.get("dtype", "bfloat16"))}
    # lse_reduce
    H, D = int(geometry["num_heads"]), int(geometry["head_dim"])
    dtype = resolve_dtype(geometry.get("dtype", "bfloat16"))
    lse_dtype = resolve_dtype(geometry.get("lse_dtype", "float32"))
    base = float(geometry.get("lse_base", math.e))
    out = rng.standard_normal((T, H, D), dtype=np.float32)
    lse = rng.normal(4.0, 2.0, size=(T, H)).astype(np.float64)
    if base != math.e:
        lse = lse / math.log(base)
    empty = rng.random((T, H)) < float(geometry.get("empty_fraction", 0.05))
    lse[empty] = -np.inf
    out[empty] = np.nan  # an empty source's payload must never be read
    bad = rng.random((T, H)) < float(geometry.get("nonfinite_fraction", 0.01))
    lse[bad] = np.where(rng.random(int(bad.sum())) < 0.5, np.nan, np.inf)
    out[bad] = np.nan
    S = int(geometry.get("num_requests", 0))
    seq_lens = qsl = None
    if S > 0:
        # query_start_loc must be equal on every rank: draw it from a rank-independent stream.
        shared = np.random.default_rng([int(seed), 0x5EED, S, T])
        cuts = np.sort(shared.integers(0, T + 1, size=S - 1)) if S > 1 else np.zeros(0, int)
        used = int(shared.integers(max(0, T - 2), T + 1))    # a few padding rows at the end
        qsl = np.concatenate([[0], np.minimum(cuts, used), [used]]).astype(np.int32)
        seq_lens = rng.integers(1, 1000, size=S).astype(np.int32)
        seq_lens[rng.random(S) < 0.3] = 0
    return {
        "out_partial": out.astype(dtype),
        "lse_partial": lse.astype(lse_dtype),
        "seq_lens": seq_lens,
        "query_start_loc": qsl,
    }
