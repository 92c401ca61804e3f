"""QGather on GPUs: bit-exact against dcpkit.reference.q_gather_reference.

Run (every rank runs every test in the same order)::

    mpirun -np 2 python -m pytest tests/mpi/test_q_gather.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_q_gather.py -p no:cacheprovider

Each rank rebuilds every peer's input from the shared seed, computes the reference locally and
checks its own result byte for byte; outputs and workspace slots are poisoned with 0xFF bytes
first. Replay a failure with ``DCPKIT_TEST_SEED``.
"""

import numpy as np
import pytest

from dcpkit.ops.q_gather import QGather
from dcpkit.reference import make_inputs, q_gather_reference, resolve_dtype

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

H_R, D, T_MAX = 4, 64, 32
DTYPES = ["bfloat16", "float16", "float32", "uint8"]  # uint8 = fp8 carried as bytes


def _inputs(comm, seed, T, dtype, H=None, head_dim=D):
    """Every rank's q for one call, and the reference result."""
    W = comm.world_size
    H = H_R * W if H is None else H
    qs = [
        make_inputs(
            s, W, seed, op="q_gather", tokens=T, num_heads=H, head_dim=head_dim, dtype=dtype
        )["q"]
        for s in range(W)
    ]
    return qs[comm.rank], q_gather_reference(qs)


def _place(q: np.ndarray, layout: str):
    """``q`` on the device in the given storage layout (the op reads it in place)."""
    T, h, d = q.shape
    if layout == "contiguous":
        return to_device(q)
    if layout == "padded_heads":  # q = x[:, 1:1+H_r] of a [T, H_r+2, D] array
        x = poisoned_empty((T, h + 2, d), q.dtype)
        bits(x)[:, 1 : 1 + h] = bits(to_device(q))
        return x[:, 1 : 1 + h]
    if layout == "token_strided":  # every other token of a [2T, H_r, D] array
        x = poisoned_empty((2 * T, h, d), q.dtype)
        bits(x)[::2] = bits(to_device(q))
        return x[::2]
    raise AssertionError(layout)


