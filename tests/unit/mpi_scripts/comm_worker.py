"""One Communicator scenario, run on every rank (by tests/unit/test_comm.py).

    mpiexec -n N python comm_worker.py SCENARIO OUTDIR
    python comm_worker.py SCENARIO OUTDIR          (outside mpirun: a one-rank group)

Each rank writes what it observed to OUTDIR/rank<r>.json; the test asserts on those files.
An unexpected exception is recorded under "unexpected" (never left uncaught, so no rank dies
while its peers wait in MPI_Finalize).
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path


def _err(e):
    return {
        "type": type(e).__name__,
        "message": str(e),
        "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None,
    }


def basic(comm, outdir):
    r, n = comm.rank, comm.world_size
    res = {
        "local_rank": comm.local_rank,
        "local_world_size": comm.local_world_size,
        "backend": comm.backend,
        "hosts": comm.hosts,
        "host": comm.host,
    }
    # allgather of a structured object, and of a large one (1 MiB per rank)
    res["allgather"] = comm.allgather({"rank": r, "payload": [r] * (r + 1)})
    big = comm.allgather(bytes([r % 256]) * (1 << 20))
    res["allgather_big"] = [[len(b), b[0], b[-1]] for b in big]
    # broadcast from the last rank (non-zero): non-root ranks pass objects that must be ignored
    root = n - 1
    res["broadcast"] = comm.broadcast({"from": r, "data": list(range(r, r + 4))}, root=root)
    res["broadcast_root"] = root
    # barrier: rank 0 creates a marker only after sleeping; every rank must see it after the
    # barrier (without a real barrier the others would look before it exists)
    marker = outdir / "marker"
    if r == 0:
        time.sleep(0.5)
        marker.write_text("rank 0 was here")
    comm.barrier()
    res["marker_seen_after_barrier"] = marker.exists()
    res["job_token"] = comm.job_token()
    return res


def agree(comm, outdir):
    r, n = comm.rank, comm.world_size
    res = {"equal": comm.agree("dtype", "bfloat16")}
    value = 16 if r == n - 1 else 8
    try:
        comm.agree("T_max", value)
        res["mismatch"] = None
    except Exception as e:  # noqa: BLE001
        res["mismatch"] = _err(e)
        res["mismatch"]["ranks"] = getattr(e, "ranks", None)
        res["mismatch"]["what"] = getattr(e, "what", None)
    comm.barrier()  # every rank got here: nobody is stuck in agree()
    res["after"] = True
    return res


def all_ok(comm, outdir):
    """A collective setup in steps; rank 1 fails in step "map"; everyone must unwind and raise."""
    r, n = comm.rank, comm.world_size
    undo_log = []
    res = {}

    def setup(fail_ranks, step_names=("reserve", "map", "publish")):
        done = []
        for step in step_names:
            err = None
            try:
                if r in fail_ranks and step == "map":
                    raise RuntimeError(f"simulated {step} failure on rank {r}")
                done.append(step)
            except Exception as e:  # noqa: BLE001
                err = e
            try:
                comm.all_ok(f"heap setup step {step!r}", err)
            except Exception:
                for s in reversed(done):  # unwind this rank's completed steps
                    undo_log.append(s)
                raise
        return done

    try:
        res["done"] = setup(fail_ranks={1})
        res["error"] = None
    except Exception as e:  # noqa: BLE001
        res["error"] = _err(e)
        res["error"]["failed"] = {str(k): v for k, v in getattr(e, "failed", {}).items()}
    res["undo"] = list(undo_log)
    undo_log.clear()
    # several failing ranks at once: every rank but 0
    try:
        setup(fail_ranks=set(range(1, n)))
        res["error_many"] = None
    except Exception as e:  # noqa: BLE001
        res["error_many"] = _err(e)
        res["error_many"]["failed"] = sorted(int(k) for k in getattr(e, "failed", {}))
    # a clean run afterwards still works (no rank left behind in an earlier step)
    res["clean"] = setup(fail_ranks=set())
    comm.barrier()
    res["after"] = True
    return res


def single(comm, outdir):
    from dcpkit.comm import Communicator
    from dcpkit.errors import PeerError

    res = {
        "rank": comm.rank,
        "world_size": comm.world_size,
        "backend": comm.backend,
        "local_rank": comm.local_rank,
        "local_world_size": comm.local_world_size,
        "allgather": comm.allgather({"x": 1}),
        "broadcast": comm.broadcast("b", root=0),
        "agree": comm.agree("x", 3),
    }
    comm.barrier()
    comm.all_ok("noop", None)
    try:
        comm.all_ok("step", ValueError("bad"))
        res["all_ok_error"] = None
    except PeerError as e:
        res["all_ok_error"] = _err(e)
    s = Communicator.single()
    res["single"] = {
        "rank": s.rank,
        "world_size": s.world_size,
        "backend": s.backend,
        "allgather": s.allgather(5),
        "broadcast": s.broadcast(6),
    }
    return res


SCENARIOS = {"basic": basic, "agree": agree, "all_ok": all_ok, "single": single}


def main():
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    try:
        from dcpkit.comm import Communicator

        comm = Communicator.from_mpi()
    except Exception as e:  # noqa: BLE001
        (outdir / f"setup-error-{os.getpid()}.json").write_text(
            json.dumps({"error": _err(e), "traceback": traceback.format_exc()})
        )
        return
    res = {"rank": comm.rank, "world_size": comm.world_size}
    try:
        res.update(SCENARIOS[scenario](comm, outdir))
    except Exception as e:  # noqa: BLE001
        res["unexpected"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    (outdir / f"rank{comm.rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
