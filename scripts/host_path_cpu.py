"""Python cost alone of one eager call of every dcpkit path, with the kernel launch stubbed out
(CPU only: no GPU, no driver).

    python scripts/host_path_cpu.py [--calls 20000] [--profile PATH] [--json PATH]

Every op is built without its collective setup (``__new__`` plus the state ``_setup`` would
give it, over made-up device addresses); the launch is replaced by a recorder, so what is timed
is the argument checks, the plan, the bookkeeping and the result, exactly as a call runs them.
Arrays are CuPy arrays over unowned made-up memory (never dereferenced). Paths:

* ``QGather`` / ``KVGather`` / ``LseReduce`` called directly, view-returning and ``out=`` forms;
* ``DCPComm`` with those ops inside (its topology probe and NCCL replaced by fakes);
* ``TorchOps`` and the custom ops ``torch.ops.dcpkit.*`` with torch CPU tensors; and a custom
  op of the same schema with an empty body (:data:`PROBE_ROWS`: no launch), torch's dispatcher
  alone. There are no
  CUDA tensors here: the tensor checks accept the CPU, torch's stream is a stand-in and a
  view result crosses back as a constant tensor, so these rows miss torch's stream query and
  one DLPack export per new view (the GPU script, ``scripts/host_overhead.py``, measures it).

Prints one table (median and p90 of the per-call time, over ``--calls`` calls, each timed
alone, by default in this thread's CPU time so that other processes on a shared machine do not
inflate it). This is a report, not a test: CI runs it with few calls and checks its rows only.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import sys
import time
import types
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

#: The DCP decode geometry of the GPU benchmark (H = 128, D_q = 576, D_v = 512, bf16), at W=2.
W, RANK, T_MAX, T = 2, 0, 8, 1
H, D_Q, D_V = 128, 576, 512
H_R = H // W
BASE = 1 << 40

ROWS = (
    "q_gather view",
    "q_gather out=",
    "kv_gather view",
    "kv_gather out=",
    "lse_reduce view",
    "lse_reduce out=",
    "DCPComm.q_gather",
    "DCPComm.lse_reduce",
    "DCPComm.kv_gather",
    "TorchOps.q_gather view",
    "TorchOps.q_gather out=",
    "TorchOps.lse_reduce out=",
    "torch.ops.dcpkit.q_gather",
    "torch.ops.dcpkit.lse_reduce",
)


#: Rows that launch nothing: what torch's dispatcher costs alone, for the custom-op rows.
PROBE_ROWS = ("torch custom op, empty body",)


class Recorder:
    """Stands in for the kernel launch: keeps the last launch's arguments and a count."""

    def __init__(self):
        self.count = 0
        self.last: tuple = ()

    def function(self, grid, block, args, shared_mem=0, stream=None):  # a cupy Function
        self.count += 1
        self.last = ("function", grid, args, stream)

    def launch(self, grid, params, stream_ptr):  # dcpkit._launch.Launcher.launch
        self.count += 1
        self.last = ("launcher", grid, params, stream_ptr)  # the buffer: read it afterwards


def _cpu_stream():
    """A CuPy stream object (it passes dcpkit's stream check) that is never capturing."""
    import warnings

    import cupy

    class CpuStream(cupy.cuda.ExternalStream):
        def is_capturing(self):
            return False

        def __enter__(self):  # CuPy's makes the stream current through the runtime
            return self

        def __exit__(self, *exc):
            return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return CpuStream(0)


def _buffer(nbytes: int):
    import cupy

    global BASE
    BASE += 1 << 28
    mem = cupy.cuda.UnownedMemory(BASE, max(nbytes, 1), None, 0)
    return cupy.ndarray((max(nbytes, 1),), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))


def array(shape, dtype):
    """A CuPy array over made-up, 256-byte aligned memory."""
    from dcpkit.reference import resolve_dtype

    dt = resolve_dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return _buffer(n).view(dt)[: int(np.prod(shape))].reshape(shape)


