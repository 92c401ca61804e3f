"""Phase marks recorded inside the kernels, and where the time of a call goes.

A kernel built with ``-DDCPKIT_TIMELINE=1`` (diagnostics only; the ops never ship it) stores, from
thread 0 of every CTA, the time of each phase mark of a call into a buffer the host sets
(``dcpkit_timeline`` in kernels/dcpkit_ptx.cuh): ``%globaltimer`` in nanoseconds, one clock for
every process on the GPU, and ``clock64`` in SM cycles. The layout, mirrored here:
``[CALLS][CTAS][2 * MARKS]`` u64, row ``epoch % CALLS`` for a call, words ``[0, MARKS)`` the
timer at each mark, ``[MARKS, 2 * MARKS)`` the cycle counter; word :data:`ROLE` holds the CTA's
role (waiter index + 1, 0 for a CTA that did not wait) and word :data:`SM` its SM.

Marks: :data:`ENTRY`, :data:`CHECKED` (poison check done), :data:`STORED` (payload stores
issued), :data:`PUBLISHED` (after the arrival; for the elected CTA after its fence and signal
stores), :data:`SEEN` (every signal seen; absent in a CTA that did not wait or help),
:data:`EXIT`.

:func:`phases` turns the marks of consecutive calls on every rank into the steps of one call,
each the mean, median and p90 over every (call, rank). ``%globaltimer`` advances in steps of
tens to hundreds of nanoseconds (``timer_step_ns`` says what this run saw), so a step shorter
than that reads 0 or one step in any one call: the median then sits on a multiple of the timer
step, while the mean over many calls, whose phases fall at random against the timer's steps,
does not. The tables show the mean:

* ``stores``: the kernel's first CTA entry to the last CTA's stores issued;
* ``publish``: that to the last CTA's publish: the elected CTA's signals stored (barrier,
  arrival atom, fence, signal stores) under the election; under share counters and in the floor
  kernel, where every CTA publishes its own part, the last one's fence and adds;
* ``slowest_rank``: that to the moment the last rank of the call published (waiting for a
  slower rank: start skew and its own longer steps);
* ``signal``: that to the first CTA that saw every signal (the one-way latency, then the
  acquire);
* ``finish``: that to the last CTA's exit (copy-out or combine, then the kernel's end);
* ``total``: first entry to last exit; ``period``: first entry to the next call's first entry
  on the same rank (the time per call in a graph); ``gap``: last exit to the next call's first
  entry; ``skew``: the latest rank's first entry minus the earliest's; ``cta_spread``: the
  last CTA's entry minus the first's; ``check``: entry to poison check done (CTA median).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "CALLS",
    "CTAS",
    "MARKS",
    "ROLE",
    "SM",
    "ENTRY",
    "CHECKED",
    "STORED",
    "PUBLISHED",
    "SEEN",
    "EXIT",
    "STEPS",
    "buffer_words",
    "ordered_calls",
    "phases",
    "format_table",
]

#: Layout of the timeline buffer (kernels/dcpkit_ptx.cuh kTimelineCalls, kTimelineCtas,
#: kTimelineMarks, kTimelineRole, kTimelineSm).
CALLS, CTAS, MARKS, ROLE, SM = 64, 512, 8, 6, 7
ENTRY, CHECKED, STORED, PUBLISHED, SEEN, EXIT = range(6)

#: The steps of a call that add up to its total, in order, with their table labels.
STEPS = (
    ("stores", "entry -> last CTA's payload stores issued"),
    ("publish", "-> signals stored (barrier, arrival, fence)"),
    ("slowest_rank", "-> the call's last rank published"),
    ("signal", "-> every signal seen"),
    ("finish", "-> last CTA's exit (copy-out, combine)"),
)
_OTHER = (
    ("total", "kernel: first entry -> last exit"),
    ("period", "per call: entry -> next call's entry"),
    ("gap", "last exit -> next call's entry"),
    ("skew", "start skew across ranks"),
    ("cta_spread", "CTA entries: first -> last"),
    ("check", "entry -> poison check done (CTA median)"),
)


def buffer_words() -> int:
    """u64 words of one timeline buffer."""
    return CALLS * CTAS * 2 * MARKS


def ordered_calls(buf: np.ndarray) -> np.ndarray:
    """The rows of one rank's buffer (``[CALLS, CTAS, 2 * MARKS]`` or flat) that a call wrote,
    in the order the calls ran (by first entry), as ``[calls, CTAS, 2 * MARKS]``."""
    b = np.asarray(buf, dtype=np.uint64).reshape(CALLS, CTAS, 2 * MARKS)
    entry = b[:, :, ENTRY].astype(np.float64)
    entry[entry == 0] = np.inf
    first = entry.min(axis=1)
    used = np.isfinite(first)
    order = np.argsort(first[used], kind="stable")
    return b[used][order]


def _per_call(calls: np.ndarray) -> dict[str, np.ndarray]:
    """Absolute times (ns) of one rank's calls: entry, stored, published, seen, exit, the
    CTA entry spread and the median poison-check time."""
    ns = calls[:, :, :MARKS].astype(np.float64)
    alive = ns[:, :, ENTRY] > 0
    entry = np.where(alive, ns[:, :, ENTRY], np.inf).min(axis=1)
    last_entry = np.where(alive, ns[:, :, ENTRY], -np.inf).max(axis=1)
    stored = np.where(alive, ns[:, :, STORED], -np.inf).max(axis=1)
    # the rank has published when its last CTA has: under the election the elected CTA (the
    # last to arrive, whose mark follows its fence and signal stores), under share counters and
    # in the floor kernel every CTA publishes its own part, and the waiters are fixed by index
    published = np.where(alive, ns[:, :, PUBLISHED], -np.inf).max(axis=1)
    seen_ns = np.where(alive & (ns[:, :, SEEN] > 0), ns[:, :, SEEN], np.inf)
    seen = seen_ns.min(axis=1)
    exit_ = np.where(alive, ns[:, :, EXIT], -np.inf).max(axis=1)
    chk = np.where(alive & (ns[:, :, CHECKED] > 0), ns[:, :, CHECKED] - ns[:, :, ENTRY], np.nan)
    check = np.full(len(ns), np.nan)
    for i, row in enumerate(chk):
        row = row[np.isfinite(row)]
        if row.size:
            check[i] = np.median(row)
    return {
        "entry": entry,
        "stored": stored,
        "published": published,
        "seen": seen,
        "exit": exit_,
        "cta_spread": last_entry - entry,
        "check": check,
    }


def _stat(v: np.ndarray) -> dict[str, Any]:
    v = np.asarray(v, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"mean_us": None, "median_us": None, "p90_us": None, "n": 0}
    return {
        "mean_us": float(np.mean(v)) / 1e3,
        "median_us": float(np.median(v)) / 1e3,
        "p90_us": float(np.percentile(v, 90)) / 1e3,
        "n": int(v.size),
    }


def phases(per_rank: list[np.ndarray]) -> dict[str, Any]:
    """The steps of a call from every rank's ordered calls (:func:`ordered_calls`; the same
    number of calls on every rank, the same calls in the same order). Returns step name ->
    ``{"median_us", "p90_us", "n"}`` (see the module docstring), plus ``"calls"`` and
    ``"timer_step_ns"``: the smallest nonzero difference between two marks of one CTA (the
    timer's resolution as seen here).

    Raises
    ------
    ValueError
        No rank, or ranks with different numbers of calls.
    """
    if not per_rank:
        raise ValueError("phases: at least one rank's calls are needed")
    n = {len(c) for c in per_rank}
    if len(n) != 1:
        raise ValueError(f"phases: every rank must have the same number of calls (got {sorted(n)})")
    t = [_per_call(c) for c in per_rank]
    pub = np.stack([x["published"] for x in t])  # [ranks, calls]
    last_pub = pub.max(axis=0)
    entries = np.stack([x["entry"] for x in t])
    out: dict[str, Any] = {"calls": int(next(iter(n))), "ranks": len(per_rank)}
    steps: dict[str, list[np.ndarray]] = {k: [] for k, _ in STEPS + _OTHER}
    for x in t:
        steps["stores"].append(x["stored"] - x["entry"])
        steps["publish"].append(x["published"] - x["stored"])
        steps["slowest_rank"].append(last_pub - x["published"])
        steps["signal"].append(x["seen"] - last_pub)
        steps["finish"].append(x["exit"] - x["seen"])
        steps["total"].append(x["exit"] - x["entry"])
        steps["period"].append(np.diff(x["entry"]))
        steps["gap"].append(x["entry"][1:] - x["exit"][:-1])
        steps["cta_spread"].append(x["cta_spread"])
        steps["check"].append(x["check"])
    steps["skew"].append(entries.max(axis=0) - entries.min(axis=0))
    for k, parts in steps.items():
        out[k] = _stat(np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in parts]))
    step = None
    for c in per_rank:
        for row in c[:, :, : EXIT + 1].reshape(-1, EXIT + 1):
            v = np.unique(row[row > 0])  # sorted, distinct
            if v.size > 1:
                d = int(np.diff(v).min())
                step = d if step is None else min(step, d)
    out["timer_step_ns"] = step
    return out


def format_table(results: list[dict[str, Any]]) -> str:
    """A markdown table: one column per result (``{"label": str, "phases": phases(...)}``),
    one row per step, ``mean (p90)`` in us."""
    head = "| step | " + " | ".join(r["label"] for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for key, label in STEPS + _OTHER:
        cells = []
        for r in results:
            s = r["phases"].get(key) or {}
            m, p = s.get("mean_us"), s.get("p90_us")
            cells.append("-" if m is None else f"{m:.2f} ({p:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
