"""How ``python -m dcpkit bench`` shows its numbers: the nccl-tests-style table, the targets table,
the PNG plots, and BENCHMARKS.md, which is generated from the JSON of the runs and never edited
by hand::

    python -m dcpkit.bench --render-md out/bench_2.json out/bench_4.json --md-out BENCHMARKS.md \
        [--notes docs/benchmark_notes.md]

Pure Python (matplotlib only for plots, imported when asked for): CPU tests render synthetic
results.
"""

from __future__ import annotations

import os
from typing import Any, List, Mapping, Optional, Sequence

from ._stats import evaluate_targets, target_summary

__all__ = ["fmt_bytes", "render_table", "render_targets", "render_ceilings", "render_markdown",
           "analyse_missed", "plot_results"]

_PATH_ORDER = {"direct": 0, "direct-pull": 1, "multicast": 2, "nccl": 3, "torch": 4}
_OP_ORDER = {"q_gather": 0, "lse_reduce": 1, "kv_gather": 2, "decode_layer": 3}


def fmt_bytes(n: Optional[float]) -> str:
    """``4 KiB``, ``36 KiB``, ``1.5 MiB``, ``256 MiB``; ``-`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _f(v: Optional[float], spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _sort_key(r: Mapping[str, Any]):
    return (_OP_ORDER.get(r["op"], 9), r.get("nominal_bytes") or 0, r.get("T") or 0,
            _PATH_ORDER.get(r["path"], 9), r["mode"] != "eager")


_COLUMNS = [("op", 12, "<"), ("size(B)", 11, ">"), ("T", 6, ">"), ("path", 11, "<"),
            ("mode", 5, "<"), ("median(us)", 10, ">"), ("p95(us)", 9, ">"),
            ("algbw(GB/s)", 11, ">"), ("busbw(GB/s)", 11, ">"), ("floor(us)", 9, ">"),
            ("x floor", 7, ">"), ("x NCCL", 7, ">"), ("#wrong", 6, ">")]


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The nccl-tests-style results table (rows already annotated), errors listed below it.

    ``size(B)`` is bytes per rank; ``x floor`` = median / floor (1.00 is perfect); ``x NCCL`` =
    median of the fastest NCCL path of the same case and mode / this median; ``#wrong`` = output
    elements that differed from the reference, summed over ranks and checks.
    """
    head = "  ".join(f"{name:{al}{w}}" for name, w, al in _COLUMNS)
    lines = ["#" + head, "#" + "-" * len(head)]
    errors = []
    for r in sorted(rows, key=_sort_key):
        err = r.get("error")
        vals = [r["op"], str(r.get("bytes_per_rank", "-")), str(r.get("T", "-")), r["path"],
                r["mode"]]
        if err:
            errors.append(r)
            vals += ["ERROR"] + ["-"] * 6 + [str(r["wrong"]) if r.get("wrong") is not None
                                             else "-"]
        else:
            vals += [_f(r.get("median_us")), _f(r.get("p95_us")), _f(r.get("algbw_GBps")),
                     _f(r.get("busbw_GBps")), _f(r.get("floor_us")), _f(r.get("x_floor")),
                     _f(r.get("speedup_vs_nccl")),
                     "-" if r.get("wrong") is None else str(r["wrong"])]
        lines.append(" " + "  ".join(f"{v:{al}{w}}" for v, (_, w, al) in zip(vals, _COLUMNS)))
    if errors:
        lines.append("# errors:")
        for r in errors:
            lines.append(f"#  {r['op']} T={r.get('T')} {r['path']} {r['mode']}: "
                         f"{_one_line(r['error'])}")
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


def _value(item: Mapping[str, Any], v: Optional[float]) -> str:
    if v is None:
        return "-"
    m = item["metric"]
    if m == "median_us":
        return f"{v:.2f} us"
    if m == "speedup_vs_nccl":
        return f"{v:.2f}x"
    if m == "busbw_frac":
        return f"{100 * v:.1f}%"
    return f"{v:.3g}"


