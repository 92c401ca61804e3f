"""Host time of one eager call of every dcpkit path, against an empty-launch baseline of the
same run, and device time of back-to-back eager calls (run on GPUs, under mpirun).

    mpirun -np 2 python scripts/host_overhead.py [--calls 10000] [--json PATH] [--profile]

Geometry: the DCP decode step (H = 128, D_q = 576, D_v = 512, bf16, T = 1), W = the number of
ranks (ranks may share one GPU under MPS). Every rank runs every row in the same order.

Rows (host time per call, each call timed alone; the device is synchronised every 100 calls,
outside the timed calls, so that a full launch queue never turns host time into device time).
Every row runs once unmeasured first, then the rows are measured in ``--rounds`` interleaved
rounds of ``calls / rounds`` calls each (median and p90 over all of a row's calls): a rank that
is slowed for a while (seen at W=4, one rank about 2.5 us slower through the first seven rows of
a run, the empty-launch baseline included, and level with the others afterwards) then weighs on
every row alike instead of on whichever rows ran at that moment:

* baselines: an empty CuPy ``RawKernel`` launch (no parameters: the targets' baseline), the same
  with 19 parameters, dcpkit's :class:`~dcpkit._launch.Launcher` (ctypes, cuda.bindings and
  CuPy's own binding) with those 19 parameters packed once, and CuPy's binding called without
  the launcher's method; q_gather with its launcher on ctypes and on cuda.bindings (the ops'
  default is CuPy's binding where it loads: the header says which ran);
* what an eager call asks the CUDA runtime besides its launch, no launch: CuPy's current stream
  (of the current device, and of a given one), the capture check of a stream (CuPy's
  ``Stream.is_capturing``, its runtime's ``streamIsCapturing``, and ``cuStreamIsCapturing``
  through cuda.bindings), the current device, each alone, and the three together as an op used to
  ask them and as it asks them now (the current device, then the current stream of the op's GPU
  and its capture state; an op row minus the launcher's launch minus these is the op's Python);
* every op with CuPy arrays, the view-returning and the ``out=`` forms; through ``DCPComm``;
  ``TorchOps`` with torch tensors; the custom ops ``torch.ops.dcpkit.*`` (where torch has CUDA),
  and a custom op of ``q_gather``'s schema with an empty body (no launch: torch's dispatcher
  alone, printed against the custom-op target's allowance);
* growth: q_gather with 4 live workspaces called in turn, and with 2 ubatches called in turn,
  each judged "no growth" within ``GROWTH_US`` (or 10 %) of its reference row, the same calls
  through the same closure on one workspace / one ubatch (:data:`GROWTH_ROWS`);
* back to back: 20 eager calls in a row between two CUDA events, device time per call (median
  over repeats), for q_gather, lse_reduce and the empty kernel.

Prints one table (max over ranks of every rank's median and p90) with the targets judged,
``<= empty launch + N us``, and writes JSON (for BENCHMARKS.md) with ``--json``. Exits with one
clear line and status 2 on a machine without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

H, D_Q, D_V, T = 128, 576, 512, 1
SYNC_EVERY = 100
#: Host time a growth row may add over the single-workspace row before it counts as growth
#: (or 10 % of that row, whichever is larger): run-to-run noise of one row on one machine.
GROWTH_US = 0.5
#: The growth rows, each with its reference row: the same calls through the same closure
#: (:func:`in_turn`), on one workspace / one ubatch.
GROWTH_ROWS = (
    ("q_gather view, 4 live workspaces in turn", "q_gather view, 1 workspace in the same turn"),
    ("q_gather view, 2 ubatches in turn", "q_gather view, 1 ubatch in the same turn"),
)


def in_turn(calls):
    """A zero-argument function that makes the calls of ``calls`` (zero-argument functions)
    one per call, in turn."""
    n, turn = len(calls), [0]

    def call():
        i = turn[0] = (turn[0] + 1) % n
        return calls[i]()

    return call


#: Row -> (target name, allowance over the empty launch in us).
TARGETS = {
    "op": ("every op with CuPy arrays", 2.0),
    "dcp": ("through DCPComm", 3.0),
    "torch": ("TorchOps with torch tensors", 3.0),
    "custom": ("torch custom ops", 6.0),
}
_EMPTY_SRC = r"""
extern "C" __global__ void dcpkit_empty() {}
extern "C" __global__ void dcpkit_empty_args(
    unsigned long long a0, unsigned long long a1, unsigned long long a2, unsigned long long a3,
    unsigned long long a4, unsigned long long a5, unsigned long long a6, int r, int w,
    unsigned long long timeout, unsigned int op, unsigned int u, unsigned long long p0,
    unsigned long long p1, unsigned long long p2, unsigned long long q, unsigned int t,
    unsigned long long o, unsigned long long s) {}
