"""The demo's timings: the communication of one path, eager and in a CUDA graph, nccl-tests
style (max over ranks of every repeat, then the median)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import DcpkitError
from .exchanges import Exchanges, build_exchanges
from .model import Model
from .steps import Say, short_error, step

#: Layers captured in one CUDA graph for the graph timings.
GRAPH_LAYERS = 20


TIMING_NOTES = (
    "microseconds per call of the communication alone (the partial attention is not timed); "
    "median over repeats of the max over ranks; eager = one call with the GPU idle before it, "
    f"the host's launch cost included; graph = {GRAPH_LAYERS} calls captured in one CUDA graph "
    f"on a non-default stream, replay time / {GRAPH_LAYERS}; layer = q_gather + lse_reduce; "
    "speedup = nccl / direct"
)


def summarize_times(per_rank_us: Sequence[Sequence[float]]) -> dict[str, float]:
    """nccl-tests style: the max over ranks of every repeat, then the median (and spread) of
    those maxima, in microseconds."""
    arr = np.asarray(per_rank_us, dtype=np.float64)
    worst = arr.max(axis=0)
    return {
        "median_us": float(np.median(worst)),
        "p10_us": float(np.percentile(worst, 10)),
        "p90_us": float(np.percentile(worst, 90)),
        "repeats": int(worst.size),
    }


def agreed_loop(comm, what: str, body: Callable[[], float], iters: int) -> list[float]:
    """``iters`` repeats of ``body`` on every rank, returning its values.

    Before each repeat the ranks allgather whether they are still healthy: that is the host
    barrier that lines them up, and it stops every rank at the same repeat when one fails
    (then :class:`~dcpkit.errors.PeerError` on every rank), so no rank is left waiting."""
    values: list[float] = []
    err: BaseException | None = None
    for _ in range(iters):
        if not all(comm.allgather(err is None)):
            break
        try:
            values.append(body())
        except Exception as e:  # noqa: BLE001 - agreed across ranks
            err = e
    comm.all_ok(what, err)
    return values


def timed(
    comm, what: str, tm, stream, run_once: Callable[[], Any], iters: int, warmups: int, per: int
) -> dict[str, float]:
    """Repeats of ``run_once`` on ``stream``, events around each, the GPU idle before each
    (so an eager time includes the host's launch cost, as an eager framework pays it).
    Microseconds per call (``per`` calls per repeat), median of the max over ranks."""
    start, end = tm.event(), tm.event()

    def warm() -> float:
        run_once()
        stream.synchronize()
        return 0.0

    def once() -> float:
        start.record(stream)
        run_once()
        end.record(stream)
        end.synchronize()
        return tm.elapsed_ms(start, end) * 1e3 / per

    with tm.on(stream):
        agreed_loop(comm, what, warm, warmups)
        times = agreed_loop(comm, what, once, iters)
    return summarize_times(comm.allgather(times))


def time_path(
    comm, ex: Exchanges, side, inputs: dict[str, Any], iters: int, say: Say
) -> dict[str, Any]:
    """Collective: q_gather, lse_reduce and a layer (both) on one path, eager and in a CUDA
    graph of :data:`GRAPH_LAYERS` calls. Every repeat is agreed across ranks."""
    q, out_partial, lse_partial = inputs["q"], inputs["out_partial"], inputs["lse_partial"]

    def buffers():
        tm = side.timing()
        return (
            tm,
            tm.stream(),
            side.empty(inputs["q_full_shape"], q),
            side.empty(inputs["out_shape"], out_partial),
        )

    tm, stream, q_out, o_out = step(comm, f"demo: timing the {ex.label} path: buffers", buffers)

    def qg(out=None):
        return ex.q_gather(q) if out is None else ex.q_gather(q, out=out)

    def lr(out=None):
        return (
            ex.lse_reduce(out_partial, lse_partial)
            if out is None
            else ex.lse_reduce(out_partial, lse_partial, out=out)
        )

    # eager: the ops' own outputs (views of workspace memory on the direct path);
    # graph: out= buffers, so that nothing is allocated during the capture.
    steps = {
        "q_gather": (lambda: qg(), lambda: qg(q_out)),
        "lse_reduce": (lambda: lr(), lambda: lr(o_out)),
        "layer": (lambda: (qg(), lr()), lambda: (qg(q_out), lr(o_out))),
    }
    tag = f"demo: timing the {ex.label} path"
    result: dict[str, Any] = {"eager": {}, "graph": {}}
    for name, (eager_fn, _) in steps.items():
        result["eager"][name] = timed(
            comm, f"{tag}, eager {name}", tm, stream, eager_fn, iters, warmups=3, per=1
        )
    result["paths"] = {op: ex.paths.get(op, "?") for op in ("q_gather", "lse_reduce")}
    for name, (_, graph_fn) in steps.items():
        err: BaseException | None = None
        graph = None
        try:
            graph = tm.capture(graph_fn, GRAPH_LAYERS, stream)
        except Exception as e:  # noqa: BLE001 - reported, agreed across ranks
            err = e
        errs = comm.allgather(None if err is None else short_error(err))
        bad = {r: m for r, m in enumerate(errs) if m}
        if bad:  # a capture launches nothing: the other ranks go on
            result["graph"][name] = {
                "error": "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
            }
            say(
                f"  {ex.label}: CUDA graph of {name} not captured: {result['graph'][name]['error']}"
            )
            continue
        result["graph"][name] = timed(
            comm,
            f"{tag}, graph {name}",
            tm,
            stream,
            lambda g=graph: tm.replay(g, stream),
            iters,
            warmups=2,
            per=GRAPH_LAYERS,
        )
    stream.synchronize()
    step(comm, f"{tag}: synchronize", ex.synchronize)
    return result


def run_timings(
    comm,
    args,
    model: Model,
    side,
    inputs: dict[str, Any],
    say: Say,
    nccl_unavailable: str | None = None,
) -> dict[str, Any]:
    """Collective: the direct and the NCCL paths, each built for the purpose, then closed.
    ``nccl_unavailable`` (equal on every rank): why the NCCL path cannot run; its timings are
    then skipped (``{"skipped": ...}``)."""
    timing: dict[str, Any] = {}
    for policy in ("direct", "nccl"):
        if policy == "nccl" and nccl_unavailable is not None:
            timing[policy] = {"skipped": f"NCCL unavailable: {nccl_unavailable}"}
            say(f"NCCL timings skipped: NCCL unavailable ({nccl_unavailable})")
            continue
        with say.timed(
            f"timing the {policy} path ({args.iters} repeats, eager and in a CUDA "
            f"graph of {GRAPH_LAYERS} layers)"
        ):
            try:
                base = step(
                    comm,
                    f"demo: building the {policy} ops",
                    lambda: build_exchanges(
                        comm,
                        model=model,
                        batch=args.batch,
                        dtype=inputs["dtype"],
                        policy=policy,
                        with_kv=False,
                        timeout_ms=getattr(args, "timeout_ms", None),
                    ),
                )
            except DcpkitError as e:
                timing[policy] = {"error": short_error(e)}
                say(f"  {policy} path unavailable: {short_error(e)}")
                continue
            try:
                ex = side.wrap(base)
                try:
                    timing[policy] = time_path(comm, ex, side, inputs, args.iters, say)
                finally:
                    if ex is not base:
                        ex.close()
            except DcpkitError as e:
                timing[policy] = {"error": short_error(e)}
                say(f"  {policy} path failed: {short_error(e)}")
            finally:
                base.close()
    return timing
