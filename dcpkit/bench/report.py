"""How ``python -m dcpkit bench`` shows its numbers in the terminal: the nccl-tests-style table,
the targets, the ceilings, and the PNG plots (BENCHMARKS.md: :mod:`dcpkit.bench.markdown`).

Pure Python (matplotlib only for plots, imported when asked for): CPU tests render synthetic
results. Everything reads the JSON form of the rows (:meth:`BenchRow.to_json`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..cli import write_output
from .targets import target_summary

__all__ = [
    "fmt_bytes",
    "render_table",
    "render_targets",
    "render_ceilings",
    "plot_results",
    "path_label",
    "case_label",
    "value_text",
    "status_text",
    "one_line",
    "number_text",
]

_PATH_ORDER = {
    "direct": 0,
    "direct-pull": 1,
    "multicast": 2,
    "floor": 3,
    "nvshmem": 4,
    "nccl": 5,
    "torch": 6,
}
_OP_ORDER = {"q_gather": 0, "lse_reduce": 1, "kv_gather": 2, "decode_layer": 3}


def fmt_bytes(n: float | None) -> str:
    """``4 KiB``, ``36 KiB``, ``1.5 MiB``, ``256 MiB``; ``-`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _f(v: float | None, spec: str = ".2f") -> str:
    """``v`` formatted, ``-`` where there is no value (None, NaN)."""
    return "-" if v is None or v != v else format(v, spec)


def path_label(r: Mapping[str, Any]) -> str:
    """The path, with the variant of the build where it is not the shipped one."""
    v = r.get("variant")
    return f"{r['path']}[{v}]" if v else str(r["path"])


def _sort_key(r: Mapping[str, Any]):
    return (
        _OP_ORDER.get(r["op"], 9),
        r.get("nominal_bytes") or 0,
        r.get("T") or 0,
        _PATH_ORDER.get(r["path"], 9),
        r.get("variant") or "",
        r["mode"] != "eager",
    )


_COLUMNS = [
    ("op", 12, "<"),
    ("size(B)", 11, ">"),
    ("T", 6, ">"),
    ("path", 21, "<"),
    ("mode", 5, "<"),
    ("median(us)", 10, ">"),
    ("p90(us)", 9, ">"),
    ("algbw(GB/s)", 11, ">"),
    ("busbw(GB/s)", 11, ">"),
    ("floor(us)", 9, ">"),
    ("x floor", 7, ">"),
    ("fk(us)", 8, ">"),
    ("x fk", 6, ">"),
    ("x NCCL", 7, ">"),
    ("x NVSHMEM", 9, ">"),
    ("#wrong", 6, ">"),
]


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The nccl-tests-style results table (rows already annotated), errors listed below it.

    ``size(B)`` is bytes per rank; ``x floor`` = median / floor (1.00 is perfect); ``fk`` = the
    median of the floor kernel (path ``floor``) of the same case and mode, ``x fk`` = median / it;
    ``x NCCL`` and ``x NVSHMEM`` = median of the fastest NCCL / NVSHMEM row of the same case and
    mode / this median; ``#wrong`` = output elements that differed from the reference, summed
    over ranks and checks.
    """
    head = "  ".join(f"{name:{al}{w}}" for name, w, al in _COLUMNS)
    lines = ["#" + head, "#" + "-" * len(head)]
    errors = []
    for r in sorted(rows, key=_sort_key):
        err = r.get("error")
        vals = [
            r["op"],
            str(r.get("bytes_per_rank", "-")),
            str(r.get("T", "-")),
            path_label(r),
            r["mode"],
        ]
        if err:
            errors.append(r)
            vals += ["ERROR"] + ["-"] * 9 + [str(r["wrong"]) if r.get("wrong") is not None else "-"]
        else:
            vals += [
                _f(r.get("median_us")),
                _f(r.get("p90_us")),
                _f(r.get("algbw_GBps")),
                _f(r.get("busbw_GBps")),
                _f(r.get("floor_us")),
                _f(r.get("x_floor")),
                _f(r.get("floor_kernel_us")),
                _f(r.get("x_floor_kernel")),
                _f(r.get("speedup_vs_nccl")),
                _f(r.get("speedup_vs_peer")),
                "-" if r.get("wrong") is None else str(r["wrong"]),
            ]
        lines.append(" " + "  ".join(f"{v:{al}{w}}" for v, (_, w, al) in zip(vals, _COLUMNS)))
    if errors:
        lines.append("# errors:")
        for r in errors:
            lines.append(
                f"#  {r['op']} T={r.get('T')} {path_label(r)} {r['mode']}: {_one_line(r['error'])}"
            )
    return "\n".join(lines)


def _one_line(s: Any, n: int = 300) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _case(item: Mapping[str, Any]) -> str:
    if item.get("op") == "kv_gather" and item.get("nominal_bytes") is not None:
        return f"{fmt_bytes(item['nominal_bytes'])}/rank"
    if item.get("T") is not None:
        return f"T={item['T']}"
    return "-"


def _value(item: Mapping[str, Any], v: float | None) -> str:
    if v is None or v != v:  # not measured, or NaN
        return "-"
    m = item["metric"]
    if m == "median_us":
        return f"{v:.2f} us"
    if m.startswith("speedup_vs"):
        return f"{v:.2f}x"
    if m == "busbw_frac":
        return f"{100 * v:.1f}%"
    return f"{v:.3g}"


def _status(item: Mapping[str, Any]) -> str:
    return {True: "met", False: "MISSED", None: "n/a"}[item["met"]]


def render_targets(items: Sequence[Mapping[str, Any]], world_size: int | None = None) -> str:
    """The targets table (plain text): one line per (target, row), met / MISSED / n/a with the
    measured value and the limit, then the counts."""
    lines = []
    if world_size is not None:
        lines.append(f"# targets, judged on this run (W = {world_size}):")
    lines.append(
        f"#{'target':<26} {'op':<12} {'case':>13} {'path':<11} {'mode':<5} "
        f"{'measured':>10} {'limit':>12} result"
    )
    for it in items:
        lim = "-" if it["limit"] is None else f"{it['sense']} {_value(it, it['limit'])}"
        note = f"  ({it['note']})" if it.get("note") else ""
        lines.append(
            f" {it['target']:<26} {it['op']:<12} {_case(it):>13} "
            f"{it['path'] or '-'!s:<11} {it['mode']:<5} "
            f"{_value(it, it['value']):>10} {lim:>12} {_status(it)}{note}"
        )
    s = target_summary(items)
    lines.append(
        f"# targets: {s['met']} met, {s['missed']} missed, {s['not_measured']} not measured"
    )
    return "\n".join(lines)


def render_ceilings(c: Mapping[str, Any]) -> str:
    """One paragraph of the ceilings measured in this run."""
    if not c:
        return "# ceilings: not measured"
    lines = ["# ceilings measured in this run:"]
    lines.append(
        f"#   one-way signal latency (ping-pong ranks 0<->1, "
        f"{c.get('round_trips', '-')} round trips): "
        f"{_f(c.get('one_way_latency_us'), '.3f')} us "
        f"(in-kernel %globaltimer: {_f(c.get('one_way_latency_globaltimer_us'), '.3f')} "
        f"us)"
    )
    lines.append(
        f"#   unicast egress per GPU (every rank -> all peers, "
        f"{fmt_bytes(c.get('egress_slice_bytes'))} slices): "
        f"{_f(c.get('egress_GBps'), '.1f')} GB/s (p5 "
        f"{_f(c.get('egress_p5_GBps'), '.1f')}), wrong words: "
        f"{c.get('egress_wrong', '-')}"
    )
    lines.append(
        f"#   empty kernel: {_f(c.get('launch_eager_us'))} us per eager launch, "
        f"{_f(c.get('launch_graph_us'))} us per kernel in a graph"
    )
    for e in c.get("errors") or []:
        lines.append(f"#   error: {_one_line(e)}")
    return "\n".join(lines)


one_line = _one_line
case_label = _case
value_text = _value
status_text = _status
number_text = _f


# ----------------------------------------------------------------------------- plots
_PLOT_OPS = ("q_gather", "lse_reduce", "kv_gather")


def plot_results(result: Mapping[str, Any], path: str, dpi: int = 80) -> str | None:
    """Draw latency vs size and bus bandwidth vs size (one line per path and mode, the floor and
    the egress ceiling dashed), one row of two panels per op, into a PNG at ``path``.

    Returns None on success, or the reason no plot was drawn (matplotlib missing, no rows, the
    file could not be written: that line is also on stderr). The file is written atomically.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}): no plot drawn"
    rows = [
        r
        for r in result.get("rows") or []
        if not r.get("error") and r.get("median_us") is not None and not r.get("variant")
    ]
    ops = [op for op in _PLOT_OPS if any(r["op"] == op for r in rows)]
    if not ops:
        return "no successful rows to plot"
    ceil = result.get("ceilings") or {}
    meta = result.get("meta") or {}
    fig, axes = plt.subplots(len(ops), 2, figsize=(10, 3.1 * len(ops)), squeeze=False)
    colors = {
        "direct": "tab:blue",
        "direct-pull": "tab:cyan",
        "multicast": "tab:purple",
        "floor": "black",
        "nvshmem": "tab:green",
        "nccl": "tab:red",
        "torch": "tab:orange",
    }
    for i, op in enumerate(ops):
        ax_t, ax_b = axes[i]
        mine = [r for r in rows if r["op"] == op]
        for name in sorted({r["path"] for r in mine}, key=lambda p: _PATH_ORDER.get(p, 9)):
            for mode, ls in (("graph", "-"), ("eager", "--")):
                pts = sorted(
                    (r["bytes_per_rank"], r["median_us"], r.get("busbw_GBps"))
                    for r in mine
                    if r["path"] == name and r["mode"] == mode
                )
                if not pts:
                    continue
                times = [(p[0], p[1]) for p in pts]
                bandwidths = [(p[0], p[2]) for p in pts if p[2]]
                for ax, series in ((ax_t, times), (ax_b, bandwidths)):
                    ax.plot(
                        [q[0] for q in series],
                        [q[1] for q in series],
                        ls,
                        marker="o",
                        ms=3,
                        color=colors.get(name),
                        label=f"{name} {mode}",
                    )
        fl = sorted(
            {(r["bytes_per_rank"], r["floor_us"]) for r in mine if r.get("floor_us") is not None}
        )
        if fl:
            ax_t.plot([p[0] for p in fl], [p[1] for p in fl], ":", color="black", label="floor")
        if ceil.get("egress_GBps"):
            ax_b.axhline(ceil["egress_GBps"], ls=":", color="black", label="egress ceiling")
        ax_t.set_xscale("log", base=2)
        ax_t.set_yscale("log")
        ax_b.set_xscale("log", base=2)
        ax_b.set_yscale("log")
        ax_t.set_title(f"{op}: time per call")
        ax_b.set_title(f"{op}: bus bandwidth")
        ax_t.set_ylabel("µs")
        ax_b.set_ylabel("GB/s")
        for ax in (ax_t, ax_b):
            ax.set_xlabel("bytes per rank")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
    fig.suptitle(
        f"dcpkit bench, W = {meta.get('world_size', '?')}, {meta.get('gpu', '')}, "
        f"commit {str(meta.get('commit', '?'))[:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    try:
        return write_output(
            path,
            lambda f: fig.savefig(f, dpi=dpi, format="png"),
            prog="dcpkit bench",
            make_folders=True,
            binary=True,
        )
    finally:
        plt.close(fig)