def _check_path(ws, errors):
    if ws.transport != "unicast" or ws.multicast or ws.launches_per_call != 1:
        errors.append(
            f"expected the unicast variant, one launch per call (got transport "
            f"{ws.transport}, multicast {ws.multicast}, launches_per_call "
            f"{ws.launches_per_call})"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_q_gather_bit_exact(comm, seed, dtype):
    """T in {1, 5, 17, T_max} x input storage x {zero-copy view, padded view, out=}."""
    W, r = comm.world_size, comm.rank
    dt = resolve_dtype(dtype)
    H = H_R * W
    H_PAD = H + 4

    def body(errors):
        with QGather(
            comm,
            max_tokens=T_MAX,
            heads_per_rank=H_R,
            head_dim=D,
            dtype=dtype,
            padded_num_heads=H_PAD,
        ) as ws:
            _check_path(ws, errors)
            poison_workspace(ws, comm)
            call = 0
            for T in (1, 5, 17, T_MAX):
                for layout in ("contiguous", "padded_heads", "token_strided"):
                    for mode in ("view", "padded_view", "out"):
                        call += 1
                        q, want = _inputs(comm, sub_seed(seed, call), T, dtype)
                        what = f"rank {r} dtype {dtype} T={T} {layout} {mode}"
                        qd = _place(q, layout)
                        if mode == "out":
                            out_full = poisoned_empty((T, H + 3, D), dt)
                            res = ws(qd, out=out_full[:, :H])
                            if res.data.ptr != out_full.data.ptr:
                                errors.append(f"{what}: the result is not out")
                            err = byte_mismatch(to_host(out_full[:, :H]), want, what)
                            err = err or all_poison(out_full[:, H:], f"{what}: out padding")
                        elif mode == "padded_view":
                            res = ws(qd, return_padded=True)
                            if res.shape != (T, H_PAD, D):
                                errors.append(f"{what}: padded view shape {res.shape}")
                                continue
                            err = byte_mismatch(to_host(res[:, :H]), want, what)
                            err = err or all_poison(res[:, H:], f"{what}: pad heads [H, H_pad)")
                        else:
                            res = ws(qd)
                            if res.shape != (T, H, D) or res.strides[0] != H_PAD * D * dt.itemsize:
                                errors.append(
                                    f"{what}: view shape {res.shape} strides {res.strides}"
                                )
                                continue
                            err = byte_mismatch(to_host(res), want, what)
                        if err:
                            errors.append(err)

    run_collective(comm, f"q_gather bit-exact {dtype}", body)


def test_q_gather_dcp_geometry(comm, seed):
    """The DCP decode shape: H = 128, D = 576, bf16, T in {1, 8} (36 KiB per rank at W = 4)."""
    W, r = comm.world_size, comm.rank
    if 128 % W:
        pytest.skip(f"H = 128 does not split over world_size {W}")

    def body(errors):
        with QGather(
            comm, max_tokens=8, heads_per_rank=128 // W, head_dim=576, dtype="bfloat16"
        ) as ws:
            poison_workspace(ws, comm)
            for i, T in enumerate((1, 8, 1, 8)):
                q, want = _inputs(comm, sub_seed(seed, i), T, "bfloat16", H=128, head_dim=576)
                if i < 2:
                    err = byte_mismatch(to_host(ws(to_device(q))), want, f"rank {r} T={T} view")
                else:
                    out = poisoned_empty((T, 128, 576), resolve_dtype("bfloat16"))
                    ws(to_device(q), out=out)
                    err = byte_mismatch(to_host(out), want, f"rank {r} T={T} out")
                if err:
                    errors.append(err)

    run_collective(comm, "q_gather DCP geometry", body)


def test_q_gather_two_ubatches_interleaved_with_lse_reduce(comm, seed):
    """Calls of ubatch 0, ubatch 1 and an LseReduce workspace interleaved on one stream."""
    from dcpkit.ops.lse_reduce import LseReduce
    from dcpkit.reference import lse_reduce_reference, lse_reduce_tolerance

    W, r = comm.world_size, comm.rank
    H, Dv, T = H_R * W, 64, 7

    def body(errors):
        with (
            QGather(
                comm,
                max_tokens=T_MAX,
                heads_per_rank=H_R,
                head_dim=D,
                dtype="bfloat16",
                num_ubatches=2,
            ) as ws,
            LseReduce(comm, max_tokens=T_MAX, num_heads=H, head_dim=Dv, dtype="bfloat16") as lr,
        ):
            poison_workspace(ws, comm)
            for i in range(6):
                q0, want0 = _inputs(comm, sub_seed(seed, i, 0), T, "bfloat16")
                q1, want1 = _inputs(comm, sub_seed(seed, i, 1), T - 2, "bfloat16")
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
                a0 = ws(to_device(q0), ubatch=0)
                res = lr(to_device(lse_in[r]["out_partial"]), to_device(lse_in[r]["lse_partial"]))
                a1 = ws(to_device(q1), ubatch=1)
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
                want = want[:, r * H_R : (r + 1) * H_R]
                diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else np.inf
                if not diff <= lse_reduce_tolerance("bfloat16"):
                    errors.append(
                        f"rank {r} iter {i}: the interleaved lse_reduce result is off "
                        f"by {diff} (shape {got.shape}); an LseReduce failure, not a "
                        f"q_gather one"
                    )

    run_collective(comm, "q_gather ubatches interleaved with lse_reduce", body)


def test_q_gather_graph_replays(comm, seed):
    """1000 replays of a graph with two q_gather calls (graph output and out=), the inputs
    refreshed in place with fresh data before every replay; checked at intervals and at the
    end; then eager calls after the capture (copy-out into the workspace output buffers)."""
    import cupy

    W, r = comm.world_size, comm.rank
    H, T = H_R * W, 5
    dt = resolve_dtype("bfloat16")
    REPLAYS = 1000
    checked = {0, 1, REPLAYS - 1} | set(range(99, REPLAYS, 100))

    def body(errors):
        with QGather(comm, max_tokens=8, heads_per_rank=H_R, head_dim=D, dtype="bfloat16") as ws:
            s = cupy.cuda.Stream(non_blocking=True)
            qa = poisoned_empty((T, H_R, D), dt)
            qb = poisoned_empty((T, H_R, D), dt)
            out_b = poisoned_empty((T, H, D), dt)
            with s:
                ws(qa, stream=s)  # the first call of a workspace is never captured
                s.synchronize()
                s.begin_capture()
                res_a = ws(qa, stream=s)
                res_b = ws(qb, out=out_b, stream=s)
                graph = s.end_capture()
            if res_b is not out_b:
                errors.append("graph: the out= call did not return out")
            if res_a.data.ptr in {ws.data_slot_ptr(0, k) for k in range(3)}:
                errors.append(
                    "graph: a captured call returned a slot view (must be the graph output buffer)"
                )
            for i in range(REPLAYS):
                ka, kb = sub_seed(seed, i, 0), sub_seed(seed, i, 1)
                bits(qa).set(bits(_inputs_own(comm, ka, T)), stream=s)
                bits(qb).set(bits(_inputs_own(comm, kb, T)), stream=s)
                graph.launch(s)
                if i in checked:
                    s.synchronize()
                    _, want_a = _inputs(comm, ka, T, "bfloat16")
                    _, want_b = _inputs(comm, kb, T, "bfloat16")
                    for err in (
                        byte_mismatch(to_host(res_a), want_a, f"rank {r} replay {i} graph output"),
                        byte_mismatch(to_host(out_b), want_b, f"rank {r} replay {i} out="),
                    ):
                        if err:
                            errors.append(err)
            s.synchronize()
            for j in range(4):  # eager after capture: copy-out, two alternating buffers
                q, want = _inputs(comm, sub_seed(seed, REPLAYS, j), T, "bfloat16")
                res = ws(to_device(q))
                if res.data.ptr in {ws.data_slot_ptr(0, k) for k in range(3)}:
                    errors.append(f"eager call {j} after capture returned a slot view")
                err = byte_mismatch(to_host(res), want, f"rank {r} eager call {j} after capture")
                if err:
                    errors.append(err)

    run_collective(comm, "q_gather graph replays", body)


def _inputs_own(comm, seed, T, dtype="bfloat16"):
    return make_inputs(
        comm.rank,
        comm.world_size,
        seed,
        op="q_gather",
        tokens=T,
        num_heads=H_R * comm.world_size,
        head_dim=D,
        dtype=dtype,
    )["q"]


def test_q_gather_view_lifetime(comm, seed):
    """A view of call n consumed on the stream after call n+1 (while rank 0's stream is held back
    by a 20 ms spin, so the peers run ahead into call n+2) is intact; call n+3 reuses its
    storage (the rule 'consume before call n+2 is issued' is tight)."""
    r = comm.rank
    T = 17

    def body(errors):
        with QGather(
            comm, max_tokens=T_MAX, heads_per_rank=H_R, head_dim=D, dtype="bfloat16"
        ) as ws:
            for rnd in range(3):
                ins = [_inputs(comm, sub_seed(seed, rnd, n), T, "bfloat16") for n in range(4)]
                qs = [to_device(q) for q, _ in ins]
                a = ws(qs[0])  # call n
                b = ws(qs[1])  # call n+1
                if r == 0:
                    spin(20_000_000)  # peers go ahead into call n+2
                a_copy = bits(a).copy()  # consume A after call n+1
                c = ws(qs[2])  # call n+2
                b_copy = bits(b).copy()  # consume B after call n+2
                d = ws(qs[3])  # call n+3
                got = [a_copy.view(a.dtype), b_copy.view(b.dtype), c, d]
                for n in range(4):
                    err = byte_mismatch(
                        to_host(got[n]), ins[n][1], f"rank {r} round {rnd} call n+{n}"
                    )
                    if err:
                        errors.append(err)
                ptrs = [x.data.ptr for x in (a, b, c, d)]
                if len(set(ptrs[:3])) != 3 or ptrs[3] != ptrs[0]:
                    errors.append(
                        f"views of calls n..n+3 must use 3 slots in turn (got "
                        f"{[hex(p) for p in ptrs]})"
                    )

    run_collective(comm, "q_gather view lifetime", body)


def test_q_gather_epoch_wrap(comm, seed):
    """Calls across the 32-bit wrap of the signals (epoch 2**32 - 3 onwards)."""
    W, r = comm.world_size, comm.rank
    dt = resolve_dtype("float16")
    H = H_R * W

    def body(errors):
        with QGather(comm, max_tokens=T_MAX, heads_per_rank=H_R, head_dim=D, dtype="float16") as ws:
            ws._set_epoch(2**32 - 3)
            for i in range(8):
                T = (5, 17)[i % 2]
                q, want = _inputs(comm, sub_seed(seed, i), T, "float16")
                if i % 3 == 2:
                    out = poisoned_empty((T, H, D), dt)
                    ws(to_device(q), out=out)
                    got = out
                else:
                    got = ws(to_device(q))
                err = byte_mismatch(
                    to_host(got), want, f"rank {r} call {i} (epoch {2**32 - 3 + i + 1})"
                )
                if err:
                    errors.append(err)
            epoch = int(ws._epoch[0].get())
            if epoch != 2**32 - 3 + 8:
                errors.append(f"device epoch {epoch} after 8 calls from 2**32 - 3")

    run_collective(comm, "q_gather epoch wrap", body)


def test_q_gather_timeout_names_silent_peer(comm, seed):
    """Rank 0 skips a call: every other rank's wait expires without hanging or killing the
    context, synchronize() raises CollectiveTimeout naming peer 0, and the next call raises
    before it launches."""
    import cupy

    from dcpkit.errors import CollectiveTimeout

    r = comm.rank

    def body(errors):
        with QGather(
            comm, max_tokens=8, heads_per_rank=H_R, head_dim=D, dtype="float16", timeout_ms=300
        ) as ws:
            q = to_device(_inputs_own(comm, sub_seed(seed, 0), 3, "float16"))
            if r != 0:
                ws(q)
                try:
                    ws.synchronize()
                    errors.append("synchronize() did not raise CollectiveTimeout")
                except CollectiveTimeout as e:
                    if (e.peer, e.rank, e.op, e.expected_epoch) != (0, r, "q_gather", 1):
                        errors.append(
                            f"timeout record names peer {e.peer}, rank {e.rank}, op "
                            f"{e.op}, expected epoch {e.expected_epoch}"
                        )
                calls = list(ws._calls)
                try:
                    ws(q)
                    errors.append("a call on a poisoned workspace did not raise")
                except CollectiveTimeout:
                    pass
                if ws._calls != calls:
                    errors.append("a rejected call advanced the call count")
                if float(cupy.arange(4, dtype=cupy.float32).sum()) != 6.0:
                    errors.append("the CUDA context is not usable after the timeout")
            cupy.cuda.runtime.deviceSynchronize()
            comm.barrier()

    run_collective(comm, "q_gather timeout", body)


def test_q_gather_programmatic_launch(comm, seed):
    """programmatic_launch=True behind a producer that lets the next kernel launch at once and
    writes q only 30 us later: every eager call and graph replay reads the producer's q."""
    W = comm.world_size
    H = H_R * W

    def body(errors):
        with QGather(
            comm,
            max_tokens=T_MAX,
            heads_per_rank=H_R,
            head_dim=D,
            dtype="bfloat16",
            programmatic_launch=True,
        ) as ws:
            # out= (copy-out in a graph), and the view form: a zero-copy slot view eager and,
            # at T_MAX (16 KiB per rank), a zero-copy graph output buffer after the credits.
            for form, T in (("out=", 1), ("out=", 17), ("view", T_MAX)):
                out = poisoned_empty((T, H, D), resolve_dtype("bfloat16"))

                def inputs(k, T=T):
                    return _inputs(comm, sub_seed(seed, 77, T, k), T, "bfloat16")

                def call(x, s, out=out if form == "out=" else None):
                    return ws(x, out=out, stream=s)

                def check(res, want, where, T=T):
                    return byte_mismatch(to_host(res), want, f"q_gather T={T}, {where}")

                what = f"q_gather T={T} {form}"
                check_programmatic(errors, call, inputs, 4, what, check, (out,))

    run_collective(comm, "q_gather with programmatic_launch", body)