def stub_workspace(ws, stream, rec: Recorder, *, rank: int = RANK, world_size: int = W):
    """Give ``ws`` (built with ``__new__`` and its ``_check_arguments``, which sets the geometry
    and the layout) the state ``OpWorkspace._setup`` and the kernel loading would give it, over
    made-up addresses, with every launch going to ``rec`` and ``stream`` as the current
    stream."""
    from dcpkit._plan import PlanCache
    from dcpkit.ops._lse_checks import float_dtypes

    U = ws.num_ubatches
    ws.rank, ws.world_size, ws.device = rank, world_size, 0
    ws._debug = False
    ws._closed = False
    ws._rec = np.zeros(8, dtype=np.uint32)
    ws._calls = [0] * U
    ws._captured = [False] * U
    ws.multicast = False
    ws.transport = "unicast"
    ws.max_ctas = 66
    ws.waiter_ctas = 8
    ws._base = 0
    ws.heap = types.SimpleNamespace(local_ptr=_buffer(ws._region).data.ptr, mc_ptr=0)
    ws.get_stream = lambda s: stream if s is None else s
    ws._current_stream_fn = lambda device=-1: stream
    ws._graph_out = _buffer(max(ws._pool_stride, 1) * max(ws.graph_outputs, 1))
    ws._graph_base = ws._graph_out.data.ptr
    ws._graph_next = 0
    ws._eager_out = [_buffer(2 * max(ws._out_bytes, 1)) for _ in range(U)]
    # The local state _init_local_state would allocate, over made-up addresses; the protocol
    # parameters built by the op's own _make_proto (the kernels' DCPKIT_PROTO_PARAMS).
    ws._epoch = _buffer(8 * U)
    ws._ctl = _buffer(4 * (3 * U + 1))
    ws._peer_sig = _buffer(8 * world_size * U)
    ws._peer_data = _buffer(8 * world_size * U)
    ws._rec_ptr = _buffer(64).data.ptr
    ws._timeout_ns = np.uint64(int(ws.timeout_ms * 1e6))
    ws._proto = [ws._make_proto(u) for u in range(U)]
    # The fast path _init_fast_path would set up, every kernel's launcher being ``rec``.
    ws._plans = PlanCache(ws._plan)
    ws._launch_failed = None
    ws._launchers = _EveryKernel(rec)
    ws._get_device = lambda: 0
    if ws.op_name == "lse_reduce":
        T_max, H_r = ws.max_tokens, ws.heads_per_rank
        ws._cupy = _cupy_shim(stream)
        ws._fn = dict.fromkeys(float_dtypes(), rec.function)
        ws._head_args = [
            ws._proto[u]
            + (
                ws.peer_data_ptr(u),
                np.uint64(ws.slot_bytes),
                np.uint64(ws._lse_offset),
                np.int32(T_max),
            )
            for u in range(U)
        ]
        ws._tail_args = (np.int32(ws.num_heads), np.int32(H_r), np.int32(ws.head_dim))
        from dcpkit.ops.lse_reduce import launch_table

        ws._grids = launch_table(world_size, H_r, T_max, ws.max_ctas)
    return ws


