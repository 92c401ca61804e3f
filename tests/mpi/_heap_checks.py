"""Helpers of tests/mpi/test_symmetric.py and scripts/two_jobs_check.py: write a rank-specific
pattern into every peer's copy of a SymmetricHeap and check what every copy holds.

Checks return messages instead of asserting, so every rank finishes its collective calls;
:func:`agree` then gathers every rank's messages and the test asserts once.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

MAX_REPORTED = 6
_KERNELS = {}


def _kernels():
    import cupy

    if not _KERNELS:
        _KERNELS["pattern"] = cupy.ElementwiseKernel(
            "uint32 base",
            "uint32 out",
            "out = (unsigned int)i * 2654435761u + base",
            "dcpkit_test_heap_pattern",
        )
        _KERNELS["copy"] = cupy.ElementwiseKernel(
            "uint32 x", "uint32 y", "y = x", "dcpkit_test_heap_copy"
        )
    return _KERNELS


def pattern_base(seed: int, writer: int, target: int) -> int:
    """The pattern rank ``writer`` stores into rank ``target``'s copy (its own included)."""
    return (int(seed) * 7919 + writer * 104729 + target * 1299709 + 1) & 0xFFFFFFFF


def pattern(seed: int, writer: int, target: int, n: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return ((i * 2654435761 + pattern_base(seed, writer, target)) & 0xFFFFFFFF).astype(np.uint32)


def _first_mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.flatnonzero(got != want)
    i = int(bad[0])
    return (
        f"{bad.size} of {want.size} words differ; first at index {i}: got 0x{int(got[i]):08x}, "
        f"expected 0x{int(want[i]):08x}"
    )


def pattern_errors(comm, heap, seed: int, max_words: int = 1 << 16) -> list[str]:
    """Every rank writes ``pattern(seed, me, p)`` into region ``me`` of every rank ``p``'s copy
    through ``heap.view(..., rank=p)`` (a kernel storing through the peer mapping), then, after a
    device synchronisation and a barrier, checks region ``s`` of every copy ``p`` (its own
    directly, the peers' through their mappings) against ``pattern(seed, s, p)``.

    Also checks that this rank's copy is zero before anything is written. Collective."""
    import cupy

    k = _kernels()
    W, me = comm.world_size, comm.rank
    n = min(heap.nbytes // 4 // W, max_words)
    errors: list[str] = []
    try:
        own_all = heap.view(0, (heap.nbytes // 4,), np.uint32)
        nz = int(cupy.count_nonzero(own_all))
        if nz:
            first = int(cupy.flatnonzero(own_all)[0])
            errors.append(f"new heap not zeroed: {nz} non-zero words, first at word {first}")
    except Exception as e:  # noqa: BLE001 - reported after the collectives
        errors.append(f"zero check raised {type(e).__name__}: {e}")
    comm.barrier()  # nobody writes before every rank checked its zeroes
    try:
        for p in range(W):
            k["pattern"](
                np.uint32(pattern_base(seed, me, p)), heap.view(me * n * 4, (n,), np.uint32, rank=p)
            )
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:  # noqa: BLE001
        errors.append(f"writing into peers raised {type(e).__name__}: {e}")
    comm.barrier()
    try:
        for p in range(W):
            for s in range(W):
                v = heap.view(s * n * 4, (n,), np.uint32, rank=None if p == me else p)
                local = cupy.empty(n, dtype=cupy.uint32)
                k["copy"](v, local)
                got = cupy.asnumpy(local)
                want = pattern(seed, s, p, n)
                if not np.array_equal(got, want):
                    where = "own copy" if p == me else f"copy of rank {p} (read through NVLink)"
                    errors.append(
                        f"{where}, region written by rank {s}: {_first_mismatch(got, want)}"
                    )
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:  # noqa: BLE001
        errors.append(f"reading back raised {type(e).__name__}: {e}")
    comm.barrier()  # nobody closes the heap while a peer still reads it
    return errors


def agree(comm, errors: list[str]):
    """(ok, message) equal on every rank: ok only if no rank reported errors."""
    short = errors[:MAX_REPORTED] + (
        [f"... {len(errors) - MAX_REPORTED} more"] if len(errors) > MAX_REPORTED else []
    )
    every = comm.allgather(short)
    bad = {r: e for r, e in enumerate(every) if e}
    msg = "\n".join(f"  rank {r}: " + "\n          ".join(e) for r, e in sorted(bad.items()))
    return (not bad), msg


def run_checked(comm, body: Callable[[list[str]], None]) -> list[str]:
    """``body(errors)`` with an exception turned into an error message."""
    errors: list[str] = []
    try:
        body(errors)
    except Exception as e:  # noqa: BLE001
        errors.append(f"raised {type(e).__name__}: {e}")
    return errors


def free_bytes(comm) -> int:
    """Free memory of the current device, after CuPy's pools returned their cached blocks on
    every rank. Collective: when ranks share a GPU the figure is device-wide, so every rank
    returns its blocks before any rank reads it (else a peer returning its blocks between this
    rank's two readings shows up as memory freed by the code under test)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    cupy.cuda.runtime.deviceSynchronize()
    comm.barrier()
    free = int(cupy.cuda.runtime.memGetInfo()[0])
    comm.barrier()  # every rank has read before any rank goes on
    return free


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
