"""Zero-copy graph outputs of the push gathers on GPUs (NOTE [dcpkit zero-copy graph outputs] in
kernels/gather.cuh): a call captured without ``out=`` returns its own graph output buffer, and
every rank stores straight into it after the receiving rank's credit.

Run (every rank runs every test in the same order)::

    mpirun -np 2 python -m pytest tests/mpi/test_graph_outputs.py -p no:cacheprovider

Inputs are fresh for every replay and rebuilt on every rank from the shared seed; results are
checked byte for byte against dcpkit.reference. Replay a failure with ``DCPKIT_TEST_SEED``.
"""

import time

import numpy as np
import pytest

from dcpkit.errors import ConfigMismatch
from dcpkit.ops.kv_gather import KVGather
from dcpkit.ops.q_gather import QGather
from dcpkit.reference import kv_gather_reference, make_inputs, q_gather_reference, resolve_dtype

from _gather_checks import (
    bits,
    byte_mismatch,
    poisoned_empty,
    run_collective,
    spin,
    sub_seed,
    to_host,
)

H_R, D, D_KV = 4, 64, 128
DT = resolve_dtype("bfloat16")
#: Tokens per call: 20 KiB per rank for q_gather (H_R * D * 2 bytes a token), 18 KiB for
#: kv_gather, above ZERO_COPY_MIN_BYTES, so that the captured view form is zero copy; SMALL_T
#: (below it) copies out into the graph output buffer.
TOKENS = {"q_gather": 40, "kv_gather": 72}
SMALL_T = 5
#: How long rank 0 holds its stream between a call and its read of the result (ns): the other
#: ranks' next replay starts meanwhile, and must not store into rank 0's buffer before its read.
HOLD_NS = 300_000
#: A mismatch must surface in about one call, not after a wait deadline.
HANG_S = 10.0


class _Case:
    """One push gather (q_gather or kv_gather) and its inputs."""

    def __init__(self, name, comm, T=None, **kw):
        self.name, self.comm = name, comm
        self.T = T = TOKENS[name] if T is None else T
        W = comm.world_size
        if name == "q_gather":
            self.op = QGather(
                comm, max_tokens=128, heads_per_rank=H_R, head_dim=D, dtype="bfloat16", **kw
            )
            self.own_shape, self.out_shape = (T, H_R, D), (T, H_R * W, D)
        else:
            self.op = KVGather(comm, max_tokens=128, row_dim=D_KV, dtype="bfloat16", **kw)
            self.own_shape, self.out_shape = (T, D_KV), (W * T, D_KV)
        self.zero_copy = self.op._zero_copy_graph(T)

    def inputs(self, seed):
        """(this rank's input, the reference result) of one call."""
        W, T = self.comm.world_size, self.T
        if self.name == "q_gather":
            xs = [
                make_inputs(
                    s,
                    W,
                    seed,
                    op="q_gather",
                    tokens=T,
                    num_heads=H_R * W,
                    head_dim=D,
                    dtype="bfloat16",
                )["q"]
                for s in range(W)
            ]
            return xs[self.comm.rank], q_gather_reference(xs)
        xs = [
            make_inputs(s, W, seed, op="kv_gather", tokens=T, row_dim=D_KV, dtype="bfloat16")["kv"]
            for s in range(W)
        ]
        return xs[self.comm.rank], kv_gather_reference(xs)


def _replay_and_check(case, graph, res, s, keys, n, label, errors):
    """``n`` replays of ``graph``, each with fresh inputs (seed ``sub_seed(*keys, i)``) and a
    synchronisation; ``res`` checked against the reference after each."""
    for i in range(n):
        own, want = case.inputs(sub_seed(*keys, i))
        with s:
            bits(case.x).set(bits(own), stream=s)
            graph.launch(s)
        s.synchronize()
        err = byte_mismatch(to_host(res), want, f"{label} replay {i}")
        if err:
            errors.append(err)