def _status(item: Mapping[str, Any]) -> str:
    return {True: "met", False: "MISSED", None: "n/a"}[item["met"]]


def render_targets(items: Sequence[Mapping[str, Any]], world_size: Optional[int] = None) -> str:
    """The targets table (plain text): one line per (target, row), met / MISSED / n/a with the
    measured value and the limit, then the counts."""
    lines = []
    if world_size is not None and world_size != 4:
        lines.append(f"# targets are defined for W = 4; this run has W = {world_size}")
    lines.append(f"#{'target':<24} {'op':<12} {'case':>13} {'path':<11} {'mode':<5} "
                 f"{'measured':>10} {'limit':>12} result")
    for it in items:
        lim = "-" if it["limit"] is None else f"{it['sense']} {_value(it, it['limit'])}"
        note = f"  ({it['note']})" if it.get("note") else ""
        lines.append(f" {it['target']:<24} {it['op']:<12} {_case(it):>13} "
                     f"{str(it['path'] or '-'):<11} {it['mode']:<5} "
                     f"{_value(it, it['value']):>10} {lim:>12} {_status(it)}{note}")
    s = target_summary(items)
    lines.append(f"# targets: {s['met']} met, {s['missed']} missed, {s['not_measured']} not "
                 f"measured")
    return "\n".join(lines)


