"""The numbers of ``python -m dcpkit bench``: statistics over timed samples, bandwidths, the
physical floor, and the derived fields of every row. Pure Python: no GPU, no CuPy, so CPU tests
check every formula on synthetic timings.

Vocabulary
----------
sample
    One timed region on one rank: ``n`` back-to-back calls (eager) or ``r`` replays of a graph of
    ``K`` calls, timed with device events; its value is the time per call in µs.
iteration time
    The maximum over ranks of sample ``i`` (nccl-tests takes the slowest rank too): a collective is
    done when its last rank is done.
floor
    ``exchanges * one_way_latency_us + egress_bytes / egress_ceiling``: the time a perfect
    implementation needs to tell every peer "data ready" and push this rank's egress bytes through
    its links, with both ceilings measured in the same run (kernels/ceilings.cu).
floor kernel
    The ``floor`` path: a minimal exchange kernel (``floor_kernel`` in kernels/ceilings.cu) that
    moves the row's egress bytes with the op's CTAs and the minimal publish / wait protocol, timed
    exactly like the op. Every op row carries its median as ``floor_kernel_us``: the floor row
    of its own grid (a pull row's is the ``pull_grid`` floor row where the run has one).
algbw, busbw
    ``algbw = bytes_per_rank / time``. ``busbw`` follows nccl-tests: for all_gather
    ``(W-1)/W * total_gathered_bytes / time``, for all_to_all ``(W-1)/W * bytes_sent_per_rank /
    time``; both equal ``egress_bytes / time``, the rate of this rank's links, directly comparable
    with the egress ceiling. GB = 1e9 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .common import FLOOR_PATH, FLOOR_PULL_GRID, NCCL_PATHS, PEER_PATHS, PULL_PATH
from .row import BenchRow, case_key

__all__ = [
    "median",
    "percentile",
    "summarize",
    "max_over_ranks",
    "geometry_bytes",
    "floor_bytes_per_peer",
    "algbw_GBps",
    "busbw_GBps",
    "nccl_tests_busbw_GBps",
    "floor_us",
    "annotate",
    "annotate_json",
    "DIRECT_PATHS",
    "NCCL_PATHS",
    "PEER_PATHS",
]

#: Paths that run dcpkit's own kernels (the rows the targets judge).
DIRECT_PATHS = ("direct", "direct-pull", "multicast")


# ----------------------------------------------------------------------------- statistics
def _finite(xs: Iterable[float | None]) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(float(x))]


def median(xs: Iterable[float | None]) -> float | None:
    """The median of the finite values (mean of the middle two for an even count); None if
    there are none."""
    v = sorted(_finite(xs))
    if not v:
        return None
    n = len(v)
    mid = n // 2
    return v[mid] if n % 2 else 0.5 * (v[mid - 1] + v[mid])


def percentile(xs: Iterable[float | None], q: float) -> float | None:
    """The nearest-rank percentile ``q`` (0 < q <= 100) of the finite values: the smallest value
    with at least ``q`` % of the values at or below it. None if there are none."""
    if not (0.0 < q <= 100.0):
        raise ValueError(f"percentile: q must lie in (0, 100] (got {q})")
    v = sorted(_finite(xs))
    if not v:
        return None
    k = max(1, math.ceil(q / 100.0 * len(v)))
    return v[k - 1]


def summarize(times_us: Sequence[float | None]) -> dict[str, float | None]:
    """``median_us``, ``p95_us``, ``min_us``, ``max_us``, ``mean_us`` and ``samples`` of the
    iteration times (µs per call)."""
    v = _finite(times_us)
    return {
        "median_us": median(v),
        "p95_us": percentile(v, 95.0),
        "min_us": min(v) if v else None,
        "max_us": max(v) if v else None,
        "mean_us": (sum(v) / len(v)) if v else None,
        "samples": len(v),
    }


def max_over_ranks(per_rank: Sequence[Sequence[float | None] | None]) -> list[float]:
    """Iteration times: element ``i`` is the maximum over ranks of each rank's sample ``i``.

    ``per_rank[r]`` is rank ``r``'s list of samples, or None for a rank that took no part (the
    ping-pong runs on two ranks only). Every participating rank must hold the same number of
    samples: the ranks time the same iterations.

    Raises
    ------
    ValueError
        The ranks hold different numbers of samples, or a sample is not a finite number.
    """
    lists = [list(p) for p in per_rank if p is not None]
    if not lists:
        return []
    n = len(lists[0])
    if any(len(p) != n for p in lists):
        raise ValueError(
            "max_over_ranks: every rank must hold the same number of samples "
            f"(got {[len(p) for p in lists]})"
        )
    out = []
    for i in range(n):
        vals = [p[i] for p in lists]
        if any(v is None or not math.isfinite(float(v)) for v in vals):
            raise ValueError(
                f"max_over_ranks: sample {i} is not a finite number on every rank (got {vals})"
            )
        out.append(max(float(v) for v in vals))
    return out


def _summary(v: list[float]) -> dict[str, float | None]:
    out = summarize(v)
    out["p90_us"] = percentile(v, 90.0) if v else None
    return out


# ----------------------------------------------------------------------------- bytes and rates
def geometry_bytes(op: str, geom: Mapping[str, Any], world_size: int) -> dict[str, int]:
    """Bytes of one call of ``op`` with geometry ``geom`` on ``world_size`` ranks.

    Returns ``bytes_per_rank`` (what nccl-tests calls the size: the input of all_gather, the send
    buffer of all_to_all), ``egress_bytes`` (bytes this rank must send to its peers) and
    ``exchanges`` (dependent cross-rank exchanges: each costs one one-way latency).

    ``geom`` keys: ``T``, ``itemsize`` and ``H``, ``D`` (q_gather), ``D_kv`` (kv_gather), ``H``,
    ``D_v`` (lse_reduce, lse sent as float32), ``H``, ``D``, ``D_v`` (decode_layer = q_gather +
    lse_reduce at the same ``T``).
    """
    W = int(world_size)
    T, isz = int(geom["T"]), int(geom.get("itemsize", 2))
    if op == "q_gather":
        per = T * (int(geom["H"]) // W) * int(geom["D"]) * isz
        return {"bytes_per_rank": per, "egress_bytes": (W - 1) * per, "exchanges": 1}
    if op == "kv_gather":
        per = T * int(geom["D_kv"]) * isz
        return {"bytes_per_rank": per, "egress_bytes": (W - 1) * per, "exchanges": 1}
    if op == "lse_reduce":
        H, Dv = int(geom["H"]), int(geom["D_v"])
        per = T * H * (Dv * isz + 4)
        return {"bytes_per_rank": per, "egress_bytes": (W - 1) * (per // W), "exchanges": 1}
    if op == "decode_layer":
        q = geometry_bytes("q_gather", geom, W)
        lse = geometry_bytes("lse_reduce", geom, W)
        return {
            "bytes_per_rank": q["bytes_per_rank"] + lse["bytes_per_rank"],
            "egress_bytes": q["egress_bytes"] + lse["egress_bytes"],
            "exchanges": 2,
        }
    raise ValueError(
        f"geometry_bytes: op must be one of q_gather, kv_gather, lse_reduce, "
        f"decode_layer (got {op!r})"
    )


def algbw_GBps(bytes_per_rank: float, time_us: float | None) -> float | None:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): bytes per rank / time."""
    if time_us is None or time_us <= 0:
        return None
    return bytes_per_rank / (time_us * 1e3)