"""
_ARG_TYPES = ["u64"] * 7 + ["i32", "i32", "u64", "u32", "u32"] + ["u64"] * 4 + ["u32", "u64", "u64"]


PROG = "scripts/host_overhead.py"


def _fail(msg: str) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return 2


def _no_gpu_line(whys) -> str | None:
    """The one line for the job from every rank's reason for having no GPU (None: it has
    one), or None when every rank has one; ranks are named unless all share the reason."""
    ranks = {}
    for r, why in enumerate(whys):
        if why is not None:
            ranks.setdefault(why, []).append(r)
    if not ranks:
        return None
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(whys):
        return next(iter(ranks))
    return "; ".join(
        f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {why}" for why, rs in ranks.items()
    )


def _connect(why):
    """The job's Communicator, or ``(None, status)`` where there is none to run on: then the
    no-GPU line has been printed once for the job (by rank 0 of the job, or of the launcher
    where MPI cannot connect the ranks) and every rank returns the same status."""
    from dcpkit.cli import job_leader
    from dcpkit.comm import Communicator

    try:
        comm = Communicator.from_mpi()
    except Exception:
        if why is None:
            raise
        if job_leader():  # no shared communicator: the launcher's rank 0 speaks for the job
            _fail(why)
        return None, 2
    line = _no_gpu_line(comm.allgather(why))  # every rank takes the same branch
    if line is not None:
        if comm.rank == 0:
            _fail(line)
        return None, 2
    return comm, 0


def _gpu_or_reason():
    """(cupy, None) where a CUDA GPU is usable, else (None, why)."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA install
        return None, f"needs CuPy and a CUDA GPU (importing cupy failed: {type(e).__name__})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver / no device
        from dcpkit import _cuda

        why = str(e).splitlines()[0] if _cuda.driver_library_loads() else _cuda.NO_DRIVER
        return None, f"needs a CUDA GPU (none usable here: {why})"
    if n < 1:
        return None, "needs a CUDA GPU (none visible)"
    return cupy, None


def _stats(us):
    import numpy as np

    a = np.asarray(us, dtype=np.float64)
    return float(np.median(a)), float(np.percentile(a, 90))


