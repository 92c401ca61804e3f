"""The floor kernel as a path of the sweep (``floor``): what any implementation of an op's
exchange must at least spend on this machine, measured in the same run and in the same way as
the op (same cases, same eager and graph timing, same checks).

For each case the floor kernel (``floor_kernel`` in kernels/ceilings.cu) stores the op's egress
bytes to each peer (:func:`~dcpkit.bench.stats.floor_bytes_per_peer`) from a fresh pattern,
with the op's CTA count (``op.ctas_for(T)`` where the op has it, else the same estimate as the
op's own grid rule), then publishes with one ``fence.acq_rel.sys`` and one relaxed store per peer
and waits with relaxed polling plus one acquire, under a deadline. The check reads what every
peer stored here (destination poisoned first) and the per-CTA status words (0: every wait
completed; a timed-out wait counts as wrong).

kv_gather has two algorithms on two grids: the floor row without a variant takes the push
path's (``direct``) grid; where the pull path's (``direct-pull``) grid differs in a mode, the
floor kernel runs again on that one, as the row of variant ``pull_grid``
(:data:`~dcpkit.bench.common.FLOOR_PULL_GRID`, :func:`pull_grid_modes`), and the pull rows
take their ``floor_kernel_us`` from it (:func:`~dcpkit.bench.stats.annotate`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DcpkitError
from .common import FLOOR_PULL_GRID
from .runners import Runner
from .stats import floor_bytes_per_peer

__all__ = ["FloorRunner", "estimate_ctas", "floor_grids", "pull_grid_modes"]

_THREADS = 256
_VECTORS_PER_CTA = 512  # the gathers' default grid rule (dcpkit/ops/_gather.py)


def _grid(total: int, per_cta: int, max_ctas: int) -> int:
    return max(1, min(int(max_ctas), -(-int(total) // max(1, int(per_cta)))))


def estimate_ctas(
    op: str,
    geom: dict[str, Any],
    world_size: int,
    max_ctas: int,
    op_obj: Any = None,
    *,
    copy_out: bool = False,
    graph_view: bool = False,
) -> int:
    """The CTAs of one launch of ``op`` at ``geom["T"]``: ``op_obj.ctas_for(T)`` where the op
    has it; for a captured call (``copy_out``, or ``graph_view``: captured without out=) the
    grid :func:`dcpkit.bench.runners.graph_ctas` gives the op's own graph row; else the ops' own
    grid rules (gathers: one CTA per ``vectors_per_cta`` 16-byte vectors of a rank's block;
    lse_reduce: one warp per (source, token, owned head)), at most ``max_ctas`` (waiting CTAs
    must be co-resident)."""
    from .runners import graph_ctas

    T, W = int(geom["T"]), int(world_size)
    fn = getattr(op_obj, "ctas_for", None)
    if callable(fn):
        n = graph_ctas(op_obj, T, graph_view=graph_view) if (copy_out or graph_view) else None
        return max(1, min(int(max_ctas), int(fn(T) if n is None else n)))
    itemsize = int(geom.get("itemsize", 2))
    per = int(getattr(op_obj, "vectors_per_cta", _VECTORS_PER_CTA) or _VECTORS_PER_CTA)
    if op == "q_gather":
        return _grid(T * (int(geom["H"]) // W) * int(geom["D"]) * itemsize // 16, per, max_ctas)
    if op == "kv_gather":
        return _grid(T * int(geom["D_kv"]) * itemsize // 16, per, max_ctas)
    if op == "lse_reduce":
        try:
            from ..ops.lse_reduce import WARPS_PER_CTA as warps
        except ImportError:  # pragma: no cover - the op's module always defines it
            warps = 8
        return _grid(W * T * (int(geom["H"]) // W), warps, max_ctas)
    raise ValueError(f"estimate_ctas: op must be q_gather, kv_gather or lse_reduce (got {op!r})")


def _grid_source(ctx, op: str, variant: str | None) -> tuple[Any, bool]:
    """The dcpkit op whose grid the floor kernel of ``variant`` takes, and whether that op's
    graph row captures without out=: the push build (``direct``) for the floor row without a
    variant, the pull build (``direct-pull``) for :data:`FLOOR_PULL_GRID` (None where that
    path was not built)."""
    if variant is None:
        return ctx.op_objects.get(op), bool(getattr(ctx, "op_graph_view", {}).get(op, False))
    if variant == FLOOR_PULL_GRID:
        obj, view = getattr(ctx, "pull_objects", {}).get(op, (None, False))
        return obj, bool(view)
    raise ValueError(f"floor kernel: unknown variant {variant!r}")


def _max_ctas(ctx, obj: Any) -> int:
    """The largest grid of the floor kernel: the op's own cap (its waiting CTAs must be
    co-resident), else this rank's share of the SMs."""
    return int(getattr(obj, "max_ctas", 0) or 0) or max(
        1, int(ctx.dev.sm_count) // max(1, int(getattr(ctx, "ranks_on_gpu", 1) or 1))
    )


def floor_grids(
    ctx, op: str, geom: dict[str, Any], variant: str | None = None
) -> tuple[int, int] | None:
    """The (eager, graph) CTAs of the floor kernel of ``variant`` at ``geom``: the grids of the
    op's own eager and graph rows (:func:`estimate_ctas`). None for :data:`FLOOR_PULL_GRID`
    where the pull path was not built (no grid to take)."""
    obj, view = _grid_source(ctx, op, variant)
    if obj is None and variant is not None:
        return None
    geom, W, cap = dict(geom, itemsize=2), ctx.world, _max_ctas(ctx, obj)
    return (
        estimate_ctas(op, geom, W, cap, obj),
        estimate_ctas(op, geom, W, cap, obj, copy_out=True, graph_view=view),
    )


