"""Soak test of the direct ops: many mixed calls, checked, with leak and wrap checks.

Run from a checkout (it reuses the op cases of ``tests/mpi/scripts/reliability_cases.py``)::

    mpirun -np 4 python scripts/soak.py --calls 100000 --json $OUT/soak.json

What one run does, on every rank, in the same order (a call sequence drawn from a seed shared
by all ranks):

* builds ``lse_reduce``, ``q_gather`` and ``kv_gather`` workspaces with two ubatches each, and
  moves the epochs of all three close to ``2**32`` (``_set_epoch``) so that the 32-bit signal
  values wrap during the run;
* captures one CUDA graph per ubatch holding one call of each op (``out=`` given);
* then mixes eager calls (random op, ubatch, ``T`` in {1, 5, 17, T_max}, with and without
  ``out=``) with graph replays, all on one stream;
* every gather call is checked on the device, bit for bit: before each call every rank XORs its
  input with a per-call value ``k`` (the same on every rank), so the expected result is the
  reference XOR ``k``; a stale slot, a torn write or a wrong peer shows up as a mismatch. The
  output of every ``out=`` call and graph replay is poisoned (0xFF bytes) before the call;
* every ``--check-every`` calls (a checkpoint): fresh random inputs, and every op, ubatch and
  path (eager with ``out=``, eager without, graph) checked on the host against the NumPy
  reference (``lse_reduce`` with its stated tolerance) with poisoned outputs;
* GPU free memory (``memGetInfo`` after emptying CuPy's pools), CuPy pool bytes in use and
  open file descriptors are sampled after the first checkpoint and at the end.

The JSON summary (rank 0 writes it) has the call counts, wrong results (with the first
failures), memory and fds at start and end, the final epochs (to show the wrap), and the time.
The exit status is 0 only if every rank saw zero wrong results, no error, flat resources and
the wrap; 2, with one line saying why, where there is no GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests" / "mpi" / "scripts"))


def _use_this_checkout_if_not_installed() -> None:
    """Import the installed dcpkit; where none is installed (or only an empty namespace folder
    of that name), the one of this checkout."""
    try:
        import dcpkit

        if getattr(dcpkit, "__file__", None):
            return
    except ImportError:
        pass
    sys.modules.pop("dcpkit", None)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


#: The name every line the soak writes to stderr starts with (``scripts/soak.py: ...``).
PROG = "scripts/soak.py"


def _gpu_or_exit() -> None:
    """Exit with status 2 and one line (printed once per job) where there is no GPU to run on:
    no CuPy, no CUDA driver, no visible device."""
    from dcpkit._cuda import require_device
    from dcpkit.errors import DcpkitError
    from dcpkit.info import launcher_rank

    try:
        require_device(PROG)
    except DcpkitError as e:
        if launcher_rank() in (None, 0):
            msg = str(e)  # "scripts/soak.py: no CUDA GPU ...", or a missing CuPy unprefixed
            prefix = f"{PROG}: "
            print(msg if msg.startswith(prefix) else prefix + msg, file=sys.stderr, flush=True)
        sys.exit(2)


_use_this_checkout_if_not_installed()

from reliability_cases import H_R, HEAD_DIM, OPS, ROW_DIM, OpCase, bits_dtype, poison, to_host  # noqa: E402 - needs the path set above

#: Slack of the flatness checks. A per-call leak over thousands of calls is far larger; the
#: slack only absorbs allocation granularity of the driver and of CuPy's pools.
MEM_SLACK_BYTES = 16 << 20
POOL_SLACK_BYTES = 1 << 20
FD_SLACK = 2


def resource_sample() -> dict[str, int]:
    """GPU free memory (CuPy pools emptied first), CuPy pool bytes in use, open fds."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    return {
        "mem_free_bytes": int(free),
        "mem_total_bytes": int(total),
        "pool_used_bytes": int(pool.used_bytes()),
        "fds": len(os.listdir("/proc/self/fd")),
    }