def host_times(fn, calls: int, sync, warmup: int = 200) -> list:
    """Per-call host time in us; ``sync()`` every SYNC_EVERY calls, outside the timed calls."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(warmup):
        fn()
    sync()
    for i in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            sync()
    sync()
    return out


def back_to_back_us(cupy, fn, repeats: int = 50, n: int = 20) -> float:
    """Device time per call of ``n`` eager calls in a row (median over ``repeats``)."""
    import numpy as np

    stream = cupy.cuda.get_current_stream()
    per = []
    for _ in range(repeats):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        for _ in range(n):
            fn()
        b.record(stream)
        b.synchronize()
        per.append(cupy.cuda.get_elapsed_time(a, b) * 1e3 / n)
    return float(np.median(per))


def _gpu_name(cupy, dev: int) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(dev)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _commit() -> str:
    """DCPKIT_COMMIT (set by scripts/gpu_suite.sh, where the checkout may carry no git
    history), else ``git rev-parse``."""
    if os.environ.get("DCPKIT_COMMIT"):
        return os.environ["DCPKIT_COMMIT"][:12]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except Exception:  # noqa: BLE001
        return "unknown"


#: The row of an empty custom op (torch's dispatcher alone, nothing launched).
DISPATCHER_ROW = "torch custom op, empty body (no launch)"


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def build_rows(cupy, comm, dev: int, have_torch: bool):
    """[(row name, kind, call)]: kind is "base", "op", "dcp", "torch", "custom" or "growth".
    Returns also what must be closed at the end."""
    import numpy as np

    from dcpkit import DCPComm
    from dcpkit._launch import KernelParams, Launcher
    from dcpkit.ops import KVGather, LseReduce, QGather
    from dcpkit.reference import make_inputs

    W, r = comm.world_size, comm.rank
    mod = cupy.RawModule(code=_EMPTY_SRC)
    empty, empty_args = mod.get_function("dcpkit_empty"), mod.get_function("dcpkit_empty_args")
    vals = [0] * 7 + [r, W, 10**9, 2, 0] + [0] * 4 + [1, 0, 0]
    cargs = tuple(
        np.int32(v) if t == "i32" else np.uint32(v) if t == "u32" else int(v)
        for v, t in zip(vals, _ARG_TYPES)
    )
    params = KernelParams(_ARG_TYPES, vals)
    sptr = cupy.cuda.get_current_stream().ptr
    rows = [
        ("empty RawKernel launch (cupy)", "base", lambda: empty((1,), (32,), ())),
        ("empty kernel, 19 params (cupy)", "info", lambda: empty_args((1,), (32,), cargs)),
    ]
    for backend in ("ctypes", "bindings", "cupy"):
        try:
            ln = Launcher(empty_args.kernel, 32, backend=backend)  # the loaded Function
            ln.launch(1, params, sptr)
            rows.append(
                (
                    f"empty kernel, 19 params (Launcher {backend})",
                    "info",
                    lambda ln=ln: ln.launch(1, params, sptr),
                )
            )
        except Exception as e:  # noqa: BLE001 - reported as a missing row
            print(f"[rank {r}] Launcher {backend}: {type(e).__name__}: {e}", file=sys.stderr)
    # What an eager op call asks the CUDA runtime besides its launch, each alone and together
    # (no launch): CuPy's current stream, the capture check of that stream, the current device.
    # The ops' rows minus the bindings launch minus these rows is their Python.
    cur, dev_of = cupy.cuda.get_current_stream, cupy.cuda.runtime.getDevice
    from cupy_backends.cuda.api import driver as _cdrv
    from cupy_backends.cuda.api import runtime as _crt

    s0 = cur()
    capturing = _crt.streamIsCapturing
    fptr = empty_args.kernel.ptr
    launch = _cdrv.launchKernel
    paddr = params.address
    rows += [
        (
            "empty kernel, 19 params (cupy launchKernel, no method)",
            "info",
            lambda: launch(fptr, 1, 1, 1, 32, 1, 1, 0, sptr, paddr, 0),
        ),
        (
            "per-call queries (stream, capture, device)",
            "info",
            lambda: (cur().is_capturing(), dev_of()),
        ),
        (
            "per-call queries as the ops ask them (device; the op GPU's stream, its capture)",
            "info",
            lambda: (dev_of(), cur(dev).is_capturing()),
        ),
        ("current stream alone (cupy)", "info", cur),
        ("current stream of a given device (cupy)", "info", lambda: cur(dev)),
        ("capture check alone (cupy Stream.is_capturing)", "info", s0.is_capturing),
        ("capture check alone (cupy runtime.streamIsCapturing)", "info", lambda: capturing(sptr)),
        ("device query alone (cudaGetDevice)", "info", dev_of),
    ]
    try:
        from cuda.bindings import driver as _drv

        cs = _drv.CUstream(sptr)
        err, _ = _drv.cuStreamIsCapturing(cs)
        if err != _drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamIsCapturing returned {err}")
        rows.append(
            (
                "capture check alone (cuStreamIsCapturing, bindings)",
                "info",
                lambda: _drv.cuStreamIsCapturing(cs),
            )
        )
    except Exception as e:  # noqa: BLE001 - reported as a missing row
        print(f"[rank {r}] cuStreamIsCapturing: {type(e).__name__}: {e}", file=sys.stderr)
    Hr = H // W
    q = cupy.asarray(make_inputs(r, W, 1, op="q_gather", tokens=T, num_heads=H, head_dim=D_Q)["q"])
    li = make_inputs(r, W, 1, op="lse_reduce", tokens=T, num_heads=H, head_dim=D_V)
    xo, lse = cupy.asarray(li["out_partial"]), cupy.asarray(li["lse_partial"])
    kv = cupy.asarray(make_inputs(r, W, 1, op="kv_gather", tokens=4, row_dim=D_Q)["kv"])
    q_out = cupy.empty((T, H, D_Q), dtype=q.dtype)
    kv_out = cupy.empty((4 * W, D_Q), dtype=kv.dtype)
    o = cupy.empty((T, Hr, D_V), dtype=xo.dtype)
    qg = QGather(comm, max_tokens=8, heads_per_rank=Hr, head_dim=D_Q, dtype="bfloat16")
    kg = KVGather(comm, max_tokens=8, row_dim=D_Q, dtype="bfloat16")
    lr = LseReduce(comm, max_tokens=8, num_heads=H, head_dim=D_V, dtype="bfloat16")
    qg4 = [
        QGather(comm, max_tokens=8, heads_per_rank=Hr, head_dim=D_Q, dtype="bfloat16")
        for _ in range(3)
    ] + [qg]
    qu2 = QGather(
        comm, max_tokens=8, heads_per_rank=Hr, head_dim=D_Q, dtype="bfloat16", num_ubatches=2
    )
    dcp = DCPComm(
        comm,
        max_tokens=8,
        num_heads=H,
        q_head_dim=D_Q,
        v_head_dim=D_V,
        kv_row_dim=D_Q,
        dtype="bfloat16",
    )
    closers = [qg, kg, lr, qu2, dcp] + qg4[:3]
    # Each growth row calls its ops in turn through in_turn; its reference row makes the same
    # calls through the same closure, on one workspace / one ubatch, so that the difference is
    # the growth alone, not the turn's own Python.
    ws_turn = in_turn([lambda w=w: w(q) for w in qg4])
    ws_ref = in_turn([lambda: qg(q)] * len(qg4))
    ub_turn = in_turn([lambda: qu2(q, ubatch=0), lambda: qu2(q, ubatch=1)])
    ub_ref = in_turn([lambda: qu2(q, ubatch=0)] * 2)

    # The ops launch through their default launcher (CuPy's binding where it loads); the same op
    # with its launcher on ctypes and on cuda.bindings, for comparison (workspaces of their own).
    qb = QGather(comm, max_tokens=8, heads_per_rank=Hr, head_dim=D_Q, dtype="bfloat16")
    qb._set_launch_backend("ctypes")
    closers.append(qb)
    qc = QGather(comm, max_tokens=8, heads_per_rank=Hr, head_dim=D_Q, dtype="bfloat16")
    qc._set_launch_backend("bindings")
    closers.append(qc)
    fast_rows = [
        ("q_gather view (launcher on ctypes)", "info", lambda: qb(q)),
        ("q_gather view (launcher on bindings)", "info", lambda: qc(q)),
    ]
    rows += (
        [("q_gather view", "op", lambda: qg(q)), ("q_gather out=", "op", lambda: qg(q, out=q_out))]
        + fast_rows
        + [
            ("kv_gather view", "op", lambda: kg(kv)),
            ("kv_gather out=", "op", lambda: kg(kv, out=kv_out)),
            ("lse_reduce view", "op", lambda: lr(xo, lse)),
            ("lse_reduce out=", "op", lambda: lr(xo, lse, out=o)),
            ("DCPComm.q_gather", "dcp", lambda: dcp.q_gather(q)),
            ("DCPComm.lse_reduce out=", "dcp", lambda: dcp.lse_reduce(xo, lse, out=o)),
            ("DCPComm.kv_gather", "dcp", lambda: dcp.kv_gather(kv)),
            (GROWTH_ROWS[0][1], "info", ws_ref),
            (GROWTH_ROWS[0][0], "growth", ws_turn),
            (GROWTH_ROWS[1][1], "info", ub_ref),
            (GROWTH_ROWS[1][0], "growth", ub_turn),
        ]
    )
    if have_torch:
        import torch

        from dcpkit.torch import TorchOps

        tops = TorchOps(dcp)
        closers.insert(0, tops)
        tq = torch.from_dlpack(q)
        tq_out = torch.empty((T, H, D_Q), dtype=tq.dtype, device=tq.device)
        txo, tlse = torch.from_dlpack(xo), torch.from_dlpack(lse)
        to = torch.empty((T, Hr, D_V), dtype=txo.dtype, device=txo.device)
        cq, cl, h = torch.ops.dcpkit.q_gather, torch.ops.dcpkit.lse_reduce, tops.handle
        from dcpkit._torch_registry import dispatcher_probe

        probe = dispatcher_probe()
        rows += [
            ("TorchOps.q_gather view", "torch", lambda: tops.q_gather(tq)),
            ("TorchOps.q_gather out=", "torch", lambda: tops.q_gather(tq, out=tq_out)),
            ("TorchOps.lse_reduce out=", "torch", lambda: tops.lse_reduce(txo, tlse, out=to)),
            ("torch.ops.dcpkit.q_gather", "custom", lambda: cq(h, tq, tq_out, 0)),
            (
                "torch.ops.dcpkit.lse_reduce",
                "custom",
                lambda: cl(h, txo, tlse, None, None, to, None, 0),
            ),
            (DISPATCHER_ROW, "info", lambda: probe(h, tq, tq_out, 0)),
        ]
    b2b = [
        ("empty kernel", lambda: empty((1,), (32,), ())),
        ("q_gather view", lambda: qg(q)),
        ("q_gather out=", lambda: qg(q, out=q_out)),
        ("lse_reduce out=", lambda: lr(xo, lse, out=o)),
    ]
    return rows, b2b, closers, qg.launch_backend


#: The most calls a row may be timed over (as scripts/host_path_cpu.py): every call's time is
#: kept, on every rank, until the end.
MAX_CALLS = 10_000_000


def parser():
    """The script's argument parser: every value is checked when parsed (one line, exit 2)."""
    from dcpkit.cli import CommandParser, file_path
    from dcpkit.demo.cli import integer

    ap = CommandParser(
        prog="scripts/host_overhead.py",
        description=" ".join(__doc__.split("\n\n")[0].split())
        + " Run it as 'mpirun -np N python scripts/host_overhead.py', one GPU per rank or ranks "
        "sharing one GPU under MPS.",
        alike_options=True,
    )
    ap.add_argument(
        "--calls",
        type=integer(1, MAX_CALLS),
        default=10000,
        help=f"timed calls of every row, each timed alone, in [1, {MAX_CALLS}] (default: 10000)",
    )
    ap.add_argument(
        "--rounds",
        type=integer(1, MAX_CALLS),
        default=5,
        help="interleaved rounds the calls of every row are split into, at most --calls "
        "(default: 5)",
    )
    ap.add_argument(
        "--json",
        metavar="PATH",
        type=file_path,
        default=None,
        help="also write the results as JSON to PATH, the input of dcpkit bench --render-md "
        "--host-overhead (rank 0; its folder must exist)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="rank 0 prints a cProfile table of 2000 calls of every row",
    )
    return ap


