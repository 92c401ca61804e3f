"""The performance targets of the benchmark, judged from one run's JSON rows.

Each :class:`Target` picks dcpkit's rows (``direct``, ``direct-pull``, ``multicast``; the build
as shipped), computes a value and a limit per row, and compares them. The machine-independent
targets hold on ranks sharing one GPU under MPS as well as on one GPU per rank, because their
limits are measured in the same run (the floor kernel, the egress ceiling, the same op's other
mode, the peer library). The NVLink targets are absolute and judged only when every rank has a
GPU of its own; on a shared GPU they read "n/a (ranks share a GPU)".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .common import KiB, MiB
from .stats import DIRECT_PATHS

__all__ = ["Target", "TARGETS", "evaluate_targets", "target_summary", "SHARED_GPU_NOTE"]

SHARED_GPU_NOTE = "ranks share a GPU"  # shown as "n/a (ranks share a GPU)"

Rows = Sequence[Mapping[str, Any]]
Fn = Callable[[Mapping[str, Any], Rows], float | None]


class Target:
    """One target, evaluated on every matching row of a dcpkit path.

    Parameters
    ----------
    key, text : str
        Short name and the sentence shown in the table.
    ops, modes : sequence of str
    select : callable(row) -> bool
        Picks the rows among those of ``ops`` and ``modes``.
    metric : str
        What is compared (a row field, or a name of the ``value`` function).
    limit : callable(row, rows) -> float or None
        The bound (None when what it needs was not measured).
    sense : {"<=", ">="}
    value : callable(row, rows) -> float or None, optional
        The measured value (default: the row's ``metric`` field).
    nvlink_only : bool
        Judged only when every rank has a GPU of its own.
    missing : str
        The note when the value or the limit is None.
    """

    def __init__(
        self,
        key: str,
        text: str,
        ops: Sequence[str],
        modes: Sequence[str],
        select: Callable[[Mapping[str, Any]], bool],
        metric: str,
        limit: Fn,
        sense: str,
        value: Fn | None = None,
        nvlink_only: bool = False,
        missing: str = "not measured in this run",
    ):
        self.key, self.text, self.ops, self.modes = key, text, tuple(ops), tuple(modes)
        self.select, self.metric, self.limit, self.sense = select, metric, limit, sense
        self.value = value or (lambda row, rows: row.get(metric))
        self.nvlink_only, self.missing = nvlink_only, missing

    def __repr__(self) -> str:
        return f"Target({self.key!r})"


def _const(v: float) -> Fn:
    return lambda row, rows: v


def _field_times(name: str, mul: float, add: float = 0.0) -> Fn:
    def f(row, rows):
        v = row.get(name)
        return None if v is None else mul * v + add

    return f


def _same_case(row, rows, **kw):
    for r in rows:
        if (
            r["op"] == row["op"]
            and r.get("T") == row.get("T")
            and r.get("nominal_bytes") == row.get("nominal_bytes")
            and all(r.get(k) == v for k, v in kw.items())
            and not r.get("error")
            and not r.get("wrong")
        ):
            return r
    return None


def _other_mode_median(mode: str, mul: float) -> Fn:
    def f(row, rows):
        r = _same_case(row, rows, path=row["path"], mode=mode, variant=None)
        return None if r is None or r.get("median_us") is None else mul * r["median_us"]

    return f


def _self_check_pair(row, rows):
    """The rows the self-check cost is judged on: the paired rows (both builds timed in
    alternating samples of one stage) where the run has them, else the op's row and the
    ``no_self_check`` row measured after it."""
    kw = {"path": row["path"], "mode": row["mode"]}
    a = _same_case(row, rows, variant="paired", **kw)
    b = _same_case(row, rows, variant="paired_no_self_check", **kw)
    if a is not None and b is not None:
        return a, b
    return row, _same_case(row, rows, variant="no_self_check", **kw)


def _self_check_value(row, rows):
    return _self_check_pair(row, rows)[0].get("median_us")


def _self_check_limit(row, rows):
    """Median without self-checking signals + the larger spread (p90 - median) of the two."""
    a, r = _self_check_pair(row, rows)
    if r is None or r.get("median_us") is None or a.get("median_us") is None:
        return None
    spread = max(
        (a.get("p90_us") or a["median_us"]) - a["median_us"],
        (r.get("p90_us") or r["median_us"]) - r["median_us"],
    )
    return r["median_us"] + spread


def _large(row) -> bool:
    if row["op"] == "kv_gather":
        return row.get("_largest", False)
    return row.get("T") == 128


_SMALL_OPS = ("q_gather", "lse_reduce", "kv_gather")
_BOTH = ("eager", "graph")
_G = ("graph",)

#: The NVLink latency targets of one call at T=1 in a CUDA graph: op -> limit in us.
_NVLINK_T1_US = {"q_gather": 3.0, "lse_reduce": 3.5}


def _nvlink_t1(op: str, limit_us: float) -> Target:
    """The NVLink target "``op`` T=1, graph: median <= ``limit_us``"."""
    return Target(
        f"nvlink.{op}_t1",
        f"NVLink: {op} T=1, graph: <= {limit_us:g} us",
        (op,),
        _G,
        lambda r: r.get("T") == 1,
        "median_us",
        _const(limit_us),
        "<=",
        nvlink_only=True,
    )


#: The targets, in the order of the table.
TARGETS: list[Target] = [
    Target(
        "small.floor_kernel",
        "T <= 8, graph: <= 1.1x floor kernel + 0.3 us",
        _SMALL_OPS,
        _G,
        lambda r: (r.get("T") or 0) <= 8,
        "median_us",
        _field_times("floor_kernel_us", 1.1, 0.3),
        "<=",
        missing="no floor kernel row in this run",
    ),
    Target(
        "decode_layer.floor_kernel",
        "decode layer T=8, graph: <= 1.1x the sum of its two floor kernels",
        ("decode_layer",),
        _G,
        lambda r: r.get("T") == 8,
        "median_us",
        _field_times("floor_kernel_us", 1.1),
        "<=",
        missing="no floor kernel row in this run",
    ),
    Target(
        "large.ceiling",
        "large sizes (T=128; kv_gather's largest): <= 1.4x (bytes / egress ceiling + L)",
        _SMALL_OPS,
        _BOTH,
        _large,
        "median_us",
        _field_times("floor_us", 1.4),
        "<=",
        missing="a ceiling was not measured",
    ),
    Target(
        "large.graph_vs_eager",
        "large sizes, graph: <= 1.1x eager",
        _SMALL_OPS,
        _G,
        _large,
        "median_us",
        _other_mode_median("eager", 1.1),
        "<=",
        missing="no eager row of this case",
    ),
    Target(
        "self_check.cost",
        "self-checking signals, T=1 graph: cost within noise of a build "
        "without them (median <= its median + the larger p90 - median spread; both timed "
        "in alternating samples where the run has the paired rows)",
        ("q_gather", "lse_reduce"),
        _G,
        lambda r: r.get("T") == 1,
        "median_us",
        _self_check_limit,
        "<=",
        value=_self_check_value,
        missing="the op has no _self_check keyword, or no such row",
    ),
    Target(
        "peer.small",
        "dcpkit vs NVSHMEM, T <= 8: >= 1.5x",
        _SMALL_OPS + ("decode_layer",),
        _BOTH,
        lambda r: (r.get("T") or 0) <= 8,
        "speedup_vs_peer",
        _const(1.5),
        ">=",
        missing="no NVSHMEM row of this case",
    ),
    Target(
        "peer.any",
        "dcpkit vs NVSHMEM, every size: not slower (>= 1.0x)",
        _SMALL_OPS + ("decode_layer",),
        _BOTH,
        lambda r: True,
        "speedup_vs_peer",
        _const(1.0),
        ">=",
        missing="no NVSHMEM row of this case",
    ),
    *(_nvlink_t1(op, limit_us) for op, limit_us in _NVLINK_T1_US.items()),
    Target(
        "nvlink.nccl_default",
        "NVLink: T <= 8 (kv_gather <= 256 KiB), graph: >= 4x NCCL's default path",
        _SMALL_OPS,
        _G,
        lambda r: (
            (r.get("nominal_bytes") or 0) <= 256 * KiB
            if r["op"] == "kv_gather"
            else (r.get("T") or 0) <= 8
        ),
        "speedup_vs_nccl",
        _const(4.0),
        ">=",
        nvlink_only=True,
        missing="no NCCL baseline in this run",
    ),
    Target(
        "nvlink.nccl_symmetric",
        "NVLink: T <= 8, graph: >= 1.3x NCCL with symmetric windows (where available)",
        ("q_gather", "lse_reduce"),
        _G,
        lambda r: (r.get("T") or 0) <= 8,
        "speedup_vs_nccl_symmetric",
        _const(1.3),
        ">=",
        nvlink_only=True,
        value=lambda row, rows: None,
        missing="no NCCL symmetric-window path in this run",
    ),
    Target(
        "nvlink.kv_egress",
        "NVLink: kv_gather >= 16 MiB per rank: >= 95% of the egress ceiling",
        ("kv_gather",),
        _BOTH,
        lambda r: (r.get("nominal_bytes") or 0) >= 16 * MiB,
        "busbw_frac",
        _const(0.95),
        ">=",
        nvlink_only=True,
    ),
]


def _item(t: Target, row: Mapping[str, Any] | None, value, limit, met, note) -> dict[str, Any]:
    return {
        "target": t.key,
        "text": t.text,
        "op": row["op"] if row else "/".join(t.ops),
        "path": row["path"] if row else None,
        "mode": row["mode"] if row else "/".join(t.modes),
        "T": row.get("T") if row else None,
        "nominal_bytes": row.get("nominal_bytes") if row else None,
        "metric": t.metric,
        "value": value,
        "limit": limit,
        "sense": t.sense,
        "met": met,
        "note": note,
    }


def evaluate_targets(
    rows: Rows, shared_gpu: bool | None = None, targets: Sequence[Target] = TARGETS
) -> list[dict[str, Any]]:
    """Evaluate every target on every matching dcpkit row (rows already annotated, as JSON).

    Parameters
    ----------
    rows : sequence of dict
        The run's rows (:meth:`BenchRow.to_json`, annotated).
    shared_gpu : bool or None
        True when ranks share a GPU (the NVLink targets are then n/a); None when unknown
        (judged as if every rank had its own GPU).

    Returns one item per (target, row): ``target``, ``text``, ``op``, ``path``, ``mode``, ``T``,
    ``nominal_bytes``, ``metric``, ``value``, ``limit``, ``sense``, ``met`` (True, False, or None
    when it could not be judged) and ``note``. A row with wrong results never meets a target. A
    target that matches no row gives one item with ``met`` None ("not measured").
    """
    items: list[dict[str, Any]] = []
    rows = list(rows)
    kv = [r for r in rows if r["op"] == "kv_gather"]
    biggest = max((r.get("nominal_bytes") or 0 for r in kv), default=None)
    for t in targets:
        matched = [
            r
            for r in rows
            if r["op"] in t.ops
            and r["mode"] in t.modes
            and r["path"] in DIRECT_PATHS
            and r.get("variant") is None
            and t.select(
                dict(r, _largest=(r["op"] == "kv_gather" and r.get("nominal_bytes") == biggest))
            )
        ]
        if not matched:
            items.append(_item(t, None, None, None, None, "not measured (no such row in this run)"))
            continue
        for r in sorted(
            matched,
            key=lambda r: (
                r["op"],
                r["path"],
                r["mode"],
                r.get("nominal_bytes") or 0,
                r.get("T") or 0,
            ),
        ):
            if t.nvlink_only and shared_gpu:
                items.append(_item(t, r, None, None, None, SHARED_GPU_NOTE))
                continue
            value, limit = t.value(r, rows), t.limit(r, rows)
            met: bool | None
            note = ""
            if r.get("error"):
                met, note = None, f"error: {str(r['error'])[:120]}"
            elif value is None or limit is None:
                met, note = None, t.missing
            else:
                met = value <= limit if t.sense == "<=" else value >= limit
                if r.get("wrong"):
                    met, note = False, f"{r['wrong']} wrong results"
            items.append(_item(t, r, value, limit, met, note))
    return items


def target_summary(items: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Counts of ``met``, ``missed`` and ``not_measured`` items."""
    return {
        "met": sum(1 for i in items if i["met"] is True),
        "missed": sum(1 for i in items if i["met"] is False),
        "not_measured": sum(1 for i in items if i["met"] is None),
    }