def _slots(op):
    return {op.data_slot_ptr(u, k) for u in range(op.num_ubatches) for k in range(3)}


@pytest.mark.parametrize("name", ["q_gather", "kv_gather"])
def test_graph_output_waits_for_its_reader(comm, seed, name):
    """A graph of [call (view form), rank 0 holds its stream, copy of the result], replayed with
    fresh inputs and no host synchronisation in between, so that the other ranks run ahead into
    the next replay while rank 0 has not read its result yet: every read sees its own replay's
    result (the peers stored into rank 0's buffer only after its credit)."""
    import cupy

    r = comm.rank
    replays = 40

    def body(errors):
        case = _Case(name, comm)
        if not case.zero_copy:
            errors.append(f"T={case.T} does not take the zero-copy graph path")
        with case.op as op:
            s = cupy.cuda.Stream(non_blocking=True)
            x = poisoned_empty(case.own_shape, DT)
            snap = poisoned_empty(case.out_shape, DT)
            with s:
                op(x, stream=s)  # the first call of a workspace is never captured
                s.synchronize()
                s.begin_capture()
                res = op(x, stream=s)
                if r == 0:
                    spin(HOLD_NS, s)
                bits(snap)[...] = bits(res)
                graph = s.end_capture()
            if res.data.ptr in _slots(op):
                errors.append("the captured call returned a data slot, not its graph output")
            reads = [poisoned_empty(case.out_shape, DT) for _ in range(replays)]
            wants = []
            with s:
                for i in range(replays):
                    own, want = case.inputs(sub_seed(seed, i))
                    wants.append(want)
                    bits(x).set(bits(own), stream=s)
                    graph.launch(s)
                    bits(reads[i])[...] = bits(snap)
            s.synchronize()
            for i in range(replays):
                err = byte_mismatch(to_host(reads[i]), wants[i], f"rank {r} replay {i}")
                if err:
                    errors.append(err)
                    break

    run_collective(comm, f"{name} zero-copy graph output read after a held stream", body)


@pytest.mark.parametrize("name", ["q_gather", "kv_gather"])
def test_graph_output_mode_mismatch_is_reported_on_every_rank(comm, seed, name):
    """Rank 0 captures the view form (zero copy into its graph output), the others ``out=``:
    the first replay raises ConfigMismatch on every rank, naming the mode, within about one
    call; every result holds the poison pattern."""
    import cupy

    r = comm.rank

    def body(errors):
        case = _Case(name, comm, timeout_ms=20000.0)
        if not case.zero_copy:
            errors.append(f"T={case.T} does not take the zero-copy graph path")
        with case.op as op:
            s = cupy.cuda.Stream(non_blocking=True)
            own, _ = case.inputs(sub_seed(seed, 7))
            x = poisoned_empty(case.own_shape, DT)
            out = poisoned_empty(case.out_shape, DT)
            with s:
                bits(x).set(bits(own), stream=s)
                op(x, stream=s)
                s.synchronize()
                s.begin_capture()
                res = op(x, stream=s) if r == 0 else op(x, out=out, stream=s)
                graph = s.end_capture()
            comm.barrier()
            t0 = time.monotonic()
            graph.launch(s)
            try:
                op.synchronize(s)
                errors.append("no ConfigMismatch after the replay")
            except ConfigMismatch as e:
                text = str(e)
                for frag in ("zero-copy graph output=yes on rank 0", "zero-copy graph output=no"):
                    if frag not in text:
                        errors.append(f"ConfigMismatch lacks {frag!r}: {text}")
            if time.monotonic() - t0 > HANG_S:
                errors.append(f"the mismatch took {time.monotonic() - t0:.1f} s to surface")
            if not op.poisoned:
                errors.append("op.poisoned is False after the mismatch")
            got = to_host(res).view(np.uint8)
            if not (got == 0xFF).all():
                errors.append("the result holds data other than the poison pattern")

    run_collective(comm, f"{name} graph output mode mismatch", body)


