"""One of two independent jobs running side by side on the same machine (issue 9, item 7).

Launched twice at the same time by ``tests/gpu/test_isolation.py``::

    mpirun -np 2 python tests/mpi/scripts/isolation_job.py OUTDIR --job a --device-offset 0
    mpirun -np 2 python tests/mpi/scripts/isolation_job.py OUTDIR --job b --device-offset 0

Each job builds the three ops (and kv_gather pull), then makes ``--calls`` calls of each, every
one checked against the reference on the host (inputs cycle through four seeded sets so that
consecutive calls carry different data; half the calls poisoned ``out=``, half zero copy).
Before the calls, rank 0 of each job waits (bounded) for the other job to reach the same point,
so the call phases really overlap (the test checks the recorded wall-clock intervals). Each
rank writes one JSON line to
``OUTDIR/<job>_rank<r>.jsonl``; the exit status is 0 only if every call of every rank was right.
"""

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_cases import OPS, OpCase, set_device, write_line


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--job", required=True)
    ap.add_argument("--other", default=None, help="name of the other job (to wait for)")
    ap.add_argument("--device-offset", type=int, default=0)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--timeout-ms", type=float, default=20000.0)
    ap.add_argument("--alarm-s", type=int, default=300)
    args = ap.parse_args()
    signal.alarm(args.alarm_s)
    outdir = Path(args.outdir)

    import cupy

    from dcpkit.comm import Communicator

    comm = Communicator.from_mpi()
    rank, W = comm.rank, comm.world_size
    device = set_device(comm, args.device_offset)
    pci = cupy.cuda.Device(device).pci_bus_id
    wrong, calls, errors = 0, 0, []
    first = []
    t_start = t_end = None
    try:
        cases = [OpCase(n, comm, max_tokens=16, timeout_ms=args.timeout_ms) for n in OPS]
        cases.append(
            OpCase("kv_gather", comm, max_tokens=16, timeout_ms=args.timeout_ms, algorithm="pull")
        )
        sets = []
        for s in range(4):
            T = (3, 8, 16, 1)[s]
            sets.append([c.prepare(1000 * s + 7, T) + (T,) for c in cases])
        # Rendezvous with the other job (files), bounded: the call phases must overlap.
        (outdir / f"ready_{args.job}").touch()
        if rank == 0 and args.other:
            deadline = time.monotonic() + 120
            while not (outdir / f"ready_{args.other}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        comm.barrier()
        t_start = time.time()
        for i in range(args.calls):
            for j, c in enumerate(cases):
                dev, exp, T = sets[i % 4][j]
                out = c.poisoned_out(T) if i % 2 == 0 else None
                res = c.call(dev, out=out)
                m = c.check(res, exp, f"job {args.job} call {i}")
                calls += 1
                if m:
                    wrong += 1
                    if len(first) < 5:
                        first.append(m)
        for c in cases:
            c.op.synchronize()
        t_end = time.time()
        for c in cases:
            c.op.close()
    except Exception as e:  # noqa: BLE001 - reported below and in the exit status
        errors.append(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
    write_line(
        outdir / f"{args.job}_rank{rank}.jsonl",
        json.dumps(
            {
                "job": args.job,
                "rank": rank,
                "world_size": W,
                "device": device,
                "pci_bus_id": pci,
                "calls": calls,
                "wrong": wrong,
                "first_failures": first,
                "errors": errors,
                "t_start": t_start,
                "t_end": t_end,
            }
        ),
    )
    return 0 if (not errors and wrong == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