class _EveryKernel(dict):
    """The op's launchers, every kernel key giving the same stand-in. A key is stored on its
    first lookup, so that later calls find it as in the plain dict of a GPU host's workspace
    (``__missing__``, a Python call, does not run on every call)."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __missing__(self, key):
        self[key] = self.rec
        return self.rec


def build_ops(stream, rec: Recorder, *, return_lse: bool = False):
    """QGather, KVGather and LseReduce (bf16, the DCP geometry) whose launches go to ``rec``
    (``return_lse``: LseReduce's, as DCPComm builds it)."""
    from dcpkit.ops.kv_gather import KVGather
    from dcpkit.ops.lse_reduce import LseReduce
    from dcpkit.ops.q_gather import QGather

    qg = QGather.__new__(QGather)
    qg._check_arguments(
        W, max_tokens=T_MAX, heads_per_rank=H_R, head_dim=D_Q, dtype="bfloat16", timeout_ms=5000.0
    )
    kg = KVGather.__new__(KVGather)
    kg._check_arguments(W, max_tokens=T_MAX, row_dim=D_Q, dtype="bfloat16", timeout_ms=5000.0)
    lr = LseReduce.__new__(LseReduce)
    lr._check_arguments(
        W,
        max_tokens=T_MAX,
        num_heads=H,
        head_dim=D_V,
        dtype="bfloat16",
        lse_base=math.e,
        return_lse=return_lse,
        timeout_ms=5000.0,
    )
    return tuple(stub_workspace(ws, stream, rec) for ws in (qg, kg, lr))


def _cupy_shim(stream):
    """CuPy, except that the current stream is ``stream`` (no driver here)."""
    import cupy

    cuda = types.SimpleNamespace(
        get_current_stream=lambda device=-1: stream,
        UnownedMemory=cupy.cuda.UnownedMemory,
        MemoryPointer=cupy.cuda.MemoryPointer,
        Device=lambda d=None: contextlib.nullcontext(),
    )
    return types.SimpleNamespace(cuda=cuda, ndarray=cupy.ndarray, empty=cupy.empty)


def build_dcpcomm(ops, stream):
    """A DCPComm whose direct ops are ``ops`` (topology probe and NCCL replaced by fakes)."""
    from dcpkit.comm import Communicator
    from dcpkit.manager import DCPComm

    by_name = {o.op_name: o for o in ops}

    class CpuDCPComm(DCPComm):
        def _current_device(self):
            return 0

        def _pci_bus_id(self):
            return None

        def _probe_topology(self):
            return None

        def _build_heap(self, nbytes):
            return None

        def _build_direct(self, op):
            return by_name[op]

        def _build_nccl_group(self):
            raise RuntimeError("no NCCL on this machine")

        def _load_copy_kernel(self):
            pass

        def _stream(self, s):
            return stream if s is None else s

    comm = Communicator(
        RANK,
        W,
        allgather=lambda o: [o] * W,
        broadcast=lambda o, root: o,
        barrier=lambda: None,
        backend="fake",
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "NCCL is unavailable"
        return CpuDCPComm(
            comm,
            max_tokens=T_MAX,
            num_heads=H,
            q_head_dim=D_Q,
            v_head_dim=D_V,
            kv_row_dim=D_Q,
            dtype="bfloat16",
        )


def _torch_module():
    """``sys.modules["dcpkit.torch"]``: the module that ``from dcpkit.torch import ...`` reads
    (the package attribute can be another one after a test imported the module afresh)."""
    import importlib

    return importlib.import_module("dcpkit.torch")


@contextlib.contextmanager
def torch_on_cpu(stream):
    """dcpkit.torch with CPU tensors: the tensor checks accept the CPU (and are otherwise the
    same), CuPy's device is the op's, torch's stream handle 0 is ``stream``, and a result
    crosses back as a constant CPU tensor (no DLPack of made-up device memory)."""
    import cupy

    try:
        import torch
    except ImportError:  # no torch rows
        yield None
        return
    dt = _torch_module()

    real_check = dt._check_tensor

    def check(t, name, device):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            if t.dtype not in dt.supported_dtypes():
                raise TypeError(name)
            return None
        return real_check(t, name, device)

    token = torch.zeros(1)
    runtime = types.SimpleNamespace(getDevice=lambda: 0)
    shim = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            Device=lambda d=None: contextlib.nullcontext(),
            runtime=runtime,
            get_current_stream=lambda device=-1: stream,
            UnownedMemory=cupy.cuda.UnownedMemory,
            MemoryPointer=cupy.cuda.MemoryPointer,
        ),
        ndarray=cupy.ndarray,
        from_dlpack=cupy.from_dlpack,
    )
    names = ("_check_tensor", "_raw_stream_fn", "_wrap_stream", "from_cupy", "_cupy")
    saved = {n: getattr(dt, n) for n in names if hasattr(dt, n)}
    dt._check_tensor = check
    dt._raw_stream_fn = lambda: lambda device: 0
    dt._wrap_stream = lambda ptr, device: stream
    dt.from_cupy = lambda a: token
    dt._cupy = lambda: shim
    try:
        yield dt
    finally:
        for n, v in saved.items():
            setattr(dt, n, v)


