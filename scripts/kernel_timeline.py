"""Where the time of one call goes, phase by phase, measured inside the kernels (run on GPUs,
under mpirun).

    mpirun -np 2 python scripts/kernel_timeline.py [--ops q_gather,lse_reduce] [--tokens 1,128]
        [--replays 20] [--json PATH]

The ops and the benchmark's floor kernel are built with ``-DDCPKIT_TIMELINE=1``: thread 0 of
every CTA stores ``%globaltimer`` at each phase mark of a call (kernels/dcpkit_ptx.cuh, NOTE in
the timeline section; the ops as shipped are compiled without it). Geometry: the DCP decode
step of the benchmark (H = 128, D_q = 576, D_v = 512, bf16), W = the number of ranks (ranks may
share one GPU under MPS: ``%globaltimer`` is then one clock for all of them).

For every op and T, each measured like the benchmark's graph rows: fresh random inputs, a CUDA
graph of 20 calls with ``out=`` (copy-out), replayed ``--replays`` times, the result checked
against the reference after the replays; then the marks of the last 64 calls of every rank are
gathered and split into the steps of a call (:mod:`dcpkit.bench.timeline`). The floor kernel of
the same op and T (the benchmark's, same CTA count, in a graph of 20 launches) is measured the
same way beside it. q_gather is also measured eagerly in its zero-copy form (64 calls in a row
without ``out=``): its kernel steps, against the copy-out kernel of the graph.

Prints one table per op and T (mean and p90 over every call of every rank, in us) and writes
them as JSON with ``--json``. Exits with one clear line and status 2 on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dcpkit.bench.args import _csv, _int_list  # the bench's own list checks
from dcpkit.cli import CommandParser, output_file, write_json
from dcpkit.demo.cli import integer

OPTIONS = ("-DDCPKIT_TIMELINE=1",)
GEOMETRY = {"H": 128, "D": 576, "D_v": 512, "D_kv": 512, "itemsize": 2}
GRAPH_CALLS = 20
FLOOR_THREADS = 256  # dcpkit/bench/floor.py
FILES = {"q_gather": "q_gather.cu", "lse_reduce": "lse_reduce.cu"}


def parser() -> argparse.ArgumentParser:
    """The script's argument parser: a bad value is one line naming it, exit status 2."""
    ap = CommandParser(
        prog="scripts/kernel_timeline.py",
        description="Phase-by-phase time of a call inside the kernels, beside the floor "
        "kernel's. Run it as 'mpirun -np N python scripts/kernel_timeline.py' on GPUs (ranks "
        "may share one GPU under MPS).",
        alike_options=True,
    )
    ap.add_argument(
        "--ops",
        type=_csv(tuple(FILES)),
        default=["q_gather", "lse_reduce"],
        help="comma list of q_gather, lse_reduce (default: both)",
    )
    ap.add_argument(
        "--tokens",
        type=_int_list,
        default=[1, 128],
        help="comma list of token counts T to measure (default: 1,128)",
    )
    ap.add_argument(
        "--replays",
        type=integer(4, 10000),
        default=20,
        help=f"graph replays of {GRAPH_CALLS} calls each, 4 to 10000 (at least 4: 64 calls "
        "are read; default: 20)",
    )
    ap.add_argument(
        "--json",
        type=output_file(),
        default=None,
        metavar="PATH",
        help="also write the results as JSON to PATH (rank 0; its folder must exist)",
    )
    return ap


def _gpu_or_exit() -> None:
    """Exit with status 2 and one line (printed once per job) where there is no GPU to run on:
    no CuPy, no CUDA driver, no visible device."""
    from dcpkit._cuda import require_device
    from dcpkit.errors import DcpkitError
    from dcpkit.info import launcher_rank

    try:
        require_device("scripts/kernel_timeline.py")
    except DcpkitError as e:
        if launcher_rank() in (None, 0):
            print(f"{e}", file=sys.stderr, flush=True)
        sys.exit(2)


