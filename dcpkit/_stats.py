"""The numbers of ``python -m dcpkit bench``: statistics over timed samples, bandwidths, the
physical floor, and the evaluation of the performance targets (issue 8). Pure Python: no GPU, no
CuPy, so CPU tests check every formula on synthetic timings.

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
    its links, with both ceilings measured in the same run (dcpkit/bench.py, kernels/ceilings.cu).
algbw, busbw
    ``algbw = bytes_per_rank / time``. ``busbw`` follows nccl-tests: for all_gather
    ``(W-1)/W * total_gathered_bytes / time``, for all_to_all ``(W-1)/W * bytes_sent_per_rank /
    time``; both equal ``egress_bytes / time``, the rate of this rank's links, directly comparable
    with the egress ceiling. GB = 1e9 bytes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

__all__ = [
    "median", "percentile", "summarize", "max_over_ranks", "geometry_bytes", "algbw_GBps",
    "busbw_GBps", "nccl_tests_busbw_GBps", "floor_us", "annotate", "TARGETS", "Target",
    "evaluate_targets", "DIRECT_PATHS", "NCCL_PATHS", "target_summary",
]

#: Paths that run dcpkit's own kernels, and paths that run NCCL (the baselines).
DIRECT_PATHS = ("direct", "direct-pull", "multicast")
NCCL_PATHS = ("nccl", "torch")


# ----------------------------------------------------------------------------- statistics
def _finite(xs: Iterable[Optional[float]]) -> List[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(float(x))]


def median(xs: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the finite values (mean of the middle two for an even count); None if
    there are none."""
    v = sorted(_finite(xs))
    if not v:
        return None
    n = len(v)
    mid = n // 2
    return v[mid] if n % 2 else 0.5 * (v[mid - 1] + v[mid])


def percentile(xs: Iterable[Optional[float]], q: float) -> Optional[float]:
    """The nearest-rank percentile ``q`` (0 < q <= 100) of the finite values: the smallest value
    with at least ``q`` % of the values at or below it. None if there are none."""
    if not (0.0 < q <= 100.0):
        raise ValueError(f"percentile: q must lie in (0, 100] (got {q})")
    v = sorted(_finite(xs))
    if not v:
        return None
    k = max(1, math.ceil(q / 100.0 * len(v)))
    return v[k - 1]