def render_ceilings(c: Mapping[str, Any]) -> str:
    """One paragraph of the ceilings measured in this run."""
    if not c:
        return "# ceilings: not measured"
    lines = ["# ceilings measured in this run:"]
    lines.append(f"#   one-way NVLink latency (signal ping-pong ranks 0<->1, "
                 f"{c.get('round_trips', '-')} round trips): "
                 f"{_f(c.get('one_way_latency_us'), '.3f')} us "
                 f"(in-kernel %globaltimer: {_f(c.get('one_way_latency_globaltimer_us'), '.3f')} "
                 f"us)")
    lines.append(f"#   unicast egress per GPU (every rank -> all peers, "
                 f"{fmt_bytes(c.get('egress_slice_bytes'))} slices): "
                 f"{_f(c.get('egress_GBps'), '.1f')} GB/s (p5 "
                 f"{_f(c.get('egress_p5_GBps'), '.1f')}), wrong words: "
                 f"{c.get('egress_wrong', '-')}")
    lines.append(f"#   empty kernel: {_f(c.get('launch_eager_us'))} us per eager launch, "
                 f"{_f(c.get('launch_graph_us'))} us per kernel in a graph")
    for e in c.get("errors") or []:
        lines.append(f"#   error: {_one_line(e)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- analysis
def analyse_missed(item: Mapping[str, Any], row: Mapping[str, Any],
                   ceilings: Mapping[str, Any], rows: Sequence[Mapping[str, Any]] = ()) -> str:
    """Where the time of a row that missed a target goes, against the measured ceilings, and
    what would close the gap (a generated first reading; notes by hand go in the notes file)."""
    t = row.get("median_us")
    lat = ceilings.get("one_way_latency_us")
    egr = ceilings.get("egress_GBps")
    if t is None or lat is None or not egr:
        return (f"{item['target']} ({_case(item)}, {row['path']}, {row['mode']}): "
                f"not analysable (a ceiling or the time is missing).")
    lat_term = int(row.get("exchanges", 1)) * lat
    bw_term = row.get("egress_bytes", 0) / (egr * 1e3)
    n_launch = int(row.get("launches_per_call") or row.get("exchanges", 1))
    per_launch = ceilings.get("launch_graph_us" if row["mode"] == "graph" else "launch_eager_us")
    launch_term = (per_launch or 0.0) * n_launch
    rest = t - lat_term - bw_term - launch_term
    head = (f"**{item['target']}** ({_case(item)}, {row['path']}, {row['mode']}): "
            f"{_value(item, item['value'])} against {item['sense']} "
            f"{_value(item, item['limit'])}. ")
    body = (f"Time {t:.2f} us = one-way latency {lat_term:.2f} us"
            f"{' (2 exchanges)' if row.get('exchanges', 1) == 2 else ''}"
            f" + bandwidth {bw_term:.2f} us ({fmt_bytes(row.get('egress_bytes'))} of egress at "
            f"{egr:.0f} GB/s) + launch {launch_term:.2f} us ({n_launch} kernel(s) at "
            f"{_f(per_launch)} us) + {rest:.2f} us not explained by the three. ")
    frac = row.get("busbw_frac")
    over = t - lat_term - bw_term   # time beyond the floor
    if item["metric"] == "speedup_vs_nccl":
        base = [r for r in rows if r["path"] == row.get("baseline_path")
                and r["op"] == row["op"] and r["mode"] == row["mode"]
                and r.get("T") == row.get("T")
                and r.get("nominal_bytes") == row.get("nominal_bytes")]
        if base and base[0].get("median_us") and row.get("floor_us"):
            b = base[0]["median_us"]
            best = row["floor_us"] + launch_term
            body += (f"NCCL ({row.get('baseline_path')}) takes {b:.2f} us; even at floor + launch "
                     f"({best:.2f} us) the ratio would be {b / best:.2f}x. ")
    if over <= 0.05 * t:
        fix = ("The time is at the floor: only fewer bytes (a narrower dtype) or fewer dependent "
               "exchanges would close it")
    elif bw_term >= lat_term and bw_term >= launch_term and frac is not None and frac < 0.9:
        fix = (f"The op is bandwidth-bound and its links run at {100 * frac:.0f}% of the egress "
               f"ceiling: keep more 16-byte stores in flight (more CTAs, unrolled loops), start "
               f"every rank at a different peer, avoid extra local copies")
    elif launch_term >= 0.5 * over:
        fix = ("Launch dominates the time beyond the floor: capture the call in a CUDA graph and "
               "trim host work per call" if row["mode"] == "eager" else
               "Launch dominates the time beyond the floor: fold the call into fewer kernels "
               f"(launches_per_call = {row.get('launches_per_call') or '?'})")
    elif lat_term >= bw_term and lat_term >= rest:
        fix = ("One-way latency dominates: only fewer dependent exchanges (e.g. fusing the "
               "exchange into the producer kernel) would close it")
    else:
        fix = ("Most of the time is beyond latency, bandwidth and launch: protocol and kernel "
               "overhead (fences, signal waits, last-CTA election, the combine or copy work); "
               "profile the kernel (nsys / ncu) and overlap the waits with the payload")
    return head + body + "What would close it: " + fix + "."


# ----------------------------------------------------------------------------- markdown
def _row_for(item: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]):
    for r in rows:
        if (r["op"] == item["op"] and r["path"] == item["path"] and r["mode"] == item["mode"]
                and r.get("T") == item["T"] and r.get("nominal_bytes") == item["nominal_bytes"]):
            return r
    return None


def _md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|")


def _targets_md(items: Sequence[Mapping[str, Any]]) -> List[str]:
    out = ["| target | op | case | path | mode | measured | limit | result |",
           "|---|---|---|---|---|---|---|---|"]
    for it in items:
        lim = "-" if it["limit"] is None else f"{it['sense']} {_value(it, it['limit'])}"
        res = _status(it) if _status(it) != "MISSED" else "**missed**"
        note = f" ({_md_escape(it['note'])})" if it.get("note") else ""
        out.append(f"| {_md_escape(it['text'])} | {it['op']} | {_case(it)} | "
                   f"{it['path'] or '-'} | {it['mode']} | {_value(it, it['value'])} | {lim} | "
                   f"{res}{note} |")
    return out