def busbw_GBps(egress_bytes: float, time_us: float | None) -> float | None:
    """Bus bandwidth in GB/s: this rank's egress bytes / time (equal to nccl-tests' busbw for
    all_gather and all_to_all, see :func:`nccl_tests_busbw_GBps`)."""
    if time_us is None or time_us <= 0:
        return None
    return egress_bytes / (time_us * 1e3)


def nccl_tests_busbw_GBps(
    collective: str, size_bytes: float, world_size: int, time_us: float
) -> float:
    """nccl-tests' bus bandwidth, from its own definitions (``src/all_gather.cu``,
    ``src/alltoall.cu``): ``size`` is the total gathered bytes (all_gather) or the bytes each rank
    sends including its own part (all_to_all); ``busbw = size / time * (W - 1) / W``."""
    if collective not in ("all_gather", "all_to_all"):
        raise ValueError(
            f"nccl_tests_busbw_GBps: collective must be all_gather or all_to_all "
            f"(got {collective!r})"
        )
    W = int(world_size)
    return size_bytes / (time_us * 1e3) * (W - 1) / W


def floor_us(
    egress_bytes: float, latency_us: float | None, egress_GBps: float | None, exchanges: int = 1
) -> float | None:
    """The physical floor of one call: ``exchanges * latency_us + egress_bytes / egress_GBps``
    (µs). None when a ceiling is missing."""
    if latency_us is None or egress_GBps is None or egress_GBps <= 0:
        return None
    return exchanges * latency_us + egress_bytes / (egress_GBps * 1e3)