def paths(stream, rec: Recorder) -> dict[str, tuple[Callable[[], object], int]]:
    """Row name -> (a zero-argument call of that path, which launches once; the data pointer
    of its first input, which the launch must receive)."""
    qg, kg, lr = build_ops(stream, rec)
    dcp = build_dcpcomm(build_ops(stream, rec, return_lse=True), stream)
    q = array((T, H_R, D_Q), "bfloat16")
    q_out = array((T, H, D_Q), "bfloat16")
    kv = array((T, D_Q), "bfloat16")
    kv_out = array((W * T, D_Q), "bfloat16")
    xo = array((T, H, D_V), "bfloat16")
    lse = array((T, H), "float32")
    o = array((T, H_R, D_V), "bfloat16")
    qp, kp, xp = q.data.ptr, kv.data.ptr, xo.data.ptr
    res = {
        "q_gather view": (lambda: qg(q), qp),
        "q_gather out=": (lambda: qg(q, out=q_out), qp),
        "kv_gather view": (lambda: kg(kv), kp),
        "kv_gather out=": (lambda: kg(kv, out=kv_out), kp),
        "lse_reduce view": (lambda: lr(xo, lse), xp),
        "lse_reduce out=": (lambda: lr(xo, lse, out=o), xp),
        "DCPComm.q_gather": (lambda: dcp.q_gather(q), qp),
        "DCPComm.lse_reduce": (lambda: dcp.lse_reduce(xo, lse, out=o), xp),
        "DCPComm.kv_gather": (lambda: dcp.kv_gather(kv), kp),
    }
    try:
        import torch
    except ImportError:
        return res
    tq = torch.zeros((T, H_R, D_Q), dtype=torch.bfloat16)
    tq_out = torch.zeros((T, H, D_Q), dtype=torch.bfloat16)
    txo = torch.zeros((T, H, D_V), dtype=torch.bfloat16)
    tlse = torch.zeros((T, H), dtype=torch.float32)
    to = torch.zeros((T, H_R, D_V), dtype=torch.bfloat16)
    TorchOps = _torch_module().TorchOps

    tops = TorchOps(dcp)
    cq, cl = torch.ops.dcpkit.q_gather, torch.ops.dcpkit.lse_reduce
    h = tops.handle
    tqp, txp = tq.data_ptr(), txo.data_ptr()
    res.update(
        {
            "TorchOps.q_gather view": (lambda: tops.q_gather(tq), tqp),
            "TorchOps.q_gather out=": (lambda: tops.q_gather(tq, out=tq_out), tqp),
            "TorchOps.lse_reduce out=": (lambda: tops.lse_reduce(txo, tlse, out=to), txp),
            "torch.ops.dcpkit.q_gather": (lambda: cq(h, tq, tq_out, 0), tqp),
            "torch.ops.dcpkit.lse_reduce": (lambda: cl(h, txo, tlse, None, None, to, None, 0), txp),
        }
    )
    from dcpkit._torch_registry import dispatcher_probe

    probe = dispatcher_probe()
    res["torch custom op, empty body"] = (lambda: probe(h, tq, tq_out, 0), tqp)
    return res


#: The clock of :func:`measure`: this thread's CPU time by default (a call that another process
#: preempts is not charged for the wait: this machine's CPUs are shared), or wall time.
CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}


def measure(fn: Callable[[], object], calls: int, clock: str = "thread") -> np.ndarray:
    """Per-call times in microseconds, each call timed alone."""
    clock = CLOCKS[clock]
    for _ in range(min(200, calls)):
        fn()
    out = np.empty(calls, dtype=np.float64)
    for i in range(calls):
        t0 = clock()
        fn()
        out[i] = clock() - t0
    return out / 1e3