@pytest.mark.parametrize("name", ["q_gather", "kv_gather"])
def test_released_graph_outputs_serve_the_next_capture(comm, seed, name):
    """graph_outputs=1: a second capture reuses the buffer after release_graph_outputs, and its
    replays are exact (rank 0 releases later than the others: each rank names its own buffer)."""
    import cupy

    r = comm.rank

    def body(errors):
        case = _Case(name, comm, graph_outputs=1)
        with case.op as op:
            s = cupy.cuda.Stream(non_blocking=True)
            x = poisoned_empty(case.own_shape, DT)
            with s:
                op(x, stream=s)
                s.synchronize()
            case.x = x
            ptrs = []
            for g in range(2):
                if r == 0:
                    time.sleep(0.05)
                if g:
                    op.release_graph_outputs()
                with s:
                    s.begin_capture()
                    res = op(x, stream=s)
                    graph = s.end_capture()
                ptrs.append(res.data.ptr)
                _replay_and_check(case, graph, res, s, (seed, g), 3, f"rank {r} graph {g}", errors)
                del graph
            if ptrs[0] != ptrs[1]:
                errors.append(f"the released buffer was not reused ({ptrs[0]:#x}, {ptrs[1]:#x})")

    run_collective(comm, f"{name} released graph outputs", body)


@pytest.mark.parametrize("name", ["q_gather", "kv_gather"])
def test_small_graph_calls_copy_out_and_mix_forms(comm, seed, name):
    """Below ZERO_COPY_MIN_BYTES a captured view-form call copies out into its graph output
    buffer, so rank 0's view form and the other ranks' ``out=`` work together: every replay is
    exact on every rank."""
    import cupy

    r = comm.rank

    def body(errors):
        case = _Case(name, comm, T=SMALL_T)
        if case.zero_copy:
            errors.append(f"T={SMALL_T} takes the zero-copy graph path")
        with case.op as op:
            s = cupy.cuda.Stream(non_blocking=True)
            x = poisoned_empty(case.own_shape, DT)
            out = poisoned_empty(case.out_shape, DT)
            with s:
                op(x, stream=s)
                s.synchronize()
                s.begin_capture()
                res = op(x, stream=s) if r == 0 else op(x, out=out, stream=s)
                graph = s.end_capture()
            case.x = x
            _replay_and_check(case, graph, res, s, (seed, 11), 4, f"rank {r}", errors)
            if op.poisoned:
                errors.append("the workspace is poisoned")

    run_collective(comm, f"{name} small captured calls, mixed forms", body)


@pytest.mark.parametrize("name", ["q_gather", "kv_gather"])
def test_replays_interleaved_with_eager_calls_of_the_same_ubatch(comm, seed, name):
    """Replays of a zero-copy graph call and eager calls of the same ubatch, in turn (the eager
    calls copy out into the workspace's eager buffers, their kernels post credits that name no
    buffer): every result is exact."""
    import cupy

    r = comm.rank

    def body(errors):
        case = _Case(name, comm)
        with case.op as op:
            s = cupy.cuda.Stream(non_blocking=True)
            x = case.x = poisoned_empty(case.own_shape, DT)
            with s:
                op(x, stream=s)
                s.synchronize()
                s.begin_capture()
                res = op(x, stream=s)
                graph = s.end_capture()
            for i in range(6):
                _replay_and_check(case, graph, res, s, (seed, 21, i), 1, f"rank {r} {i}", errors)
                own, want = case.inputs(sub_seed(seed, 22, i))
                with s:
                    bits(x).set(bits(own), stream=s)
                    eager = op(x, stream=s)
                s.synchronize()
                if eager.data.ptr == res.data.ptr:
                    errors.append("an eager call returned the graph output buffer")
                err = byte_mismatch(to_host(eager), want, f"rank {r} eager call {i}")
                if err:
                    errors.append(err)

    run_collective(comm, f"{name} replays and eager calls in turn", body)