def floor_bytes_per_peer(op: str, geom: Mapping[str, Any], world_size: int) -> int:
    """Bytes the floor kernel stores into each peer for one call of ``op`` (the op's egress to
    one peer): q_gather ``T*H_r*D*itemsize``, lse_reduce ``T*H_r*(D_v*itemsize + 4)``, kv_gather
    ``T*D_kv*itemsize``. decode_layer has two floor kernels (q_gather's and lse_reduce's)."""
    W = int(world_size)
    b = geometry_bytes(op, geom, W)
    if op == "decode_layer":
        raise ValueError(
            "floor_bytes_per_peer: decode_layer runs the floor kernels of q_gather and lse_reduce"
        )
    return b["egress_bytes"] // max(1, W - 1)


def _best(
    rows: Sequence[BenchRow], paths: Sequence[str], variant: str | None = None
) -> dict[Any, BenchRow]:
    """Per case and mode, the fastest correct row of ``paths`` and ``variant`` (default: the
    variant-free build)."""
    best: dict[Any, BenchRow] = {}
    for r in rows:
        if (
            (r.path in paths or any(r.path.startswith(p) for p in paths))
            and r.median_us is not None
            and not r.error
            and not r.wrong
            and r.variant == variant
        ):
            k = case_key(vars(r))
            if k not in best or r.median_us < best[k].median_us:
                best[k] = r
    return best


def annotate(rows: list[BenchRow], ceilings: Mapping[str, Any]) -> list[BenchRow]:
    """Fill the derived fields of every row in place (and return the rows); see
    :class:`~dcpkit.bench.row.BenchRow` for what each means."""
    lat = ceilings.get("one_way_latency_us") if ceilings else None
    egr = ceilings.get("egress_GBps") if ceilings else None
    for r in rows:
        for k, v in _summary(_finite(r.times_us or [])).items():
            setattr(r, k, v)
        med = r.median_us
        r.algbw_GBps = algbw_GBps(r.bytes_per_rank or 0, med)
        r.busbw_GBps = busbw_GBps(r.egress_bytes or 0, med)
        r.floor_us = floor_us(r.egress_bytes or 0, lat, egr, int(r.exchanges or 1))
        r.x_floor = (med / r.floor_us) if (med is not None and r.floor_us) else None
        r.busbw_frac = (r.busbw_GBps / egr) if (r.busbw_GBps is not None and egr) else None
    floors = _best(rows, (FLOOR_PATH,))
    # The floor row on the pull path's grid, where that differs from the push path's (the
    # floor row without a variant has the push grid). Where the run has one, even a failed
    # one, the pull rows are compared with it alone: the other grid's floor is not theirs.
    pull_floors = _best(rows, (FLOOR_PATH,), FLOOR_PULL_GRID)
    pull_cases = {
        case_key(vars(r)) for r in rows if r.path == FLOOR_PATH and r.variant == FLOOR_PULL_GRID
    }
    nccl = _best(rows, NCCL_PATHS)
    peer = _best(rows, PEER_PATHS)
    for r in rows:
        k = case_key(vars(r))
        if r.path == FLOOR_PATH:
            f = None  # not a row's own baseline
        elif r.path == PULL_PATH and k in pull_cases:
            f = pull_floors.get(k)
        else:
            f = floors.get(k)
        r.floor_kernel_us = f.median_us if f is not None else None
        r.x_floor_kernel = (
            (r.median_us / r.floor_kernel_us) if (r.median_us and r.floor_kernel_us) else None
        )
        b = nccl.get(k)
        r.speedup_vs_nccl = b.median_us / r.median_us if (b is not None and r.median_us) else None
        r.baseline_path = b.path if (b is not None and r.median_us) else None
        p = peer.get(k) if not r.path.startswith(PEER_PATHS) else None
        r.speedup_vs_peer = p.median_us / r.median_us if (p is not None and r.median_us) else None
        r.peer_path = p.path if (p is not None and r.median_us) else None
    return rows


def annotate_json(
    rows: Sequence[Mapping[str, Any]], ceilings: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """:func:`annotate` on JSON rows; returns new JSON rows."""
    return [r.to_json() for r in annotate([BenchRow.from_json(d) for d in rows], ceilings)]
