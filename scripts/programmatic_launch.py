"""Programmatic dependent launch, measured: each op behind a producer kernel in a CUDA graph,
with and without ``programmatic_launch=True`` (run on GPUs, under mpirun).

    mpirun -np 2 python scripts/programmatic_launch.py [--replays 50] [--json PATH]

Geometry: the DCP decode step of the benchmark (H = 128, D_q = 576, D_v = 512, bf16), W = the
number of ranks (ranks may share one GPU under MPS). For each case, two workspaces of the op (a
plain launch, and ``programmatic_launch=True``: NOTE [dcpkit programmatic launch]) are measured
alike: a graph of 20 pairs (producer, op call with ``out=``), where the producer is a small
kernel that writes the op's input (a copy from a source buffer over 4 CTAs) and lets the kernel
after it launch at once (``griddepcontrol.launch_dependents`` when it starts, as a producer that
supports programmatic launch does); replayed ``--replays`` times between CUDA events, the median
per pair, the maximum over ranks. A graph of 20 producers alone is the third column. The result
of the last replay is checked against the reference (bit for bit for the gathers, within the
tolerance for lse_reduce): a row whose result is wrong prints WRONG and the script exits 1.

Prints one table and writes it as JSON with ``--json``. Exits with one clear line and status 2
on a machine without a GPU or below compute capability 9.0.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dcpkit.cli import CommandParser, output_file, write_json
from dcpkit.demo.cli import integer

H, D_Q, D_V, D_KV = 128, 576, 512, 576
PAIRS = 20
CASES = (("q_gather", 1), ("q_gather", 8), ("lse_reduce", 1), ("lse_reduce", 8), ("kv_gather", 4))
_PRODUCER_SRC = r"""
extern "C" __global__ void dcpkit_producer(const uint4* src, uint4* dst, unsigned long long n) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


def parser():
    ap = CommandParser(
        prog="scripts/programmatic_launch.py",
        description="Each op behind a producer kernel in a CUDA graph, with and without "
        "programmatic_launch=True. Run it as 'mpirun -np N python scripts/programmatic_launch.py' "
        "on GPUs of compute capability 9.0+ (ranks may share one GPU under MPS).",
        alike_options=True,
    )
    ap.add_argument(
        "--replays",
        type=integer(4, 10000),
        default=50,
        help="timed replays of each graph of 20 pairs, 4 to 10000 (default: 50)",
    )
    ap.add_argument(
        "--json",
        metavar="PATH",
        type=output_file(),
        default=None,
        help="also write the results as JSON to PATH (rank 0; its folder must exist)",
    )
    return ap


def _gpu_or_exit() -> None:
    """Exit with status 2 and one line (once per job) without a usable GPU of sm_90+."""
    from dcpkit._cuda import require_device
    from dcpkit.errors import DcpkitError
    from dcpkit.info import launcher_rank

    why = None
    try:
        dev = require_device("scripts/programmatic_launch.py")
        import cupy

        cc = int(cupy.cuda.Device(dev).compute_capability)
        if cc < 90:
            why = (
                "scripts/programmatic_launch.py: needs compute capability 9.0 or newer "
                f"(device {dev}: {cc})"
            )
    except DcpkitError as e:
        why = str(e)
    if why is not None:
        if launcher_rank() in (None, 0):
            print(why, file=sys.stderr, flush=True)
        sys.exit(2)


