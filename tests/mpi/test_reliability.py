"""Reliability of the direct ops (issue 9): no hangs, no silent corruption, no leaks, clear
errors for bad input.

Run on GPUs, N = 2 and 4::

    mpirun -np N python -m pytest tests/mpi/test_reliability.py -p no:cacheprovider -s

With ``DCPKIT_RELIABILITY_REPORT=path.jsonl`` rank 0 appends one JSON line per measurement
(fault detection times, soak summary) for the README's Reliability section.

What each test shows (items of issue 9):
1. ``test_silent_rank_*``: a rank that skips a call; the waiting ranks' ``synchronize()`` raises
   :class:`CollectiveTimeout` within the timeout (plus a generous margin that only rules out a
   hang), naming op, epoch and the silent rank; the next call raises again before launching;
   the CUDA context stays usable; the silent rank itself times out at its next calls; closing
   poisoned workspaces does not hang.
2. A rank that dies: ``tests/gpu/test_process_faults.py`` (launches its own mpirun).
3. ``test_debug_*``: ``DCPKIT_DEBUG=1`` turns a T / ubatch mismatch into ConfigMismatch naming
   the odd rank, before any launch; without it a call makes no host collective at all.
4. ``test_short_soak_with_epoch_wrap``: a 3000-call mixed soak (``scripts/soak.py``) crossing
   the 32-bit signal wrap; the 100,000-call soak is ``scripts/soak.py`` itself.
5. ``test_bad_input_table``: 60+ bad calls across the ops and the heap, each raising its error
   class before any launch, each followed by a correct call.
6. ``test_close_*``: close() collective and idempotent, calls after close raise ClosedError.
   Exit without close and the one-rank finaliser: ``tests/gpu/test_process_faults.py``.
7. Isolation of two jobs: ``tests/gpu/test_isolation.py``.

Every test makes all its collective calls on every rank before asserting (failures are gathered
with ``comm.allgather`` and reported for every rank at once).
"""

import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from dcpkit.errors import (
    ClosedError,
    CollectiveTimeout,
    ConfigMismatch,
    InvalidArgument,
    InvalidType,
)

from reliability_cases import (
    H_R,
    HEAD_DIM,
    HEAD_DIM_V,
    OPS,
    ROW_DIM,
    OpCase,
    context_usable,
    gather_failures,
)

#: (op, kv_gather algorithm) of every direct op variant.
VARIANTS = [
    ("lse_reduce", "push"),
    ("q_gather", "push"),
    ("kv_gather", "push"),
    ("kv_gather", "pull"),
]
VARIANT_IDS = ["lse_reduce", "q_gather", "kv_gather_push", "kv_gather_pull"]

#: Deadline of the fault tests. The margin below only rules out a hang: it is not a
#: performance bound.
FAULT_TIMEOUT_MS = 300.0
HANG_MARGIN_S = 5.0


def _one_checked_call(case, dev, exp, n_tokens, what):
    """One call into a poisoned out= buffer, checked: what went wrong, or "" when right."""
    try:
        res = case.call(dev, out=case.poisoned_out(n_tokens))
        case.op.synchronize()
        return case.check(res, exp, what)
    except Exception as e:  # noqa: BLE001
        return f"{what} raised {type(e).__name__}: {e}"


def _fail_if_any(comm, msgs, what):
    """Collective: fail on every rank if any rank reported a failure."""
    msg = "\n".join(m for m in msgs if m) or None
    lines = gather_failures(comm, msg)
    if lines:
        pytest.fail(f"{what}:\n" + "\n".join(lines), pytrace=False)