class _Gather:
    """Device buffers of one gather op in the soak."""

    def __init__(self, case: OpCase, Ts, stream):
        import cupy

        self.case = case
        self.Ts = Ts
        self.T_max = case.max_tokens
        self.bt = bits_dtype(case.dtype)
        in_shape = (self.T_max, H_R, HEAD_DIM) if case.name == "q_gather" else (self.T_max, ROW_DIM)
        self.in_shape = in_shape
        self.base = cupy.zeros(in_shape, self.bt)  # this rank's input (raw bits)
        self.work = cupy.zeros(in_shape, self.bt)  # eager input = base ^ k
        self.gin = [cupy.zeros(in_shape, self.bt) for _ in range(2)]  # graph inputs
        self.exp = {T: cupy.zeros(case.out_shape(T), self.bt) for T in Ts}
        self.eout = {T: cupy.zeros(case.out_shape(T), self.bt) for T in Ts}
        self.gout = [cupy.zeros(case.out_shape(self.T_max), self.bt) for _ in range(2)]
        self.exp_host: dict[int, np.ndarray] = {}
        self.stream = stream

    def refresh(self, seed: int) -> None:
        """Fresh inputs: every rank's input for T_max; expected results for every T."""
        all_host = self.case.all_host_inputs(seed, self.T_max)
        key = "q" if self.case.name == "q_gather" else "kv"
        self.base.set(
            np.ascontiguousarray(all_host[self.case.rank][key]).view(self.bt), self.stream
        )
        for T in self.Ts:
            e = self.case.expected([{key: h[key][:T]} for h in all_host])
            self.exp_host[T] = e
            self.exp[T].set(np.ascontiguousarray(e).view(self.bt), self.stream)

    def inputs(self, buf, T: int) -> dict:
        key = "q" if self.case.name == "q_gather" else "kv"
        return {key: buf[:T].view(self.case.dtype)}


def _xor_value(i: int, bt: np.dtype) -> int:
    """A non-zero per-call value that differs between consecutive calls."""
    return (
        (i * 40503 + 1) % ((1 << (8 * bt.itemsize)) - 1) + 1
        if bt.itemsize < 4
        else (i * 2654435761 + 1) % 0xFFFFFFFF + 1
    )