def summarize(times_us: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
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


def max_over_ranks(per_rank: Sequence[Optional[Sequence[Optional[float]]]]) -> List[float]:
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
        raise ValueError("max_over_ranks: every rank must hold the same number of samples "
                         f"(got {[len(p) for p in lists]})")
    out = []
    for i in range(n):
        vals = [p[i] for p in lists]
        if any(v is None or not math.isfinite(float(v)) for v in vals):
            raise ValueError(f"max_over_ranks: sample {i} is not a finite number on every rank "
                             f"(got {vals})")
        out.append(max(float(v) for v in vals))
    return out


# ----------------------------------------------------------------------------- bytes and rates
def geometry_bytes(op: str, geom: Mapping[str, Any], world_size: int) -> Dict[str, int]:
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
        return {"bytes_per_rank": q["bytes_per_rank"] + lse["bytes_per_rank"],
                "egress_bytes": q["egress_bytes"] + lse["egress_bytes"], "exchanges": 2}
    raise ValueError(f"geometry_bytes: op must be one of q_gather, kv_gather, lse_reduce, "
                     f"decode_layer (got {op!r})")


def algbw_GBps(bytes_per_rank: float, time_us: Optional[float]) -> Optional[float]:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): bytes per rank / time."""
    if time_us is None or time_us <= 0:
        return None
    return bytes_per_rank / (time_us * 1e3)


def busbw_GBps(egress_bytes: float, time_us: Optional[float]) -> Optional[float]:
    """Bus bandwidth in GB/s: this rank's egress bytes / time (equal to nccl-tests' busbw for
    all_gather and all_to_all, see :func:`nccl_tests_busbw_GBps`)."""
    if time_us is None or time_us <= 0:
        return None
    return egress_bytes / (time_us * 1e3)


def nccl_tests_busbw_GBps(collective: str, size_bytes: float, world_size: int,
                          time_us: float) -> float:
    """nccl-tests' bus bandwidth, from its own definitions (``src/all_gather.cu``,
    ``src/alltoall.cu``): ``size`` is the total gathered bytes (all_gather) or the bytes each rank
    sends including its own part (all_to_all); ``busbw = size / time * (W - 1) / W``."""
    if collective not in ("all_gather", "all_to_all"):
        raise ValueError(f"nccl_tests_busbw_GBps: collective must be all_gather or all_to_all "
                         f"(got {collective!r})")
    W = int(world_size)
    return size_bytes / (time_us * 1e3) * (W - 1) / W


def floor_us(egress_bytes: float, latency_us: Optional[float], egress_GBps: Optional[float],
             exchanges: int = 1) -> Optional[float]:
    """The physical floor of one call: ``exchanges * latency_us + egress_bytes / egress_GBps``
    (µs). None when a ceiling is missing."""
    if latency_us is None or egress_GBps is None or egress_GBps <= 0:
        return None
    return exchanges * latency_us + egress_bytes / (egress_GBps * 1e3)


def _case_key(row: Mapping[str, Any]):
    return (row["op"], row.get("T"), row.get("nominal_bytes"), row["mode"])


def annotate(rows: List[Dict[str, Any]], ceilings: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Fill the derived fields of every row in place (and return the rows).

    A row holds what the harness measured: ``op``, ``path``, ``mode``, ``T``, ``nominal_bytes``,
    ``bytes_per_rank``, ``egress_bytes``, ``exchanges``, ``times_us`` (iteration times) and
    ``wrong``, ``error``. Added: the :func:`summarize` fields, ``algbw_GBps``, ``busbw_GBps``,
    ``floor_us``, ``x_floor`` (median / floor), ``busbw_frac`` (busbw / egress ceiling),
    ``speedup_vs_nccl`` (median of the fastest NCCL path of the same case and mode / this
    median) and ``baseline_path`` (that NCCL path).
    """
    lat = ceilings.get("one_way_latency_us") if ceilings else None
    egr = ceilings.get("egress_GBps") if ceilings else None
    for r in rows:
        stats = summarize(r.get("times_us") or [])
        r.update(stats)
        med = stats["median_us"]
        r["algbw_GBps"] = algbw_GBps(r.get("bytes_per_rank", 0), med)
        r["busbw_GBps"] = busbw_GBps(r.get("egress_bytes", 0), med)
        r["floor_us"] = floor_us(r.get("egress_bytes", 0), lat, egr, int(r.get("exchanges", 1)))
        r["x_floor"] = (med / r["floor_us"]) if (med is not None and r["floor_us"]) else None
        r["busbw_frac"] = (r["busbw_GBps"] / egr) if (r["busbw_GBps"] is not None and egr) \
            else None
    best: Dict[Any, Dict[str, Any]] = {}
    for r in rows:
        if r["path"] in NCCL_PATHS and r.get("median_us") is not None and not r.get("error") \
                and not r.get("wrong"):
            k = _case_key(r)
            if k not in best or r["median_us"] < best[k]["median_us"]:
                best[k] = r
    for r in rows:
        b = best.get(_case_key(r))
        if b is not None and r.get("median_us"):
            r["speedup_vs_nccl"] = b["median_us"] / r["median_us"]
            r["baseline_path"] = b["path"]
        else:
            r["speedup_vs_nccl"] = None
            r["baseline_path"] = None
    return rows


# ----------------------------------------------------------------------------- targets
KiB, MiB = 1024, 1024 * 1024


class Target:
    """One target of issue 8, evaluated on every matching row of a direct path.

    ``select(row)`` picks the rows, ``metric`` names the row field compared, ``limit(row)`` gives
    the bound (None when a ceiling it needs is missing), ``sense`` is ``"<="`` or ``">="``.
    """

    def __init__(self, key: str, text: str, ops: Sequence[str], modes: Sequence[str],
                 select, metric: str, limit, sense: str):
        self.key, self.text, self.ops, self.modes = key, text, tuple(ops), tuple(modes)
        self.select, self.metric, self.limit, self.sense = select, metric, limit, sense

    def __repr__(self) -> str:
        return f"Target({self.key!r})"


def _const(v):
    return lambda row: v


def _floor_plus(add):
    return lambda row: None if row.get("floor_us") is None else row["floor_us"] + add


def _floor_times(mul):
    return lambda row: None if row.get("floor_us") is None else row["floor_us"] * mul


def _latency_targets(op: str, t1_us: float) -> List[Target]:
    g = ("graph",)
    return [
        Target(f"{op}.t1", f"{op} in a graph: <= {t1_us:g} us at T = 1", [op], g,
               lambda r: r.get("T") == 1, "median_us", _const(t1_us), "<="),
        Target(f"{op}.floor_small", f"{op} in a graph: <= floor + 2.5 us for T <= 8", [op], g,
               lambda r: (r.get("T") or 0) <= 8, "median_us", _floor_plus(2.5), "<="),
        Target(f"{op}.floor_large", f"{op} in a graph: <= 1.15x floor for T >= 32", [op], g,
               lambda r: (r.get("T") or 0) >= 32, "median_us", _floor_times(1.15), "<="),
        Target(f"{op}.nccl_small", f"{op} in a graph: >= 3x NCCL for T <= 8", [op], g,
               lambda r: (r.get("T") or 0) <= 8, "speedup_vs_nccl", _const(3.0), ">="),
        Target(f"{op}.nccl_128", f"{op} in a graph: >= 1.5x NCCL at T = 128", [op], g,
               lambda r: r.get("T") == 128, "speedup_vs_nccl", _const(1.5), ">="),
    ]