class Timeline:
    """One timeline buffer, set as the ``dcpkit_timeline`` global of one kernel module: ``file``
    built with ``options`` (an op's ``_kernel_options()``, which may add more than OPTIONS)."""

    def __init__(self, cupy, file: str, options=OPTIONS):
        from dcpkit import jit
        from dcpkit.bench.timeline import buffer_words

        self.cupy = cupy
        self.buf = cupy.zeros(buffer_words(), dtype=cupy.uint64)
        addr = jit.module_global(file, "dcpkit_timeline", options)
        slot = cupy.ndarray(
            (1,), cupy.uint64, cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(addr, 8, None), 0)
        )
        slot[0] = self.buf.data.ptr
        cupy.cuda.Device().synchronize()

    def clear(self) -> None:
        self.buf.fill(0)
        self.cupy.cuda.Device().synchronize()

    def calls(self):
        from dcpkit.bench.timeline import ordered_calls

        self.cupy.cuda.Device().synchronize()
        return ordered_calls(self.buf.get())


def _phases(comm, calls):
    from dcpkit.bench.timeline import phases

    every = comm.allgather(calls)
    n = min(len(c) for c in every)
    return phases([c[-n:] for c in every])


def _check(cupy, dev, out, refs) -> None:
    kind, ref, tol = refs[0]
    got = dev.compare([out], [(kind, cupy.asarray(ref), tol)])
    if got["wrong"]:
        raise SystemExit(f"scripts/kernel_timeline.py: wrong result after the replays: {got}")


def _graph(cupy, stream, fn):
    stream.begin_capture()
    for _ in range(GRAPH_CALLS):
        fn()
    return stream.end_capture()


def measure_op(cupy, comm, dev, op, T, replays, seed):
    """{"op": ..., "graph": phases, "floor": phases, "eager": phases (q_gather)} for one T."""
    from dcpkit.bench.cases import host_inputs
    from dcpkit.ops import LseReduce, QGather

    W = comm.world_size
    geom = dict(GEOMETRY, T=T)
    inp, refs = host_inputs(op, geom, comm.rank, W, seed, True)
    x = {k: dev.upload(v) for k, v in inp.items()}
    stream = cupy.cuda.Stream(non_blocking=True)
    if op == "q_gather":

        class Op(QGather):
            _diagnostic_options = OPTIONS

        obj = Op(
            comm,
            max_tokens=T,
            heads_per_rank=GEOMETRY["H"] // W,
            head_dim=GEOMETRY["D"],
            dtype=x["q"].dtype,
        )

        def call(out=None):
            return obj(x["q"], out=out, stream=stream)
    else:

        class Op(LseReduce):
            _diagnostic_options = OPTIONS

        obj = Op(
            comm,
            max_tokens=T,
            num_heads=GEOMETRY["H"],
            head_dim=GEOMETRY["D_v"],
            dtype=x["out_partial"].dtype,
        )

        def call(out=None):
            return obj(x["out_partial"], x["lse_partial"], out=out, stream=stream)

    result = {"op": op, "T": T, "world_size": W}
    try:
        tl = Timeline(cupy, FILES[op], obj._kernel_options())  # the module the op built
        first = call()
        stream.synchronize()
        if op == "q_gather":  # zero copy, eager, 64 calls in a row
            tl.clear()
            comm.barrier()
            for _ in range(64):
                call()
            stream.synchronize()
            result["eager_zero_copy"] = _phases(comm, tl.calls())
        out = dev.empty(first.shape, first.dtype)
        for _ in range(3):
            call(out)
        stream.synchronize()
        g = _graph(cupy, stream, lambda: call(out))
        dev.poison([out])
        tl.clear()
        comm.barrier()
        for _ in range(replays):
            g.launch(stream)
        stream.synchronize()
        _check(cupy, dev, out, refs)
        obj.check()
        result["graph"] = _phases(comm, tl.calls())
        result["ctas"] = int(
            obj.ctas_for(T, copy_out=True) if op == "q_gather" else obj.ctas_for(T)
        )
        result["floor"] = measure_floor(cupy, comm, dev, op, geom, obj, replays)
    finally:
        obj.close()
    return result