def _meta(res: Mapping[str, Any], key: str, default: str = "-") -> str:
    v = (res.get("meta") or {}).get(key)
    return default if v in (None, "") else str(v)


def render_markdown(results: Sequence[Mapping[str, Any]], *, notes: Optional[str] = None,
                    plots: Optional[Mapping[int, str]] = None,
                    sources: Sequence[str] = ()) -> str:
    """BENCHMARKS.md from the JSON of one or more runs (one per world size).

    Parameters
    ----------
    results : sequence of dict
        Parsed JSON files written by ``dcpkit bench --json``.
    notes : str, optional
        Markdown kept by hand in a separate file, shown under "Notes" before the tables.
    plots : dict world_size -> str, optional
        Relative paths of the PNG plots, shown under each run.
    sources : sequence of str
        The JSON paths, named in the header.
    """
    res = sorted(results, key=lambda r: (r.get("meta") or {}).get("world_size", 0))
    plots = dict(plots or {})
    src = " ".join(sources) if sources else "the JSON of the runs"
    out = ["# dcpkit benchmarks", "",
           f"<!-- Generated by `python -m dcpkit.bench --render-md {src}`: do not edit by hand; "
           f"regenerate from the JSON. -->",
           "Generated from the JSON written by `python -m dcpkit bench` (see "
           "`scripts/gpu_suite.sh`); every figure below comes from that JSON. Times are µs per "
           "call: the median (and p95) over iterations, each iteration timed with CUDA events "
           "and taken as the maximum over ranks. The **floor** of a row is the one-way NVLink "
           "latency plus the bytes each GPU must send divided by the unicast egress ceiling, both "
           "measured in the same run; `x floor` = time / floor; `x NCCL` = time of the fastest "
           "NCCL path (CuPy NCCL or torch.distributed) in the same mode / this time.", ""]
    if notes:  # kept by hand: what a reader must know before reading the numbers
        out += ["## Notes", "", notes.strip(), ""]
    out += ["## Runs", "",
           "| W | machine | GPU | driver | CUDA runtime | CuPy | NCCL | torch | commit | date |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        out.append(f"| {_meta(r, 'world_size')} | {_meta(r, 'machine')} | {_meta(r, 'gpu')} | "
                   f"{_meta(r, 'driver')} | {_meta(r, 'cuda_runtime')} | {_meta(r, 'cupy')} | "
                   f"{_meta(r, 'nccl')} | {_meta(r, 'torch')} | `{_meta(r, 'commit')[:12]}` | "
                   f"{_meta(r, 'date')} |")
    out += ["", "Commands:", ""]
    for r in res:
        out.append(f"- `{_meta(r, 'command')}`")
    out += ["", "## Ceilings measured in each run", "",
            "| W | one-way latency (µs) | egress per GPU (GB/s) | egress slice | empty kernel, "
            "eager (µs) | empty kernel in a graph (µs) | egress wrong words |",
            "|---|---|---|---|---|---|---|"]
    for r in res:
        c = r.get("ceilings") or {}
        out.append(f"| {_meta(r, 'world_size')} | {_f(c.get('one_way_latency_us'), '.3f')} | "
                   f"{_f(c.get('egress_GBps'), '.1f')} | {fmt_bytes(c.get('egress_slice_bytes'))} "
                   f"| {_f(c.get('launch_eager_us'))} | {_f(c.get('launch_graph_us'))} | "
                   f"{c.get('egress_wrong', '-')} |")
    # Targets: judged on W = 4 (issue 8); shown for every run.
    judged = [r for r in res if (r.get("meta") or {}).get("world_size") == 4] or res[-1:]
    for r in judged:
        W = _meta(r, "world_size")
        items = r.get("targets") or evaluate_targets(r.get("rows") or [])
        s = target_summary(items)
        out += ["", f"## Targets (issue 8, judged on W = {W})", "",
                f"{s['met']} met, {s['missed']} missed, {s['not_measured']} not measured.", ""]
        out += _targets_md(items)
        missed = [it for it in items if it["met"] is False]
        out += ["", "### Where the time goes (missed targets)", ""]
        if not missed:
            out.append("No target was missed.")
        rows = r.get("rows") or []
        for it in missed:
            row = _row_for(it, rows)
            if row is not None:
                out.append("- " + analyse_missed(it, row, r.get("ceilings") or {}, rows))
    for r in res:
        W = (r.get("meta") or {}).get("world_size")
        out += ["", f"## Results, W = {W}", "", "```text", render_table(r.get("rows") or []),
                "```"]
        if W in plots:
            out += ["", f"![latency and bandwidth vs size, W = {W}]({plots[W]})"]
        if r not in judged:
            items = r.get("targets") or evaluate_targets(r.get("rows") or [])
            s = target_summary(items)
            out += ["", f"Targets at W = {W} (defined for W = 4, shown for reference): "
                    f"{s['met']} met, {s['missed']} missed, {s['not_measured']} not measured.",
                    ""] + _targets_md(items)
        if r.get("errors"):
            out += ["", "Errors of this run:", ""]
            out += [f"- {_md_escape(_one_line(e))}" for e in r["errors"]]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- plots
