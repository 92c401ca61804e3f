"""Host-side cost of one eager call of each direct op, and where it goes (cProfile).

    mpirun -np 2 python scripts/host_overhead.py [--calls 2000] [--json PATH]

For each op at the DCP decode geometry (H = 128, D_q = 576, D_v = 512, bf16), every rank issues
``--calls`` back-to-back eager calls and measures the host time per call (the loop alone, no
synchronisation inside it) and the time per call including the final synchronisation. Rank 0
then profiles 500 more calls with cProfile and prints the functions that cost the most. This is
a diagnostic for the "eager call <= 15 us" target of the benchmark, not a test.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from dcpkit.comm import Communicator  # noqa: E402
from dcpkit.ops import KVGather, LseReduce, QGather  # noqa: E402
from dcpkit.reference import make_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = Communicator.from_mpi()
    cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    W, r = comm.world_size, comm.rank
    H, Dq, Dv, T = 128, 576, 512, 1
    q = cupy.asarray(make_inputs(r, W, 1, op="q_gather", tokens=T, num_heads=H,
                                 head_dim=Dq)["q"])
    li = make_inputs(r, W, 1, op="lse_reduce", tokens=T, num_heads=H, head_dim=Dv)
    op_in = cupy.asarray(li["out_partial"])
    lse_in = cupy.asarray(li["lse_partial"])
    kv = cupy.asarray(make_inputs(r, W, 1, op="kv_gather", tokens=4, row_dim=Dq)["kv"])
    ops = {
        "q_gather": (QGather(comm, max_tokens=8, heads_per_rank=H // W, head_dim=Dq,
                             dtype="bfloat16"), lambda o: o(q)),
        "lse_reduce": (LseReduce(comm, max_tokens=8, num_heads=H, head_dim=Dv,
                                 dtype="bfloat16"), lambda o: o(op_in, lse_in)),
        "kv_gather": (KVGather(comm, max_tokens=8, row_dim=Dq, dtype="bfloat16"),
                      lambda o: o(kv)),
    }
    report = {"world_size": W, "calls": args.calls, "ops": {}}
    for name, (op, call) in ops.items():
        for _ in range(50):
            call(op)
        op.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call(op)
        t1 = time.perf_counter()
        op.synchronize()
        t2 = time.perf_counter()
        host_us = (t1 - t0) / args.calls * 1e6
        total_us = (t2 - t0) / args.calls * 1e6
        comm.barrier()
        prof_text = ""
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(500):
            call(op)
        pr.disable()
        op.synchronize()
        comm.barrier()
        if r == 0:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(10)
            prof_text = s.getvalue()
        every = comm.allgather((host_us, total_us))
        report["ops"][name] = {"host_us_per_call": [e[0] for e in every],
                               "with_sync_us_per_call": [e[1] for e in every]}
        if r == 0:
            print(f"{name:11s} host {max(e[0] for e in every):7.2f} us/call   "
                  f"with sync {max(e[1] for e in every):7.2f} us/call (max over ranks)")
            print("\n".join(line for line in prof_text.splitlines()[6:24] if line.strip()))
            sys.stdout.flush()
    for op, _ in ops.values():
        op.close()
    if r == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
