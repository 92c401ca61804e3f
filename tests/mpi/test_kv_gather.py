"""KVGather on GPUs, push and pull: bit-exact against dcpkit.reference.kv_gather_reference.

Run (every rank runs every test in the same order)::

    mpirun -np 2 python -m pytest tests/mpi/test_kv_gather.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_kv_gather.py -p no:cacheprovider

Each rank rebuilds every peer's input from the shared seed, computes the reference locally and
checks its own result byte for byte; outputs and workspace slots are poisoned with 0xFF bytes
first. Replay a failure with ``DCPKIT_TEST_SEED``.
"""

import numpy as np
import pytest

from dcpkit.ops.kv_gather import KVGather
from dcpkit.reference import kv_gather_reference, make_inputs, resolve_dtype

from _gather_checks import (
    all_poison,
    bits,
    byte_mismatch,
    check_programmatic,
    poison_workspace,
    poisoned_empty,
    run_collective,
    spin,
    sub_seed,
    to_device,
    to_host,
)

D_KV, T_MAX = 64, 32
DTYPES = ["bfloat16", "float16", "float32", "uint8"]  # uint8 = fp8 carried as bytes
ALGORITHMS = ["push", "pull"]


def _inputs(comm, seed, T, dtype, row_dim=D_KV):
    """Every rank's kv for one call, and the reference result."""
    W = comm.world_size
    kvs = [
        make_inputs(s, W, seed, op="kv_gather", tokens=T, row_dim=row_dim, dtype=dtype)["kv"]
        for s in range(W)
    ]
    return kvs[comm.rank], kv_gather_reference(kvs)


def _check_path(ws, algorithm, errors):
    if (
        ws.algorithm != algorithm
        or ws.transport != "unicast"
        or ws.multicast
        or ws.launches_per_call != 1
    ):
        errors.append(
            f"expected the unicast {algorithm} variant, one launch per call (got "
            f"algorithm {ws.algorithm}, transport {ws.transport}, multicast "
            f"{ws.multicast}, launches_per_call {ws.launches_per_call})"
        )


