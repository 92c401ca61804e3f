"""Synthetic benchmark rows and runs for the CPU tests of dcpkit.bench."""

from dcpkit import bench
from dcpkit.bench import stats
from dcpkit.bench.row import BenchRow
from dcpkit.bench.targets import evaluate_targets

KiB, MiB = 1024, 1024 * 1024

CEIL = {
    "one_way_latency_us": 1.25,
    "egress_GBps": 350.0,
    "launch_eager_us": 5.0,
    "launch_graph_us": 0.9,
    "egress_slice_bytes": 64 * MiB,
    "round_trips": 20000,
}


def row(op, path, mode, T, times, nominal=None, W=4, wrong=0, error=None, variant=None):
    g = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "itemsize": 2, "T": T}
    b = stats.geometry_bytes(op, g, W)
    return BenchRow(
        op=op,
        path=path,
        mode=mode,
        T=T,
        nominal_bytes=nominal if nominal is not None else b["bytes_per_rank"],
        geometry=g,
        times_us=list(times),
        wrong=wrong,
        error=error,
        variant=variant,
        world_size=W,
        launches_per_call=1 if path.startswith("direct") else None,
        bytes_per_rank=b["bytes_per_rank"],
        egress_bytes=b["egress_bytes"],
        exchanges=b["exchanges"],
    )


def annotated(rows, ceil=CEIL):
    """The rows annotated, as JSON dicts (what the renderer and the targets read)."""
    return [r.to_json() for r in stats.annotate(rows, ceil)]


def synthetic_result(W=4, shared=True):
    rows = []
    for T, (d, n, f, p) in {
        1: (7.1, 14.0, 6.8, 17.0),
        8: (9.0, 18.0, 8.5, 20.0),
        32: (19.0, 40.0, 15.0, 30.0),
        128: (55.0, 75.0, 40.0, 90.0),
    }.items():
        for op in ("q_gather", "lse_reduce"):
            rows += [
                row(op, "direct", "graph", T, [d, d * 1.1, d * 0.95], W=W),
                row(op, "floor", "graph", T, [f] * 3, W=W),
                row(op, "nvshmem", "graph", T, [p] * 3, W=W),
                row(op, "nccl", "graph", T, [n] * 3, W=W),
                row(op, "direct", "eager", T, [d + 9] * 3, W=W),
                row(op, "floor", "eager", T, [f + 9] * 3, W=W),
                row(op, "nccl", "eager", T, [n + 30] * 3, W=W),
                row(
                    op,
                    "nvshmem",
                    "eager",
                    T,
                    [],
                    W=W,
                    error="StageFailed: nvshmem: build failed: no nvshmem4py",
                ),
            ]
    rows.append(row("q_gather", "direct", "graph", 1, [7.0] * 3, W=W, variant="no_self_check"))
    rows.append(row("decode_layer", "direct", "graph", 8, [18.5] * 3, W=W))
    rows.append(row("decode_layer", "floor", "graph", 8, [16.0] * 3, W=W))
    rows.append(row("kv_gather", "direct", "graph", 4, [3.0] * 3, nominal=4 * KiB, W=W))
    rows.append(row("kv_gather", "nccl", "graph", 4, [12.0] * 3, nominal=4 * KiB, W=W))
    rows.append(
        row(
            "kv_gather",
            "direct-pull",
            "graph",
            4,
            [],
            nominal=4 * KiB,
            W=W,
            error="StageFailed: kv_gather pull: check failed on rank(s) [1]",
        )
    )
    js = annotated(rows)
    meta = {
        "world_size": W,
        "gpu": "NVIDIA H200",
        "driver": "580.65",
        "cuda_runtime": "13.0",
        "cupy": "cupy-cuda13x 14.2.0",
        "nccl": "2.28.9",
        "torch": "2.11.0",
        "commit": "0123456789abcdef",
        "date": "2026-12-01 10:00 UTC",
        "machine": "1x H200",
        "command": f"mpirun -np {W} python -m dcpkit bench",
        "ranks_share_gpu": shared,
        "mps_active_thread_percentage": str(100 // W) if shared else None,
    }
    return {
        "schema": bench.SCHEMA,
        "meta": meta,
        "config": {},
        "ceilings": dict(CEIL),
        "rows": js,
        "targets": evaluate_targets(js, shared),
        "errors": [],
    }