def run_soak(
    comm,
    *,
    calls: int = 100_000,
    seed: int = 0,
    check_every: int = 1000,
    max_tokens: int = 32,
    dtype="bfloat16",
    timeout_ms: float | None = None,
    graph_fraction: float = 0.25,
    wrap_after: dict[str, int] | None = None,
    log=None,
) -> dict:
    """Run the soak on every rank of ``comm`` (collective); returns the summary of all ranks.

    Parameters
    ----------
    calls : int
        Op calls to make (a graph replay counts three: one per op).
    seed : int
        Seed of the call sequence and of the inputs; must be equal on every rank.
    check_every : int
        Calls between checkpoints (fresh inputs, host checks of every op, ubatch and path).
    wrap_after : dict op -> int
        For each op named, start its epochs at ``2**32 - n``: the signals wrap after ``n``
        calls of each ubatch. Default ``{"q_gather": 50, "kv_gather": calls // 24,
        "lse_reduce": calls // 40}`` (each at least 50).
    """
    import cupy

    W, rank = comm.world_size, comm.rank
    seed = comm.broadcast(int(seed), root=0)
    if wrap_after is None:
        wrap_after = {
            "q_gather": 50,
            "kv_gather": max(50, calls // 24),
            "lse_reduce": max(50, calls // 40),
        }
    say = log if log is not None else (lambda s: print(s, flush=True) if rank == 0 else None)
    rng = np.random.default_rng([seed, 0x50A4])  # equal on every rank: the call sequence
    stream = cupy.cuda.Stream(non_blocking=True)
    Ts = sorted({t for t in (1, 5, 17, max_tokens) if t <= max_tokens})
    t_start = time.monotonic()

    cases = {
        n: OpCase(
            n,
            comm,
            max_tokens=max_tokens,
            dtype=dtype,
            num_ubatches=2,
            timeout_ms=timeout_ms,
            num_requests=3 if n == "lse_reduce" else 0,
        )
        for n in OPS
    }
    for n, after in wrap_after.items():
        cases[n].op._set_epoch(2**32 - int(after))
    gathers = {n: _Gather(cases[n], Ts, stream) for n in ("q_gather", "kv_gather")}
    lse = cases["lse_reduce"]
    dt = cupy.dtype(lse.dtype)
    with cupy.cuda.Device(lse.op.device):
        l_in = lse.upload(lse.host_inputs(seed, max_tokens))  # persistent buffers
        l_gout = [cupy.zeros(lse.out_shape(max_tokens), dt) for _ in range(2)]
        l_eout = cupy.zeros(lse.out_shape(max_tokens), dt)
    l_exp = {"host": None}

    stats = {
        "calls": 0,
        "eager_calls": 0,
        "graph_replays": 0,
        "checked_calls": 0,
        "device_checked_calls": 0,
        "wrong_results": 0,
        "checkpoints": 0,
    }
    failures: list[str] = []
    errors: list[str] = []
    pending: list = []  # (0-d device count of mismatches, description)

    def note_failure(msg):
        stats["wrong_results"] += 1
        if len(failures) < 20:
            failures.append(msg)

    def device_check(g: _Gather, res, exp_T: int, k: int, what: str):
        r = res.view(g.bt) if res.dtype != g.bt else res
        cnt = cupy.count_nonzero(cupy.bitwise_xor(r, g.exp[exp_T]) != g.bt.type(k))
        pending.append((cnt, what))
        stats["device_checked_calls"] += 1

    def drain_pending():
        if not pending:
            return
        counts = cupy.stack([c for c, _ in pending]).get()
        for (_, what), c in zip(pending, counts, strict=True):
            if c:
                note_failure(f"rank {rank}: {what}: {int(c)} elements differ (device check)")
        pending.clear()

    # ---- graphs: one call of each op per ubatch, outputs in fixed buffers
    def capture(u):
        with stream:
            stream.begin_capture()
            try:
                for g in gathers.values():
                    g.case.call(
                        g.inputs(g.gin[u], max_tokens),
                        ubatch=u,
                        out=g.gout[u].view(g.case.dtype),
                        stream=stream,
                    )
                lse.call(l_in, ubatch=u, out=l_gout[u], stream=stream)
            finally:
                graph = stream.end_capture()
        return graph

    # A workspace's first call is eager (capturing it is refused): one warm-up call of the
    # merge before the captures (the gathers were called above).
    with stream:
        lse.call(l_in, ubatch=0, out=l_gout[0], stream=stream)
    stream.synchronize()
    graphs = [capture(0), capture(1)]
    counter = {"i": 0}

    def next_k(g):
        counter["i"] += 1
        return _xor_value(counter["i"], g.bt)

    def replay(u, check_host: bool):
        ks = {}
        with stream:
            for n, g in gathers.items():
                ks[n] = next_k(g)
                cupy.bitwise_xor(g.base, g.bt.type(ks[n]), out=g.gin[u])
                poison(g.gout[u], stream)
            if check_host:
                poison(l_gout[u], stream)
            graphs[u].launch(stream)
            for n, g in gathers.items():
                device_check(
                    g,
                    g.gout[u],
                    max_tokens,
                    ks[n],
                    f"{n} graph replay u={u} call #{stats['calls']}",
                )
        stats["calls"] += 3
        stats["graph_replays"] += 1
        if check_host:
            stream.synchronize()  # the host reads below run on another stream
            for n, g in gathers.items():
                m = g.case.check(
                    to_host(g.gout[u].view(g.case.dtype)),
                    g.exp_host[max_tokens],
                    f"graph u={u} checkpoint {stats['checkpoints']}",
                    xor=ks[n],
                )
                stats["checked_calls"] += 1
                if m:
                    note_failure(m)
            m = lse.check(
                to_host(l_gout[u]), l_exp["host"], f"graph u={u} checkpoint {stats['checkpoints']}"
            )
            stats["checked_calls"] += 1
            if m:
                note_failure(m)

    def eager_gather(n, u, T, with_out: bool, check_host: bool):
        g = gathers[n]
        k = next_k(g)
        with stream:
            cupy.bitwise_xor(g.base, g.bt.type(k), out=g.work)
            out = None
            if with_out:
                poison(g.eout[T], stream)
                out = g.eout[T].view(g.case.dtype)
            res = g.case.call(g.inputs(g.work, T), ubatch=u, out=out, stream=stream)
            device_check(
                g, res, T, k, f"{n} eager u={u} T={T} out={with_out} call #{stats['calls']}"
            )
            if check_host:
                host = to_host(res)
        stats["calls"] += 1
        stats["eager_calls"] += 1
        if check_host:
            m = g.case.check(
                host,
                g.exp_host[T],
                f"eager u={u} out={with_out} checkpoint {stats['checkpoints']}",
                xor=k,
            )
            stats["checked_calls"] += 1
            if m:
                note_failure(m)

    def eager_lse(u, with_out: bool, check_host: bool):
        with stream:
            out = None
            if with_out:
                if check_host:
                    poison(l_eout, stream)
                out = l_eout
            res = lse.call(l_in, ubatch=u, out=out, stream=stream)
            if check_host:
                host = to_host(res)
        stats["calls"] += 1
        stats["eager_calls"] += 1
        if check_host:
            m = lse.check(
                host, l_exp["host"], f"eager u={u} out={with_out} checkpoint {stats['checkpoints']}"
            )
            stats["checked_calls"] += 1
            if m:
                note_failure(m)

    def checkpoint():
        """Drain device checks, then fresh inputs and host checks of every op/ubatch/path."""
        stream.synchronize()
        for c in cases.values():
            c.op.synchronize(stream)  # raises CollectiveTimeout if poisoned
        drain_pending()
        iseed = int(rng.integers(1 << 31))
        for g in gathers.values():
            g.refresh(iseed)
        all_host = lse.all_host_inputs(iseed, max_tokens)
        mine = all_host[rank]
        with stream:
            for key in ("out_partial", "lse_partial", "seq_lens", "query_start_loc"):
                h = np.ascontiguousarray(mine[key])
                l_in[key].view(bits_dtype(h.dtype)).set(h.view(bits_dtype(h.dtype)), stream)
        l_exp["host"] = lse.expected(all_host)
        stats["checkpoints"] += 1
        for u in (0, 1):
            for n in gathers:
                T = int(rng.choice(Ts))
                eager_gather(n, u, T, True, True)
                eager_gather(n, u, T, False, True)
            eager_lse(u, True, True)
            eager_lse(u, False, True)
            replay(u, True)
        stream.synchronize()
        drain_pending()

    start_sample = end_sample = None
    ok_to_go = True
    try:
        checkpoint()
    except Exception as e:  # noqa: BLE001 - agreed on below
        errors.append(
            f"rank {rank}: first checkpoint: {type(e).__name__}: {e}\n"
            f"{traceback.format_exc(limit=4)}"
        )
    agreed = comm.allgather(len(errors) == 0)
    ok_to_go = all(agreed)
    if ok_to_go:
        start_sample = resource_sample()
        t_loop = time.monotonic()
        next_cp = stats["calls"] + check_every
        last_log = time.monotonic()
        while stats["calls"] < calls:
            try:
                while stats["calls"] < min(next_cp, calls):
                    if rng.random() < graph_fraction:
                        replay(int(rng.integers(2)), False)
                    else:
                        n = OPS[int(rng.integers(len(OPS)))]
                        u = int(rng.integers(2))
                        with_out = bool(rng.integers(2))
                        if n == "lse_reduce":
                            eager_lse(u, with_out, False)
                        else:
                            eager_gather(n, u, int(rng.choice(Ts)), with_out, False)
                checkpoint()
            except Exception as e:  # noqa: BLE001 - agreed on below
                errors.append(
                    f"rank {rank} at call {stats['calls']}: {type(e).__name__}: "
                    f"{e}\n{traceback.format_exc(limit=4)}"
                )
            next_cp = stats["calls"] + check_every
            # One host exchange per checkpoint: stop every rank when any rank failed.
            if not all(comm.allgather(len(errors) == 0 and stats["wrong_results"] == 0)):
                break
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                say(
                    f"[soak] {stats['calls']} / {calls} calls, "
                    f"{stats['calls'] / (last_log - t_loop):.0f} calls/s"
                )
        end_sample = resource_sample()

    epochs = {}
    for n, c in cases.items():
        try:
            epochs[n] = [int(v) for v in c.op._epoch.get()]
        except Exception:  # noqa: BLE001 - closed or broken: reported as missing
            epochs[n] = None
    for c in cases.values():
        try:
            c.op.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {rank}: close {c.label}: {type(e).__name__}: {e}")
    elapsed = time.monotonic() - t_start

    wrapped = {
        n: (epochs.get(n) is not None and all(e >= 2**32 for e in epochs[n])) for n in wrap_after
    }
    flat = None
    if start_sample and end_sample:
        flat = (
            start_sample["mem_free_bytes"] - end_sample["mem_free_bytes"] <= MEM_SLACK_BYTES
            and end_sample["pool_used_bytes"] - start_sample["pool_used_bytes"] <= POOL_SLACK_BYTES
            and end_sample["fds"] - start_sample["fds"] <= FD_SLACK
        )
    mine = dict(
        rank=rank,
        stats=stats,
        failures=failures,
        errors=errors,
        start=start_sample,
        end=end_sample,
        epochs=epochs,
        wrapped=wrapped,
        flat=flat,
    )
    every = comm.allgather(mine)
    summary = {
        "world_size": W,
        "calls": min(r["stats"]["calls"] for r in every),
        "calls_requested": calls,
        "eager_calls": every[0]["stats"]["eager_calls"],
        "graph_replays": every[0]["stats"]["graph_replays"],
        "checkpoints": every[0]["stats"]["checkpoints"],
        "checked_calls": sum(r["stats"]["checked_calls"] for r in every),
        "device_checked_calls": sum(r["stats"]["device_checked_calls"] for r in every),
        "wrong_results": sum(r["stats"]["wrong_results"] for r in every),
        "first_failures": [f for r in every for f in r["failures"]][:20],
        "errors": [e for r in every for e in r["errors"]],
        "flat": all(r["flat"] is True for r in every),
        "wrapped": all(all(r["wrapped"].values()) for r in every),
        "wrap_after": wrap_after,
        "elapsed_s": round(elapsed, 2),
        "timeout_ms": lse.op.timeout_ms,
        "seed": seed,
        "dtype": str(lse.dtype),
        "max_tokens": max_tokens,
        "check_every": check_every,
        "per_rank": [{k: r[k] for k in ("rank", "start", "end", "epochs", "flat")} for r in every],
    }
    return summary


def problems(summary: dict) -> str | None:
    """``None`` when the soak passed, else what went wrong (one line per problem)."""
    out = []
    if summary["errors"]:
        out.append("errors:\n  " + "\n  ".join(summary["errors"]))
    if summary["wrong_results"]:
        out.append(
            f"{summary['wrong_results']} wrong results; first:\n  "
            + "\n  ".join(summary["first_failures"])
        )
    if summary["calls"] < summary["calls_requested"]:
        out.append(f"only {summary['calls']} of {summary['calls_requested']} calls ran")
    if not summary["flat"]:
        out.append(
            "GPU memory, CuPy pool or fds not flat: "
            + json.dumps([{k: r[k] for k in ("rank", "start", "end")} for r in summary["per_rank"]])
        )
    if not summary["wrapped"]:
        out.append(
            "the epochs did not cross 2**32: "
            + json.dumps([r["epochs"] for r in summary["per_rank"]])
        )
    return "\n".join(out) or None


def write_json(path: str, summary: dict, *, prog: str) -> int:
    """Write ``--json`` (missing folders created); the exit status: 0, or 1 after one line on
    stderr (``<prog>: could not write <path>: <OS error>``)."""
    from dcpkit.cli import write_json as write

    return write(path, summary, prog=prog, make_folders=True, sort_keys=True)


def parser():
    """The soak's argument parser: every value is checked when parsed (one line, exit 2)."""
    from dcpkit.cli import CommandParser, output_file
    from dcpkit.demo.cli import integer

    ap = CommandParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0]
        + " Run it as 'mpirun -np N python scripts/soak.py' with one GPU per rank (or ranks "
        "sharing one GPU under MPS); exit status 0 only when every rank passed.",
        alike_options=True,
    )
    ap.add_argument(
        "--calls",
        type=integer(1),
        default=100_000,
        help="op calls to make; a graph replay counts three, one per op (default: 100000)",
    )
    ap.add_argument(
        "--check-every",
        type=integer(1),
        default=1000,
        help="calls between checkpoints: fresh inputs, and every op, ubatch and path checked "
        "on the host against the reference (default: 1000)",
    )
    ap.add_argument(
        "--seed",
        type=integer(0),
        default=None,
        help="seed of the call sequence and the inputs, >= 0 (default: random, printed)",
    )
    ap.add_argument(
        "--max-tokens",
        type=integer(1),
        default=32,
        help="T_max of the workspaces; calls use T in {1, 5, 17, T_max} (default: 32)",
    )
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of every op's inputs and outputs (default: bfloat16)",
    )
    ap.add_timeout_option("every wait of the ops")
    ap.add_argument(
        "--json",
        metavar="PATH",
        type=output_file(folder_must_exist=False),
        default=None,
        help="also write the summary as JSON to PATH (rank 0; missing folders are created)",
    )
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _gpu_or_exit()

    import cupy

    from dcpkit.comm import Communicator

    comm = Communicator.from_mpi()
    cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    summary = run_soak(
        comm,
        calls=args.calls,
        seed=seed,
        check_every=args.check_every,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        timeout_ms=args.timeout_ms,
    )
    bad = problems(summary)
    json_status = 0
    if comm.rank == 0:
        try:
            summary["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        except Exception:  # noqa: BLE001 - informational
            pass
        # rank 0 alone, after the last collective step: no rank waits on it
        if args.json:
            json_status = write_json(args.json, summary, prog=PROG)
        print(
            f"[soak] world_size {summary['world_size']}: {summary['calls']} calls "
            f"({summary['eager_calls']} eager, {summary['graph_replays']} graph replays), "
            f"{summary['checked_calls']} host-checked, {summary['device_checked_calls']} "
            f"device-checked, {summary['wrong_results']} wrong, flat={summary['flat']}, "
            f"wrapped={summary['wrapped']}, {summary['elapsed_s']} s, seed {summary['seed']}"
        )
        for r in summary["per_rank"]:
            print(f"[soak] rank {r['rank']}: start {r['start']} end {r['end']}")
        if bad:
            print(f"[soak] FAILED:\n{bad}", flush=True)
    return 0 if bad is None and json_status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
