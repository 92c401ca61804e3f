"""The run's context and its stages: every step that can fail runs on every rank, waits for
the GPU, then agrees on the outcome with one allgather, so every rank takes the same branch."""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..cli import write_output
from .common import SCHEMA, BenchHang, StageFailed, jsonable, short
from .row import BenchRow
from .stats import annotate
from .targets import evaluate_targets

__all__ = ["Ctx", "stage"]


class Ctx:
    """What one run carries around: settings, group, device, results so far."""

    def __init__(self, cfg: dict[str, Any], comm, dev, argv: Sequence[str]):
        self.cfg = cfg
        self.comm = comm
        self.dev = dev
        self.argv = list(argv)
        self.rank = comm.rank
        self.world = comm.world_size
        self.rows: list[BenchRow] = []
        self.errors: list[str] = []
        self.ceilings: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.torch_env = None
        self.nccl_group = None  # one NCCL communicator shared by the nccl path's ops
        self.peer_env = None  # NVSHMEM, started for the nvshmem path
        self.op_objects: dict[str, Any] = {}  # dcpkit's op of each op name (for ctas_for)
        self.op_graph_view: dict[str, bool] = {}  # whether its graph row captures without out=
        # dcpkit's pull build of each op (kv_gather) and whether its graph row captures without
        # out=: the grid of the floor row on the pull path's grid (variant FLOOR_PULL_GRID)
        self.pull_objects: dict[str, tuple[Any, bool]] = {}
        self.json_error: str | None = None  # why rank 0 could not write the JSON
        self.shared_gpu = None  # whether ranks share a GPU (None: unknown)
        self.ranks_on_gpu = 1  # ranks on this rank's GPU
        self.t0 = time.monotonic()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[bench {time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    def result(self) -> dict[str, Any]:
        rows = [r.to_json() for r in annotate([r.copy() for r in self.rows], self.ceilings)]
        return {
            "schema": SCHEMA,
            "meta": self.meta,
            "config": jsonable(self.cfg),
            "ceilings": self.ceilings,
            "rows": rows,
            "targets": evaluate_targets(rows, self.meta.get("ranks_share_gpu")),
            "errors": list(self.errors),
            "elapsed_s": round(time.monotonic() - self.t0, 1),
        }

    def save(self) -> None:
        """Rank 0 writes the JSON of everything so far (atomically). A file it cannot write is
        one line on stderr, said once (:attr:`json_error`; the run then ends with status 1),
        never an exception: the other ranks go on into the next collective step."""
        if self.rank != 0 or not self.cfg.get("json") or self.json_error is not None:
            return
        self.json_error = write_output(
            self.cfg["json"],
            lambda f: json.dump(jsonable(self.result()), f, indent=1, allow_nan=False),
            prog="dcpkit bench",
            make_folders=True,
        )


def stage(ctx: Ctx, what: str, fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on every rank, wait for the GPU, and agree on the outcome.

    Returns every rank's result (a list indexed by rank). Raises :class:`StageFailed` on every
    rank when ``fn`` raised on any rank, so that all ranks take the same branch afterwards.
    ``fn`` makes no host collective of its own (a rank that failed half-way would leave its peers
    in a collective it never enters): cross-rank work inside a stage happens on the GPU, where
    every wait has a deadline. The exceptions are the collective constructors and ``close()`` of
    dcpkit resources (heaps, ops, NCCL groups), whose own setup transactions agree on failure.

    Raises
    ------
    BenchHang
        A host wait for the GPU outlived ``--hang-s`` (fatal: the caller aborts the job).
    """
    err = None
    val = None
    try:
        val = fn()
    except BenchHang:
        raise
    except Exception as e:  # noqa: BLE001 - recorded and agreed on, never swallowed silently
        err = f"{type(e).__name__}: {e}"
        tb = traceback.format_exc() if ctx.cfg.get("verbose") else ""
        print(
            f"[bench rank {ctx.rank}] {what}: {short(err, 1000)}\n{tb}", file=sys.stderr, flush=True
        )
    try:
        ctx.dev.quiesce()
    except BenchHang:
        raise
    except Exception as e:  # noqa: BLE001
        if err is None:
            err = f"after {what}: {type(e).__name__}: {e}"
    gathered = ctx.comm.allgather((err, None if err else val, ctx.dev.barrier_token()))
    ctx.dev.barrier_resync(max(g[2] for g in gathered))
    failed = {r: g[0] for r, g in enumerate(gathered) if g[0] is not None}
    if failed:
        raise StageFailed(what, failed)
    return [g[1] for g in gathered]