#: The targets of issue 8 (defined for 4 x H200, bf16), in the issue's order.
TARGETS: List[Target] = (
    _latency_targets("q_gather", 4.0)
    + _latency_targets("lse_reduce", 5.0)
    + [
        Target("decode_layer.graph", "decode layer (q_gather + lse_reduce), batch 8, in a graph: "
               "<= 10 us", ["decode_layer"], ("graph",), lambda r: True, "median_us",
               _const(10.0), "<="),
        Target("kv_gather.nccl_small", "kv_gather <= 256 KiB per rank, in a graph: >= 3x NCCL",
               ["kv_gather"], ("graph",),
               lambda r: (r.get("nominal_bytes") or 0) <= 256 * KiB, "speedup_vs_nccl",
               _const(3.0), ">="),
        Target("kv_gather.ceiling_large", "kv_gather >= 16 MiB per rank: >= 95% of the egress "
               "ceiling", ["kv_gather"], ("graph", "eager"),
               lambda r: (r.get("nominal_bytes") or 0) >= 16 * MiB, "busbw_frac", _const(0.95),
               ">="),
        Target("kv_gather.nccl_large", "kv_gather >= 16 MiB per rank: >= 1.1x NCCL",
               ["kv_gather"], ("graph", "eager"),
               lambda r: (r.get("nominal_bytes") or 0) >= 16 * MiB, "speedup_vs_nccl",
               _const(1.1), ">="),
        Target("eager.t8", "every op, eager (host launch included), T <= 8: <= 15 us per call",
               ["q_gather", "lse_reduce", "kv_gather"], ("eager",),
               lambda r: (r.get("T") or 0) <= 8, "median_us", _const(15.0), "<="),
    ]
)


def evaluate_targets(rows: Sequence[Mapping[str, Any]],
                     targets: Sequence[Target] = TARGETS) -> List[Dict[str, Any]]:
    """Evaluate every target on every matching row of a direct path (rows already
    :func:`annotate`-d).

    Returns one item per (target, row): ``target``, ``text``, ``op``, ``path``, ``mode``, ``T``,
    ``nominal_bytes``, ``metric``, ``value``, ``limit``, ``sense``, ``met`` (True, False, or None
    when it could not be measured) and ``note``. A row with wrong results never meets a target.
    A target that matches no row gives one item with ``met`` None ("not measured").
    """
    items: List[Dict[str, Any]] = []
    for t in targets:
        matched = [r for r in rows if r["op"] in t.ops and r["mode"] in t.modes
                   and r["path"] in DIRECT_PATHS and t.select(r)]
        if not matched:
            items.append({"target": t.key, "text": t.text, "op": "/".join(t.ops), "path": None,
                          "mode": "/".join(t.modes), "T": None, "nominal_bytes": None,
                          "metric": t.metric, "value": None, "limit": None, "sense": t.sense,
                          "met": None, "note": "not measured (no such row in this run)"})
            continue
        for r in sorted(matched, key=lambda r: (r["op"], r["path"], r["mode"],
                                                r.get("nominal_bytes") or 0, r.get("T") or 0)):
            value = r.get(t.metric)
            limit = t.limit(r)
            met: Optional[bool]
            note = ""
            if r.get("error"):
                met, note = None, f"error: {str(r['error'])[:120]}"
            elif value is None or limit is None:
                met = None
                note = ("no NCCL baseline in this run" if t.metric == "speedup_vs_nccl" and
                        value is None else "a ceiling was not measured")
            else:
                met = value <= limit if t.sense == "<=" else value >= limit
                if r.get("wrong"):
                    met, note = False, f"{r['wrong']} wrong results"
            items.append({"target": t.key, "text": t.text, "op": r["op"], "path": r["path"],
                          "mode": r["mode"], "T": r.get("T"),
                          "nominal_bytes": r.get("nominal_bytes"), "metric": t.metric,
                          "value": value, "limit": limit, "sense": t.sense, "met": met,
                          "note": note})
    return items


def target_summary(items: Sequence[Mapping[str, Any]]) -> Dict[str, int]:
    """Counts of ``met``, ``missed`` and ``not_measured`` items."""
    return {"met": sum(1 for i in items if i["met"] is True),
            "missed": sum(1 for i in items if i["met"] is False),
            "not_measured": sum(1 for i in items if i["met"] is None)}
