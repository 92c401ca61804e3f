"""A group of ranks as threads of one process, for CPU tests of collective setup logic.

``run_group(3, fn)`` runs ``fn(comm)`` on three threads, each with a real
:class:`dcpkit.comm.Communicator` whose allgather / broadcast / barrier meet the other threads.
Objects are copied through pickle, as they would be between processes. A thread that never
arrives makes the others fail with ``threading.BrokenBarrierError`` after ``timeout_s`` instead
of hanging the test.
"""

import pickle
import threading

from dcpkit.comm import Communicator


class _Rendezvous:
    def __init__(self, n, timeout_s):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)

    def allgather(self, rank, obj):
        self.barrier.wait()  # every rank has read the previous round
        self.slots[rank] = pickle.dumps(obj)
        self.barrier.wait()  # every rank has written this round
        return [pickle.loads(s) for s in self.slots]


def make_comm(rv, rank, world_size):
    return Communicator(
        rank,
        world_size,
        allgather=lambda obj: rv.allgather(rank, obj),
        broadcast=lambda obj, root: rv.allgather(rank, obj)[root],
        barrier=lambda: rv.allgather(rank, None),
        backend="threads",
    )


def run_group(world_size, fn, timeout_s=20.0):
    """Run ``fn(comm)`` on ``world_size`` threads; return a list, per rank, of
    ``("ok", result)`` or ``("err", exception)``."""
    rv = _Rendezvous(world_size, timeout_s)
    out = [None] * world_size

    def body(rank):
        try:
            comm = make_comm(rv, rank, world_size)
            out[rank] = ("ok", fn(comm))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[rank] = ("err", e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    assert all(not t.is_alive() for t in threads), "a rank thread hung"
    return out
