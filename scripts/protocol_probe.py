"""What each step of a small exchange costs, one step at a time, beside q_gather (run on GPUs,
under mpirun).

    mpirun -np 2 python scripts/protocol_probe.py [--tokens 1,8] [--replays 200] [--json PATH]

Geometry: q_gather's block of the benchmark's decode step (H = 128, D = 576, bf16: T x H / W x D
per rank), W = the number of ranks (ranks may share one GPU under MPS). For each T, the probe
kernel (``kernels/protocol_probe.cu``) moves that block to every peer with q_gather's grid in a
graph (``QGather.ctas_for(T, graph_view=True)``), once per variant:

* ``floor``: the floor kernel's protocol (per-CTA fence and signal, no election);
* ``+poison``, ``+elect``, ``+poison+elect``, ``+poison+elect+credit``: the ops' poison check,
  their CTA election (one fence and one signal per rank, one waiting CTA) and the credits of a
  zero-copy graph call, added one at a time (the last: the shape of q_gather's graph call
  while it had the election);
* ``+poison+counter`` (``+credit``): a publish without an election, every CTA adding its share
  to a per-source counter of every rank, one waiting CTA; ``+poison+counter+sig`` (``+credit``):
  the same with the push gathers' signal word (CTA 0 stores it before its fence, the waiter
  loads it beside every poll and checks it after the acquire), the shape of q_gather's call;
* ``ll``: flags inside the data instead of a fence and a signal (two 16-byte stores of
  data + epoch words per vector, polled and copied out by the receiver), with the receivers the
  co-residency rule allows (``waiter_ctas``) or with every CTA, and ``ll+poison+elect`` (what an
  op on that protocol would add);
* ``floor`` and ``+poison+elect+credit`` again with 256 threads per CTA (the same grid);

and q_gather itself, view form (zero copy into its graph output buffer) and ``out=``, with its
own 512 threads per CTA and with 256 (a subclass that launches the same kernel). Each is a
CUDA graph of 20 calls replayed ``--replays`` times between CUDA events: the median per call,
the maximum over ranks. Every variant is checked first, on fresh random data with the
destination poisoned (bit for bit; every wait completed): a wrong row prints WRONG and the
script exits 1.

Prints one table and writes it as JSON with ``--json``. Exits with one clear line and status 2
on a machine without a GPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dcpkit.bench.args import _int_list  # the bench's own list checks
from dcpkit.cli import CommandParser, output_file, write_json
from dcpkit.demo.cli import integer

H, D = 128, 576
CALLS = 20
#: Largest T of --tokens (the probe's heap holds every variant's slots for the largest T).
MAX_T = 64
THREADS = 512
POISON, ELECT, CREDIT, LL, COUNTER, SIGWORD = 1, 2, 4, 8, 16, 32
#: (name, features, receivers, threads per CTA): receivers "waiters" = QGather.waiter_ctas,
#: "grid" = every CTA.
VARIANTS = (
    ("floor", 0, None, THREADS),
    ("+poison", POISON, None, THREADS),
    ("+elect", ELECT, None, THREADS),
    ("+poison+elect", POISON | ELECT, None, THREADS),
    ("+poison+elect+credit", POISON | ELECT | CREDIT, None, THREADS),
    ("+poison+counter", POISON | COUNTER, None, THREADS),
    ("+poison+counter+credit", POISON | COUNTER | CREDIT, None, THREADS),
    ("+poison+counter+sig", POISON | COUNTER | SIGWORD, None, THREADS),
    ("+poison+counter+sig+credit", POISON | COUNTER | SIGWORD | CREDIT, None, THREADS),
    ("ll, waiters receive", LL, "waiters", THREADS),
    ("ll, every CTA receives", LL, "grid", THREADS),
    ("ll+poison+elect, waiters receive", LL | POISON | ELECT, "waiters", THREADS),
    ("floor, 256 threads", 0, None, 256),
    ("+poison+elect+credit, 256 threads", POISON | ELECT | CREDIT, None, 256),
)


def _tokens(text: str) -> list[int]:
    """The bench's own list rule (items, blanks and repeats alike), with T at most MAX_T."""
    from argparse import ArgumentTypeError

    why = f"must be a comma list of integers in [1, {MAX_T}] (got {text!r})"
    try:
        vals = _int_list(text)
    except ArgumentTypeError as e:
        raise ArgumentTypeError(str(e) if "repeat" in str(e) else why) from None
    if any(v > MAX_T for v in vals):
        raise ArgumentTypeError(why)
    return sorted(vals)