def _call_checked(ws, kv, want, mode, what, errors):
    """One call in ``mode`` ("view" or "out"), checked byte for byte (consumed at once)."""
    W = ws.world_size
    rows = want.shape[0]
    if mode == "out":
        full = poisoned_empty((rows + 2, ws.row_dim), ws.dtype)  # a poisoned row either side
        out = full[1 : 1 + rows]
        res = ws(to_device(kv), out=out)
        if res is not out:
            errors.append(f"{what}: the result is not out")
        err = byte_mismatch(to_host(out), want, what)
        err = err or all_poison(full[:1], f"{what}: row before out")
        err = err or all_poison(full[1 + rows :], f"{what}: row after out")
    else:
        res = ws(to_device(kv))
        if res.shape != (W * kv.shape[0], ws.row_dim) or not res.flags.c_contiguous:
            errors.append(f"{what}: view shape {res.shape}, strides {res.strides}")
            return
        err = byte_mismatch(to_host(res), want, what)
    if err:
        errors.append(err)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_gather_bit_exact(comm, seed, dtype, algorithm):
    """T in {1, 5, 17, T_max} x {zero-copy view, out=}."""
    r = comm.rank

    def body(errors):
        with KVGather(comm, max_tokens=T_MAX, row_dim=D_KV, dtype=dtype, algorithm=algorithm) as ws:
            _check_path(ws, algorithm, errors)
            poison_workspace(ws, comm)
            call = 0
            for T in (1, 5, 17, T_MAX):
                for mode in ("view", "out", "view"):
                    call += 1
                    kv, want = _inputs(comm, sub_seed(seed, call), T, dtype)
                    _call_checked(
                        ws,
                        kv,
                        want,
                        mode,
                        f"rank {r} {algorithm} {dtype} T={T} {mode} call {call}",
                        errors,
                    )

    run_collective(comm, f"kv_gather bit-exact {dtype} {algorithm}", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_sizes(comm, seed, algorithm):
    """4 KiB to 4 MiB per rank (bf16 rows of 1 KiB), view and out=, each size twice."""
    r = comm.rank

    def body(errors):
        with KVGather(
            comm, max_tokens=4096, row_dim=512, dtype="bfloat16", algorithm=algorithm
        ) as ws:
            poison_workspace(ws, comm)
            for i, T in enumerate((4, 64, 1024, 4096, 3, 4096, 1024, 64, 4)):
                kv, want = _inputs(comm, sub_seed(seed, i), T, "bfloat16", row_dim=512)
                _call_checked(
                    ws,
                    kv,
                    want,
                    ("view", "out")[i % 2],
                    f"rank {r} {algorithm} {T} KiB per rank call {i}",
                    errors,
                )

    run_collective(comm, f"kv_gather sizes {algorithm}", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_two_ubatches_interleaved_with_lse_reduce(comm, seed, algorithm):
    """Calls of ubatch 0, ubatch 1 and an LseReduce workspace interleaved on one stream."""
    from dcpkit.ops.lse_reduce import LseReduce
    from dcpkit.reference import lse_reduce_reference, lse_reduce_tolerance

    W, r = comm.world_size, comm.rank
    H, Dv, T = 4 * W, 64, 9

    def body(errors):
        with (
            KVGather(
                comm,
                max_tokens=T_MAX,
                row_dim=D_KV,
                dtype="bfloat16",
                num_ubatches=2,
                algorithm=algorithm,
            ) as ws,
            LseReduce(comm, max_tokens=T_MAX, num_heads=H, head_dim=Dv, dtype="bfloat16") as lr,
        ):
            poison_workspace(ws, comm)
            for i in range(6):
                kv0, want0 = _inputs(comm, sub_seed(seed, i, 0), T, "bfloat16")
                kv1, want1 = _inputs(comm, sub_seed(seed, i, 1), T + 3, "bfloat16")
                lse_in = [
                    make_inputs(
                        s,
                        W,
                        sub_seed(seed, i, 2),
                        op="lse_reduce",
                        tokens=T,
                        num_heads=H,
                        head_dim=Dv,
                        dtype="bfloat16",
                    )
                    for s in range(W)
                ]
                a0 = ws(to_device(kv0), ubatch=0)
                res = lr(to_device(lse_in[r]["out_partial"]), to_device(lse_in[r]["lse_partial"]))
                a1 = ws(to_device(kv1), ubatch=1)
                for err in (
                    byte_mismatch(to_host(a0), want0, f"rank {r} iter {i} ubatch 0"),
                    byte_mismatch(to_host(a1), want1, f"rank {r} iter {i} ubatch 1"),
                ):
                    if err:
                        errors.append(err)
                got = to_host(res[0] if isinstance(res, tuple) else res).astype(np.float64)
                want, _ = lse_reduce_reference(
                    [x["out_partial"] for x in lse_in], [x["lse_partial"] for x in lse_in]
                )
                H_r = H // W
                want = want[:, r * H_r : (r + 1) * H_r]
                diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else np.inf
                if not diff <= lse_reduce_tolerance("bfloat16"):
                    errors.append(
                        f"rank {r} iter {i}: the interleaved lse_reduce result is off "
                        f"by {diff} (shape {got.shape}); an LseReduce failure, not a "
                        f"kv_gather one"
                    )

    run_collective(comm, f"kv_gather {algorithm} ubatches interleaved with lse_reduce", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_graph_replays(comm, seed, algorithm):
    """1000 replays of a graph with two kv_gather calls (graph output and out=), the inputs
    refreshed in place with fresh data before every replay; checked at intervals and at the
    end; then eager calls after the capture (copy-out into the workspace output buffers)."""
    import cupy

    W, r = comm.world_size, comm.rank
    T = 6
    dt = resolve_dtype("bfloat16")
    REPLAYS = 1000
    checked = {0, 1, REPLAYS - 1} | set(range(99, REPLAYS, 100))

    def own(seed_):
        return make_inputs(r, W, seed_, op="kv_gather", tokens=T, row_dim=D_KV, dtype="bfloat16")[
            "kv"
        ]

    def body(errors):
        with KVGather(
            comm, max_tokens=8, row_dim=D_KV, dtype="bfloat16", algorithm=algorithm
        ) as ws:
            s = cupy.cuda.Stream(non_blocking=True)
            ka = poisoned_empty((T, D_KV), dt)
            kb = poisoned_empty((T, D_KV), dt)
            out_b = poisoned_empty((W * T, D_KV), dt)
            with s:
                ws(ka, stream=s)  # the first call of a workspace is never captured
                s.synchronize()
                s.begin_capture()
                res_a = ws(ka, stream=s)
                res_b = ws(kb, out=out_b, stream=s)
                graph = s.end_capture()
            if res_b is not out_b:
                errors.append("graph: the out= call did not return out")
            if res_a.data.ptr in {ws.data_slot_ptr(0, k) for k in range(3)}:
                errors.append(
                    "graph: a captured call returned a slot view (must be the graph output buffer)"
                )
            for i in range(REPLAYS):
                sa, sb = sub_seed(seed, i, 0), sub_seed(seed, i, 1)
                bits(ka).set(bits(own(sa)), stream=s)
                bits(kb).set(bits(own(sb)), stream=s)
                graph.launch(s)
                if i in checked:
                    s.synchronize()
                    _, want_a = _inputs(comm, sa, T, "bfloat16")
                    _, want_b = _inputs(comm, sb, T, "bfloat16")
                    for err in (
                        byte_mismatch(to_host(res_a), want_a, f"rank {r} replay {i} graph output"),
                        byte_mismatch(to_host(out_b), want_b, f"rank {r} replay {i} out="),
                    ):
                        if err:
                            errors.append(err)
            s.synchronize()
            for j in range(4):  # eager after capture: copy-out, two alternating buffers
                kv, want = _inputs(comm, sub_seed(seed, REPLAYS, j), T, "bfloat16")
                res = ws(to_device(kv))
                if res.data.ptr in {ws.data_slot_ptr(0, k) for k in range(3)}:
                    errors.append(f"eager call {j} after capture returned a slot view")
                err = byte_mismatch(to_host(res), want, f"rank {r} eager call {j} after capture")
                if err:
                    errors.append(err)

    run_collective(comm, f"kv_gather {algorithm} graph replays", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_view_lifetime(comm, seed, algorithm):
    """A view of call n consumed on the stream after call n+1 (while rank 0's stream is held back
    by a 20 ms spin, so the peers run ahead into call n+2) is intact; call n+3 reuses its
    storage (the rule 'consume before call n+2 is issued' is tight)."""
    r = comm.rank
    T = 17

    def body(errors):
        with KVGather(
            comm, max_tokens=T_MAX, row_dim=D_KV, dtype="bfloat16", algorithm=algorithm
        ) as ws:
            for rnd in range(3):
                ins = [_inputs(comm, sub_seed(seed, rnd, n), T, "bfloat16") for n in range(4)]
                kvs = [to_device(kv) for kv, _ in ins]
                a = ws(kvs[0])  # call n
                b = ws(kvs[1])  # call n+1
                if r == 0:
                    spin(20_000_000)  # peers go ahead into call n+2
                a_copy = bits(a).copy()  # consume A after call n+1
                c = ws(kvs[2])  # call n+2
                b_copy = bits(b).copy()  # consume B after call n+2
                d = ws(kvs[3])  # call n+3
                got = [a_copy.view(a.dtype), b_copy.view(b.dtype), c, d]
                for n in range(4):
                    err = byte_mismatch(
                        to_host(got[n]), ins[n][1], f"rank {r} {algorithm} round {rnd} call n+{n}"
                    )
                    if err:
                        errors.append(err)
                ptrs = [x.data.ptr for x in (a, b, c, d)]
                if len(set(ptrs[:3])) != 3 or ptrs[3] != ptrs[0]:
                    errors.append(
                        f"views of calls n..n+3 must use 3 slots in turn (got "
                        f"{[hex(p) for p in ptrs]})"
                    )

    run_collective(comm, f"kv_gather {algorithm} view lifetime", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_epoch_wrap(comm, seed, algorithm):
    """Calls across the 32-bit wrap of the signals (epoch 2**32 - 3 onwards)."""
    r = comm.rank

    def body(errors):
        with KVGather(
            comm, max_tokens=T_MAX, row_dim=D_KV, dtype="float16", algorithm=algorithm
        ) as ws:
            ws._set_epoch(2**32 - 3)
            for i in range(8):
                T = (5, 17)[i % 2]
                kv, want = _inputs(comm, sub_seed(seed, i), T, "float16")
                _call_checked(
                    ws,
                    kv,
                    want,
                    ("view", "view", "out")[i % 3],
                    f"rank {r} {algorithm} call {i} (epoch {2**32 - 3 + i + 1})",
                    errors,
                )
            epoch = int(ws._epoch[0].get())
            if epoch != 2**32 - 3 + 8:
                errors.append(f"device epoch {epoch} after 8 calls from 2**32 - 3")

    run_collective(comm, f"kv_gather {algorithm} epoch wrap", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_timeout_names_silent_peer(comm, seed, algorithm):
    """Rank 0 skips a call: every other rank's wait expires without hanging or killing the
    context, synchronize() raises CollectiveTimeout naming peer 0, and the next call raises
    before it launches."""
    import cupy

    from dcpkit.errors import CollectiveTimeout

    r = comm.rank

    def body(errors):
        with KVGather(
            comm, max_tokens=8, row_dim=D_KV, dtype="float16", algorithm=algorithm, timeout_ms=300
        ) as ws:
            kv, _ = _inputs(comm, sub_seed(seed, 0), 3, "float16")
            kv = to_device(kv)
            if r != 0:
                ws(kv, out=poisoned_empty((3 * comm.world_size, D_KV), ws.dtype))
                try:
                    ws.synchronize()
                    errors.append("synchronize() did not raise CollectiveTimeout")
                except CollectiveTimeout as e:
                    if (e.peer, e.rank, e.op, e.expected_epoch) != (0, r, "kv_gather", 1):
                        errors.append(
                            f"timeout record names peer {e.peer}, rank {e.rank}, op "
                            f"{e.op}, expected epoch {e.expected_epoch}"
                        )
                calls = list(ws._calls)
                try:
                    ws(kv)
                    errors.append("a call on a poisoned workspace did not raise")
                except CollectiveTimeout:
                    pass
                if ws._calls != calls:
                    errors.append("a rejected call advanced the call count")
                if float(cupy.arange(4, dtype=cupy.float32).sum()) != 6.0:
                    errors.append("the CUDA context is not usable after the timeout")
            cupy.cuda.runtime.deviceSynchronize()
            comm.barrier()

    run_collective(comm, f"kv_gather {algorithm} timeout", body)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_kv_gather_programmatic_launch(comm, seed, algorithm):
    """programmatic_launch=True behind a producer that lets the next kernel launch at once and
    writes kv only 30 us later: every eager call and graph replay reads the producer's kv."""
    W = comm.world_size

    def body(errors):
        with KVGather(
            comm,
            max_tokens=T_MAX,
            row_dim=D_KV,
            dtype="bfloat16",
            algorithm=algorithm,
            programmatic_launch=True,
        ) as ws:
            for T in (1, T_MAX):
                out = poisoned_empty((W * T, D_KV), resolve_dtype("bfloat16"))

                def inputs(k, T=T):
                    return _inputs(comm, sub_seed(seed, 78, T, k), T, "bfloat16")

                def call(x, s, out=out):
                    return ws(x, out=out, stream=s)

                def check(res, want, where, T=T):
                    return byte_mismatch(to_host(res), want, f"kv_gather T={T}, {where}")

                check_programmatic(errors, call, inputs, 4, f"kv_gather T={T}", check, (out,))

    run_collective(comm, f"kv_gather ({algorithm}) with programmatic_launch", body)