def measure_floor(cupy, comm, dev, op, geom, obj, replays):
    """The floor kernel of ``op`` at ``geom`` in a graph, as the benchmark runs it."""
    import numpy as np

    from dcpkit import jit
    from dcpkit.bench.floor import estimate_ctas
    from dcpkit.bench.stats import floor_bytes_per_peer
    from dcpkit.symmetric import SymmetricHeap

    W, r = comm.world_size, comm.rank
    per_peer = floor_bytes_per_peer(op, geom, W)
    nvec = -(-per_peer // 16)
    slot_bytes = -(-per_peer // 256) * 256
    max_ctas = int(obj.max_ctas)
    ctas = estimate_ctas(op, geom, W, max_ctas, obj, copy_out=True)  # as the graph calls
    sig_off = W * slot_bytes
    heap = SymmetricHeap(comm, sig_off + -(-(max_ctas * W * 4) // 256) * 256, multicast=False)
    try:
        peer_base = cupy.asarray(np.array(heap.peer_ptrs, dtype=np.uint64))
        epochs = cupy.zeros(max_ctas, dtype=cupy.uint32)
        status = cupy.zeros(max_ctas, dtype=cupy.uint32)
        src = cupy.arange(nvec * 4, dtype=cupy.uint32) * np.uint32(2654435761) + np.uint32(r)
        kernel = jit.get_kernel("ceilings.cu", "dcpkit::floor_kernel", OPTIONS).kernel
        tl = Timeline(cupy, "ceilings.cu")
        stream = cupy.cuda.Stream(non_blocking=True)
        args = (
            src,
            np.uint64(nvec),
            peer_base,
            np.uint64(slot_bytes),
            np.uint64(sig_off),
            epochs,
            np.int32(r),
            np.int32(W),
            np.uint64(10**10),
            status,
        )

        def launch():
            kernel((ctas,), (FLOOR_THREADS,), args, stream=stream)

        comm.barrier()
        launch()
        stream.synchronize()
        g = _graph(cupy, stream, launch)
        tl.clear()
        comm.barrier()
        for _ in range(replays):
            g.launch(stream)
        stream.synchronize()
        if int(status[:ctas].max()) != 0:
            raise SystemExit("scripts/kernel_timeline.py: a wait of the floor kernel timed out")
        for s in range(W):  # what rank s stored here
            if s == r:
                continue
            got = heap.view(s * slot_bytes, (nvec * 4,), np.uint32)
            want = cupy.arange(nvec * 4, dtype=cupy.uint32) * np.uint32(2654435761) + np.uint32(s)
            if not bool((got == want).all()):
                raise SystemExit(
                    f"scripts/kernel_timeline.py: the floor kernel's bytes from rank {s} differ"
                )
        res = _phases(comm, tl.calls())
        res["ctas"] = int(ctas)
        comm.barrier()
        return res
    finally:
        heap.close()


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _gpu_or_exit()
    import cupy

    from dcpkit.bench.device import CupyDevice
    from dcpkit.bench.timeline import format_table
    from dcpkit.comm import Communicator

    comm = Communicator.from_mpi()
    dev = CupyDevice(comm, {"timeout_ms": 10000.0, "hang_s": 60.0})
    results = []
    for op in args.ops:
        for T in args.tokens:
            results.append(measure_op(cupy, comm, dev, op, T, args.replays, seed=1000 + T))
    if comm.rank == 0:
        for r in results:
            cols = [
                {"label": f"{r['op']} graph ({r['ctas']} CTAs)", "phases": r["graph"]},
                {"label": f"floor graph ({r['floor']['ctas']} CTAs)", "phases": r["floor"]},
            ]
            if "eager_zero_copy" in r:
                cols.append({"label": "eager, zero copy", "phases": r["eager_zero_copy"]})
            step = r["graph"].get("timer_step_ns")
            print(
                f"\n{r['op']} T={r['T']} W={r['world_size']}: mean (p90) us over "
                f"{r['graph']['calls']} calls x {r['graph']['ranks']} ranks; "
                f"timer step {step} ns"
            )
            print(format_table(cols))
    comm.barrier()
    if comm.rank == 0 and args.json:  # after the last collective step: no rank waits on it
        doc = {"results": results, "commit": os.environ.get("DCPKIT_COMMIT")}
        return write_json(args.json, doc, prog=ap.prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
