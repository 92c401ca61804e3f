"""One job of the "two jobs at once on one machine" heap check.

Run under an MPI launcher, for example::

    mpirun -np 2 python scripts/two_jobs_check.py --job a

Each round every rank builds a SymmetricHeap (cumem backend, POSIX descriptors over abstract
sockets named after this job's token), writes a rank-specific pattern into every peer's copy,
checks every copy, and closes the heap. Every rank prints one line
``DCPKIT_TWO_JOBS {json}`` with its results, including the multicast-disabling variables it
saw (so a launcher can check they were inherited), and the exit status is 0 only if every rank
of the job saw correct heaps (2 where there is no GPU, with one line saying why).
tests/gpu/test_two_jobs.py starts two of these at the same time.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "mpi"))


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


def _gpu_or_exit(what: str) -> None:
    """Exit with status 2 and one line (printed once per job) where there is no GPU to run on:
    no CuPy, no CUDA driver, no visible device."""
    from dcpkit._cuda import require_device
    from dcpkit.errors import DcpkitError
    from dcpkit.info import launcher_rank

    try:
        require_device(what)
    except DcpkitError as e:
        if launcher_rank() in (None, 0):
            print(f"{e}", file=sys.stderr, flush=True)
        sys.exit(2)


def parser():
    """The script's argument parser: every value is checked when parsed (one line, exit 2)."""
    _use_this_checkout_if_not_installed()
    from dcpkit.cli import CommandParser
    from dcpkit.demo.cli import integer

    ap = CommandParser(
        prog="scripts/two_jobs_check.py",
        description=__doc__.split("\n\n")[0]
        + " Start two jobs at once under mpirun, the first with --ready-file F and the second "
        "with --wait-file F, so that their heaps are built side by side.",
    )
    ap.add_argument("--job", default="job", help="name printed with the results (default: job)")
    ap.add_argument(
        "--rounds",
        type=integer(1),
        default=20,
        help="heaps built one after the other (default: 20)",
    )
    ap.add_argument(
        "--nbytes",
        type=integer(1),
        default=8 << 20,
        help="bytes of each rank's copy (default: 8388608)",
    )
    ap.add_argument(
        "--device-offset",
        type=integer(0),
        default=0,
        help="GPU of local rank 0; local rank i uses GPU (offset + i) mod the GPU count "
        "(default: 0)",
    )
    ap.add_argument(
        "--ready-file",
        metavar="PATH",
        help="rank 0 creates this file once the job is set up (default: none)",
    )
    ap.add_argument(
        "--wait-file",
        metavar="PATH",
        help="start the rounds only once this file exists (another job's --ready-file), so "
        "that the two jobs overlap; waits at most 300 s (default: none)",
    )
    ap.distinct_files(outputs=("--ready-file",), inputs=("--wait-file",))
    return ap


def main() -> int:
    args = parser().parse_args()
    _gpu_or_exit("scripts/two_jobs_check.py")

    import cupy

    from dcpkit.comm import Communicator
    from dcpkit.multicast import KILL_SWITCHES
    from dcpkit.symmetric import SymmetricHeap

    from _heap_checks import agree, pattern_errors, run_checked

    comm = Communicator.from_mpi()
    ndev = cupy.cuda.runtime.getDeviceCount()
    device = (args.device_offset + comm.local_rank) % ndev
    cupy.cuda.Device(device).use()
    seed = comm.broadcast(int.from_bytes(os.urandom(4), "little"), root=0)
    handle_types = []
    if comm.rank == 0 and args.ready_file:
        Path(args.ready_file).touch()
    if comm.rank == 0 and args.wait_file:
        deadline = time.time() + 300
        while not os.path.exists(args.wait_file) and time.time() < deadline:
            time.sleep(0.01)
    comm.barrier()
    t0 = time.time()

    def body(errors):
        for k in range(args.rounds):
            with SymmetricHeap(comm, args.nbytes) as heap:
                handle_types.append(heap.handle_type)
                errors.extend(f"round {k}: {e}" for e in pattern_errors(comm, heap, seed + k))

    errors = run_checked(comm, body)
    ok, msg = agree(comm, errors)
    print(
        "DCPKIT_TWO_JOBS "
        + json.dumps(
            {
                "job": args.job,
                "rank": comm.rank,
                "world_size": comm.world_size,
                "device": device,
                "rounds": args.rounds,
                "ok": ok,
                "errors": errors[:6],
                "job_errors": msg,
                "handle_types": sorted(set(handle_types)),
                "start": t0,
                "end": time.time(),
                "kill_switches": {name: os.environ.get(name) for name, _ in KILL_SWITCHES},
            }
        ),
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
