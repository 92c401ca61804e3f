"""The NCCL ops (dcpkit.fallback) on GPUs: bit-exact gathers, lse_reduce within tolerance for
all three algorithms, strided inputs and outputs, T past the buffer capacity, the output
lifetime rule, CUDA graph capture, and errors raised on every rank before any NCCL call.

Run (every rank runs every test in the same order)::

    mpirun -np 2 python -m pytest tests/mpi/test_fallback.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_fallback.py -p no:cacheprovider

Inputs are fresh every run (``seed`` fixture; replay with ``DCPKIT_TEST_SEED``); outputs and
workspace buffers are poisoned (all bits set) before each call.

Every test here needs NCCL: where ranks share a GPU (NCCL needs one GPU per rank) the whole
module is skipped with that reason (the ``nccl_usable`` fixture of conftest.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dcpkit.errors import InvalidArgument, InvalidType
from dcpkit.fallback import LSE_ALGORITHMS, NcclGroup, NcclKVGather, NcclLseReduce, NcclQGather
from dcpkit.reference import resolve_dtype

from _dcp_checks import (
    KVCase,
    LseCase,
    QCase,
    bits,
    empty_poisoned,
    poison,
    poison_nccl_outputs,
    run_all_ranks,
    sub_seed,
    to_gpu,
)

cupy = pytest.importorskip("cupy")

T_MAX = 16

pytestmark = pytest.mark.usefixtures("nccl_usable")


@pytest.fixture(scope="module")
def group(comm, nccl_usable):
    """One NCCL communicator shared by every op of this module (needs one GPU per rank)."""
    g = NcclGroup(comm)
    yield g
    g.close()


def _place(a, layout: str):
    """``a`` (device, 3-D) in the given storage: contiguous, padded heads, every other token."""
    if layout == "contiguous":
        return a
    T, h, d = a.shape
    if layout == "padded_heads":
        x = empty_poisoned((T, h + 2, d), a.dtype)
        bits(x)[:, 1 : 1 + h] = bits(a)
        return x[:, 1 : 1 + h]
    x = empty_poisoned((2 * T, h, d), a.dtype)
    bits(x)[::2] = bits(a)
    return x[::2]


# ----------------------------------------------------------------------------- q_gather
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "uint8"])
def test_nccl_q_gather_bit_exact(comm, seed, group, dtype):
    """T in {1, 5, T_max} x q storage x {workspace view, out=, strided out=}; path recorded."""
    H_r, D = 4, 64
    H = H_r * comm.world_size

    def body(errors):
        with NcclQGather(
            comm, max_tokens=T_MAX, heads_per_rank=H_r, head_dim=D, dtype=dtype, nccl_group=group
        ) as op:
            if op.path != "nccl" or op.algorithm != "all_gather":
                errors.append(f"path {op.path!r} / algorithm {op.algorithm!r}")
            k = 0
            for T in (1, 5, T_MAX):
                for layout in ("contiguous", "padded_heads", "token_strided"):
                    k += 1
                    c = QCase(comm, sub_seed(seed, k), T=T, H_r=H_r, D=D, dtype=dtype)
                    q = _place(to_gpu(c.q), layout)
                    poison_nccl_outputs(op)
                    res = op(q)
                    errors.append(c.check(comm.rank, res, f"{layout} workspace view"))
                    out = empty_poisoned((T, H, D), dtype)
                    if op(q, out=out) is not out:
                        errors.append("out= was not returned")
                    errors.append(c.check(comm.rank, out, f"{layout} out="))
                    wide = empty_poisoned((T, H + 3, D), dtype)
                    op(q, out=wide[:, 2 : 2 + H])
                    errors.append(c.check(comm.rank, wide[:, 2 : 2 + H], f"{layout} strided out="))
            cupy.cuda.get_current_stream().synchronize()

    run_all_ranks(comm, f"NcclQGather {dtype}", body)


def test_nccl_q_gather_padded_heads_and_past_capacity(comm, seed, group):
    """padded_num_heads storage, return_padded, and T > max_tokens (per-call buffers)."""
    H_r, D, dtype = 2, 32, "bfloat16"
    H = H_r * comm.world_size

    def body(errors):
        with NcclQGather(
            comm,
            max_tokens=4,
            heads_per_rank=H_r,
            head_dim=D,
            dtype=dtype,
            padded_num_heads=H + 4,
            nccl_group=group,
        ) as op:
            for k, T in enumerate((3, 4, 9, 33)):
                c = QCase(comm, sub_seed(seed, 50, k), T=T, H_r=H_r, D=D, dtype=dtype)
                poison_nccl_outputs(op)
                res = op(to_gpu(c.q))
                if res.strides[0] != (H + 4) * D * 2:
                    errors.append(
                        f"T={T}: token stride {res.strides[0]}, expected "
                        f"{(H + 4) * D * 2} (padded storage)"
                    )
                errors.append(c.check(comm.rank, res, f"T={T} (max_tokens 4)"))
                padded = op(to_gpu(c.q), return_padded=True)
                if padded.shape != (T, H + 4, D):
                    errors.append(f"return_padded shape {padded.shape}")
                errors.append(c.check(comm.rank, padded[:, :H], f"T={T} return_padded"))

    run_all_ranks(comm, "NcclQGather padded heads, T > max_tokens", body)


# ----------------------------------------------------------------------------- kv_gather
@pytest.mark.parametrize("dtype", ["bfloat16", "uint8"])
def test_nccl_kv_gather_bit_exact(comm, seed, group, dtype):
    """T in {1, 5, T_max, 3*T_max (per-call buffers)} x {contiguous, strided} kv x {view, out=,
    strided out=}."""
    D = 576
    W = comm.world_size

    def body(errors):
        with NcclKVGather(comm, max_tokens=T_MAX, row_dim=D, dtype=dtype, nccl_group=group) as op:
            for k, T in enumerate((1, 5, T_MAX, 3 * T_MAX)):
                c = KVCase(comm, sub_seed(seed, 100, k), T=T, D=D, dtype=dtype)
                for strided in (False, True):
                    kv = to_gpu(c.kv)
                    if strided:
                        big = empty_poisoned((T, D + 8), dtype)
                        bits(big)[:, 4 : 4 + D] = bits(kv)
                        kv = big[:, 4 : 4 + D]
                    where = f"T={T} {'strided' if strided else 'contiguous'} kv"
                    poison_nccl_outputs(op)
                    errors.append(c.check(comm.rank, op(kv), where + ", view"))
                    out = empty_poisoned((W * T, D), dtype)
                    op(kv, out=out)
                    errors.append(c.check(comm.rank, out, where + ", out="))
                    wide = empty_poisoned((W * T, D + 16), dtype)
                    op(kv, out=wide[:, 16:])
                    errors.append(c.check(comm.rank, wide[:, 16:], where + ", strided out="))

    run_all_ranks(comm, f"NcclKVGather {dtype}", body)


# ----------------------------------------------------------------------------- lse_reduce
@pytest.mark.parametrize("algorithm", LSE_ALGORITHMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_nccl_lse_reduce_matches_reference(comm, seed, group, algorithm, dtype):
    """Every algorithm x dtype: T in {1, 5, T_max, 2*T_max}, lse dtypes bf16 / fp32 / fp64,
    base e and 2, masks, out=/out_lse= and workspace outputs."""
    H, D = 8 * comm.world_size, 128
    all_heads = algorithm == "allgather_all_reduce"

    def body(errors):
        for base in (math.e, 2.0):
            with NcclLseReduce(
                comm,
                max_tokens=T_MAX,
                num_heads=H,
                head_dim=D,
                dtype=dtype,
                lse_base=base,
                algorithm=algorithm,
                nccl_group=group,
            ) as op:
                Ho = op.out_heads
                if Ho != (H if all_heads else H // comm.world_size):
                    errors.append(f"out_heads {Ho}")
                k = 0
                for T in (1, 5, T_MAX, 2 * T_MAX):
                    for lse_dtype, S in (("float32", 0), ("bfloat16", 3), ("float64", 2)):
                        k += 1
                        c = LseCase(
                            comm,
                            sub_seed(seed, 200, k, 0 if base == math.e else 1),
                            T=T,
                            H=H,
                            D=D,
                            dtype=dtype,
                            lse_dtype=lse_dtype,
                            lse_base=base,
                            num_requests=S,
                            all_heads=all_heads,
                        )
                        x, l, kw = c.gpu_args()
                        out = empty_poisoned((T, Ho, D), dtype)
                        out_lse = empty_poisoned((T, Ho), "float32")
                        res = op(x, l, out=out, out_lse=out_lse, **kw)
                        if not (isinstance(res, tuple) and res[0] is out and res[1] is out_lse):
                            errors.append("(out, out_lse) not returned")
                        errors.append(c.check(comm.rank, out, out_lse, f"{algorithm} out="))
                        poison_nccl_outputs(op)
                        res = op(x, l, **kw)
                        errors.append(c.check(comm.rank, res, where=f"{algorithm} workspace"))

    run_all_ranks(comm, f"NcclLseReduce {algorithm} {dtype}", body)


@pytest.mark.parametrize("algorithm", LSE_ALGORITHMS)
def test_nccl_lse_reduce_in_place(comm, seed, group, algorithm):
    """out= over the first bytes of out_partial and out_lse= over those of lse_partial (an
    in-place call, as the direct op takes it): the result of the inputs as they were."""
    H, D, dtype = 8 * comm.world_size, 128, "bfloat16"
    all_heads = algorithm == "allgather_all_reduce"

    def body(errors):
        with NcclLseReduce(
            comm,
            max_tokens=T_MAX,
            num_heads=H,
            head_dim=D,
            dtype=dtype,
            algorithm=algorithm,
            nccl_group=group,
        ) as op:
            Ho = op.out_heads
            for k, T in enumerate((1, 5, T_MAX)):
                c = LseCase(
                    comm, sub_seed(seed, 260, k), T=T, H=H, D=D, dtype=dtype, all_heads=all_heads
                )
                x, l, kw = c.gpu_args()
                x, l = x.copy(), l.astype(cupy.float32)  # own, contiguous storage
                out = x.reshape(-1)[: T * Ho * D].reshape(T, Ho, D)
                out_lse = l.reshape(-1)[: T * Ho].reshape(T, Ho)
                op(x, l, out=out, out_lse=out_lse, **kw)
                errors.append(c.check(comm.rank, out, out_lse, f"{algorithm} in place, T={T}"))

    run_all_ranks(comm, f"NcclLseReduce {algorithm} in place", body)


@pytest.mark.parametrize("algorithm", LSE_ALGORITHMS)
def test_nccl_lse_reduce_strided(comm, seed, group, algorithm):
    """Padded head / token storage of out_partial, a transposed lse, strided out and out_lse
    (copied out), return_lse=True."""
    H, D, dtype, T = 8 * comm.world_size, 64, "bfloat16", 7
    all_heads = algorithm == "allgather_all_reduce"

    def body(errors):
        with NcclLseReduce(
            comm,
            max_tokens=T_MAX,
            num_heads=H,
            head_dim=D,
            dtype=dtype,
            return_lse=True,
            algorithm=algorithm,
            nccl_group=group,
        ) as op:
            Ho = op.out_heads
            c = LseCase(
                comm,
                sub_seed(seed, 300),
                T=T,
                H=H,
                D=D,
                dtype=dtype,
                all_heads=all_heads,
                num_requests=2,
            )
            x, l, kw = c.gpu_args()
            big = empty_poisoned((T, H + 1, D + 8), dtype)
            bits(big)[:, :H, :D] = bits(x)
            xs = big[:, :H, :D]
            lt = cupy.full((H, T), np.nan, dtype=cupy.float32)
            lt[...] = l.T
            ls = lt.T
            wide = empty_poisoned((T, Ho + 2, D), dtype)
            wl = empty_poisoned((T, 2 * Ho), "float32")
            res = op(xs, ls, out=wide[:, 1 : 1 + Ho], out_lse=wl[:, ::2], **kw)
            errors.append(c.check(comm.rank, res[0], res[1], "strided everything"))
            poison_nccl_outputs(op)
            res = op(xs, ls, **kw)
            if not isinstance(res, tuple):
                errors.append("return_lse=True did not return (out, out_lse)")
            else:
                errors.append(c.check(comm.rank, res[0], res[1], "return_lse workspace"))

    run_all_ranks(comm, f"NcclLseReduce {algorithm} strided", body)


def test_nccl_view_lifetime(comm, seed, group):
    """A view returned by call n survives call n+1 (two eager buffers alternate)."""
    H_r, D = 2, 64

    def body(errors):
        with NcclQGather(
            comm,
            max_tokens=T_MAX,
            heads_per_rank=H_r,
            head_dim=D,
            dtype="bfloat16",
            nccl_group=group,
        ) as op:
            c1 = QCase(comm, sub_seed(seed, 400), T=5, H_r=H_r, D=D, dtype="bfloat16")
            c2 = QCase(comm, sub_seed(seed, 401), T=5, H_r=H_r, D=D, dtype="bfloat16")
            r1 = op(to_gpu(c1.q))
            r2 = op(to_gpu(c2.q))
            errors.append(c1.check(comm.rank, r1, "view of call n after call n+1"))
            errors.append(c2.check(comm.rank, r2, "view of call n+1"))
            if r1.data.ptr == r2.data.ptr:
                errors.append("calls n and n+1 returned the same buffer")

    run_all_ranks(comm, "NCCL view lifetime", body)


@pytest.mark.parametrize("algorithm", LSE_ALGORITHMS)
def test_nccl_graph_capture(comm, seed, group, algorithm):
    """q_gather, kv_gather and lse_reduce captured in one CuPy graph, replayed 20 times with
    fresh inputs copied in place; every replay checked. T > max_tokens while capturing is
    refused on every rank before any NCCL call."""
    H, Dq, Dv, Dk, T = 4 * comm.world_size, 64, 64, 96, 5
    H_r = H // comm.world_size
    all_heads = algorithm == "allgather_all_reduce"

    def body(errors):
        s = cupy.cuda.Stream(non_blocking=True)
        with (
            NcclQGather(
                comm,
                max_tokens=8,
                heads_per_rank=H_r,
                head_dim=Dq,
                dtype="bfloat16",
                nccl_group=group,
            ) as qg,
            NcclKVGather(comm, max_tokens=8, row_dim=Dk, dtype="bfloat16", nccl_group=group) as kg,
            NcclLseReduce(
                comm,
                max_tokens=8,
                num_heads=H,
                head_dim=Dv,
                dtype="bfloat16",
                algorithm=algorithm,
                nccl_group=group,
            ) as lr,
        ):
            Ho = lr.out_heads
            q = empty_poisoned((T, H_r, Dq), "bfloat16")
            kv = empty_poisoned((T, Dk), "bfloat16")
            x = empty_poisoned((T, H, Dv), "bfloat16")
            lse = cupy.zeros((T, H), dtype=cupy.float32)
            out_l = empty_poisoned((T, Ho, Dv), "bfloat16")
            with s:
                s.begin_capture()
                try:
                    res_q = qg(q, stream=s)
                    res_k = kg(kv, stream=s)
                    lr(x, lse, out=out_l, stream=s)
                finally:
                    graph = s.end_capture()
            for i in range(20):
                cq = QCase(comm, sub_seed(seed, 500, i), T=T, H_r=H_r, D=Dq, dtype="bfloat16")
                ck = KVCase(comm, sub_seed(seed, 501, i), T=T, D=Dk, dtype="bfloat16")
                cl = LseCase(
                    comm,
                    sub_seed(seed, 502, i),
                    T=T,
                    H=H,
                    D=Dv,
                    dtype="bfloat16",
                    all_heads=all_heads,
                )
                bits(q).set(bits(cq.q), stream=s)
                bits(kv).set(bits(ck.kv), stream=s)
                bits(x).set(bits(cl.out_partial), stream=s)
                lse.set(cl.lse_partial, stream=s)
                with s:
                    poison(out_l)
                graph.launch(s)
                s.synchronize()
                errors.append(cq.check(comm.rank, res_q, f"replay {i}"))
                errors.append(ck.check(comm.rank, res_k, f"replay {i}"))
                errors.append(cl.check(comm.rank, out_l, where=f"replay {i}"))
            # past the capacity while capturing: refused on every rank, nothing enqueued
            big = cupy.zeros((9, H_r, Dq), dtype=cupy.uint16).view(resolve_dtype("bfloat16"))
            with s:
                s.begin_capture()
                try:
                    qg(big, stream=s)
                    errors.append("T > max_tokens was accepted while capturing")
                except InvalidArgument as e:
                    if "while a CUDA graph is being captured" not in str(e):
                        errors.append(f"unexpected message: {e}")
                finally:
                    s.end_capture()
            # eager calls after the capture still work
            cq = QCase(comm, sub_seed(seed, 510), T=T, H_r=H_r, D=Dq, dtype="bfloat16")
            errors.append(cq.check(comm.rank, qg(to_gpu(cq.q)), "eager after capture"))

    run_all_ranks(comm, f"NCCL ops in a CUDA graph ({algorithm})", body)


def test_nccl_bad_input_raises_on_every_rank(comm, group):
    """Argument errors are raised before any NCCL call (same inputs on every rank: no hang)."""

    def body(errors):
        with (
            NcclQGather(
                comm,
                max_tokens=4,
                heads_per_rank=2,
                head_dim=32,
                dtype="bfloat16",
                nccl_group=group,
            ) as op,
            NcclLseReduce(
                comm,
                max_tokens=4,
                num_heads=2 * comm.world_size,
                head_dim=32,
                dtype="float16",
                nccl_group=group,
            ) as lr,
        ):
            for what, call, exc in [
                ("wrong dtype", lambda: op(cupy.zeros((2, 2, 32), cupy.float32)), InvalidType),
                ("host array", lambda: op(np.zeros((2, 2, 32), np.float32)), InvalidType),
                (
                    "wrong shape",
                    lambda: op(empty_poisoned((2, 3, 32), "bfloat16")),
                    InvalidArgument,
                ),
                (
                    "ubatch",
                    lambda: op(empty_poisoned((2, 2, 32), "bfloat16"), ubatch=1),
                    InvalidArgument,
                ),
                (
                    "lse dtype",
                    lambda: lr(
                        empty_poisoned((2, 2 * comm.world_size, 32), "float16"),
                        cupy.zeros((2, 2 * comm.world_size), cupy.int32),
                    ),
                    InvalidType,
                ),
                (
                    "seq_lens without query_start_loc",
                    lambda: lr(
                        empty_poisoned((2, 2 * comm.world_size, 32), "float16"),
                        cupy.zeros((2, 2 * comm.world_size), cupy.float32),
                        seq_lens=cupy.zeros(1, cupy.int32),
                    ),
                    InvalidArgument,
                ),
            ]:
                try:
                    call()
                    errors.append(f"{what}: no error")
                except exc as e:
                    if not str(e).startswith(("q_gather: ", "lse_reduce: ")):
                        errors.append(f"{what}: message {e!r}")
            # the ops are still usable afterwards
            c = QCase(comm, 7, T=3, H_r=2, D=32, dtype="bfloat16")
            errors.append(c.check(comm.rank, op(to_gpu(c.q)), "after rejected calls"))

    run_all_ranks(comm, "NCCL op argument errors", body)
