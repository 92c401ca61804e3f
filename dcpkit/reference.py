"""NumPy references of the three ops, and the per-rank seeded inputs every test, the demo and the
benchmark share.

Each rank can rebuild every peer's input with :func:`make_inputs` (same ``seed``, the peer's
``rank``), compute the reference locally and check only its own output. Data movement
(``q_gather``, ``kv_gather``) is checked bit for bit; ``lse_reduce`` is computed in float64 and
checked with a tolerance stated by the caller (:func:`lse_reduce_tolerance`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set

import numpy as np

from ._checks import check_int, check_lse_base, check_real, resolve_dtype
from .errors import InvalidArgument, InvalidType

__all__ = [
    "q_gather_reference",
    "kv_gather_reference",
    "lse_reduce_reference",
    "make_inputs",
    "lse_reduce_tolerance",
    "merged_lse_matches",
    "resolve_dtype",
    "random_array",
]

_OP_SEEDS = {"q_gather": 1, "kv_gather": 2, "lse_reduce": 3}


def _is_ml_dtype(dt: np.dtype) -> bool:
    return getattr(dt.type, "__module__", "").startswith("ml_dtypes")


def _is_float(dt: np.dtype) -> bool:
    """IEEE-like floating dtypes: NumPy's and ml_dtypes' (bfloat16, float8_*)."""
    return dt.kind == "f" or (_is_ml_dtype(dt) and "float" in dt.name)


def _is_numeric(dt: np.dtype) -> bool:
    return dt.kind in "biufc" or _is_ml_dtype(dt)


def _random(
    rng: np.random.Generator, shape: Sequence[int], dt: np.dtype, op: str, name: str
) -> np.ndarray:
    if not _is_numeric(dt):
        raise InvalidType(f"{op}: {name} must be a numeric dtype (got {dt})")
    if dt.kind == "b":
        return rng.integers(0, 2, size=tuple(shape)).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=tuple(shape), dtype=dt, endpoint=True)
    return rng.standard_normal(size=tuple(shape), dtype=np.float32).astype(dt)


def random_array(rng: np.random.Generator, shape: Sequence[int], dtype) -> np.ndarray:
    """Random data of ``dtype``: normal values for floats, uniform values over the whole range
    for integers, 0/1 for bool."""
    dt = resolve_dtype(dtype, op="random_array")
    return _random(rng, shape, dt, "random_array", "dtype")


# ----------------------------------------------------------------------------- argument checks
def _type_name(x) -> str:
    return type(x).__name__


def _fraction(value, op: str, name: str) -> float:
    f = check_real(value, op, name)
    if not 0.0 <= f <= 1.0:  # NaN fails too
        raise InvalidArgument(f"{op}: {name} must lie in [0, 1] (got {value!r})")
    return f


def _not_an_array(x) -> bool:
    """Objects NumPy would turn into a 0-d or object array without complaint: None, strings,
    mappings and sets (a dict's keys, or nothing, would be read as the data)."""
    return x is None or isinstance(x, (str, bytes, bytearray, Mapping, Set))


def _as_array(x, op: str, name: str, what: str) -> np.ndarray:
    """``np.asarray(x)``, refusing what is no array of ``what`` and ragged nested lists."""
    if _not_an_array(x):
        raise InvalidType(f"{op}: {name} must be {what} (got {_type_name(x)})")
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:  # a ragged list of lists, say
        raise InvalidArgument(f"{op}: {name} must be {what} (got {_type_name(x)}: {e})") from None


def _arrays(seq, op: str, name: str, real: bool = False) -> list[np.ndarray]:
    """A non-empty sequence of host arrays (one per rank) as a list of ndarrays of a numeric
    dtype (bool, integer, float, complex unless ``real``, ml_dtypes): never strings, objects
    or records."""
    if _not_an_array(seq) or not hasattr(seq, "__len__"):
        raise InvalidType(
            f"{op}: {name} must be a sequence of arrays, one per rank (got {_type_name(seq)})"
        )
    arrs = [_as_array(a, op, f"{name}[{s}]", "an array") for s, a in enumerate(seq)]
    if not arrs:
        raise InvalidArgument(f"{op}: {name} must hold one array per rank (got an empty sequence)")
    what = "a real numeric dtype" if real else "a numeric dtype"
    for s, a in enumerate(arrs):
        if not _is_numeric(a.dtype) or (real and a.dtype.kind == "c"):
            raise InvalidType(f"{op}: {name}[{s}] dtype must be {what} (got {a.dtype})")
    return arrs


def _same_layout(arrs: list[np.ndarray], op: str, name: str, ndim: int, dims: str) -> None:
    """Every array has ``ndim`` dimensions, and the shape and dtype of ``arrs[0]``."""
    a0 = arrs[0]
    if a0.ndim != ndim:
        raise InvalidArgument(
            f"{op}: {name}[0] must have {ndim} dimensions [{dims}] (got shape {a0.shape})"
        )
    for s, a in enumerate(arrs[1:], start=1):
        if a.shape != a0.shape:
            raise InvalidArgument(
                f"{op}: {name}[{s}] shape must equal {name}[0]'s {a0.shape} "
                f"[{dims}] (got {a.shape})"
            )
        if a.dtype != a0.dtype:
            raise InvalidType(
                f"{op}: {name}[{s}] dtype must equal {name}[0]'s {a0.dtype} (got {a.dtype})"
            )


# ----------------------------------------------------------------------------- references
def q_gather_reference(qs: Sequence[np.ndarray]) -> np.ndarray:
    """``all_gather(q, dim=1)``: ``qs[s]`` is rank ``s``'s ``q [T, H_r, D]``; returns
    ``[T, H, D]`` with heads ``[s*H_r, (s+1)*H_r)`` from rank ``s``.

    Raises
    ------
    InvalidArgument
        ``qs`` is empty, or its arrays are not 3-D of one shape.
    InvalidType
        ``qs`` is not a sequence (a string, dict or set is not one), an item is not an array
        or not of a numeric dtype (strings, objects), or the arrays differ in dtype.
    """
    arrs = _arrays(qs, "q_gather_reference", "qs")
    _same_layout(arrs, "q_gather_reference", "qs", 3, "T, H_r, D")
    return np.concatenate(arrs, axis=1)


def kv_gather_reference(kvs: Sequence[np.ndarray]) -> np.ndarray:
    """``all_gather_into_tensor(kv)``: ``kvs[s]`` is rank ``s``'s ``kv [T, D_kv]``; returns
    ``[world_size*T, D_kv]`` with rows ``[s*T, (s+1)*T)`` from rank ``s``.

    Raises as :func:`q_gather_reference`, for 2-D arrays.
    """
    arrs = _arrays(kvs, "kv_gather_reference", "kvs")
    _same_layout(arrs, "kv_gather_reference", "kvs", 2, "T, D_kv")
    return np.concatenate(arrs, axis=0)


def _valid_rows(T: int, seq_lens: np.ndarray | None, qsl: np.ndarray | None) -> np.ndarray:
    """Rows [T] that are not masked: not padding, not a request whose local KV length is 0."""
    valid = np.ones(T, dtype=bool)
    if qsl is None:
        return valid
    qsl = np.asarray(qsl, dtype=np.int64)
    S = len(qsl) - 1
    valid[min(int(qsl[S]), T) :] = False
    if seq_lens is not None:
        sl = np.asarray(seq_lens, dtype=np.int64)
        for i in range(S):
            if sl[i] == 0:
                valid[max(0, int(qsl[i])) : min(T, int(qsl[i + 1]))] = False
    return valid


def _shown(a: np.ndarray) -> str:
    """The values of a 1-D integer array for a message, exact for every integer dtype (a
    uint64 2**63 is not shown as a negative int64); the ends only of a long one."""
    v = a.tolist()
    if len(v) <= 16:
        return str(v)
    return f"[{str(v[:8])[1:-1]}, ..., {str(v[-4:])[1:-1]}] ({len(v)} values)"


def _index_array(
    x, op: str, name: str, dims: str, monotonic: bool = True, maximum: tuple[str, int] | None = None
) -> np.ndarray:
    """``x`` as a 1-D int64 array of non-negative values (non-decreasing if ``monotonic``; at
    most ``maximum = (what, value)``, for example ``("T", 8)``, if given)."""
    what = f"a 1-D integer array [{dims}]"
    if isinstance(x, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in x):
        raise InvalidType(f"{op}: {name} must be {what} (got a {_type_name(x)} holding bools)")
    a = _as_array(x, op, name, what)
    if a.size == 0 and isinstance(x, (list, tuple)):  # [] has no dtype of its own (float64)
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidType(f"{op}: {name} dtype must be an integer dtype (got {a.dtype})")
    if a.ndim != 1:
        raise InvalidArgument(f"{op}: {name} must have 1 dimension [{dims}] (got shape {a.shape})")
    if monotonic and a.size == 0:
        raise InvalidArgument(f"{op}: {name} length must be >= 1 for [{dims}] (got 0)")
    if a.size:
        if int(a.min()) < 0:
            raise InvalidArgument(f"{op}: {name} values must be >= 0 (got {_shown(a)})")
        if maximum is not None and int(a.max()) > maximum[1]:
            raise InvalidArgument(
                f"{op}: {name} values must be <= {maximum[0]} = {maximum[1]} (got {_shown(a)})"
            )
        if int(a.max()) > np.iinfo(np.int64).max:  # a uint64 array: int64 would wrap
            raise InvalidArgument(f"{op}: {name} values must be < 2**63 (got {_shown(a)})")
    a = a.astype(np.int64)
    if monotonic and (np.diff(a) < 0).any():
        raise InvalidArgument(f"{op}: {name} values must be non-decreasing (got {_shown(a)})")
    return a


def lse_reduce_reference(
    out_partials: Sequence[np.ndarray],
    lse_partials: Sequence[np.ndarray],
    *,
    lse_base: float = math.e,
    seq_lens: Sequence[np.ndarray] | None = None,
    query_start_loc: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
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
        Row offsets of the requests, non-decreasing, in ``[0, T]``; rows at or past
        ``query_start_loc[S]`` are padding, empty on every rank.

    Returns
    -------
    out : float64 [T, H, D_v]
        ``sum_s w_s * out_s`` with ``w_s = exp(l_s - m) / sum_j exp(l_j - m)``; sources with
        ``w_s == 0`` are never read (they may hold NaN); all-empty rows are 0.
    lse : float64 [T, H]
        Merged natural-log lse; ``-inf`` for all-empty rows.

    The rows of rank ``r`` are ``out[:, r*H_r:(r+1)*H_r]``.

    Raises
    ------
    InvalidArgument
        Empty sequences, a different number of out and lse partials, shapes that differ
        between ranks or do not match ``[T, H, D_v]`` / ``[T, H]``, ``lse_base`` other than e
        or 2, ``seq_lens`` without ``query_start_loc`` or of the wrong length, an empty,
        negative or decreasing ``query_start_loc`` or one with a value past ``T``, a
        ``seq_lens`` value below 0 or from 2**63 on, a ragged nested list.
    InvalidType
        Arrays that are not of a real numeric dtype (strings, objects, complex numbers);
        a string, dict or set given for a sequence or an array; non-integer ``seq_lens`` /
        ``query_start_loc`` (bools included); a non-numeric ``lse_base``.
    """
    op = "lse_reduce_reference"
    outs = _arrays(out_partials, op, "out_partials", real=True)
    lses = _arrays(lse_partials, op, "lse_partials", real=True)
    W = len(outs)
    if len(lses) != W:
        raise InvalidArgument(
            f"{op}: lse_partials length must equal len(out_partials) = {W}: "
            f"one lse_partial per rank is needed (got {len(lses)})"
        )
    if outs[0].ndim != 3:
        raise InvalidArgument(
            f"{op}: out_partials[0] must have 3 dimensions [T, H, D_v] (got shape {outs[0].shape})"
        )
    T, H, D = outs[0].shape
    for name, arrs, want, dims in (
        ("out_partials", outs, (T, H, D), "T, H, D_v"),
        ("lse_partials", lses, (T, H), "T, H"),
    ):
        for s, a in enumerate(arrs):
            if a.shape != want:
                raise InvalidArgument(
                    f"{op}: {name}[{s}] shape must be {want} [{dims}] (got {a.shape})"
                )
    base = check_lse_base(lse_base, op)
    if seq_lens is not None and query_start_loc is None:
        raise InvalidArgument(f"{op}: seq_lens needs query_start_loc (got query_start_loc=None)")
    qsl = (
        None
        if query_start_loc is None
        else _index_array(query_start_loc, op, "query_start_loc", "S+1", maximum=("T", T))
    )
    sls: list[np.ndarray | None] = [None] * W
    if seq_lens is not None:
        S = len(qsl) - 1
        if _not_an_array(seq_lens) or not hasattr(seq_lens, "__len__"):
            raise InvalidType(
                f"{op}: seq_lens must be a sequence of int arrays [S], one per "
                f"rank (got {_type_name(seq_lens)})"
            )
        if len(seq_lens) != W:
            raise InvalidArgument(
                f"{op}: seq_lens length must be world_size = {W}, one array "
                f"per rank (got {len(seq_lens)})"
            )
        for s in range(W):
            sls[s] = _index_array(seq_lens[s], op, f"seq_lens[{s}]", "S", monotonic=False)
            if len(sls[s]) != S:
                raise InvalidArgument(
                    f"{op}: seq_lens[{s}] length must be "
                    f"len(query_start_loc) - 1 = {S} (got {len(sls[s])})"
                )
    scale = 1.0 if base == math.e else math.log(base)
    lse = np.empty((W, T, H), dtype=np.float64)
    for s in range(W):
        ls = lses[s].astype(np.float64) * scale
        ls[~np.isfinite(ls) & ~np.isneginf(ls)] = -np.inf  # NaN, +inf -> -inf
        valid = _valid_rows(T, sls[s], qsl)
        ls[~valid, :] = -np.inf
        lse[s] = ls
    m = lse.max(axis=0)  # [T, H]
    empty = np.isneginf(m)
    m_safe = np.where(empty, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lse - m_safe[None])  # [W, T, H], 0 for -inf sources
    p[:, empty] = 0.0
    denom = p.sum(axis=0)
    w = np.divide(p, denom[None], out=np.zeros_like(p), where=denom[None] > 0)
    out = np.zeros((T, H, D), dtype=np.float64)
    for s in range(W):
        ws = w[s]
        nz = ws > 0
        if nz.any():
            src = outs[s].astype(np.float64)
            out[nz] += ws[nz][:, None] * src[nz]
    with np.errstate(divide="ignore"):
        merged = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, denom)))
    return out, merged


#: Max abs error of an ``lse_reduce`` output against :func:`lse_reduce_reference`, per output
#: dtype: the ops' three (fp32 accumulation, one rounding to the dtype), and float64 for an
#: implementation that computes in float64 throughout (another reference, say).
LSE_REDUCE_TOLERANCES = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5, "float64": 1e-12}


def lse_reduce_tolerance(dtype) -> float:
    """Max abs error allowed against :func:`lse_reduce_reference` for outputs of ``dtype``
    with inputs of magnitude about 1 (:data:`LSE_REDUCE_TOLERANCES`).

    Parameters
    ----------
    dtype : dtype or dtype name
        An output dtype of the ops, bfloat16, float16 or float32, or float64 (a computation in
        float64 throughout: 1e-12).

    Raises
    ------
    InvalidType
        ``dtype`` is not one of those four (integers, bool, fp8, complex, float128 and names
        NumPy does not know included): no lse_reduce output has it.
    """
    op = "lse_reduce_tolerance"
    dt = resolve_dtype(dtype, op=op)
    tol = LSE_REDUCE_TOLERANCES.get(dt.name) if _is_float(dt) else None
    if tol is None:
        names = ", ".join(LSE_REDUCE_TOLERANCES)
        raise InvalidType(f"{op}: dtype must be one of [{names}] (got {dt})")
    return tol


#: Tolerance of a merged lse (an fp32 max plus the log of an fp32 sum) against the float64
#: reference: absolute below 1, relative to ``|lse|`` above.
MERGED_LSE_TOL = 1e-4


def merged_lse_matches(got, ref) -> np.ndarray:
    """Element-wise: whether a merged lse ``got`` (any float array, e.g. ``out_lse [T, H_r]`` on
    the host) matches the reference ``ref`` (:func:`lse_reduce_reference`'s second result, the
    same shape): ``-inf`` exactly where the reference is ``-inf`` (every source empty), else
    within :data:`MERGED_LSE_TOL` x ``max(1, |ref|)``; NaN never matches.

    Returns
    -------
    numpy.ndarray of bool, the shape of ``ref``.

    Raises
    ------
    InvalidArgument
        ``got`` and ``ref`` differ in shape: no broadcasting, which would let a result of the
        wrong shape (one value against a whole row, say) read as matching.
    """
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if g.shape != r.shape:
        raise InvalidArgument(
            f"merged_lse_matches: got and ref must have the same shape (got {g.shape} and "
            f"{r.shape})"
        )
    with np.errstate(invalid="ignore"):
        return np.where(
            np.isneginf(r),
            np.isneginf(g),
            np.abs(g - r) <= MERGED_LSE_TOL * np.maximum(1.0, np.abs(r)),
        )


# ----------------------------------------------------------------------------- inputs
def _rng(seed: int, rank: int, op: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(rank), _OP_SEEDS[op]])


# Keyword arguments of make_inputs per op: (required, optional).
_GEOMETRY = {
    "q_gather": (("tokens", "num_heads", "head_dim"), ("dtype",)),
    "kv_gather": (("tokens", "row_dim"), ("dtype",)),
    "lse_reduce": (
        ("tokens", "num_heads", "head_dim"),
        ("dtype", "lse_dtype", "lse_base", "num_requests", "empty_fraction", "nonfinite_fraction"),
    ),
}


def make_inputs(rank: int, world_size: int, seed: int, *, op: str, **geometry) -> dict:
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

    ``dtype`` defaults to bfloat16. All arrays are host (NumPy) arrays.

    Raises
    ------
    InvalidArgument
        Unknown ``op``; a required keyword missing or an unknown one given (a typo such as
        ``num_request``); ``world_size < 1``; ``rank`` outside ``[0, world_size)``; a negative
        ``seed``, ``tokens`` or ``num_requests``; ``num_heads`` / ``head_dim`` / ``row_dim`` < 1;
        ``num_heads`` not a multiple of ``world_size`` (q_gather); a fraction outside [0, 1];
        ``lse_base`` other than e or 2.
    InvalidType
        A count that is not an int (bools included), an unknown or non-numeric dtype, a
        non-float ``dtype`` / ``lse_dtype`` for lse_reduce.
    """
    fn = "make_inputs"
    if not isinstance(op, str) or op not in _OP_SEEDS:
        raise InvalidArgument(f"{fn}: op must be one of {sorted(_OP_SEEDS)} (got {op!r})")
    required, optional = _GEOMETRY[op]
    unknown = sorted(k for k in geometry if k not in required and k not in optional)
    if unknown:
        raise InvalidArgument(
            f"{fn}: keyword arguments for op={op!r} must be among "
            f"{list(required + optional)} (got unknown {unknown})"
        )
    missing = [k for k in required if k not in geometry]
    if missing:
        raise InvalidArgument(
            f"{fn}: op={op!r} needs the keyword arguments {list(required)} (missing {missing})"
        )
    W = check_int(world_size, fn, "world_size", minimum=1)
    r = check_int(rank, fn, "rank", minimum=0)
    if r >= W:
        raise InvalidArgument(f"{fn}: rank must lie in [0, {W}) (got {r})")
    seed = check_int(seed, fn, "seed", minimum=0)
    T = check_int(geometry["tokens"], fn, "tokens", minimum=0)
    rng = _rng(seed, r, op)
    dtype = resolve_dtype(geometry.get("dtype", "bfloat16"), op=fn)
    if op == "q_gather":
        H = check_int(geometry["num_heads"], fn, "num_heads", minimum=1)
        D = check_int(geometry["head_dim"], fn, "head_dim", minimum=1)
        if H % W:
            raise InvalidArgument(f"{fn}: num_heads must be a multiple of world_size {W} (got {H})")
        return {"q": _random(rng, (T, H // W, D), dtype, fn, "dtype")}
    if op == "kv_gather":
        D = check_int(geometry["row_dim"], fn, "row_dim", minimum=1)
        return {"kv": _random(rng, (T, D), dtype, fn, "dtype")}
    # lse_reduce
    H = check_int(geometry["num_heads"], fn, "num_heads", minimum=1)
    D = check_int(geometry["head_dim"], fn, "head_dim", minimum=1)
    lse_dtype = resolve_dtype(geometry.get("lse_dtype", "float32"), op=fn, name="lse_dtype")
    for name, dt in (("dtype", dtype), ("lse_dtype", lse_dtype)):
        if not _is_float(dt):
            raise InvalidType(
                f"{fn}: {name} must be a floating dtype for op='lse_reduce' (got {dt})"
            )
    base = check_lse_base(geometry.get("lse_base", math.e), fn)
    empty_fraction = _fraction(geometry.get("empty_fraction", 0.05), fn, "empty_fraction")
    nonfinite_fraction = _fraction(
        geometry.get("nonfinite_fraction", 0.01), fn, "nonfinite_fraction"
    )
    S = check_int(geometry.get("num_requests", 0), fn, "num_requests", minimum=0)
    out = rng.standard_normal((T, H, D), dtype=np.float32)
    lse = rng.normal(4.0, 2.0, size=(T, H)).astype(np.float64)
    if base != math.e:
        lse = lse / math.log(base)
    empty = rng.random((T, H)) < empty_fraction
    lse[empty] = -np.inf
    out[empty] = np.nan  # an empty source's payload must never be read
    bad = rng.random((T, H)) < nonfinite_fraction
    lse[bad] = np.where(rng.random(int(bad.sum())) < 0.5, np.nan, np.inf)
    out[bad] = np.nan
    seq_lens = qsl = None
    if S > 0:
        # query_start_loc must be equal on every rank: draw it from a rank-independent stream.
        shared = np.random.default_rng([seed, 0x5EED, S, T])
        cuts = np.sort(shared.integers(0, T + 1, size=S - 1)) if S > 1 else np.zeros(0, int)
        used = int(shared.integers(max(0, T - 2), T + 1))  # a few padding rows at the end
        qsl = np.concatenate([[0], np.minimum(cuts, used), [used]]).astype(np.int32)
        seq_lens = rng.integers(1, 1000, size=S).astype(np.int32)
        seq_lens[rng.random(S) < 0.3] = 0
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf into the narrow dtypes
        return {
            "out_partial": out.astype(dtype),
            "lse_partial": lse.astype(lse_dtype),
            "seq_lens": seq_lens,
            "query_start_loc": qsl,
        }