def run(calls: int = 20000, *, profile_calls: int = 0, clock: str = "thread") -> dict[str, dict]:
    """Every row: ``{"median_us", "p90_us", "calls", "launches", "last_launch", "input_ptr"[,
    "profile"]}``. ``launches`` is how many times the stubbed launch ran during the timed calls;
    ``last_launch`` is ``(kind, grid, kernel arguments, stream)`` of the last one."""
    rows: dict[str, dict] = {}
    rec = Recorder()
    stream = _cpu_stream()
    with torch_on_cpu(stream):
        fns = paths(stream, rec)
        for name in ROWS + PROBE_ROWS:
            if name not in fns:
                continue
            fn, ptr = fns[name]
            fn()
            before = rec.count
            t = measure(fn, calls, clock)
            row = {
                "median_us": float(np.median(t)),
                "p90_us": float(np.percentile(t, 90)),
                "calls": calls,
                "launches": rec.count - before - (0 if name in PROBE_ROWS else min(200, calls)),
                "last_launch": rec.last,
                "input_ptr": ptr,
            }
            if profile_calls:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(profile_calls):
                    fn()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
                row["profile"] = s.getvalue()
            rows[name] = row
    return rows


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'path (CPU, launch stubbed)':32s} {'median us':>10s} {'p90 us':>10s} {'calls':>8s}"]
    for name, r in rows.items():
        lines.append(f"{name:32s} {r['median_us']:10.2f} {r['p90_us']:10.2f} {r['calls']:8d}")
    return "\n".join(lines)


#: The most calls a row may be timed over: enough for a stable p90, small enough to end.
MAX_CALLS = 10_000_000


def parser():
    """The script's argument parser: every value is checked when parsed (one line, exit 2)."""
    from dcpkit.cli import CommandParser, output_file
    from dcpkit.demo.cli import integer

    ap = CommandParser(
        prog="scripts/host_path_cpu.py",
        description=" ".join(__doc__.split("\n\n")[0].split())
        + " The GPU counterpart is scripts/host_overhead.py.",
    )
    ap.add_argument(
        "--calls",
        type=integer(1, MAX_CALLS),
        default=20000,
        help=f"calls of every row, each timed alone, in [1, {MAX_CALLS}] (default: 20000)",
    )
    ap.add_argument(
        "--profile",
        metavar="PATH",
        type=output_file(),
        default=None,
        help="also write a cProfile table of 2000 calls of every row to PATH (its folder must "
        "exist)",
    )
    ap.add_argument(
        "--json",
        metavar="PATH",
        type=output_file(),
        default=None,
        help="also write the rows (median, p90, calls) as JSON to PATH (its folder must exist)",
    )
    ap.distinct_files(outputs=("--profile", "--json"))
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="thread",
        help="what is timed: this thread's CPU time (default: immune to other processes) or "
        "wall time",
    )
    return ap


def main(argv: list[str] = None) -> int:
    ap = parser()
    # DCPComm is built without timeout_ms, so it reads the variable: a bad value is a usage
    # line here, as in the commands that run ops, not an InvalidArgument traceback later
    args = ap.parse_agreed(argv, check=lambda ns: ap.timeout_from_env())
    from dcpkit._cuda import require_cupy
    from dcpkit.errors import MissingDependency

    try:
        require_cupy()  # the stand-in arrays and stream are CuPy objects (no GPU needed)
    except MissingDependency as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    rows = run(args.calls, profile_calls=2000 if args.profile else 0, clock=args.clock)
    print(table(rows))
    if not any(name.startswith(("TorchOps", "torch")) for name in rows):
        print(
            f"{ap.prog}: no torch rows: torch is not installed (README: Install)", file=sys.stderr
        )
    return write_files(rows, profile=args.profile, json_path=args.json, prog=ap.prog)


def write_files(rows: dict, *, profile: str | None, json_path: str | None, prog: str) -> int:
    """Write ``--profile`` and ``--json`` from the rows; the exit status: 0, or 1 after one line
    per file that could not be written (``<prog>: could not write <path>: <OS error>``)."""
    from dcpkit.cli import write_output

    failed = False
    if profile:

        def write_profile(f):
            for name, r in rows.items():
                f.write(f"==== {name}\n{r['profile']}\n")

        failed |= write_output(profile, write_profile, prog=prog) is not None
    if json_path:
        doc = {
            k: {kk: vv for kk, vv in v.items() if kk not in ("last_launch", "input_ptr", "profile")}
            for k, v in rows.items()
        }
        failed |= (
            write_output(json_path, lambda f: json.dump(doc, f, indent=1), prog=prog) is not None
        )
    return 1 if failed else 0


if __name__ == "__main__":
    from dcpkit.cli import pipe_safe

    raise SystemExit(pipe_safe(main, prog="scripts/host_path_cpu.py"))
