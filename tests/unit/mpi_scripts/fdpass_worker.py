"""One rank of the fd-exchange check (run by tests/unit/test_fdpass.py under mpiexec).

Usage: fdpass_worker.py OUTDIR ROUNDS

Every rank makes a memfd holding "job <token> rank <r> round <k>", sends it to every peer with
dcpkit._fdpass.exchange_fds (socket names from comm.job_token()), reads what every peer's
descriptor holds, and closes them; then a broadcast from rank 0 (senders=[0]). Writes
rank<r>.json with what it saw and the open-descriptor counts before and after.
"""

import json
import os
import sys

from dcpkit import _fdpass
from dcpkit.comm import Communicator


def read_fd(fd):
    return os.pread(fd, 4096, 0).decode()


def main():
    outdir, rounds = sys.argv[1], int(sys.argv[2])
    comm = Communicator.from_mpi()
    rank, world = comm.rank, comm.world_size
    result = {"rank": rank, "world_size": world, "rounds": [], "broadcast": None}
    comm.barrier()
    fds_before = len(os.listdir("/proc/self/fd"))
    for k in range(rounds):
        token = comm.job_token()
        text = f"job {token} rank {rank} round {k}"
        fd = os.memfd_create(f"dcpkit-test-{rank}")
        os.write(fd, text.encode())
        got = _fdpass.exchange_fds(token, f"r{k}", rank, world, fd, timeout_s=30)
        seen = {}
        for s, rfd in enumerate(got):
            if rfd is None:
                continue
            seen[s] = read_fd(rfd)
            os.close(rfd)
        os.close(fd)
        result["rounds"].append(
            {"token": token, "none_at": [s for s, f in enumerate(got) if f is None], "seen": seen}
        )
    token = comm.job_token()
    fd = None
    if rank == 0:
        fd = os.memfd_create("dcpkit-test-bcast")
        os.write(fd, f"broadcast {token}".encode())
    got = _fdpass.exchange_fds(token, "bcast", rank, world, fd, senders=[0], timeout_s=30)
    result["broadcast"] = {
        "token": token,
        "value": read_fd(got[0]) if got[0] is not None else None,
        "none_at": [s for s, f in enumerate(got) if f is None],
    }
    for f in got:
        if f is not None:
            os.close(f)
    if fd is not None:
        os.close(fd)
    comm.barrier()
    result["fds_before"] = fds_before
    result["fds_after"] = len(os.listdir("/proc/self/fd"))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
