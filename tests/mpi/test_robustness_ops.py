"""GPU part of the constructor and ``stream=`` robustness checks (the CPU part, with every
error message, is tests/unit/test_robustness_ops_cpu.py).

Run on GPUs, N = 2 and 4::

    mpirun -np N python -m pytest tests/mpi/test_robustness_ops.py -p no:cacheprovider -s

Shown here on real GPUs, real heaps and real kernels:

* a bad ``timeout_ms`` / ``num_ubatches`` on the LAST rank only makes every rank raise (that
  rank its own error, the others PeerError naming it) instead of hanging; the user's heap keeps
  no reservation; then a good op built in the same heap works (its first call's result is
  checked bit for bit for the gathers);
* ``stream="x"`` raises InvalidType on every rank before anything is launched or counted: the
  next good call still meets the peers at the same epoch (a counted bad call would desynchronise
  the epochs and time out);
* DCPComm with a bad ``timeout_ms`` on one rank raises on every rank.

Multicast is never created (``DCPKIT_DISABLE_MULTICAST=1`` is added). Every test makes all its
collective calls on every rank before asserting.
"""

import os

import numpy as np
import pytest

from dcpkit.errors import InvalidArgument, InvalidType, PeerError
from dcpkit.multicast import kill_switches_set
from dcpkit.ops import KVGather, LseReduce, QGather
from dcpkit.symmetric import SymmetricHeap

T, H_R, D, D_KV = 4, 2, 64, 64
BUILD = {
    "q_gather": lambda c, **kw: QGather(
        c,
        max_tokens=8,
        heads_per_rank=H_R,
        head_dim=D,
        dtype="float16",
        timeout_ms=kw.pop("timeout_ms", 5000),
        **kw,
    ),
    "kv_gather": lambda c, **kw: KVGather(
        c, max_tokens=8, row_dim=D_KV, dtype="float16", timeout_ms=kw.pop("timeout_ms", 5000), **kw
    ),
    "lse_reduce": lambda c, **kw: LseReduce(
        c,
        max_tokens=8,
        num_heads=H_R * c.world_size,
        head_dim=D,
        dtype="float16",
        timeout_ms=kw.pop("timeout_ms", 5000),
        **kw,
    ),
}
BAD = [dict(timeout_ms=-5), dict(timeout_ms="soon"), dict(num_ubatches=0)]


@pytest.fixture(autouse=True)
def _never_multicast(monkeypatch):
    """Add a disabling variable for these tests (never clears the machine's own)."""
    monkeypatch.setenv("DCPKIT_DISABLE_MULTICAST", "1")
    assert kill_switches_set(os.environ)


def _report(comm, errors, what):
    every = comm.allgather(list(errors))
    msgs = [f"rank {r}: {m}" for r, errs in enumerate(every) for m in errs]
    return not msgs, f"{what} (world_size {comm.world_size}):\n" + "\n".join(msgs)


def _inputs(name, comm):
    """This rank's inputs: every element equal to rank + 1 (exact in float16)."""
    import cupy

    v = float(comm.rank + 1)
    if name == "q_gather":
        return (cupy.full((T, H_R, D), v, dtype=cupy.float16),)
    if name == "kv_gather":
        return (cupy.full((T, D_KV), v, dtype=cupy.float16),)
    H = H_R * comm.world_size
    return (cupy.full((T, H, D), v, dtype=cupy.float16), cupy.zeros((T, H), dtype=cupy.float32))


