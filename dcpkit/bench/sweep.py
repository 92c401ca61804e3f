"""The sweep: every case of every op on every path, each checked then timed eager and in a
graph, and the run around it (ceilings, paths, teardown, printing)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import report
from .cases import cases_for, host_inputs
from .ceilings import measure_ceilings
from .common import (
    ALL_OPS,
    FLOOR_PATH,
    FLOOR_PULL_GRID,
    NCCL_PATHS,
    PEER_PATHS,
    PULL_PATH,
    BenchHang,
    StageFailed,
    short,
)
from .factory import local_paths, make_runner, paths_for
from .floor import pull_grid_modes
from .meta import collect_meta
from .peers import finalize_nvshmem
from .row import BenchRow
from .runners import Runner, TorchEnv, VariantUnavailable, accepts_keyword, free_port
from .stages import Ctx, stage
from .stats import max_over_ranks, median

__all__ = ["plan", "run_case", "run_op", "run_bench", "SELF_CHECK_OPS"]

#: The ops whose T=1 graph rows are also measured without self-checking signals.
SELF_CHECK_OPS = ("q_gather", "lse_reduce")


def plan(est_us: float, cfg: dict[str, Any], graph: bool) -> dict[str, int]:
    """Calls per sample and samples for a call of about ``est_us`` µs: samples of about
    ``sample_target_us``; exactly ``iters`` samples when ``--iters`` was given, else at most
    ``mode_budget_s`` per mode (at least 5 samples)."""
    est = max(float(est_us), 0.5)
    target = float(cfg["sample_target_us"])
    if graph:
        K = int(cfg["graph_calls"]) if est <= 1000.0 else max(2, int(20000.0 // est))
        R = max(1, min(10, int(round(target / (K * est)))))
        per_sample = K * R * est
        calls = {"graph_calls": K, "replays": R}
    else:
        n = max(2, min(50, int(round(target / est))))
        per_sample = n * est
        calls = {"calls": n}
    S = int(cfg["iters"])
    if not cfg.get("iters_exact"):  # the default count yields to the time budget
        S = max(min(S, 5), min(S, int(cfg["mode_budget_s"] * 1e6 // max(per_sample, 1.0))))
    calls["samples"] = S
    return calls


def _check_record(stage: str, per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    errs = [p.get("max_abs_err") for p in per_rank if p.get("max_abs_err") is not None]
    rels = [p.get("rel_err") for p in per_rank if p.get("rel_err") is not None]
    return {
        "stage": stage,
        "wrong": int(sum(p["wrong"] for p in per_rank)),
        "first_bad_by_rank": [p["first_bad"] for p in per_rank],
        "max_abs_err": max(errs) if errs else None,
        "rel_err": max(rels) if rels else None,
    }


def _ctas(runner: Runner, mode: str) -> int | None:
    """The CTAs of one launch of ``runner`` in ``mode`` (a graph call may use its own grid)."""
    g = getattr(runner, "ctas_graph", None) if mode == "graph" else None
    return g if g is not None else getattr(runner, "ctas", None)


def _new_row(ctx: Ctx, case: dict[str, Any], runner: Runner, mode: str) -> BenchRow:
    return BenchRow.for_case(
        case,
        runner.path,
        mode,
        ctx.world,
        variant=getattr(runner, "variant", None),
        launches_per_call=runner.launches_per_call,
        ctas=_ctas(runner, mode),
    )


def run_case(
    ctx: Ctx,
    runner: Runner,
    case: dict[str, Any],
    data: dict[str, Any],
    modes: Sequence[str] | None = None,
) -> tuple[list[BenchRow], bool]:
    """Check, then time eager and graph, one path on one case. Returns the rows and whether
    the runner must be rebuilt (a stage failed: the op may be poisoned)."""
    dev, cfg = ctx.dev, ctx.cfg
    modes = list(cfg["modes"] if modes is None else modes)
    rows = {m: _new_row(ctx, case, runner, m) for m in modes}
    label = f"{case['op']} T={case['T']} {runner.path}"
    A, B = data["check"], data["timed"]

    def fail(modes, e):
        for m in modes:
            rows[m].error = str(e)
        return list(rows.values()), True

    # Every step that can fail on one rank only (binding, allocating, capturing) is a stage of
    # its own, before any step in which the ranks wait for each other: a peer that failed
    # there would leave the others waiting inside NCCL, which has no deadline.
    box: dict[str, Any] = {}

    # 1. correctness on poisoned outputs, fresh inputs with edge cases
    def bind_check():
        runner.bind(A["dev"], case, A["refs"])
        box["refs"] = runner.own_refs() or A["refs"]
        box["outs"] = runner.check_outputs()
        dev.poison(box["outs"])

    def check():
        with runner.enqueue_context():
            res = runner.call(outs=box["outs"])
        dev.wait_stream(runner.stream, f"{label} check")
        return dev.compare(res, box["refs"])

    try:
        stage(ctx, f"{label}: bind check inputs", bind_check)
        rec = _check_record("check", stage(ctx, f"{label}: check", check))
    except StageFailed as e:
        return fail(modes, e)
    box.clear()
    for m, r in rows.items():
        r.checks.append(rec)
        r.wrong += rec["wrong"]
        r.ctas = _ctas(runner, m)

    # 2. warm-up on the timed inputs, and an estimate of the time per call (max over ranks)
    def warm():
        runner.calls(3)
        return dev.sample(runner.stream, lambda: runner.calls(5)) / 5

    try:
        stage(ctx, f"{label}: bind timed inputs", lambda: runner.bind(B["dev"], case, B["refs"]))
        refs_b = runner.own_refs() or B["refs"]
        est = max(stage(ctx, f"{label}: warm-up", warm))
    except StageFailed as e:
        return fail(modes, e)

    # 3. eager: n back-to-back calls per sample, host launch included
    if "eager" in rows:
        pe = plan(est, cfg, graph=False)

        def eager():
            box: list[Any] = []
            times = [
                dev.sample(runner.stream, lambda: box.append(runner.calls(pe["calls"])))
                / pe["calls"]
                for _ in range(pe["samples"])
            ]
            return {"times": times, "check": dev.compare(box[-1], refs_b)}

        try:
            per = stage(ctx, f"{label}: eager", eager)
            row = rows["eager"]
            row.times_us = max_over_ranks([p["times"] for p in per])
            row.plan = pe
            rec = _check_record("eager, after timing", [p["check"] for p in per])
            row.checks.append(rec)
            row.wrong += rec["wrong"]
        except StageFailed as e:
            return fail(modes, e)

    # 4. graph: K calls per graph, R replays per sample; output poisoned before the first replay
    if "graph" in rows:
        pg = plan(est, cfg, graph=True)

        def capture():
            box["launch"], box["last"] = runner.capture(pg["graph_calls"])
            dev.poison(box["last"])

        def graph():
            launch, last = box["launch"], box["last"]
            launch()
            dev.wait_stream(runner.stream, f"{label} first replay")
            first = dev.compare(last, refs_b)
            times = [
                dev.sample(runner.stream, lambda: [launch() for _ in range(pg["replays"])])
                / (pg["replays"] * pg["graph_calls"])
                for _ in range(pg["samples"])
            ]
            final = dev.compare(last, refs_b)
            return {"times": times, "first": first, "final": final}

        try:
            try:
                stage(ctx, f"{label}: graph capture", capture)
                per = stage(ctx, f"{label}: graph", graph)
            finally:
                box.clear()  # drops the graph
            row = rows["graph"]
            row.times_us = max_over_ranks([p["times"] for p in per])
            row.plan = pg
            for st, key in (
                ("graph, first replay (poisoned)", "first"),
                ("graph, after timing", "final"),
            ):
                rec = _check_record(st, [p[key] for p in per])
                row.checks.append(rec)
                row.wrong += rec["wrong"]
        except StageFailed as e:
            return fail(["graph"], e)
    return list(rows.values()), False


def _prepare_data(ctx: Ctx, op: str, case: dict[str, Any], seed: int) -> dict[str, Any]:
    """Host inputs and references of both input sets, uploaded (inside a stage)."""
    dev = ctx.dev
    data = {}
    for name, s, finite in (("check", seed, False), ("timed", seed + 1, True)):
        local, refs = host_inputs(op, case["geom"], ctx.rank, ctx.world, s, finite)
        data[name] = {
            "dev": {k: dev.upload(v) for k, v in local.items()},
            "refs": [(kind, dev.upload(r), tol) for kind, r, tol in refs],
        }
    dev.sync_null()
    return data


def _build(ctx: Ctx, factory, op: str, path: str, max_tokens: int, variant=None):
    """Build one runner (collective); None and the error when it failed on any rank."""
    if variant is None:
        runner = factory(ctx, op, path, max_tokens)
    else:
        runner = factory(ctx, op, path, max_tokens, variant=variant)
    what = f"{op} {path}" + (f" ({variant})" if variant else "")
    try:
        stage(ctx, f"{what}: build", runner.build)
        return runner, None
    except StageFailed as e:
        with contextlib.suppress(StageFailed):
            stage(ctx, f"{what}: cleanup", runner.close)
        return None, str(e)


def _summary_line(rows: Sequence[BenchRow]) -> str:
    parts = []
    for r in rows:
        if r.error:
            parts.append(f"{r.mode} ERROR")
        else:
            med = median(r.times_us)
            parts.append(f"{r.mode} {med:.2f} us" if med is not None else f"{r.mode} -")
    wrong = sum(r.wrong or 0 for r in rows[:1])
    return ", ".join(parts) + f", wrong {wrong}"


_VARIANT = "no_self_check"


def _variant_runner(ctx: Ctx, op: str, paths: Sequence[str], factory, cases, max_tokens):
    """The op built without self-checking signals (its T=1 graph row), or None; a missing
    keyword is recorded in ``meta["variants_not_available"]``."""
    if (
        op not in SELF_CHECK_OPS
        or "direct" not in paths
        or "graph" not in ctx.cfg["modes"]
        or not any(c["T"] == 1 for c in cases)
        or not accepts_keyword(factory, "variant")
    ):
        return None
    runner, err = _build(ctx, factory, op, "direct", max_tokens, variant=_VARIANT)
    if err:
        why = (
            "the op has no _self_check keyword"
            if VariantUnavailable.__name__ in err
            else f"build failed: {short(err, 300)}"
        )
        ctx.meta.setdefault("variants_not_available", {})[op] = f"{_VARIANT}: {why}"
        ctx.log(f"{op} direct ({_VARIANT}): n/a: {why}")
    return runner


#: Variants of the paired rows: the op as shipped and without self-checking signals, timed in
#: alternating samples of one stage (self_check.cost judges these where present).
PAIRED = ("paired", "paired_" + _VARIANT)


def paired_graph(ctx: Ctx, a: Runner, b: Runner, case, data) -> list[BenchRow]:
    """Graph rows of two builds of one op at one case, timed in alternating samples (A B B A
    ...) of one stage, so that a drift of the machine during the run weighs on both alike:
    the fair A/B of the self-check cost. Both use the timed inputs; each output is poisoned
    before the first replay and checked after it and after the timing. Rows: variants
    ``PAIRED`` (``a``, then ``b``)."""
    dev, cfg = ctx.dev, ctx.cfg
    B = data["timed"]
    runners = (a, b)
    rows = [_new_row(ctx, case, r, "graph") for r in runners]
    for row, name in zip(rows, PAIRED):
        row.variant = name
    label = f"{case['op']} T={case['T']} direct (paired)"
    box: dict[str, Any] = {}

    def setup():
        ests = []
        for i, r in enumerate(runners):
            r.bind(B["dev"], case, B["refs"])
            box[f"refs{i}"] = r.own_refs() or B["refs"]
            r.calls(3)
            ests.append(dev.sample(r.stream, lambda r=r: r.calls(5)) / 5)
        return max(ests)

    def capture(pg):
        for i, r in enumerate(runners):
            box[f"g{i}"] = r.capture(pg["graph_calls"])
            dev.poison(box[f"g{i}"][1])

    def timed(pg):
        out = {"times": ([], []), "first": [], "final": []}
        for i, r in enumerate(runners):
            launch, last = box[f"g{i}"]
            launch()
            dev.wait_stream(r.stream, f"{label} first replay")
            out["first"].append(dev.compare(last, box[f"refs{i}"]))
        for k in range(pg["samples"]):
            for i in (0, 1) if k % 2 == 0 else (1, 0):
                launch, r = box[f"g{i}"][0], runners[i]
                t = dev.sample(r.stream, lambda: [launch() for _ in range(pg["replays"])])
                out["times"][i].append(t / (pg["replays"] * pg["graph_calls"]))
        for i in (0, 1):
            out["final"].append(dev.compare(box[f"g{i}"][1], box[f"refs{i}"]))
        return out

    try:
        est = max(stage(ctx, f"{label}: bind and warm up", setup))
        pg = plan(est, cfg, graph=True)
        try:
            stage(ctx, f"{label}: graph capture", lambda: capture(pg))
            per = stage(ctx, f"{label}: graph", lambda: timed(pg))
        finally:
            box.clear()  # drops the graphs
    except StageFailed as e:
        for row in rows:
            row.error = str(e)
        return rows
    for i, row in enumerate(rows):
        row.times_us = max_over_ranks([p["times"][i] for p in per])
        row.plan = pg
        for st, key in (
            ("graph, first replay (poisoned)", "first"),
            ("graph, after timing", "final"),
        ):
            rec = _check_record(st, [p[key][i] for p in per])
            row.checks.append(rec)
            row.wrong += rec["wrong"]
    return rows


def _error_rows(ctx: Ctx, case, path: str, modes, error: str, variant=None) -> list[BenchRow]:
    return [
        BenchRow.for_case(case, path, m, ctx.world, variant=variant, error=error) for m in modes
    ]


class _PullFloor:
    """The floor kernel on the pull path's grid (variant ``FLOOR_PULL_GRID``), for the cases
    and modes where that grid differs from the push path's: the floor row without a variant
    runs on the push grid and serves both where they are equal. Built on first need; after a
    failed case it is closed and built again at the next case that needs it, and a failed
    build leaves error rows for every later such case (as a path's failed build does)."""

    def __init__(self, ctx: Ctx, factory, op: str, max_tokens: int):
        self.ctx, self.factory, self.op, self.max_tokens = ctx, factory, op, max_tokens
        self.runner: Runner | None = None
        self.build_err: str | None = None

    def modes(self, case) -> list[str]:
        """The modes to run at ``case``: where the grids differ on any rank (one stage, so
        that every rank runs the same rows)."""
        modes = self.ctx.cfg["modes"]
        what = f"{self.op} T={case['T']} {FLOOR_PATH} ({FLOOR_PULL_GRID}): grids"
        per = stage(self.ctx, what, lambda: pull_grid_modes(self.ctx, self.op, case, modes))
        return [m for m in modes if any(m in p for p in per)]

    def run(self, case, measure) -> None:
        """Plan, then measure, the rows of ``case`` (``measure``: run_op's, which records them)."""
        ctx, op, name = self.ctx, self.op, FLOOR_PULL_GRID
        try:
            modes = self.modes(case)
        except StageFailed as e:  # the pull rows then have no floor of their grid, not another's
            ctx.rows.extend(_error_rows(ctx, case, FLOOR_PATH, ctx.cfg["modes"], str(e), name))
            return
        if not modes:
            return
        if self.runner is None and self.build_err is None:
            if not accepts_keyword(self.factory, "variant"):
                self.build_err = "the runner factory takes no variant"
            else:
                self.runner, self.build_err = _build(
                    ctx, self.factory, op, FLOOR_PATH, self.max_tokens, variant=name
                )
        if self.runner is None:
            msg = f"build: {self.build_err}"
            ctx.rows.extend(_error_rows(ctx, case, FLOOR_PATH, modes, msg, name))
            return
        if measure(self.runner, case, FLOOR_PATH, modes, name):
            self.close()

    def close(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            try:
                stage(self.ctx, f"{self.op} {FLOOR_PATH} ({FLOOR_PULL_GRID}): close", runner.close)
            except StageFailed as e:
                self.ctx.errors.append(str(e))


def run_op(ctx: Ctx, op: str, paths: Sequence[str], factory, base_seed: int) -> None:
    """Every case of ``op`` on every path: build the runners once, share each case's inputs.
    The floor path runs after dcpkit's paths (it takes the op's CTA count), then again on the
    pull path's grid where that differs (:class:`_PullFloor`); the op without self-checking
    signals runs at T=1 in a graph, right after the op, then both again in alternating samples
    (:func:`paired_graph`)."""
    cases = cases_for(op, ctx.cfg, ctx.world)
    if ctx.cfg["geometry"]["H"] % ctx.world and op != "kv_gather":
        # a property of the geometry at this world size, not a failure of the run
        why = f"H = {ctx.cfg['geometry']['H']} heads do not divide by world_size {ctx.world}"
        ctx.meta.setdefault("ops_not_run", {})[op] = why
        ctx.log(f"{op}: not run: {why}")
        return
    max_tokens = max(c["T"] for c in cases)
    modes = ctx.cfg["modes"]
    runners: dict[str, Runner | None] = {}
    build_err: dict[str, str] = {}
    for p in paths_for(op, paths):
        runners[p], err = _build(ctx, factory, op, p, max_tokens)
        if err:
            build_err[p] = err
            ctx.log(f"{op} {p}: build failed: {short(err, 300)}")
    variant = _variant_runner(ctx, op, paths_for(op, paths), factory, cases, max_tokens)
    pull_floor = _PullFloor(ctx, factory, op, max_tokens)

    def measure(runner, case, box, path, run_modes, variant_name=None):
        try:
            rows, rebuild = run_case(ctx, runner, case, box, run_modes)
        except (BenchHang, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - a harness bug: same on every rank
            traceback.print_exc()
            rows = _error_rows(
                ctx, case, path, run_modes, f"harness error: {type(e).__name__}: {e}", variant_name
            )
            rebuild = True
        ctx.rows.extend(rows)
        ctx.log(
            f"{op} {report.fmt_bytes(case['bytes_per_rank'])}/rank T={case['T']} "
            f"{path}{f' ({variant_name})' if variant_name else ''}: {_summary_line(rows)}"
        )
        return rebuild

    try:
        for ci, case in enumerate(cases):
            seed = base_seed + 1000 * ALL_OPS.index(op) + 2 * ci
            box: dict[str, Any] = {}
            try:
                stage(
                    ctx,
                    f"{op} T={case['T']}: inputs",
                    lambda: box.update(_prepare_data(ctx, op, case, seed)),
                )
            except StageFailed as e:
                for p in runners:
                    ctx.rows.extend(_error_rows(ctx, case, p, modes, str(e)))
                continue
            for p in list(runners):
                runner = runners[p]
                if runner is None:
                    ctx.rows.extend(
                        _error_rows(ctx, case, p, modes, f"build: {build_err.get(p, 'failed')}")
                    )
                    continue
                if measure(runner, case, box, p, modes):
                    with contextlib.suppress(StageFailed):
                        stage(ctx, f"{op} {p}: close after failure", runner.close)
                    runners[p], err = _build(ctx, factory, op, p, max_tokens)
                    if err:
                        build_err[p] = err
                if p == FLOOR_PATH and PULL_PATH in runners:
                    pull_floor.run(case, lambda r, c, *a: measure(r, c, box, *a))
                if p == "direct" and variant is not None and case["T"] == 1:
                    if measure(variant, case, box, p, ["graph"], _VARIANT):
                        with contextlib.suppress(StageFailed):
                            stage(ctx, f"{op} {p} ({_VARIANT}): close", variant.close)
                        variant = None
                    elif runners[p] is not None:
                        pair = paired_graph(ctx, runners[p], variant, case, box)
                        ctx.rows.extend(pair)
                        ctx.log(
                            f"{op} T=1 direct, graph, paired: "
                            + ", ".join(f"{r.variant} {_summary_line([r])}" for r in pair)
                        )
            box.clear()
            ctx.dev.free_memory()
            ctx.save()
    finally:
        for p, runner in list(runners.items()) + [(f"direct ({_VARIANT})", variant)]:
            if runner is not None:
                try:
                    stage(ctx, f"{op} {p}: close", runner.close)
                except StageFailed as e:
                    ctx.errors.append(str(e))
        pull_floor.close()
        ctx.dev.free_memory()


def _agree_paths(ctx: Ctx) -> list[str]:
    per = stage(ctx, "paths", lambda: local_paths(ctx))
    common = [p for p in per[0][0] if all(p in q for q, _ in per[1:])]
    dropped = sorted(set(ctx.cfg["paths"]) - set(common))
    if dropped:
        ctx.log(
            f"paths not run here: {', '.join(dropped)} (multicast only where NOTE "
            f"[dcpkit multicast guard] allows it; torch only where installed)"
        )
    reasons: dict[tuple[str, str, bool], list[int]] = {}
    for rank, (_, why) in enumerate(per):
        for p, (reason, error) in why.items():
            reasons.setdefault((p, reason, error), []).append(rank)
    for (p, reason, error), ranks in sorted(reasons.items()):
        where = "every rank" if len(ranks) == len(per) else f"rank(s) {ranks}"
        ctx.log(f"path {p} not run on {where}: {short(reason, 300)}")
        if error:
            ctx.errors.append(f"path {p} not run on {where}: {reason}")
    gated = [p for p in common if p in NCCL_PATHS]
    why = _gpu_layout(ctx)
    if why is not None and gated:
        note = f"n/a (NCCL unavailable: {why})"
        ctx.meta["paths_not_available"] = dict.fromkeys(gated, note)
        ctx.log(f"paths not run here: {', '.join(gated)}: {note}")
        common = [p for p in common if p not in gated]
    return common


def _gpu_layout(ctx: Ctx) -> str | None:
    """Collective (one stage): which ranks share a GPU. Sets ``meta["ranks_share_gpu"]``
    (True, False, or None when a bus id could not be read), ``ctx.shared_gpu`` and
    ``ctx.ranks_on_gpu`` (ranks on this rank's GPU); returns why NCCL cannot start in this group,
    or None. NCCL refuses two ranks of one host on one GPU (``ncclInvalidUsage`` in
    ``ncclCommInitRank``), a documented limit of NCCL: the NCCL paths are then n/a, not
    failures. A GPU whose bus id cannot be read counts as unknown (NCCL is then tried, and a
    failure is an error as usual)."""
    from ..manager import shared_gpu_blocker

    def mine():
        try:
            bus = ctx.dev.pci_bus_id()
        except Exception:  # noqa: BLE001 - unknown: NCCL is tried as usual
            bus = None
        return ctx.comm.host, bus

    try:
        per = stage(ctx, "gpus", mine)
    except StageFailed as e:
        ctx.log(f"could not compare the GPUs of the ranks ({short(e, 200)}): NCCL is tried")
        ctx.meta["ranks_share_gpu"] = None
        return None
    known = all(b is not None for _, b in per)
    me = per[ctx.rank]
    ctx.ranks_on_gpu = sum(1 for hb in per if hb == me) if me[1] is not None else 1
    shared = len(set(per)) < len(per) if known else None
    ctx.shared_gpu = shared
    ctx.meta["ranks_share_gpu"] = shared
    return shared_gpu_blocker(hosts=[h for h, _ in per], bus_ids=[b for _, b in per])


def _nccl_group(ctx: Ctx):
    from ..fallback import NcclGroup

    return NcclGroup(ctx.comm)


def _start_torch(ctx: Ctx) -> str | None:
    """Start torch.distributed (collective) into ``ctx.torch_env``; an error message or None."""
    box: dict[str, Any] = {}
    try:
        port = stage(ctx, "torch: port", lambda: free_port() if ctx.rank == 0 else None)[0]
        addr = "127.0.0.1"
        if ctx.comm.spans_hosts:
            addr = stage(ctx, "torch: address", socket.gethostname)[0]
        stage(ctx, "torch: init", lambda: box.__setitem__("env", TorchEnv(ctx, port, addr)))
    except StageFailed as e:
        env = box.get("env")
        if env is not None:
            env.close()
        return str(e)
    ctx.torch_env = box["env"]
    ctx.meta["torch_nccl"] = ctx.torch_env.nccl_version
    return None


def run_bench(cfg: dict[str, Any], comm, dev, argv: Sequence[str] = (), factory=make_runner) -> int:
    """One benchmark run on an existing group and device (see the module doc).

    Returns 0 when every measured case of dcpkit, the floor kernel and NCCL was correct and
    nothing failed, 1 otherwise (missed targets and failed NVSHMEM rows do not count: they are
    results). Rank 0 prints the tables, writes the JSON and the plot.
    """
    ctx = Ctx(cfg, comm, dev, argv)
    try:
        return _run(ctx, factory)
    except BenchHang as e:
        msg = f"dcpkit bench: {e}; aborting the job"
        print(msg, file=sys.stderr, flush=True)
        ctx.errors.append(str(e))
        with contextlib.suppress(Exception):
            ctx.save()
        sys.stdout.flush()
        handle = getattr(comm, "handle", None)
        if getattr(comm, "backend", "") == "mpi" and handle is not None:
            handle.Abort(70)
        os._exit(70)


def _run(ctx: Ctx, factory) -> int:
    cfg = ctx.cfg
    seed = cfg["seed"]
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (2**31))
    seed = ctx.comm.broadcast(seed, root=0)
    cfg["seed"] = seed
    ctx.meta = collect_meta(ctx, ctx.argv)
    ctx.log(
        f"dcpkit bench: W={ctx.world}, {ctx.meta.get('gpu')}, commit "
        f"{str(ctx.meta.get('commit'))[:12]}, seed {seed} (replay with --seed {seed})"
    )
    try:
        stage(ctx, "setup", ctx.dev.setup)
    except StageFailed as e:
        ctx.errors.append(str(e))
        ctx.save()
        if ctx.rank == 0:
            print(f"dcpkit bench: setup failed, nothing measured: {e}", file=sys.stderr)
        return 1
    try:
        ctx.ceilings = measure_ceilings(ctx)
    except (BenchHang, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - a harness bug: same on every rank
        traceback.print_exc()
        ctx.ceilings = {"errors": [f"harness error: {type(e).__name__}: {e}"]}
    ctx.save()
    paths = _agree_paths(ctx)
    if "torch" in paths and factory is make_runner:
        err = _start_torch(ctx)
        if err:
            ctx.errors.append(f"torch path disabled: {err}")
            ctx.log(f"torch path disabled: {short(err, 300)}")
            paths = [p for p in paths if p != "torch"]
    if "nccl" in paths and factory is make_runner:
        box: dict[str, Any] = {}
        try:
            stage(ctx, "nccl: group", lambda: box.__setitem__("group", _nccl_group(ctx)))
            ctx.nccl_group = box.get("group")
        except StageFailed as e:
            ctx.log(f"no shared NCCL group ({short(e, 200)}): each NCCL op makes its own")
            group = box.get("group")
            if group is not None:  # made here but not everywhere: do not keep half a group
                with contextlib.suppress(Exception):
                    group.close()
    try:
        # The NVSHMEM peer rows run after every row of dcpkit's own paths: with ranks sharing a
        # GPU, rows measured in a process after NVSHMEM's collectives had run there came out up
        # to 100x slower, so interleaving them would misstate dcpkit's own rows.
        own = [p for p in paths if p != "nvshmem"]
        for op in cfg["ops"]:
            run_op(ctx, op, own, factory, seed)
        if len(own) < len(paths):
            for op in cfg["ops"]:
                run_op(ctx, op, ["nvshmem"], factory, seed)
    finally:
        if ctx.nccl_group is not None:
            with contextlib.suppress(StageFailed):
                stage(ctx, "nccl: close group", ctx.nccl_group.close)
        env = ctx.torch_env
        if env is not None:
            with contextlib.suppress(StageFailed):
                stage(ctx, "torch: close", env.close)
        if "nvshmem" in paths and factory is make_runner:
            try:
                finalize_nvshmem(ctx.comm)
            except Exception as e:  # noqa: BLE001 - recorded; the results stand
                ctx.errors.append(f"nvshmem: finalize: {type(e).__name__}: {e}")
        with contextlib.suppress(StageFailed):
            stage(ctx, "teardown", getattr(ctx.dev, "close", lambda: None))
    res = ctx.result()
    ctx.save()
    if ctx.rank == 0:
        if cfg.get("plot"):
            why = report.plot_results(res, cfg["plot"])
            print(f"# plot: {why}" if why else f"# plot written to {cfg['plot']}")
        print()
        print(report.render_ceilings(ctx.ceilings))
        print(report.render_table(res["rows"]))
        print(report.render_targets(res["targets"], ctx.world))
        if res["errors"]:
            print("# run errors:")
            for e in res["errors"]:
                print(f"#   {short(e, 300)}")
        for p, note in (ctx.meta.get("paths_not_available") or {}).items():
            print(f"# path {p}: {short(note, 300)}")
        for op, note in (ctx.meta.get("variants_not_available") or {}).items():
            print(f"# {op} {short(note, 300)}")
        for op, note in (ctx.meta.get("ops_not_run") or {}).items():
            print(f"# {op}: not run: {short(note, 300)}")
        wrong = sum(r.get("wrong") or 0 for r in res["rows"])
        failed = sum(1 for r in res["rows"] if r.get("error"))
        print(
            f"# dcpkit bench: W={ctx.world}, {len(res['rows'])} rows, {failed} failed, "
            f"{wrong} wrong results, {res['elapsed_s']} s"
            + (f", JSON {cfg['json']}" if cfg.get("json") and ctx.json_error is None else "")
            + (f", JSON not written ({ctx.json_error})" if ctx.json_error else ""),
            flush=True,
        )
    # a failed or wrong peer row is a result about the peer, not a failure of the run
    ours = [r for r in res["rows"] if not r["path"].startswith(PEER_PATHS)]
    bad = (
        any(r.get("error") or r.get("wrong") for r in ours)
        or bool(res["errors"])
        or bool(ctx.ceilings.get("errors"))
        or ctx.json_error is not None
    )
    return 1 if bad else 0
