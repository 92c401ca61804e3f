"""Teardown without close(): a process that exits with open workspaces neither hangs nor
crashes, and a finaliser never does collective work.

Launched by ``tests/gpu/test_process_faults.py``::

    mpirun -np N python tests/mpi/scripts/noclose.py OUTDIR

1. Every rank builds the three ops and makes checked calls.
2. One rank only (rank 0) drops its extra ``q_gather`` workspace without closing it
   (``del`` + ``gc.collect()``): its finaliser may warn (ResourceWarning) but must not make a
   collective call. That workspace can no longer be closed (close is collective and rank 0 can
   no longer take part), so the other ranks must not close theirs either: every copy leaks until
   the process exits, when the driver returns the memory.
3. Every rank then builds a fresh workspace and makes checked calls: the group is still in step
   (a finaliser that had made a collective call would have shifted the sequence and hung or
   mismatched here), and closes it.
4. Every rank exits normally without closing the three ops.

Each rank writes one JSON line to ``OUTDIR/rank<r>.jsonl``; the test checks that every rank got
there, that mpirun returned 0 within its timeout, and that nothing crashed.
"""

import argparse
import gc
import json
import signal
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_cases import OPS, OpCase, set_device, write_line


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--alarm-s", type=int, default=240)
    args = ap.parse_args()
    signal.alarm(args.alarm_s)
    warnings.simplefilter("default", ResourceWarning)  # let the exit-time warnings show

    from dcpkit.comm import Communicator

    comm = Communicator.from_mpi()
    rank, W = comm.rank, comm.world_size
    set_device(comm)
    problems = []
    T = 5

    def checked_calls(case, seed, n=3):
        dev, exp = case.prepare(seed, T)
        for i in range(n):
            res = case.call(dev, out=case.poisoned_out(T))
            case.op.synchronize()
            m = case.check(res, exp, f"call {i}")
            if m:
                problems.append(m)

    kept = [OpCase(n, comm, max_tokens=8) for n in OPS]
    for i, c in enumerate(kept):
        checked_calls(c, 100 + i)

    dropped = OpCase("q_gather", comm, max_tokens=8)
    checked_calls(dropped, 200)
    warned = None
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            op = dropped.op
            dropped.op = None
            del op
            gc.collect()
        warned = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        if not warned:
            problems.append("dropping an open workspace gave no ResourceWarning")

    # The group is still in step: a fresh workspace works on every rank.
    fresh = OpCase("kv_gather", comm, max_tokens=8)
    checked_calls(fresh, 300)
    fresh.op.close()
    comm.barrier()

    write_line(
        Path(args.outdir) / f"rank{rank}.jsonl",
        json.dumps(
            {
                "rank": rank,
                "world_size": W,
                "problems": problems,
                "warned": warned,
                "reached_exit": True,
            }
        ),
    )
    return 0  # exit without closing `kept` (nor the other ranks' copies of `dropped`)


if __name__ == "__main__":
    sys.exit(main())