def parser():
    ap = CommandParser(
        prog="scripts/protocol_probe.py",
        description="The cost of each step of a small exchange (poison check, election, credits, "
        "flags inside the data), beside q_gather. Run it as 'mpirun -np N python "
        "scripts/protocol_probe.py' on GPUs (ranks may share one GPU under MPS).",
        alike_options=True,
    )
    ap.add_argument(
        "--tokens",
        type=_tokens,
        default=[1, 8],
        help=f"comma list of token counts T in [1, {MAX_T}] (default: 1,8)",
    )
    ap.add_argument(
        "--replays",
        type=integer(4, 10000),
        default=200,
        help="timed replays of each graph of 20 calls, 4 to 10000 (default: 200)",
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
    """Exit with status 2 and one line (once per job) without a usable GPU."""
    from dcpkit._cuda import require_device
    from dcpkit.errors import DcpkitError
    from dcpkit.info import launcher_rank

    try:
        require_device("scripts/protocol_probe.py")
    except DcpkitError as e:
        if launcher_rank() in (None, 0):
            print(str(e), file=sys.stderr, flush=True)
        sys.exit(2)


def _median_call_us(cupy, graph, stream, replays: int) -> float:
    import numpy as np

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(5):
        graph.launch(stream)
    times = []
    for _ in range(replays):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / CALLS)
    return float(np.median(times))


def _graph_of(cupy, stream, call):
    stream.begin_capture()
    for _ in range(CALLS):
        call()
    return stream.end_capture()