_PLOT_OPS = ("q_gather", "lse_reduce", "kv_gather")


def plot_results(result: Mapping[str, Any], path: str, dpi: int = 80) -> Optional[str]:
    """Draw latency vs size and bus bandwidth vs size (one line per path and mode, the floor and
    the egress ceiling dashed), one row of two panels per op, into a PNG at ``path``.

    Returns None on success, or the reason no plot was drawn (matplotlib missing, no rows).
    """
    try:
        import matplotlib  # noqa: WPS433

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: WPS433
    except ImportError as e:
        return f"matplotlib is not installed ({e}): no plot drawn"
    rows = [r for r in result.get("rows") or [] if not r.get("error")
            and r.get("median_us") is not None]
    ops = [op for op in _PLOT_OPS if any(r["op"] == op for r in rows)]
    if not ops:
        return "no successful rows to plot"
    ceil = result.get("ceilings") or {}
    meta = result.get("meta") or {}
    fig, axes = plt.subplots(len(ops), 2, figsize=(10, 3.1 * len(ops)), squeeze=False)
    colors = {"direct": "tab:blue", "direct-pull": "tab:cyan", "multicast": "tab:purple",
              "nccl": "tab:red", "torch": "tab:orange"}
    for i, op in enumerate(ops):
        ax_t, ax_b = axes[i]
        mine = [r for r in rows if r["op"] == op]
        for name in sorted({r["path"] for r in mine}, key=lambda p: _PATH_ORDER.get(p, 9)):
            for mode, ls in (("graph", "-"), ("eager", "--")):
                pts = sorted((r["bytes_per_rank"], r["median_us"], r.get("busbw_GBps"))
                             for r in mine if r["path"] == name and r["mode"] == mode)
                if not pts:
                    continue
                x = [p[0] for p in pts]
                ax_t.plot(x, [p[1] for p in pts], ls, marker="o", ms=3,
                          color=colors.get(name), label=f"{name} {mode}")
                bw = [(p[0], p[2]) for p in pts if p[2]]
                ax_b.plot([q[0] for q in bw], [q[1] for q in bw], ls, marker="o", ms=3,
                          color=colors.get(name), label=f"{name} {mode}")
        fl = sorted({(r["bytes_per_rank"], r["floor_us"]) for r in mine
                     if r.get("floor_us") is not None})
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
    fig.suptitle(f"dcpkit bench, W = {meta.get('world_size', '?')}, {meta.get('gpu', '')}, "
                 f"commit {str(meta.get('commit', '?'))[:10]}", fontsize=10)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return None