def pull_grid_modes(ctx, op: str, case: dict[str, Any], modes) -> list[str]:
    """The modes of ``modes`` in which the floor kernel must run again on the pull path's grid
    at ``case`` (this rank's view; the sweep agrees across ranks): those where the pull build's
    grid differs from the push build's. Where they are equal the one floor row serves both, and
    where the pull path was not built there is nothing to compare with."""
    push = floor_grids(ctx, op, case["geom"])
    pull = floor_grids(ctx, op, case["geom"], FLOOR_PULL_GRID)
    if pull is None:
        return []
    col = {"eager": 0, "graph": 1}
    return [m for m in modes if push[col[m]] != pull[col[m]]]


def pattern(xp, src_rank: int, salt: int, nwords: int):
    """The words rank ``src_rank`` sends in bind number ``salt`` (fresh for every bind)."""
    x = xp.arange(nwords, dtype=xp.uint32) * np.uint32(2654435761)
    return x ^ np.uint32((0x9E3779B9 * (src_rank + 1) + 0x85EBCA6B * (salt + 1)) & 0xFFFFFFFF)


class FloorRunner(Runner):
    """The floor kernel for one op (q_gather, lse_reduce or kv_gather); decode_layer runs the two
    floor kernels of its halves back to back (:class:`~dcpkit.bench.runners.DecodeRunner`).
    Variant :data:`FLOOR_PULL_GRID`: the same kernel on the grids of the pull build."""

    family = "floor"

    def build(self) -> None:
        from .. import jit
        from ..symmetric import SymmetricHeap

        ctx, dev, W = self.ctx, self.dev, self.ctx.world
        xp = dev.xp
        geom = dict(self.geom, itemsize=2, T=self.max_tokens)
        self.slot_bytes = -(-floor_bytes_per_peer(self.op, geom, W) // 256) * 256
        self.max_ctas = _max_ctas(ctx, _grid_source(ctx, self.op, self.variant)[0])
        self.sig_off = W * self.slot_bytes
        sig_bytes = -(-(self.max_ctas * W * 4) // 256) * 256
        self.heap = SymmetricHeap(ctx.comm, self.sig_off + sig_bytes, multicast=False)
        self.peer_base = xp.asarray(np.array(self.heap.peer_ptrs, dtype=np.uint64))
        # the heap starts zeroed: signals 0, and every epoch starts at 1
        self.epochs = xp.zeros(self.max_ctas, dtype=xp.uint32)
        self.status = xp.zeros(self.max_ctas, dtype=xp.uint32)
        self.kernel = jit.get_kernel("ceilings.cu", "dcpkit::floor_kernel").kernel
        self.stream = dev.new_stream()
        self.launches_per_call = 1
        self.binds = 0

    def bind(self, inp, case, refs=None) -> None:
        super().bind(inp, case, refs)
        ctx, dev, W = self.ctx, self.dev, self.ctx.world
        xp = dev.xp
        geom = dict(case["geom"], itemsize=2)
        per_peer = floor_bytes_per_peer(self.op, geom, W)
        self.nvec = -(-per_peer // 16)
        # a graph call of the op has its own grid (zero copy into a graph output buffer, or
        # copy-out): the floor's graph call takes that one
        grids = floor_grids(ctx, self.op, geom, self.variant)
        if grids is None:
            raise DcpkitError(
                f"{self.op} floor ({self.variant}): no pull build to take a grid from"
            )
        # never more CTAs than the signal words and epochs built for
        self.ctas, self.ctas_graph = (min(int(g), self.max_ctas) for g in grids)
        nwords = self.nvec * 4
        salt = self.binds
        self.binds += 1
        self.src = pattern(xp, ctx.rank, salt, nwords)
        peers = [s for s in range(W) if s != ctx.rank]
        self.outs = tuple(
            self.heap.view(s * self.slot_bytes, (nwords,), np.uint32) for s in peers
        ) + (self.status[: self.ctas],)
        self.refs = [("bits", pattern(xp, s, salt, nwords), None) for s in peers] + [
            ("bits", xp.zeros(self.ctas, dtype=xp.uint32), None)
        ]
        dev.sync_null()

    def check_outputs(self):
        return self.outs

    def own_refs(self):
        return self.refs

    def call(self, outs=None, graph: bool = False):
        ctx = self.ctx
        self.kernel(
            (self.ctas_graph if graph else self.ctas,),
            (_THREADS,),
            (
                self.src,
                np.uint64(self.nvec),
                self.peer_base,
                np.uint64(self.slot_bytes),
                np.uint64(self.sig_off),
                self.epochs,
                np.int32(ctx.rank),
                np.int32(ctx.world),
                np.uint64(int(ctx.cfg["timeout_ms"] * 1e6)),
                self.status,
            ),
            stream=self.stream,
        )
        return self.outs

    def close(self) -> None:
        heap, self.heap = getattr(self, "heap", None), None
        self.outs, self.refs, self.src = (), [], None
        if heap is not None:
            self.dev.quiesce()
            heap.close()
