"""The machine's ceilings, measured at the start of every run by dcpkit's own kernels
(kernels/ceilings.cu): one-way signal latency, unicast egress bandwidth, launch costs."""

from __future__ import annotations

import math
from typing import Any

from .common import StageFailed
from .report import fmt_bytes
from .stages import Ctx, stage
from .stats import max_over_ranks, median

__all__ = ["measure_ceilings"]


def measure_ceilings(ctx: Ctx) -> dict[str, Any]:
    """One-way latency, egress bandwidth and launch costs, measured now (see module doc)."""
    cfg, dev, W = ctx.cfg, ctx.dev, ctx.world
    c: dict[str, Any] = {"errors": []}
    R = int(cfg["round_trips"])
    try:
        per = stage(
            ctx, "ceilings: ping-pong", lambda: dev.pingpong(R, int(cfg["pingpong_repeats"]))
        )
        ev = max_over_ranks([[x["event_us"] for x in per[0]], [x["event_us"] for x in per[1]]])
        one_way = [t / (2.0 * R) for t in ev]
        warm = per[0][0]["warm"] if per[0] else 0
        gt = [x["globaltimer_ns"] / 1e3 / (2.0 * (R - warm)) for x in per[0]]
        c.update(
            {
                "one_way_latency_us": median(one_way),
                "one_way_latency_samples_us": one_way,
                "one_way_latency_globaltimer_us": median(gt),
                "round_trips": R,
            }
        )
        ctx.log(
            f"one-way latency {c['one_way_latency_us']:.3f} us "
            f"(globaltimer {c['one_way_latency_globaltimer_us']:.3f} us)"
        )
    except StageFailed as e:
        c["errors"].append(str(e))
    slice_bytes = int(cfg["egress_slice_bytes"])
    try:
        try:
            stage(ctx, "ceilings: egress setup", lambda: dev.egress_setup(slice_bytes))
            per = stage(ctx, "ceilings: egress", lambda: dev.egress_run(int(cfg["egress_samples"])))
            t = max_over_ranks(per)
            gbps = [(W - 1) * slice_bytes / (x * 1e3) for x in t]
            c.update(
                {
                    "egress_GBps": median(gbps),
                    "egress_samples_GBps": gbps,
                    "egress_p5_GBps": sorted(gbps)[max(0, math.ceil(0.05 * len(gbps)) - 1)],
                    "egress_slice_bytes": slice_bytes,
                }
            )
            per = stage(ctx, "ceilings: egress check", dev.egress_check)
            c["egress_wrong"] = int(sum(per))
            if c["egress_wrong"]:
                c["errors"].append(f"egress: {c['egress_wrong']} words landed wrong")
            ctx.log(
                f"unicast egress {c['egress_GBps']:.1f} GB/s per GPU "
                f"({fmt_bytes(slice_bytes)} to each of {W - 1} peers), "
                f"{c['egress_wrong']} wrong words"
            )
        finally:
            stage(ctx, "ceilings: egress release", dev.egress_release)
    except StageFailed as e:
        c["errors"].append(str(e))
    try:
        per = stage(
            ctx, "ceilings: launch cost", lambda: dev.launch_costs(5 if cfg["quick"] else 10)
        )
        c["launch_eager_us"] = max(p["launch_eager_us"] for p in per)
        c["launch_graph_us"] = max(p["launch_graph_us"] for p in per)
        ctx.log(
            f"empty kernel: {c['launch_eager_us']:.2f} us eager, "
            f"{c['launch_graph_us']:.2f} us in a graph"
        )
    except StageFailed as e:
        c["errors"].append(str(e))
    return c