class Probe:
    """The probe kernel's heap and state, for blocks of up to ``max_vec`` vectors per rank."""

    def __init__(self, cupy, comm, max_vec: int, max_ctas: int, timeout_ms: float):
        import numpy as np

        from dcpkit import jit
        from dcpkit.symmetric import SymmetricHeap

        self.cp, self.comm, self.W = cupy, comm, comm.world_size
        self.max_ctas = max_ctas
        self.slot_bytes = -(-max_vec * 32 // 256) * 256  # room for the LL form
        self.sig_off = 2 * self.W * self.slot_bytes
        self.cred_off = self.sig_off + 2 * max_ctas * self.W * 8
        self.nbytes = -(-(self.cred_off + 2 * self.W * 8) // 256) * 256  # credits, counters
        self.heap = SymmetricHeap(comm, self.nbytes, multicast=False)
        self.peer_base = cupy.asarray(np.array(self.heap.peer_ptrs, dtype=np.uint64))
        self.epochs = cupy.zeros(max_ctas, dtype=cupy.uint64)
        self.arrive = cupy.zeros(1, dtype=cupy.uint32)
        self.abort = cupy.zeros(1, dtype=cupy.uint32)
        self.status = cupy.zeros(max_ctas, dtype=cupy.uint32)
        self.out = cupy.zeros(self.W * max_vec * 4, dtype=cupy.uint32)
        self.timeout_ns = int(timeout_ms * 1e6)
        self.kernel = jit.get_kernel("protocol_probe.cu", "dcpkit::protocol_probe_kernel").kernel

    def reset(self) -> None:
        """Before a configuration, on every rank: the signals, credits, epochs and counters
        zeroed, the data slots and ``out`` poisoned (0xFF); then a barrier, so that no peer
        stores into this rank's slots before they are poisoned."""
        cp = self.cp
        cp.cuda.Device().synchronize()
        self.heap.view(0, (self.sig_off,), "uint8").fill(0xFF)
        self.heap.view(self.sig_off, (self.nbytes - self.sig_off,), "uint8").fill(0)
        for a in (self.epochs, self.arrive, self.status):
            a.fill(0)
        self.out.fill(0xFFFFFFFF)
        cp.cuda.Device().synchronize()
        self.comm.barrier()

    def launch(
        self, stream, src, nvec: int, grid: int, features: int, recv: int, threads: int
    ) -> None:
        import numpy as np

        self.kernel(
            (grid,),
            (threads,),
            (
                src,
                np.uint64(nvec),
                self.peer_base,
                np.uint64(self.slot_bytes),
                np.uint64(self.sig_off),
                np.uint64(self.cred_off),
                self.epochs,
                self.arrive,
                self.abort,
                self.status,
                self.out,
                np.int32(self.comm.rank),
                np.int32(self.W),
                np.uint64(self.timeout_ns),
                np.uint32(features),
                np.uint32(recv),
                np.uint32(self.max_ctas),
            ),
            stream=stream,
        )

    def check(self, srcs, nvec: int, grid: int, features: int) -> bool:
        """After one call: every peer's block where the variant puts it, bit for bit, and every
        wait of the call completed."""
        cp, W, r = self.cp, self.W, self.comm.rank
        cp.cuda.Device().synchronize()
        if int(self.status[:grid].sum()) != 0:
            return False
        if features & LL:
            got = self.out[: W * nvec * 4].reshape(W, nvec * 4)
            return all(bool((got[s] == srcs[s]).all()) for s in range(W))
        e = int(self.epochs[0])  # elect, counter: the shared epoch; else every CTA's (all equal)
        par = e & 1
        for s in range(W):
            if s == r:
                continue
            off = (par * W + s) * self.slot_bytes
            got = self.heap.view(off, (nvec * 4,), "uint32")
            if not bool((got == srcs[s]).all()):
                return False
        return True

    def close(self) -> None:
        self.cp.cuda.Device().synchronize()
        self.heap.close()


def _sources(cupy, W: int, nvec: int, seed: int):
    """Every rank's block (u32 words), fresh for each seed; the same on every rank."""
    import numpy as np

    return [
        cupy.asarray(
            np.random.default_rng(seed * 1009 + s)
            .integers(0, 2**32, size=nvec * 4, dtype=np.uint64)
            .astype(np.uint32)
        )
        for s in range(W)
    ]


def measure(cupy, comm, probe: Probe, qgs, T: int, replays: int, seed: int) -> list[dict]:
    import numpy as np

    from dcpkit.reference import make_inputs, q_gather_reference, resolve_dtype

    W, r = comm.world_size, comm.rank
    nvec = T * (H // W) * D * 2 // 16
    qg = qgs[0]
    grid = int(qg.ctas_for(T, graph_view=True))
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for i, (name, features, recv_kind, threads) in enumerate(VARIANTS):
        recv = 0
        if recv_kind == "waiters":
            recv = min(grid, int(qg.waiter_ctas))
        elif recv_kind == "grid":
            recv = grid
        probe.reset()
        srcs = _sources(cupy, W, nvec, seed + 31 * i)
        src = srcs[r]
        with stream:
            probe.launch(stream, src, nvec, grid, features, recv, threads)
            ok = probe.check(srcs, nvec, grid, features)
            args = (stream, src, nvec, grid, features, recv, threads)
            g = _graph_of(cupy, stream, lambda a=args: probe.launch(*a))
            comm.barrier()
            us = _median_call_us(cupy, g, stream, replays)
            stream.synchronize()
            ok = ok and int(probe.status[:grid].sum()) == 0
            del g
        rows.append(
            {
                "T": T,
                "variant": name,
                "features": features,
                "ctas": grid,
                "receivers": recv,
                "threads": threads,
                "us": us,
                "ok": ok,
            }
        )
    # q_gather itself, same block, same grid rule
    bf16 = resolve_dtype("bfloat16")
    ins = [
        make_inputs(
            s, W, seed + 7, op="q_gather", tokens=T, num_heads=H, head_dim=D, dtype="bfloat16"
        )
        for s in range(W)
    ]
    want = q_gather_reference([x["q"] for x in ins])
    q = np.ascontiguousarray(ins[r]["q"])
    x = cupy.asarray(q.view(np.uint16)).view(bf16)
    out = cupy.empty(want.shape, dtype=bf16)

    def host(a):
        return cupy.asnumpy(a.view(cupy.uint16)).view(bf16)

    cases = []
    for qg in qgs:
        tail = "" if qg.THREADS == THREADS else f", {qg.THREADS} threads"
        cases += [(f"q_gather view{tail}", qg, {}), (f"q_gather out={tail}", qg, {"out": out})]
    for name, qg, kw in cases:
        qg.release_graph_outputs()
        with stream:
            out.view(cupy.uint16).fill(0xFFFF)
            res = qg(x, stream=stream, **kw)
            stream.synchronize()
            ok = bool((host(res) == want).all())
            g = _graph_of(cupy, stream, lambda qg=qg, kw=kw: qg(x, stream=stream, **kw))
            comm.barrier()
            us = _median_call_us(cupy, g, stream, replays)
            stream.synchronize()
            del g
        ctas = qg.ctas_for(T, copy_out=True) if kw else qg.ctas_for(T, graph_view=True)
        rows.append(
            {
                "T": T,
                "variant": name,
                "features": None,
                "ctas": int(ctas),
                "receivers": None,
                "threads": qg.THREADS,
                "us": us,
                "ok": ok,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _gpu_or_exit()
    import cupy

    from dcpkit.comm import Communicator
    from dcpkit.ops import QGather

    comm = Communicator.from_mpi()
    W = comm.world_size
    tmax = max(args.tokens)
    kw = {"max_tokens": tmax, "heads_per_rank": H // W, "head_dim": D, "dtype": "bfloat16"}
    # the op, and the same op launched with 256 threads per CTA (same grid: each thread moves
    # two of a CTA's vectors where the op's moves one)
    qgs = [
        QGather(comm, graph_outputs=CALLS, **kw),
        type("QGather256", (QGather,), {"THREADS": 256})(comm, graph_outputs=CALLS, **kw),
    ]
    probe = Probe(cupy, comm, tmax * (H // W) * D * 2 // 16, int(qgs[0].max_ctas), 2000.0)
    rows = []
    try:
        for T in args.tokens:
            rows += measure(cupy, comm, probe, qgs, T, args.replays, seed=9000 + T)
    finally:
        probe.close()
        for qg in qgs:
            qg.close()
    every = comm.allgather(rows)
    table = []
    for i, row in enumerate(rows):
        merged = dict(row)
        merged["us"] = max(rk[i]["us"] for rk in every)
        merged["ok"] = all(rk[i]["ok"] for rk in every)
        table.append(merged)
    wrong = any(not r["ok"] for r in table)
    if comm.rank == 0:
        print(
            f"one exchange of q_gather's block per call, CUDA graph of {CALLS} calls, W={W}, "
            f"{args.replays} replays, median us per call, max over ranks"
        )
        print(f"{'T':>3}  {'variant':<36}{'ctas':>5}{'recv':>5}{'us':>9}  result")
        for r in table:
            recv = "-" if not r["receivers"] else str(r["receivers"])
            print(
                f"{r['T']:>3}  {r['variant']:<36}{r['ctas']:>5}{recv:>5}{r['us']:>9.2f}  "
                f"{'ok' if r['ok'] else 'WRONG'}"
            )
    comm.barrier()
    if comm.rank == 0 and args.json:  # after the last collective step: no rank waits on it
        doc = {
            "world_size": W,
            "replays": args.replays,
            "calls": CALLS,
            "commit": os.environ.get("DCPKIT_COMMIT"),
            "rows": table,
        }
        if write_json(args.json, doc, prog=ap.prog) != 0:
            return 1
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