def _build(comm, op: str, pdl: bool):
    from dcpkit.ops import KVGather, LseReduce, QGather

    W = comm.world_size
    kw = {"max_tokens": 16, "programmatic_launch": pdl}
    if op == "q_gather":
        return QGather(comm, heads_per_rank=H // W, head_dim=D_Q, dtype="bfloat16", **kw)
    if op == "lse_reduce":
        return LseReduce(comm, num_heads=H, head_dim=D_V, dtype="bfloat16", **kw)
    return KVGather(comm, row_dim=D_KV, dtype="bfloat16", **kw)


def _case(cupy, comm, op: str, T: int, seed: int):
    """(this rank's input on the device, extra call arguments, out, check(out) -> bool)."""
    import numpy as np

    from dcpkit.reference import (
        kv_gather_reference,
        lse_reduce_reference,
        lse_reduce_tolerance,
        make_inputs,
        q_gather_reference,
        resolve_dtype,
    )

    W, r = comm.world_size, comm.rank
    bf16 = resolve_dtype("bfloat16")

    def dev(a):
        a = np.ascontiguousarray(a)
        u = np.dtype(f"u{a.dtype.itemsize}")
        return cupy.asarray(a.view(u)).view(a.dtype)

    def host(x):
        u = np.dtype(f"u{x.dtype.itemsize}")
        return cupy.asnumpy(x.view(u)).view(x.dtype)

    if op == "q_gather":
        ins = [
            make_inputs(s, W, seed, op=op, tokens=T, num_heads=H, head_dim=D_Q, dtype="bfloat16")
            for s in range(W)
        ]
        want = q_gather_reference([i["q"] for i in ins])
        out = cupy.empty(want.shape, dtype=bf16)
        return dev(ins[r]["q"]), (), out, lambda o: bool((host(o) == want).all())
    if op == "kv_gather":
        ins = [
            make_inputs(s, W, seed, op=op, tokens=T, row_dim=D_KV, dtype="bfloat16")
            for s in range(W)
        ]
        want = kv_gather_reference([i["kv"] for i in ins])
        out = cupy.empty(want.shape, dtype=bf16)
        return dev(ins[r]["kv"]), (), out, lambda o: bool((host(o) == want).all())
    lse_kw = {"num_heads": H, "head_dim": D_V, "dtype": "bfloat16", "lse_dtype": "float32"}
    ins = [make_inputs(s, W, seed, op=op, tokens=T, **lse_kw) for s in range(W)]
    own = slice(r * H // W, (r + 1) * H // W)
    want, _ = lse_reduce_reference(
        [i["out_partial"][:, own] for i in ins], [i["lse_partial"][:, own] for i in ins]
    )
    tol = lse_reduce_tolerance(bf16)
    out = cupy.empty(want.shape, dtype=bf16)
    lse = cupy.asarray(ins[r]["lse_partial"])

    def ok(o):
        return bool((np.abs(host(o).astype(np.float64) - want) <= tol).all())

    return dev(ins[r]["out_partial"]), (lse,), out, ok


def _median_pair_us(cupy, graph, stream, replays: int) -> float:
    import numpy as np

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(3):
        graph.launch(stream)
    for _ in range(replays):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / PAIRS)
    return float(np.median(times))


def measure(cupy, comm, op: str, T: int, replays: int, producer) -> dict:
    x, extra, out, ok = _case(cupy, comm, op, T, seed=4242 + T)
    src = x.copy()
    n16 = x.nbytes // 16
    row = {"op": op, "T": T, "bytes_per_rank": int(x.nbytes)}
    s = cupy.cuda.Stream(non_blocking=True)
    with s:

        def produce():
            producer((4,), (256,), (src, x, cupy.uint64(n16)))

        g = None
        s.begin_capture()
        for _ in range(PAIRS):
            produce()
        g = s.end_capture()
        row["producer_alone_us"] = _median_pair_us(cupy, g, s, replays)
        for pdl in (False, True):
            key = "programmatic_us" if pdl else "plain_us"
            ws = _build(comm, op, pdl)
            try:
                ws(x, *extra, out=out, stream=s)  # the first call of a workspace: eager
                s.synchronize()
                s.begin_capture()
                for _ in range(PAIRS):
                    produce()
                    ws(x, *extra, out=out, stream=s)
                g = s.end_capture()
                out.view(cupy.uint16).fill(0xFFFF)
                x.view(cupy.uint16).fill(0xFFFF)  # the producer of each replay writes it
                row[key] = _median_pair_us(cupy, g, s, replays)
                s.synchronize()
                row[key.replace("_us", "_ok")] = ok(out)
                del g
            finally:
                ws.close()
    return row


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _gpu_or_exit()
    import cupy

    from dcpkit.comm import Communicator

    comm = Communicator.from_mpi()
    producer = cupy.RawKernel(_PRODUCER_SRC, "dcpkit_producer")
    rows = []
    for op, T in CASES:
        rows.append(measure(cupy, comm, op, T, args.replays, producer))
    every = comm.allgather(rows)
    table = []
    for i, row in enumerate(rows):
        merged = dict(row)
        for k in ("producer_alone_us", "plain_us", "programmatic_us"):
            merged[k] = max(r[i][k] for r in every)
        for k in ("plain_ok", "programmatic_ok"):
            merged[k] = all(r[i][k] for r in every)
        table.append(merged)
    wrong = any(not (r["plain_ok"] and r["programmatic_ok"]) for r in table)
    if comm.rank == 0:
        W = comm.world_size
        print(
            f"producer + op in a CUDA graph of {PAIRS} pairs, W={W}, {args.replays} replays, "
            "median us per pair, max over ranks"
        )
        print(
            f"{'op':<11}{'T':>4}{'bytes/rank':>12}{'producer':>10}{'plain':>9}"
            f"{'programmatic':>14}{'saved':>8}  result"
        )
        for r in table:
            res = "ok" if r["plain_ok"] and r["programmatic_ok"] else "WRONG"
            print(
                f"{r['op']:<11}{r['T']:>4}{r['bytes_per_rank']:>12}{r['producer_alone_us']:>10.2f}"
                f"{r['plain_us']:>9.2f}{r['programmatic_us']:>14.2f}"
                f"{r['plain_us'] - r['programmatic_us']:>8.2f}  {res}"
            )
    comm.barrier()
    if comm.rank == 0 and args.json:  # after the last collective step: no rank waits on it
        doc = {
            "world_size": comm.world_size,
            "replays": args.replays,
            "pairs": PAIRS,
            "commit": os.environ.get("DCPKIT_COMMIT"),
            "rows": table,
        }
        if write_json(args.json, doc, prog=ap.prog) != 0:
            return 1
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
