"""A rank dies mid-run (``os._exit``) right before a call; the survivors must raise
CollectiveTimeout within the timeout, naming the dead rank, and report it.

Launched by ``tests/gpu/test_process_faults.py``::

    mpirun -np N python tests/mpi/scripts/die.py OUTDIR --timeout-ms 300

Every rank builds every op variant (``--ops``) and makes a checked call of each. Every rank
appends JSON lines to ``OUTDIR/rank<r>.jsonl`` (flushed and fsynced, so they survive the
os._exit that follows). After a barrier the dead rank (the last by default) exits with status
3. The survivors ignore SIGTERM from then on (Open MPI kills the job when a rank exits without
MPI_Finalize; the survivors must get to raise and write), call every op in turn, and write one
``{"phase": "fault", "op": ..., "raised": ..., "peer": ...}`` line per op (the first call races
with the death, the later ones run after it); then ``os._exit(0)`` (MPI_Finalize would wait
for the dead rank). ``signal.alarm`` bounds every rank
process's life, so nothing outlives a hang.
"""

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_cases import OpCase, context_usable, set_device, write_line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument(
        "--ops",
        default="lse_reduce,q_gather,kv_gather:push,kv_gather:pull",
        help="op[:kv_gather algorithm], comma separated",
    )
    ap.add_argument("--timeout-ms", type=float, default=300.0)
    ap.add_argument("--dead-rank", type=int, default=-1, help="default: the last rank")
    ap.add_argument("--alarm-s", type=int, default=150)
    args = ap.parse_args()
    signal.alarm(args.alarm_s)  # default action of SIGALRM: terminate, even inside a CUDA wait

    from dcpkit.comm import Communicator
    from dcpkit.errors import CollectiveTimeout

    comm = Communicator.from_mpi()
    rank, W = comm.rank, comm.world_size
    dead = args.dead_rank % W
    path = Path(args.outdir) / f"rank{rank}.jsonl"

    def record(**kw):
        write_line(path, json.dumps(dict(kw, rank=rank, world_size=W)))

    set_device(comm)
    T = 8
    cases = []
    for i, spec in enumerate(args.ops.split(",")):
        name, _, algorithm = spec.partition(":")
        case = OpCase(
            name, comm, max_tokens=16, timeout_ms=args.timeout_ms, algorithm=algorithm or "push"
        )
        dev, exp = case.prepare(1234 + i, T)
        res = case.call(dev, out=case.poisoned_out(T))
        case.op.synchronize()
        record(phase="setup", op=case.label, good_call=case.check(res, exp, "before the death"))
        cases.append((case, dev))

    if rank != dead:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    comm.barrier()
    if rank == dead:
        time.sleep(0.05)  # the survivors launch their first call around now
        os._exit(3)

    record(phase="survivor", dead=dead)
    for case, dev in cases:
        t0 = time.monotonic()
        info = {"phase": "fault", "op": case.label, "raised": None}
        try:
            case.call(dev)
            case.op.synchronize()
        except CollectiveTimeout as e:
            info.update(
                raised="CollectiveTimeout", peer=e.peer, expected=e.expected_epoch, message=str(e)
            )
        except Exception as e:  # noqa: BLE001 - reported
            info.update(raised=type(e).__name__, message=str(e), tb=traceback.format_exc(limit=5))
        info["elapsed_s"] = time.monotonic() - t0
        try:
            case.call(dev)
            info["next_call"] = "did not raise"
        except CollectiveTimeout:
            info["next_call"] = "CollectiveTimeout"
        except Exception as e:  # noqa: BLE001
            info["next_call"] = f"{type(e).__name__}: {e}"
        record(**info)
    record(phase="context", context=context_usable() or "ok")
    try:
        print(f"rank {rank}: survived the death of rank {dead}", flush=True)
    except OSError:  # the launcher may have closed our stdout already
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