def _report(comm, record):
    """Rank 0 appends ``record`` (plus world_size) to $DCPKIT_RELIABILITY_REPORT and prints it."""
    if comm.rank != 0:
        return
    record = dict(record, world_size=comm.world_size)
    line = json.dumps(record, sort_keys=True)
    print(f"\n[reliability] {line}")
    path = os.environ.get("DCPKIT_RELIABILITY_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _case(comm, name, algorithm, **kw):
    return OpCase(name, comm, algorithm=algorithm, **kw)


def _epochs_match_calls(case):
    """``None`` when the device epoch of every ubatch equals the host call count (so no kernel
    ran for a rejected call); valid while the op was only called eagerly."""
    case.op.synchronize()
    dev = [int(e) for e in case.op._epoch.get()]
    if dev != list(case.op._calls):
        return (
            f"{case.label}: device epochs {dev} != host call counts {case.op._calls}: a "
            f"rejected call ran a kernel, or a call did not advance the epoch"
        )
    return None


# ============================================================================ 1. silent rank
@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_silent_rank_times_out(comm, seed, name, algorithm):
    """The last rank skips call 3; every other rank raises CollectiveTimeout naming it."""
    W, rank = comm.world_size, comm.rank
    silent = W - 1
    T = 8
    case = _case(comm, name, algorithm, max_tokens=16, timeout_ms=FAULT_TIMEOUT_MS)
    op = case.op
    dev, exp = case.prepare(seed, T)
    msgs = []

    # Two good calls, checked (the workspace is healthy before the fault).
    comm.barrier()
    for i in range(2):
        out = case.poisoned_out(T)
        try:
            res = case.call(dev, out=out)
            op.synchronize()
            msgs.append(case.check(res, exp, f"good call {i} before the fault"))
        except Exception as e:  # noqa: BLE001 - reported collectively below
            msgs.append(f"good call {i} raised {type(e).__name__}: {e}")
    _fail_if_any(comm, msgs, f"{case.label}: calls before the fault")
    fault_epoch = op._calls[0] + 1  # the epoch of the call the silent rank skips

    # The fault: every rank but `silent` makes call `fault_epoch`.
    comm.barrier()
    detect_s = None
    if rank != silent:
        t0 = time.monotonic()
        err = None
        try:
            case.call(dev)  # a healthy workspace launches normally
            op.synchronize()  # ... and the wait expires in the kernel
        except CollectiveTimeout as e:
            err = e
        except Exception as e:  # noqa: BLE001
            msgs.append(
                f"call {fault_epoch} raised {type(e).__name__} instead of CollectiveTimeout: {e}"
            )
        detect_s = time.monotonic() - t0
        if err is None and not msgs:
            msgs.append(
                f"call {fault_epoch} without rank {silent} did not raise "
                f"CollectiveTimeout ({detect_s:.2f} s)"
            )
        if err is not None:
            if detect_s > FAULT_TIMEOUT_MS / 1e3 + HANG_MARGIN_S:
                msgs.append(
                    f"CollectiveTimeout took {detect_s:.2f} s (> timeout "
                    f"{FAULT_TIMEOUT_MS:g} ms + {HANG_MARGIN_S} s margin)"
                )
            want = dict(
                op=name, rank=rank, peer=silent, expected_epoch=fault_epoch & 0xFFFFFFFF, ubatch=0
            )
            got = {k: getattr(err, k) for k in want}
            if got != want:
                msgs.append(f"CollectiveTimeout fields {got} != {want} ({err})")
            text = str(err)
            for frag in (name, f"peer {silent}", f"expected epoch {fault_epoch}"):
                if frag not in text:
                    msgs.append(f"CollectiveTimeout message lacks {frag!r}: {text}")
            if err.observed_epoch == err.expected_epoch:
                msgs.append(f"observed epoch equals the expected one: {err}")
            if not op.poisoned:
                msgs.append("op.poisoned is False after the timeout")
            # The next call raises again, before anything is launched or counted.
            before = list(op._calls)
            try:
                case.call(dev)
                msgs.append("the call after the timeout did not raise")
            except CollectiveTimeout as e2:
                if (e2.peer, e2.expected_epoch) != (err.peer, err.expected_epoch):
                    msgs.append(f"the next call names another timeout: {e2} vs {err}")
            except Exception as e:  # noqa: BLE001
                msgs.append(f"the call after the timeout raised {type(e).__name__}: {e}")
            if op._calls != before:
                msgs.append(f"the rejected call counted: _calls {before} -> {op._calls}")
            try:
                op.synchronize()
                msgs.append("synchronize() after the timeout did not raise")
            except CollectiveTimeout:
                pass
    detect = comm.allgather(detect_s)

    # The silent rank arrives late. Its call of the skipped epoch finds every peer's signal of
    # that epoch already set (the peers published before they waited), so it may complete; the
    # call after it waits for peers that never call again (their workspaces are poisoned) and
    # times out naming one of them. Within three calls it must have raised.
    comm.barrier()
    late = []
    if rank == silent:
        t0 = time.monotonic()
        for attempt in range(3):
            try:
                case.call(dev)
                op.synchronize()
                late.append("completed")
            except CollectiveTimeout as e:
                late.append(f"CollectiveTimeout(peer={e.peer}, expected={e.expected_epoch})")
                if not (0 <= e.peer < W and e.peer != silent and e.rank == silent):
                    msgs.append(f"the late rank's timeout names peer {e.peer}: {e}")
                break
            except Exception as e:  # noqa: BLE001
                late.append(f"{type(e).__name__}: {e}")
                msgs.append(f"the late rank's call raised {type(e).__name__}: {e}")
                break
        late_s = time.monotonic() - t0
        if not late or not late[-1].startswith("CollectiveTimeout"):
            msgs.append(f"the late rank never timed out: {late}")
        if late_s > 3 * (FAULT_TIMEOUT_MS / 1e3 + HANG_MARGIN_S):
            msgs.append(f"the late rank took {late_s:.2f} s to time out")
    late_all = comm.allgather(late)
    comm.barrier()

    # The CUDA context stays usable on every rank.
    msgs.append(context_usable())

    # Closing the poisoned workspaces (collective) does not hang; close is idempotent and later
    # calls raise ClosedError.
    t0 = time.monotonic()
    try:
        op.close()
        op.close()
    except Exception as e:  # noqa: BLE001
        msgs.append(f"close() of a poisoned workspace raised {type(e).__name__}: {e}")
    close_s = time.monotonic() - t0
    try:
        case.call(dev)
        msgs.append("a call after close() did not raise")
    except ClosedError:
        pass
    except Exception as e:  # noqa: BLE001
        msgs.append(f"a call after close() raised {type(e).__name__} instead of ClosedError")
    _report(
        comm,
        {
            "test": "silent_rank",
            "op": case.label,
            "timeout_ms": FAULT_TIMEOUT_MS,
            "detect_s_per_rank": detect,
            "late_rank_saw": late_all[silent],
            "close_s_rank0": round(close_s, 3),
        },
    )
    _fail_if_any(comm, msgs, f"{case.label}: silent rank {silent}")


def test_timeout_poisons_every_ubatch_but_no_other_workspace(comm, seed):
    """A timeout poisons the whole workspace (every ubatch): a ubatch other than the one that
    timed out raises too, before launching. A separate, healthy workspace keeps working."""
    W, rank = comm.world_size, comm.rank
    silent = W - 1
    T = 4
    bad = OpCase("q_gather", comm, max_tokens=8, num_ubatches=2, timeout_ms=FAULT_TIMEOUT_MS)
    good = OpCase("kv_gather", comm, max_tokens=8)
    dev_b, _ = bad.prepare(seed, T)
    dev_g, exp_g = good.prepare(seed + 1, T)
    msgs = []
    comm.barrier()
    if rank != silent:
        try:
            bad.call(dev_b, ubatch=1)
            bad.op.synchronize()
            msgs.append("no CollectiveTimeout")
        except CollectiveTimeout as e:
            if e.ubatch != 1 or e.peer != silent:
                msgs.append(f"wrong timeout record: {e}")
        before = list(bad.op._calls)
        try:
            bad.call(dev_b, ubatch=0)
            msgs.append("ubatch 0 of a poisoned workspace did not raise")
        except CollectiveTimeout:
            pass
        if bad.op._calls != before:
            msgs.append(f"rejected call counted: {before} -> {bad.op._calls}")
    comm.barrier()
    # The silent rank's own copy is not poisoned (it never waited); it makes no call here.
    if rank == silent and bad.op.poisoned:
        msgs.append("the silent rank's workspace is poisoned although it never waited")
    # The healthy workspace works on every rank.
    out = good.poisoned_out(T)
    try:
        res = good.call(dev_g, out=out)
        good.op.synchronize()
        msgs.append(good.check(res, exp_g, "healthy workspace next to a poisoned one"))
    except Exception as e:  # noqa: BLE001
        msgs.append(f"healthy workspace raised {type(e).__name__}: {e}")
    bad.op.close()
    good.op.close()
    _fail_if_any(comm, msgs, "poisoned q_gather next to a healthy kv_gather")


# ============================================================================ 3. DCPKIT_DEBUG
@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_debug_mismatch_raises_before_launch(comm, seed, name, algorithm, monkeypatch):
    """DCPKIT_DEBUG=1: one rank passing T=8 while the others pass T=16 (and one rank using
    another ubatch) raises ConfigMismatch on every rank, naming the odd rank, before anything
    is launched or counted; then a good call is correct."""
    monkeypatch.setenv("DCPKIT_DEBUG", "1")
    W, rank = comm.world_size, comm.rank
    odd = W - 1
    case = _case(comm, name, algorithm, max_tokens=16, num_ubatches=2)
    op = case.op
    msgs = []
    if not op._debug:
        msgs.append("DCPKIT_DEBUG=1 at construction but op._debug is False")

    def expect_mismatch(what, dev, ubatch):
        before = list(op._calls)
        try:
            case.call(dev, ubatch=ubatch)
            msgs.append(f"{what}: no ConfigMismatch")
        except ConfigMismatch as e:
            if e.ranks != [odd]:
                msgs.append(f"{what}: ConfigMismatch names ranks {e.ranks}, expected [{odd}]: {e}")
            if f"rank {odd}" not in str(e):
                msgs.append(f"{what}: message does not name rank {odd}: {e}")
        except Exception as e:  # noqa: BLE001
            msgs.append(f"{what}: raised {type(e).__name__} instead of ConfigMismatch: {e}")
        if op._calls != before:
            msgs.append(f"{what}: the rejected call counted: _calls {before} -> {op._calls}")

    T_mine = 8 if rank == odd else 16
    dev_t, _ = case.prepare(seed, T_mine)
    expect_mismatch(f"T={T_mine} on rank {rank}", dev_t, 0)
    dev, exp = case.prepare(seed + 1, 16)
    expect_mismatch("ubatch 1 on the odd rank", dev, 1 if rank == odd else 0)

    # A good call afterwards: correct, and exactly one host allgather per call. Counted at the
    # Communicator's transport (_allgather), which every exchange (allgather, agree, ...) uses.
    counts = {"allgather": 0}
    real = comm._allgather

    def counting(obj):
        counts["allgather"] += 1
        return real(obj)

    monkeypatch.setattr(comm, "_allgather", counting)
    out = case.poisoned_out(16)
    try:
        res = case.call(dev, ubatch=1, out=out)
        op.synchronize()
        msgs.append(case.check(res, exp, "good call after the mismatches"))
    except Exception as e:  # noqa: BLE001
        msgs.append(f"good call raised {type(e).__name__}: {e}")
    monkeypatch.setattr(comm, "_allgather", real)
    if counts["allgather"] != 1:
        msgs.append(f"DCPKIT_DEBUG=1 call made {counts['allgather']} allgathers (expected 1)")
    msgs.append(_epochs_match_calls(case))
    op.close()
    _fail_if_any(comm, msgs, f"{case.label} with DCPKIT_DEBUG=1")


@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_debug_set_on_one_rank_only_fails_every_constructor(comm, name, algorithm, monkeypatch):
    """DCPKIT_DEBUG=1 on the last rank only: the constructor raises ConfigMismatch naming
    DCPKIT_DEBUG and that rank on every rank (with it, that rank alone would run a host
    collective per call and wait forever); nothing is left open, and an op built afterwards
    with the setting alike everywhere works."""
    W, rank = comm.world_size, comm.rank
    odd = W - 1
    if rank == odd:
        monkeypatch.setenv("DCPKIT_DEBUG", "1")
    else:
        monkeypatch.delenv("DCPKIT_DEBUG", raising=False)
    msgs = []
    try:
        case = _case(comm, name, algorithm, max_tokens=16)
        case.op.close()
        msgs.append("the constructor accepted DCPKIT_DEBUG set on one rank only")
    except ConfigMismatch as e:
        if "DCPKIT_DEBUG" not in str(e) or e.ranks != [odd]:
            msgs.append(f"ConfigMismatch does not name DCPKIT_DEBUG and rank [{odd}]: {e}")
    except Exception as e:  # noqa: BLE001
        msgs.append(f"raised {type(e).__name__} instead of ConfigMismatch: {e}")
    monkeypatch.delenv("DCPKIT_DEBUG", raising=False)
    case = _case(comm, name, algorithm, max_tokens=16)
    dev, exp = case.prepare(11, 8)
    msgs.append(_one_checked_call(case, dev, exp, 8, "op built after the mismatch"))
    case.op.close()
    _fail_if_any(comm, msgs, f"{name} ({algorithm}) with DCPKIT_DEBUG on one rank")


@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_no_debug_no_host_collectives(comm, seed, name, algorithm, monkeypatch):
    """Without DCPKIT_DEBUG a call makes no host collective (allgather, broadcast, barrier)."""
    monkeypatch.delenv("DCPKIT_DEBUG", raising=False)
    case = _case(comm, name, algorithm, max_tokens=16, num_ubatches=2)
    op = case.op
    msgs = []
    if op._debug:
        msgs.append("op._debug is True without DCPKIT_DEBUG")
    dev, exp = case.prepare(seed, 16)
    # Counted at the Communicator's transport (_allgather, _broadcast, _barrier), which every
    # host exchange goes through.
    counts = {"_allgather": 0, "_broadcast": 0, "_barrier": 0}
    real = {k: getattr(comm, k) for k in counts}

    def counting(kind):
        def f(*a, **k):
            counts[kind] += 1
            return real[kind](*a, **k)

        return f

    for k in counts:
        monkeypatch.setattr(comm, k, counting(k))
    res = None
    try:
        for i in range(20):
            res = case.call(dev, ubatch=i % 2)
        res = res.copy()
        op.synchronize()
    except Exception as e:  # noqa: BLE001
        msgs.append(f"calls raised {type(e).__name__}: {e}")
    for k in counts:
        monkeypatch.setattr(comm, k, real[k])
    if any(counts.values()):
        msgs.append(f"20 calls made host collectives: {counts}")
    if res is not None:
        msgs.append(case.check(res, exp, "20th call"))
    op.close()
    _fail_if_any(comm, msgs, f"{case.label} without DCPKIT_DEBUG")


# ============================================================================ 4. soak
def test_short_soak_with_epoch_wrap(comm, seed):
    """3000 mixed calls (three ops, two ubatches, eager and graph replays), checked, crossing
    the 32-bit wrap of the signals on q_gather and kv_gather; memory and fds flat."""
    import soak

    summary = soak.run_soak(
        comm, calls=3000, seed=seed, check_every=500, wrap_after={"q_gather": 40, "kv_gather": 150}
    )
    _report(
        comm,
        {
            "test": "short_soak",
            **{
                k: summary[k]
                for k in (
                    "calls",
                    "wrong_results",
                    "checked_calls",
                    "device_checked_calls",
                    "elapsed_s",
                    "flat",
                    "wrapped",
                )
            },
        },
    )
    problems = soak.problems(summary)
    _fail_if_any(comm, [problems], "short soak")


# ============================================================================ 5. bad input
def _bad_input_rows(comm, q, k, l, heap, dq, dk, dl, T):
    """(id, case or None, thunk, error class, message fragment) of every bad call."""
    import cupy

    W = comm.world_size
    bf16 = q.dtype
    dt = cupy.dtype(bf16)
    H = H_R * W
    ndev = cupy.cuda.runtime.getDeviceCount()
    rows = []

    def add(rid, case, thunk, exc, frag):
        rows.append((rid, case, thunk, exc, frag))

    def misaligned(shape, dtype):
        """A view offset by one element from a 256-byte aligned allocation."""
        n = int(np.prod(shape))
        flat = cupy.zeros(n + 16, dtype=dtype)
        return flat[1 : 1 + n].reshape(shape)

    def other_device(shape, dtype):
        with cupy.cuda.Device((cupy.cuda.Device().id + 1) % ndev):
            return cupy.zeros(shape, dtype=dtype)

    # ---- q_gather: q [T, H_r, D]
    qx = dq["q"]
    add(
        "q dtype float32",
        q,
        lambda: q.op(cupy.zeros((T, H_R, HEAD_DIM), cupy.float32)),
        InvalidType,
        "q dtype",
    )
    add(
        "q host numpy",
        q,
        lambda: q.op(np.zeros((T, H_R, HEAD_DIM), np.float16)),
        InvalidType,
        "GPU array",
    )
    add("q python list", q, lambda: q.op([[0.0]]), InvalidType, "GPU array")
    add("q 2-D", q, lambda: q.op(qx.reshape(T, H_R * HEAD_DIM)), InvalidArgument, "dimensions")
    add(
        "q heads H_r+1",
        q,
        lambda: q.op(cupy.zeros((T, H_R + 1, HEAD_DIM), dt)),
        InvalidArgument,
        "q shape",
    )
    add(
        "q head_dim D/2",
        q,
        lambda: q.op(cupy.zeros((T, H_R, HEAD_DIM // 2), dt)),
        InvalidArgument,
        "q shape",
    )
    add(
        "q T > max_tokens",
        q,
        lambda: q.op(cupy.zeros((q.max_tokens + 1, H_R, HEAD_DIM), dt)),
        InvalidArgument,
        "max_tokens",
    )
    add(
        "q element stride 2",
        q,
        lambda: q.op(cupy.zeros((T, H_R, 2 * HEAD_DIM), dt)[:, :, ::2]),
        InvalidArgument,
        "stride",
    )
    add(
        "q head stride 2*D",
        q,
        lambda: q.op(cupy.zeros((T, 2 * H_R, HEAD_DIM), dt)[:, ::2, :]),
        InvalidArgument,
        "head stride",
    )
    add(
        "q token stride not a multiple of 16 bytes",
        q,
        lambda: q.op(
            cupy.lib.stride_tricks.as_strided(
                cupy.zeros(T * (H_R * HEAD_DIM + 1), dt),
                shape=(T, H_R, HEAD_DIM),
                strides=((H_R * HEAD_DIM + 1) * dt.itemsize, HEAD_DIM * dt.itemsize, dt.itemsize),
            )
        ),
        InvalidArgument,
        "token stride",
    )
    add(
        "q misaligned pointer (offset one element)",
        q,
        lambda: q.op(misaligned((T, H_R, HEAD_DIM), dt)),
        InvalidArgument,
        "pointer",
    )
    add(
        "q out shape [T, H-1, D]",
        q,
        lambda: q.op(qx, out=cupy.zeros((T, H - 1, HEAD_DIM), dt)),
        InvalidArgument,
        "out shape",
    )
    add(
        "q out dtype float16",
        q,
        lambda: q.op(qx, out=cupy.zeros((T, H, HEAD_DIM), cupy.float16)),
        InvalidType,
        "out dtype",
    )
    add(
        "q out host numpy",
        q,
        lambda: q.op(qx, out=np.zeros((T, H, HEAD_DIM), np.float16)),
        InvalidType,
        "GPU array",
    )
    add(
        "q out misaligned",
        q,
        lambda: q.op(qx, out=misaligned((T, H, HEAD_DIM), dt)),
        InvalidArgument,
        "pointer",
    )
    q_buf = cupy.zeros((T, H, HEAD_DIM), dt)
    add(
        "q the own heads of out (in place)",
        q,
        lambda: q.op(q_buf[:, comm.rank * H_R : (comm.rank + 1) * H_R], out=q_buf),
        InvalidArgument,
        "out must not share memory with q",
    )

    def in_region(op, shape, dtype, offset=4096):
        """An array over the op's own symmetric region (where its peers store)."""
        ptr = op.heap.local_ptr + op._base + offset
        n = int(np.prod(shape)) * cupy.dtype(dtype).itemsize
        mem = cupy.cuda.UnownedMemory(ptr, n, op, op.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    add(
        "q out in the op's own workspace region",
        q,
        lambda: q.op(qx, out=in_region(q.op, (T, H, HEAD_DIM), dt)),
        InvalidArgument,
        "out must not lie in the op's own workspace",
    )
    add("q ubatch = num_ubatches", q, lambda: q.op(qx, ubatch=1), InvalidArgument, "ubatch")
    add("q ubatch -1", q, lambda: q.op(qx, ubatch=-1), InvalidArgument, "ubatch")
    add("q ubatch '0'", q, lambda: q.op(qx, ubatch="0"), InvalidType, "ubatch")
    add("q ubatch True", q, lambda: q.op(qx, ubatch=True), InvalidType, "ubatch")
    add(
        "q return_padded with out",
        q,
        lambda: q.op(qx, out=cupy.zeros((T, H, HEAD_DIM), dt), return_padded=True),
        InvalidArgument,
        "return_padded",
    )
    if ndev >= 2:
        add(
            "q on another GPU",
            q,
            lambda: q.op(other_device((T, H_R, HEAD_DIM), dt)),
            InvalidArgument,
            "device",
        )

    # ---- kv_gather: kv [T, D_kv]
    kx = dk["kv"]
    add(
        "kv dtype float16",
        k,
        lambda: k.op(cupy.zeros((T, ROW_DIM), cupy.float16)),
        InvalidType,
        "kv dtype",
    )
    add("kv 3-D", k, lambda: k.op(cupy.zeros((T, 1, ROW_DIM), dt)), InvalidArgument, "dimensions")
    add(
        "kv row_dim - 8",
        k,
        lambda: k.op(cupy.zeros((T, ROW_DIM - 8), dt)),
        InvalidArgument,
        "kv shape",
    )
    add(
        "kv T > max_tokens",
        k,
        lambda: k.op(cupy.zeros((k.max_tokens + 1, ROW_DIM), dt)),
        InvalidArgument,
        "max_tokens",
    )
    add(
        "kv padded rows (non-contiguous)",
        k,
        lambda: k.op(cupy.zeros((T, 2 * ROW_DIM), dt)[:, :ROW_DIM]),
        InvalidArgument,
        "contiguous",
    )
    add(
        "kv column stride 2",
        k,
        lambda: k.op(cupy.zeros((T, 2 * ROW_DIM), dt)[:, ::2]),
        InvalidArgument,
        "contiguous",
    )
    add(
        "kv misaligned pointer (offset one element)",
        k,
        lambda: k.op(misaligned((T, ROW_DIM), dt)),
        InvalidArgument,
        "pointer",
    )
    add(
        "kv host numpy",
        k,
        lambda: k.op(np.zeros((T, ROW_DIM), np.float16)),
        InvalidType,
        "GPU array",
    )
    add(
        "kv out rows W*T-1",
        k,
        lambda: k.op(kx, out=cupy.zeros((W * T - 1, ROW_DIM), dt)),
        InvalidArgument,
        "out shape",
    )
    add(
        "kv out dtype float32",
        k,
        lambda: k.op(kx, out=cupy.zeros((W * T, ROW_DIM), cupy.float32)),
        InvalidType,
        "out dtype",
    )
    add(
        "kv out non-contiguous",
        k,
        lambda: k.op(kx, out=cupy.zeros((W * T, 2 * ROW_DIM), dt)[:, :ROW_DIM]),
        InvalidArgument,
        "contiguous",
    )
    kv_buf = cupy.zeros((W * T, ROW_DIM), dt)
    add(
        "kv the own rows of out (in place)",
        k,
        lambda: k.op(kv_buf[comm.rank * T : (comm.rank + 1) * T], out=kv_buf),
        InvalidArgument,
        "out must not share memory with kv",
    )
    add("kv ubatch 3", k, lambda: k.op(kx, ubatch=3), InvalidArgument, "ubatch")
    if ndev >= 2:
        add(
            "kv on another GPU",
            k,
            lambda: k.op(other_device((T, ROW_DIM), dt)),
            InvalidArgument,
            "device",
        )

    # ---- lse_reduce: out_partial [T, H, D_v], lse_partial [T, H], masks
    xo, xl = dl["out_partial"], dl["lse_partial"]
    sl, qsl = dl["seq_lens"], dl["query_start_loc"]
    add(
        "lse out_partial dtype float32",
        l,
        lambda: l.op(cupy.zeros((T, H, HEAD_DIM_V), cupy.float32), xl),
        InvalidType,
        "out_partial dtype",
    )
    add(
        "lse out_partial host numpy",
        l,
        lambda: l.op(np.zeros((T, H, HEAD_DIM_V), np.float32), xl),
        InvalidType,
        "GPU array",
    )
    add(
        "lse out_partial heads H-1",
        l,
        lambda: l.op(cupy.zeros((T, H - 1, HEAD_DIM_V), dt), xl),
        InvalidArgument,
        "out_partial shape",
    )
    add(
        "lse out_partial 2-D",
        l,
        lambda: l.op(xo.reshape(T, H * HEAD_DIM_V), xl),
        InvalidArgument,
        "out_partial",
    )
    add(
        "lse T > max_tokens",
        l,
        lambda: l.op(
            cupy.zeros((l.max_tokens + 1, H, HEAD_DIM_V), dt),
            cupy.zeros((l.max_tokens + 1, H), cupy.float32),
        ),
        InvalidArgument,
        "max_tokens",
    )
    add(
        "lse out_partial misaligned pointer",
        l,
        lambda: l.op(misaligned((T, H, HEAD_DIM_V), dt), xl),
        InvalidArgument,
        "aligned",
    )
    add(
        "lse out_partial negative stride",
        l,
        lambda: l.op(xo[::-1], xl),
        InvalidArgument,
        "non-negative",
    )
    add(
        "lse lse_partial int32",
        l,
        lambda: l.op(xo, cupy.zeros((T, H), cupy.int32)),
        InvalidType,
        "lse_partial dtype",
    )
    add(
        "lse lse_partial [T-1, H]",
        l,
        lambda: l.op(xo, cupy.zeros((T - 1, H), cupy.float32)),
        InvalidArgument,
        "lse_partial shape",
    )
    add(
        "lse lse_partial host numpy",
        l,
        lambda: l.op(xo, np.zeros((T, H), np.float32)),
        InvalidType,
        "GPU array",
    )
    add(
        "lse seq_lens without query_start_loc",
        l,
        lambda: l.op(xo, xl, seq_lens=sl),
        InvalidArgument,
        "query_start_loc",
    )
    add(
        "lse seq_lens length S+1 (mismatched query_start_loc)",
        l,
        lambda: l.op(xo, xl, seq_lens=cupy.zeros(sl.shape[0] + 1, cupy.int32), query_start_loc=qsl),
        InvalidArgument,
        "seq_lens length",
    )
    add(
        "lse seq_lens int64",
        l,
        lambda: l.op(xo, xl, seq_lens=sl.astype(cupy.int64), query_start_loc=qsl),
        InvalidType,
        "seq_lens dtype",
    )
    add(
        "lse query_start_loc host numpy",
        l,
        lambda: l.op(xo, xl, seq_lens=sl, query_start_loc=qsl.get()),
        InvalidType,
        "GPU array",
    )
    add(
        "lse query_start_loc 2-D",
        l,
        lambda: l.op(xo, xl, query_start_loc=qsl.reshape(1, -1)),
        InvalidArgument,
        "query_start_loc",
    )
    add(
        "lse query_start_loc float32",
        l,
        lambda: l.op(xo, xl, query_start_loc=qsl.astype(cupy.float32)),
        InvalidType,
        "query_start_loc dtype",
    )
    add(
        "lse out shape [T, H_r+1, D_v]",
        l,
        lambda: l.op(xo, xl, out=cupy.zeros((T, H_R + 1, HEAD_DIM_V), dt)),
        InvalidArgument,
        "out shape",
    )
    add(
        "lse out non-contiguous",
        l,
        lambda: l.op(xo, xl, out=cupy.zeros((T, H_R, 2 * HEAD_DIM_V), dt)[:, :, :HEAD_DIM_V]),
        InvalidArgument,
        "contiguous",
    )
    add(
        "lse out misaligned",
        l,
        lambda: l.op(xo, xl, out=misaligned((T, H_R, HEAD_DIM_V), dt)),
        InvalidArgument,
        "aligned",
    )

    def leading(a, shape, dtype):
        """A C-contiguous ``shape`` view of ``dtype`` over the first bytes of ``a``."""
        n = int(np.prod(shape)) * cupy.dtype(dtype).itemsize
        return a.reshape(-1).view(cupy.uint8)[:n].view(dtype).reshape(shape)

    # (out= / out_lse= over out_partial / lse_partial is an in-place call, which the op serves:
    # tests/mpi/test_lse_reduce.py::test_out_overlapping_the_input.)
    lse_buf = cupy.zeros(T * H_R * HEAD_DIM_V * dt.itemsize, cupy.uint8)
    mask_buf = cupy.zeros(max(T * H_R * 4, qsl.nbytes), cupy.uint8)
    mask_buf[: qsl.nbytes] = qsl.view(cupy.uint8)
    qsl_in_buf = mask_buf[: qsl.nbytes].view(qsl.dtype)
    add(
        "lse out_lse over query_start_loc",
        l,
        lambda: l.op(
            xo, xl, query_start_loc=qsl_in_buf, out_lse=leading(mask_buf, (T, H_R), cupy.float32)
        ),
        InvalidArgument,
        "out_lse must not share memory with query_start_loc",
    )
    add(
        "lse out over out_lse",
        l,
        lambda: l.op(
            xo,
            xl,
            out=leading(lse_buf, (T, H_R, HEAD_DIM_V), dt),
            out_lse=leading(lse_buf, (T, H_R), cupy.float32),
        ),
        InvalidArgument,
        "out must not share memory with out_lse",
    )
    add(
        "lse out_lse float16",
        l,
        lambda: l.op(xo, xl, out_lse=cupy.zeros((T, H_R), cupy.float16)),
        InvalidType,
        "out_lse dtype",
    )
    add(
        "lse out_lse shape [T, H_r+1]",
        l,
        lambda: l.op(xo, xl, out_lse=cupy.zeros((T, H_R + 1), cupy.float32)),
        InvalidArgument,
        "out_lse shape",
    )
    add("lse ubatch 2", l, lambda: l.op(xo, xl, ubatch=2), InvalidArgument, "ubatch")
    if ndev >= 2:
        add(
            "lse out_partial on another GPU",
            l,
            lambda: l.op(other_device((T, H, HEAD_DIM_V), dt), xl),
            InvalidArgument,
            "device",
        )

    # ---- the symmetric heap (local checks; the heap stays usable)
    nb = heap.nbytes
    add(
        "heap view past the end",
        None,
        lambda: heap.view(nb - 64, (128,), np.uint8),
        InvalidArgument,
        "offset + view bytes must be <=",
    )
    add(
        "heap view negative offset",
        None,
        lambda: heap.view(-256, (16,), np.uint8),
        InvalidArgument,
        "offset must be >= 0",
    )
    add(
        "heap view rank = world_size",
        None,
        lambda: heap.view(0, (16,), np.uint8, rank=W),
        InvalidArgument,
        "rank must lie in",
    )
    add(
        "heap view rank -1",
        None,
        lambda: heap.view(0, (16,), np.uint8, rank=-1),
        InvalidArgument,
        "rank must be >= 0",
    )
    add(
        "heap view misaligned for float32",
        None,
        lambda: heap.view(2, (4,), np.float32),
        InvalidArgument,
        "multiple of the itemsize",
    )
    add(
        "heap view shape not ints",
        None,
        lambda: heap.view(0, "abc", np.uint8),
        InvalidType,
        "shape must be",
    )
    add(
        "heap reserve more than the heap",
        None,
        lambda: heap.reserve(2 * nb + 4096),
        InvalidArgument,
        "must fit in the heap",
    )
    add(
        "heap reserve align 48",
        None,
        lambda: heap.reserve(64, align=48),
        InvalidArgument,
        "align must be a power of two",
    )
    return rows


def _warm_up(cases, seed: int, T: int) -> None:
    """Good calls of every op (view and out= forms, three each, collective): they fill the
    ops' plan caches with their arrays' descriptions."""
    import cupy

    for i, c in enumerate(cases.values()):
        dev, _ = c.prepare(seed + 100 + i, T)
        for _ in range(3):
            c.call(dev)
            c.call(dev, out=c.poisoned_out(T))
        c.op.synchronize()
    cupy.cuda.runtime.deviceSynchronize()


@pytest.mark.parametrize("warm", ["cold", "same arrays", "reused addresses"])
def test_bad_input_table(comm, seed, monkeypatch, warm):
    """Every bad call raises its error class (and message fragment) before anything is
    launched or counted; the workspace gives the right result on the next good call.

    Cold (no call before the table), after warm-up calls with the very arrays the table then
    uses, and after warm-up calls whose arrays were freed before the table's were allocated
    (CuPy's pool hands the freed addresses out again): a warm plan cache never hides an
    error."""
    import cupy

    from dcpkit.symmetric import SymmetricHeap

    monkeypatch.delenv("DCPKIT_DEBUG", raising=False)
    T = 8
    q = OpCase("q_gather", comm, max_tokens=16)
    k = OpCase("kv_gather", comm, max_tokens=16)
    l = OpCase("lse_reduce", comm, max_tokens=16, num_requests=3)
    heap = SymmetricHeap(comm, 1 << 20)
    cases = {"q": q, "k": k, "l": l}
    if warm == "reused addresses":
        _warm_up(cases, seed, T)  # its arrays are freed on return
    prepared = {n: c.prepare(seed + i, T) for i, (n, c) in enumerate(cases.items())}
    if warm == "same arrays":
        for n, c in cases.items():
            for _ in range(3):
                c.call(prepared[n][0])
                c.call(prepared[n][0], out=c.poisoned_out(T))
            c.op.synchronize()
    cold_caches = [n for n, c in cases.items() if warm != "cold" and not c.op._plans.hits]
    rows = _bad_input_rows(
        comm, q, k, l, heap, prepared["q"][0], prepared["k"][0], prepared["l"][0], T
    )
    msgs = [f"warm-up ({warm}) did not hit the plan cache of {cold_caches}"] if cold_caches else []
    n_rows = len(rows)
    for rid, case, thunk, exc, frag in rows:
        before = {n: list(c.op._calls) for n, c in cases.items()}
        try:
            thunk()
            msgs.append(f"[{rid}] did not raise (expected {exc.__name__})")
        except exc as e:
            if frag and frag not in str(e):
                msgs.append(f"[{rid}] {exc.__name__} message lacks {frag!r}: {e}")
        except Exception as e:  # noqa: BLE001
            msgs.append(f"[{rid}] raised {type(e).__name__} instead of {exc.__name__}: {e}")
        after = {n: list(c.op._calls) for n, c in cases.items()}
        if after != before:
            msgs.append(f"[{rid}] a call was counted (launched?): {before} -> {after}")
        # The next good call of the same op is correct (collective: same order on every rank).
        if case is not None:
            name = next(n for n, c in cases.items() if c is case)
            dev, exp = prepared[name]
            out = case.poisoned_out(T)
            try:
                res = case.call(dev, out=out)
                case.op.synchronize()
                m = case.check(res, exp, f"good call after [{rid}]")
                if m:
                    msgs.append(m)
            except Exception as e:  # noqa: BLE001
                msgs.append(f"good call after [{rid}] raised {type(e).__name__}: {e}")

    # No rejected call ran a kernel: the device epochs equal the host call counts.
    msgs += [_epochs_match_calls(c) for c in cases.values()]

    # The heap still works after its rejected calls: write this rank's view, read a peer's.
    W, rank = comm.world_size, comm.rank
    try:
        mine = heap.view(4096, (64,), np.int32)
        mine[:] = cupy.arange(64, dtype=cupy.int32) + 1000 * rank
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:  # noqa: BLE001
        msgs.append(f"heap view after the bad calls raised {type(e).__name__}: {e}")
    comm.barrier()
    try:
        peer = (rank + 1) % W
        got = heap.view(4096, (64,), np.int32, rank=peer).get()
        if not np.array_equal(got, np.arange(64, dtype=np.int32) + 1000 * peer):
            msgs.append(f"heap peer view of rank {peer} reads {got[:4]}...")
    except Exception as e:  # noqa: BLE001
        msgs.append(f"heap peer view raised {type(e).__name__}: {e}")
    comm.barrier()

    # Closed resources: the heap, and a closed workspace of each op.
    heap.close()
    heap.close()
    closed_rows = 0
    for rid, thunk in (
        ("heap view after close", lambda: heap.view(0, (16,), np.uint8)),
        ("heap reserve after close", lambda: heap.reserve(256)),
    ):
        closed_rows += 1
        try:
            thunk()
            msgs.append(f"[{rid}] did not raise ClosedError")
        except ClosedError:
            pass
        except Exception as e:  # noqa: BLE001
            msgs.append(f"[{rid}] raised {type(e).__name__} instead of ClosedError: {e}")
    for name, c in cases.items():
        dev, _ = prepared[name]
        c.op.close()
        for what, thunk in (
            ("call", lambda: c.call(dev)),
            ("synchronize", lambda: c.op.synchronize()),
        ):
            closed_rows += 1
            try:
                thunk()
                msgs.append(f"[{c.label} {what} after close] did not raise ClosedError")
            except ClosedError as e:
                if "closed" not in str(e):
                    msgs.append(f"[{c.label} {what} after close] message: {e}")
            except Exception as e:  # noqa: BLE001
                msgs.append(f"[{c.label} {what} after close] raised {type(e).__name__}: {e}")
    total = n_rows + closed_rows
    if total < 30:
        msgs.append(f"only {total} bad calls in the table (>= 30 required)")
    _report(comm, {"test": "bad_input_table", "bad_calls": total})
    _fail_if_any(comm, msgs, f"bad-input table ({total} bad calls)")


# ============================================================================ 6. teardown
@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_close_collective_idempotent(comm, seed, name, algorithm):
    """close() twice is fine; calls and synchronize() after close raise ClosedError; the
    context manager closes; a fresh workspace afterwards works."""
    msgs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with _case(comm, name, algorithm, max_tokens=8).op as op:
            pass
        del op
        gc.collect()
    if any(issubclass(w.category, ResourceWarning) for w in caught):
        msgs.append(f"a closed workspace warned at collection: {[str(w.message) for w in caught]}")
    case = _case(comm, name, algorithm, max_tokens=8)
    dev, exp = case.prepare(seed, 5)
    res = case.call(dev)
    res = res.copy()
    case.op.synchronize()
    msgs.append(case.check(res, exp, "before close"))
    case.op.close()
    case.op.close()
    if case.op.poisoned:
        msgs.append("a closed workspace reports poisoned")
    for what, thunk in (
        ("call", lambda: case.call(dev)),
        ("call with out=", lambda: case.call(dev, out=case.poisoned_out(5))),
        ("synchronize", case.op.synchronize),
    ):
        try:
            thunk()
            msgs.append(f"{what} after close did not raise")
        except ClosedError:
            pass
        except Exception as e:  # noqa: BLE001
            msgs.append(f"{what} after close raised {type(e).__name__}: {e}")
    # A fresh workspace works after the closed ones.
    again = _case(comm, name, algorithm, max_tokens=8)
    msgs.append(_one_checked_call(again, dev, exp, 5, "fresh workspace after close"))
    again.op.close()
    _fail_if_any(comm, msgs, f"{case.label} teardown")


def test_close_memory_returned(comm, seed):
    """Building and closing workspaces repeatedly returns their GPU memory (free memory and
    open fds flat over 10 build/close rounds of all three ops)."""
    from soak import resource_sample

    def round_trip(i):
        cs = [OpCase(n, comm, max_tokens=64) for n in OPS]
        for c in cs:
            dev, _ = c.prepare(seed + i, 3)
            c.call(dev)
            c.op.synchronize()
        for c in cs:
            c.op.close()

    round_trip(0)
    start = resource_sample()
    for i in range(1, 11):
        round_trip(i)
    end = resource_sample()
    msgs = []
    lost = start["mem_free_bytes"] - end["mem_free_bytes"]
    if lost > 16 << 20:
        msgs.append(
            f"GPU free memory dropped by {lost} bytes over 10 build/close rounds ({start} -> {end})"
        )
    if end["fds"] > start["fds"] + 2:
        msgs.append(f"open fds grew over 10 build/close rounds: {start['fds']} -> {end['fds']}")
    _report(comm, {"test": "build_close_rounds", "rounds": 10, "start": start, "end": end})
    _fail_if_any(comm, msgs, "build/close rounds")
