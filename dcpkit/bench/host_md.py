"""The "Host time per call" section of BENCHMARKS.md, from the JSON of
``scripts/host_overhead.py --json`` (one file per world size) and the benchmark runs beside it.

Each row's median and p90 are the maximum over ranks; a row with a target carries its limit
(``limit_us``: the same run's empty CuPy launch plus the allowance). The back-to-back rows (20
eager calls in a row, device time per call) are set beside NVSHMEM's on-stream collective of the
same op at T = 1 in the benchmark run of the same world size, where it has one.

Pure Python: CPU tests render synthetic files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["host_overhead_md", "check_host_overhead"]

#: Back-to-back row name prefix -> the benchmark op of its NVSHMEM peer row.
_PEER_OP = {"q_gather": "q_gather", "lse_reduce": "lse_reduce", "kv_gather": "kv_gather"}


def check_host_overhead(run: Any) -> None:
    """Raise ValueError unless ``run`` looks like ``host_overhead.py --json`` output."""
    if not isinstance(run, Mapping):
        raise ValueError("not a JSON object")
    for key in ("meta", "host", "back_to_back_device_us"):
        if not isinstance(run.get(key), Mapping):
            raise ValueError(f"no {key!r} object")
    if "world_size" not in run["meta"]:
        raise ValueError("meta has no world_size")
    W = run["meta"]["world_size"]
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"meta world_size must be a positive int (got {W!r})")


def _max(v) -> float:
    return max(float(x) for x in v) if isinstance(v, (list, tuple)) else float(v)


def _peer_us(bench: Mapping[str, Any] | None, op: str) -> float | None:
    """Fastest NVSHMEM eager row of ``op`` at T = 1 in a benchmark run, in us."""
    best = None
    for r in (bench or {}).get("rows") or []:
        if (
            str(r.get("path", "")).startswith("nvshmem")
            and r.get("mode") == "eager"
            and r.get("op") == op
            and r.get("T") == 1
            and r.get("median_us") is not None
            and not r.get("error")
        ):
            best = r["median_us"] if best is None else min(best, r["median_us"])
    return best


def host_overhead_md(
    runs: Sequence[Mapping[str, Any]], benches: Sequence[Mapping[str, Any]] = ()
) -> list[str]:
    """Markdown lines of the section (empty when there is no run)."""
    if not runs:
        return []
    by_w = {(b.get("meta") or {}).get("world_size"): b for b in benches}
    out = [
        "## Host time per call",
        "",
        "`scripts/host_overhead.py`: host time of one eager call (T = 1), the median and p90 "
        "over the calls, each the maximum over ranks; the targets are judged against the same "
        "run's empty CuPy `RawKernel` launch.",
    ]
    for run in sorted(runs, key=lambda r: r["meta"]["world_size"]):
        m = run["meta"]
        W = m["world_size"]
        base = m.get("empty_launch_us")
        out += [
            "",
            f"### W = {W} (commit `{str(m.get('commit', '-'))[:12]}`, {m.get('gpu', '-')}, "
            f"{m.get('calls', '-')} calls per row, ops launch through "
            f"{m.get('launch_backend', '-')})",
            "",
            "| path | median µs | p90 µs | target | limit µs | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in run["host"].items():
            med, p90 = _max(row["median_us"]), _max(row["p90_us"])
            limit = row.get("limit_us")
            if limit is None:
                verdict = "-"
            elif row.get("kind") == "growth":
                verdict = "no growth" if med <= limit else "GROWS"
            else:
                verdict = "met" if med <= limit else "MISSED"
            lim = "-" if limit is None else f"{limit:.2f}"
            out.append(
                f"| {name} | {med:.2f} | {p90:.2f} | {row.get('target', '-')} | {lim} | {verdict} |"
            )
        if base is not None:
            out += ["", f"Empty CuPy launch of this run: {float(base):.2f} µs."]
        b2b = run["back_to_back_device_us"]
        if b2b:
            bench = by_w.get(W)
            out += [
                "",
                "Back-to-back eager calls, 20 in a row, device time per call (maximum over "
                "ranks), beside NVSHMEM's on-stream collective of the same op at T = 1, eager, "
                "in the benchmark run of the same world size:",
                "",
                "| path | µs per call | NVSHMEM µs | faster than NVSHMEM |",
                "|---|---|---|---|",
            ]
            for name, v in b2b.items():
                op = _PEER_OP.get(name.split(" ")[0])
                peer = _peer_us(bench, op) if op else None
                us = _max(v)
                if peer is None:
                    cmp_ = "-" if op is None else "no NVSHMEM row"
                    out.append(f"| {name} | {us:.2f} | - | {cmp_} |")
                else:
                    word = "yes" if us < peer else "NO"
                    out.append(f"| {name} | {us:.2f} | {peer:.2f} | {word} ({peer / us:.2f}x) |")
    return out