def main(argv=None) -> int:
    ap = parser()
    from dcpkit.cli import output_file_problem

    def check(args) -> None:
        why = output_file_problem(args.json) if args.json is not None else None
        if why:
            ap.error(f"argument --json: {why}")
        if args.rounds > args.calls:
            ap.error(
                f"argument --rounds: must be at most --calls {args.calls} (every round times "
                f"at least one call of every row) (got {args.rounds})"
            )
        ap.timeout_from_env()  # the ops are built without timeout_ms: they read the variable

    # every check of the command line, agreed by the ranks (NOTE [dcpkit agreed parse])
    args = ap.parse_agreed(argv, check=check)
    cupy, why = _gpu_or_reason()
    comm, status = _connect(why)
    if comm is None:
        return status
    W, r = comm.world_size, comm.rank
    dev = comm.local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    torch = _torch_cuda()
    if torch is not None:
        torch.cuda.set_device(dev)
    have_torch = all(comm.allgather(torch is not None))
    rows, b2b, closers, backend = build_rows(cupy, comm, dev, have_torch)
    # every rank must run the same rows
    names = [n for n, _, _ in rows]
    every = comm.allgather(names)
    common = [n for n in names if all(n in e for e in every)]
    sync = cupy.cuda.get_current_stream().synchronize
    if have_torch:
        tsync = torch.cuda.current_stream(dev).synchronize

        def sync():
            cupy.cuda.get_current_stream().synchronize()
            tsync()

    rows = [row for row in rows if row[0] in common]
    for _name, _kind, fn in rows:  # every row once, unmeasured
        comm.barrier()
        host_times(fn, 1000, sync, warmup=0)
    per_round = -(-args.calls // args.rounds)
    times = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, _kind, fn in rows:
            comm.barrier()
            times[name] += host_times(fn, per_round, sync)
    results = {}
    for name, kind, fn in rows:
        med, p90 = _stats(times[name])
        every = comm.allgather((med, p90))
        results[name] = {
            "kind": kind,
            "median_us": [m for m, _ in every],
            "p90_us": [p for _, p in every],
            "calls": len(times[name]),
        }
        if args.profile:
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for i in range(2000):
                fn()
                if i % SYNC_EVERY == 0:
                    sync()
            pr.disable()
            sync()
            comm.barrier()
            if r == 0:
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
                print(f"==== {name}\n{s.getvalue()}")
    device = {}
    for name, fn in b2b:
        comm.barrier()
        for _ in range(20):
            fn()
        sync()
        comm.barrier()
        device[name] = comm.allgather(back_to_back_us(cupy, fn))
    for c in closers:
        c.close()
    if r != 0:
        return 0
    base = max(results["empty RawKernel launch (cupy)"]["median_us"])
    lines = [
        f"host time per call, W={W}, T={T}, {per_round * args.rounds} calls per row in "
        f"{args.rounds} interleaved rounds, max over ranks "
        f"(commit {_commit()}, {_gpu_name(cupy, dev)}, ops launch through {backend})",
        f"{'path':44s} {'median us':>10s} {'p90 us':>9s}  target",
    ]
    verdicts = {}
    for name, row in results.items():
        med, p90 = max(row["median_us"]), max(row["p90_us"])
        judged = ""
        if row["kind"] in TARGETS:
            what, allow = TARGETS[row["kind"]]
            ok = med <= base + allow
            verdicts[name] = ok
            row["target"] = f"<= empty + {allow:g} us"
            row["limit_us"] = base + allow
            judged = f"<= empty + {allow:g} us ({base + allow:.1f}): {'met' if ok else 'MISSED'}"
        elif row["kind"] == "growth":
            ref_name = dict(GROWTH_ROWS)[name]
            ref = max(results[ref_name]["median_us"])
            grows = med - ref > max(GROWTH_US, 0.1 * ref)
            verdicts[name] = not grows
            row["target"] = f"within {GROWTH_US:g} us or 10 % of {ref_name}"
            row["reference"] = ref_name
            row["limit_us"] = ref + max(GROWTH_US, 0.1 * ref)
            judged = f"vs the row above {ref:.2f}: {med - ref:+.2f} us: " + (
                "GROWS" if grows else "no growth"
            )
        lines.append(f"{name:44s} {med:10.2f} {p90:9.2f}  {judged}")
    if DISPATCHER_ROW in results:
        allow = TARGETS["custom"][1]
        alone = max(results[DISPATCHER_ROW]["median_us"])
        lines.append(
            f"torch's dispatcher alone (an empty custom op, no launch): {alone:.2f} us median, "
            f"against the {allow:g} us the custom-op target allows over the empty launch"
            + (": the dispatcher alone exceeds it" if alone > allow else "")
        )
    lines.append("")
    lines.append("back-to-back eager calls, 20 in a row, device time per call (max over ranks)")
    for name, v in device.items():
        lines.append(f"{name:44s} {max(v):10.2f} us")
    print("\n".join(lines))
    if args.json:
        meta = {
            "world_size": W,
            "tokens": T,
            "calls": per_round * args.rounds,
            "rounds": args.rounds,
            "commit": _commit(),
            "gpu": _gpu_name(cupy, dev),
            "driver": cupy.cuda.runtime.driverGetVersion(),
            "empty_launch_us": base,
            "launch_backend": backend,
        }
        doc = {
            "meta": meta,
            "host": results,
            "back_to_back_device_us": device,
            "targets_met": verdicts,
        }
        # rank 0 alone, after the last collective step: no rank waits on it
        return write_json(args.json, doc, prog=ap.prog)
    return 0


def write_json(path: str, doc: dict, *, prog: str) -> int:
    """Write ``--json`` (:func:`dcpkit.cli.write_json`): 0, or 1 after one line on stderr."""
    from dcpkit.cli import write_json as write

    return write(path, doc, prog=prog)


if __name__ == "__main__":
    from dcpkit.cli import pipe_safe

    raise SystemExit(pipe_safe(main, prog="scripts/host_overhead.py"))