def _check_result(name, comm, res):
    """What the call must return (bit for bit for the gathers)."""
    W = comm.world_size
    got = np.asarray(res.get()) if hasattr(res, "get") else None
    if name == "q_gather":
        want = np.concatenate([np.full((T, H_R, D), s + 1, np.float16) for s in range(W)], 1)
    elif name == "kv_gather":
        want = np.concatenate([np.full((T, D_KV), s + 1, np.float16) for s in range(W)], 0)
    else:
        # equal lse everywhere: the mean of 1..W, rounded once to float16
        want = np.full((T, H_R, D), np.float16(np.mean(np.arange(1, W + 1))), np.float16)
    if got is None or got.shape != want.shape:
        return f"result shape {None if got is None else got.shape}, expected {want.shape}"
    if name == "lse_reduce":
        bad = np.argwhere(np.abs(got.astype(np.float32) - want.astype(np.float32)) > 1e-2)
    else:
        bad = np.argwhere(got.view(np.uint16) != want.view(np.uint16))
    if len(bad):
        i = tuple(bad[0])
        return f"first mismatch at {i}: got {got[i]!r}, expected {want[i]!r}"
    return None


@pytest.mark.parametrize("name", list(BUILD))
def test_bad_argument_on_one_rank_then_a_good_op_in_the_same_heap(comm, name):
    import cupy

    bad_rank = comm.world_size - 1
    errors = []
    heap = SymmetricHeap(comm, 16 << 20)
    try:
        before = heap.reserved_bytes
        for kw in BAD:
            mine = kw if comm.rank == bad_rank else {}
            try:
                BUILD[name](comm, heap=heap, **dict(mine)).close()
                errors.append(f"{kw} on rank {bad_rank}: built")
            except (InvalidArgument, InvalidType) as e:
                if comm.rank != bad_rank:
                    errors.append(f"{kw}: a good rank raised {e!r}, expected PeerError")
            except PeerError as e:
                if comm.rank == bad_rank or set(e.failed) != {bad_rank}:
                    errors.append(
                        f"{kw}: PeerError {e} (expected on the good ranks, naming rank {bad_rank})"
                    )
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"{kw}: unexpected {e!r}")
            if heap.reserved_bytes != before:
                errors.append(
                    f"{kw}: the failed constructor reserved "
                    f"{heap.reserved_bytes - before} bytes of the user's heap"
                )
        # a good op in the same heap; a bad stream raises and counts nothing
        op = BUILD[name](comm, heap=heap)
        try:
            args = _inputs(name, comm)
            try:
                op(*args, stream="x")
                errors.append("stream='x' was accepted")
            except InvalidType as e:
                if "stream must be a cupy.cuda.Stream (got str)" not in str(e):
                    errors.append(f"stream='x': {e}")
            if op._calls != [0] * op.num_ubatches:
                errors.append(f"a rejected call was counted: {op._calls}")
            res = op(*args, stream=cupy.cuda.get_current_stream())
            op.synchronize()
            msg = _check_result(name, comm, res)
            if msg:
                errors.append(f"first good call after the rejected ones: {msg}")
        finally:
            op.close()
    except Exception as e:  # noqa: BLE001 - reported for every rank
        errors.append(f"unexpected {e!r}")
    finally:
        heap.close()
    ok, msg = _report(comm, errors, f"{name}: bad arguments on rank {bad_rank}")
    assert ok, msg


def test_dcpcomm_bad_timeout_on_one_rank_raises_on_every_rank(comm):
    from dcpkit.manager import DCPComm

    bad_rank = comm.world_size - 1
    errors = []
    try:
        DCPComm(
            comm,
            max_tokens=8,
            num_heads=H_R * comm.world_size,
            q_head_dim=D,
            v_head_dim=D,
            dtype="float16",
            policy="direct",
            timeout_ms=-5 if comm.rank == bad_rank else 1000,
        ).close()
        errors.append("built")
    except InvalidArgument as e:
        if comm.rank != bad_rank or "DCPComm: timeout_ms must lie in" not in str(e):
            errors.append(f"InvalidArgument {e}")
    except PeerError as e:
        if comm.rank == bad_rank or set(e.failed) != {bad_rank}:
            errors.append(f"PeerError {e}")
    except Exception as e:  # noqa: BLE001 - reported
        errors.append(f"unexpected {e!r}")
    ok, msg = _report(comm, errors, "DCPComm: bad timeout_ms on one rank")
    assert ok, msg
