"""LseReduce on real GPUs: every rank checks its own heads against the float64 reference.

Run (2 and 4 ranks, one GPU each)::

    mpirun -np 2 python -m pytest tests/mpi/test_lse_reduce.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_lse_reduce.py -p no:cacheprovider

Inputs are fresh every run (the ``seed`` fixture; replay with ``DCPKIT_TEST_SEED``) and rebuilt
per rank with ``make_inputs``, so each rank computes the reference of every peer locally.
Outputs are poisoned (all bits set: NaN in every float dtype) before each call, so a row the
kernel did not write fails. Every collective call is made on every rank before any assert
(``all_ranks_ok``); failure messages name the rank, the case and the first mismatching index.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpkit.errors import InvalidType
from dcpkit.ops.lse_reduce import LseReduce, lse_combine
from dcpkit.reference import lse_reduce_reference, make_inputs, resolve_dtype

try:
    from conftest import all_ranks_ok
except ImportError:  # another directory's conftest.py was imported under that name first

    def all_ranks_ok(comm, ok, what=""):
        oks = comm.allgather(bool(ok))
        bad = [r for r, v in enumerate(oks) if not v]
        return (not bad), f"{what} failed on ranks {bad}"


cupy = pytest.importorskip("cupy")

from _dcp_checks import LseCase, empty_poisoned, poison, to_gpu, to_host  # noqa: E402

BF16 = resolve_dtype("bfloat16")
T_MAX = 32
GEOMETRIES = [(128, 512), (64, 512)]  # (H, D_v): DeepSeek-V3 style, Kimi-K2 style
DTYPES = ["bfloat16", "float16", "float32"]


# ----------------------------------------------------------------------------- helpers
def _uint(dt):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[np.dtype(dt).itemsize]


def poison_workspace_outputs(ws, ubatch=0):
    """Poison both eager output buffers of ``ubatch`` (allocating them first if needed)."""
    ws.output_ptr(ubatch, False)
    poison(ws._eager_out[ubatch])


def agree(comm, errors, what, limit=10):
    """Collective: (True, '') when no rank has errors, else (False, ranks + this rank's first
    ``limit`` errors)."""
    ok, msg = all_ranks_ok(comm, not errors, what)
    more = [f"... {len(errors) - limit} more"] if len(errors) > limit else []
    return ok, msg + ("\n" + "\n".join(errors[:limit] + more) if errors else "")


def geometry_ok(comm, H):
    if H % comm.world_size:
        pytest.skip(f"H={H} is not a multiple of world_size {comm.world_size}")


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("H,D", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(comm, seed, dtype, H, D):
    """bf16/fp16/fp32 outputs x bf16/fp32 lse, T in {1, 5, 17, T_max}, poisoned out= and the
    workspace output."""
    geometry_ok(comm, H)
    errors = []
    with LseReduce(comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype) as ws:
        k = 0
        for lse_dtype in ("bfloat16", "float32"):
            for T in (1, 5, 17, T_MAX):
                k += 1
                case = LseCase(comm, seed + k, T=T, H=H, D=D, dtype=dtype, lse_dtype=lse_dtype)
                x, l, kw = case.gpu_args()
                out = empty_poisoned((T, ws.heads_per_rank, D), dtype)
                res = ws(x, l, out=out, **kw)
                ws.synchronize()
                if res is not out:
                    errors.append(f"rank {comm.rank}: out= was not returned")
                errors.append(case.check(comm.rank, out, where="out="))
                # the workspace output
                poison_workspace_outputs(ws)
                res = ws(x, l, **kw)
                ws.synchronize()
                errors.append(case.check(comm.rank, res, where="workspace output"))
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"lse_reduce {dtype} H={H} D_v={D}")
    assert ok, msg


@pytest.mark.parametrize("H,D", GEOMETRIES)
def test_noncontiguous_inputs(comm, seed, H, D):
    """Padded head storage, padded row storage, an inner stride that needs a copy, lse as a
    transposed view and as every other column."""
    geometry_ok(comm, H)
    dtype = "bfloat16"
    errors = []
    with LseReduce(comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype) as ws:
        for k, (T, layout) in enumerate(
            [(5, "pad_heads"), (17, "pad_rows"), (T_MAX, "both"), (3, "inner_stride")]
        ):
            case = LseCase(comm, seed + 100 + k, T=T, H=H, D=D, dtype=dtype)
            xu = cupy.asarray(case.out_partial.view(np.uint16))
            lu = cupy.asarray(case.lse_partial)
            ph = 3 if layout in ("pad_heads", "both") else 0
            pd = 8 if layout in ("pad_rows", "both") else 0  # 16 bytes of bf16
            if layout == "inner_stride":
                big = cupy.full((T, H, 2 * D), 0xFFFF, dtype=cupy.uint16)
                big[:, :, ::2] = xu
                x = big[:, :, ::2].view(BF16)
            else:
                big = cupy.full((T, H + ph, D + pd), 0xFFFF, dtype=cupy.uint16)  # NaN padding
                big[:, :H, :D] = xu
                x = big[:, :H, :D].view(BF16)
            if k % 2 == 0:
                lt = cupy.full((H, T), np.nan, dtype=cupy.float32)
                lt[...] = lu.T
                lse = lt.T  # strides (4, 4*T) bytes
            else:
                l2 = cupy.full((T, 2 * H), np.nan, dtype=cupy.float32)
                l2[:, ::2] = lu
                lse = l2[:, ::2]  # head stride 2 elements
            out = empty_poisoned((T, ws.heads_per_rank, D), dtype)
            ws(x, lse, out=out)
            ws.synchronize()
            errors.append(
                case.check(
                    comm.rank, out, where=f"layout {layout}, strides {x.strides} / {lse.strides}"
                )
            )
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"lse_reduce non-contiguous inputs H={H}")
    assert ok, msg


@pytest.mark.parametrize("where", ["own_heads", "start", "tail"])
def test_out_overlapping_the_input(comm, seed, where):
    """out= inside out_partial's own memory (an in-place call): the result still equals the
    reference of the input as it was before the call. ``own_heads``: out is the storage of this
    rank's heads of a head-major input; ``start`` / ``tail``: out is the first / last bytes of
    the input's buffer (rows of other heads and tokens)."""
    H, D, dtype = 128, 512, "bfloat16"
    geometry_ok(comm, H)
    W, r = comm.world_size, comm.rank
    errors = []
    with LseReduce(comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype) as ws:
        H_r = ws.heads_per_rank
        for k, T in enumerate((1, 7, T_MAX)):
            case = LseCase(comm, seed + 800 + k, T=T, H=H, D=D, dtype=dtype)
            x, lse, kw = case.gpu_args()
            n_out = T * H_r * D
            if where == "own_heads":  # head-major storage [H, T, D]; own heads are contiguous
                hm = cupy.ascontiguousarray(x.view(cupy.uint16).transpose(1, 0, 2))
                xin = hm.transpose(1, 0, 2).view(BF16)
                out = hm[r * H_r : (r + 1) * H_r].reshape(-1)[:n_out].view(BF16)
            else:
                flat = x.reshape(-1)
                lo = 0 if where == "start" else flat.size - n_out
                xin = x
                out = flat[lo : lo + n_out].view(BF16)
            out = out.reshape(T, H_r, D)
            ws(xin, lse, out=out, **kw)
            ws.synchronize()
            errors.append(case.check(r, out, where=f"out= overlapping the input ({where})"))
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"lse_reduce out= overlapping the input ({where}), W={W}")
    assert ok, msg


@pytest.mark.parametrize("dtype,H", [("bfloat16", 128), ("float32", 64)])
def test_large_t_matches_reference(comm, seed, dtype, H):
    """Calls large enough for the batched send and the wide combine (several units of two items
    per warp on every CTA): plain, with masks and the merged lse, with padded head storage, and
    with out_lse= or out= overlapping the input."""
    D, T_max = 512, 128
    geometry_ok(comm, H)
    errors = []
    with LseReduce(
        comm, max_tokens=T_max, num_heads=H, head_dim=D, dtype=dtype, return_lse=True
    ) as ws:
        H_r = ws.heads_per_rank
        for k, (T, S) in enumerate(((48, 0), (T_max, 0), (T_max, 3), (97, 2))):
            case = LseCase(comm, seed + 900 + k, T=T, H=H, D=D, dtype=dtype, num_requests=S)
            x, lse, kw = case.gpu_args()
            out = empty_poisoned((T, H_r, D), dtype)
            out_lse = empty_poisoned((T, H_r), "float32")
            ws(x, lse, out=out, out_lse=out_lse, **kw)
            ws.synchronize()
            errors.append(case.check(comm.rank, out, out_lse, where=f"T={T} S={S}"))
            # padded head storage
            u = _uint(resolve_dtype(dtype))
            big = cupy.full((T, H + 3, D), np.iinfo(u).max, dtype=u)
            big[:, :H] = x.view(u)
            xp = big[:, :H].view(resolve_dtype(dtype))
            out = empty_poisoned((T, H_r, D), dtype)
            ws(xp, lse, out=out, **kw)
            ws.synchronize()
            errors.append(case.check(comm.rank, out, where=f"T={T} S={S}, padded heads"))
            # out_lse= over the input's first bytes: the combine writes it while it still reads
            # the input
            out = empty_poisoned((T, H_r, D), dtype)
            lse_over = x.view(cupy.uint8).reshape(-1)[: T * H_r * 4].view(cupy.float32)
            ws(x, lse, out=out, out_lse=lse_over.reshape(T, H_r), **kw)
            ws.synchronize()
            errors.append(
                case.check(
                    comm.rank, out, lse_over.reshape(T, H_r), where=f"T={T} S={S}, out_lse= over"
                )
            )
            x, lse, kw = case.gpu_args()  # the input again (the call above overwrote it)
            # out= over the input's first bytes (an in-place call)
            flat = x.view(u).reshape(-1)
            out = flat[: T * H_r * D].view(resolve_dtype(dtype)).reshape(T, H_r, D)
            ws(x, lse, out=out, **kw)
            ws.synchronize()
            errors.append(case.check(comm.rank, out, where=f"T={T} S={S}, out= over the input"))
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"lse_reduce large T {dtype} H={H}")
    assert ok, msg


@pytest.mark.parametrize("num_requests", [1, 3])
def test_masks(comm, seed, num_requests):
    """seq_lens with zeros (empty requests on some ranks) and padding rows; and
    query_start_loc alone (padding only)."""
    H, D, dtype = 64, 512, "float16"
    geometry_ok(comm, H)
    errors = []
    with LseReduce(
        comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype, return_lse=True
    ) as ws:
        for k, T in enumerate((5, 17, T_MAX)):
            for qsl_only in (False, True):
                case = LseCase(
                    comm,
                    seed + 200 + 10 * k + qsl_only,
                    T=T,
                    H=H,
                    D=D,
                    dtype=dtype,
                    num_requests=num_requests,
                    qsl_only=qsl_only,
                )
                x, l, kw = case.gpu_args()
                out = empty_poisoned((T, ws.heads_per_rank, D), dtype)
                out_lse = empty_poisoned((T, ws.heads_per_rank), "float32")
                res = ws(x, l, out=out, out_lse=out_lse, **kw)
                ws.synchronize()
                if not (isinstance(res, tuple) and res[0] is out and res[1] is out_lse):
                    errors.append(f"rank {comm.rank}: expected (out, out_lse) back")
                errors.append(
                    case.check(
                        comm.rank, out, out_lse, where=f"query_start_loc {case.qsl.tolist()}"
                    )
                )
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"lse_reduce masks S={num_requests}")
    assert ok, msg


def test_base2_lse_and_return_lse(comm, seed):
    """lse_base=2 input; return_lse=True returns the merged natural-log lse (workspace output
    and out= with the lse in the workspace)."""
    H, D, dtype = 128, 512, "bfloat16"
    geometry_ok(comm, H)
    errors = []
    with LseReduce(
        comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype, lse_base=2, return_lse=True
    ) as ws:
        for k, T in enumerate((1, 17, T_MAX)):
            case = LseCase(comm, seed + 300 + k, T=T, H=H, D=D, dtype=dtype, lse_base=2.0)
            x, l, kw = case.gpu_args()
            poison_workspace_outputs(ws)
            out, out_lse = ws(x, l, **kw)
            ws.synchronize()
            errors.append(case.check(comm.rank, out, out_lse, where="workspace output"))
            out2 = empty_poisoned((T, ws.heads_per_rank, D), dtype)
            res = ws(x, l, out=out2, **kw)
            ws.synchronize()
            errors.append(case.check(comm.rank, res[0], res[1], where="out= and workspace lse"))
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, "lse_reduce base-2 lse")
    assert ok, msg


def test_two_ubatches_interleaved(comm, seed):
    """Two ubatches on two streams, calls interleaved, each checked."""
    H, D, dtype, T = 128, 512, "bfloat16", 17
    geometry_ok(comm, H)
    errors = []
    s0, s1 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with LseReduce(
        comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype, num_ubatches=2
    ) as ws:
        pending = []
        for k in range(6):
            for ub, st in ((0, s0), (1, s1)):
                case = LseCase(
                    comm,
                    seed + 400 + 2 * k + ub,
                    T=T,
                    H=H,
                    D=D,
                    dtype=dtype,
                    num_requests=2 if ub else 0,
                )
                x, l, kw = case.gpu_args()
                out = empty_poisoned((T, ws.heads_per_rank, D), dtype)
                cupy.cuda.get_current_stream().synchronize()  # inputs ready before st uses them
                ws(x, l, out=out, ubatch=ub, stream=st, **kw)
                pending.append((case, out, x, l, kw, ub))
        s0.synchronize()
        s1.synchronize()
        ws.synchronize()
        for case, out, *_keep, ub in pending:
            errors.append(case.check(comm.rank, out, where=f"ubatch {ub}"))
        if ws._calls != [6, 6]:
            errors.append(f"rank {comm.rank}: calls per ubatch {ws._calls}, expected [6, 6]")
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, "lse_reduce two ubatches")
    assert ok, msg


def test_cuda_graph_1000_replays_with_eager_calls_interleaved(comm, seed):
    """Capture two calls (out= and the graph output buffer), replay 1000 times with the inputs
    refreshed in place before every replay; check every 100th replay and the last one; eager
    calls (out= and workspace output) in between."""
    H, D, dtype, T = 128, 512, "bfloat16", 8
    geometry_ok(comm, H)
    errors = []
    pool = [LseCase(comm, seed + 500 + k, T=T, H=H, D=D, dtype=dtype) for k in range(7)]
    pool_x = [cupy.asarray(c.out_partial.view(np.uint16)) for c in pool]
    pool_l = [cupy.asarray(c.lse_partial) for c in pool]
    st = cupy.cuda.Stream(non_blocking=True)
    with LseReduce(comm, max_tokens=T, num_heads=H, head_dim=D, dtype=dtype) as ws:
        H_r = ws.heads_per_rank
        xin = cupy.empty((T, H, D), dtype=cupy.uint16)
        lin = cupy.empty((T, H), dtype=cupy.float32)
        x = xin.view(BF16)
        out = empty_poisoned((T, H_r, D), dtype)
        with st:
            xin[...] = pool_x[0]
            lin[...] = pool_l[0]
        ws(x, lin, out=out, stream=st)  # the first call of a workspace is never captured
        st.synchronize()
        comm.barrier()
        st.begin_capture()
        ws(x, lin, out=out, stream=st)
        g_out = ws(x, lin, stream=st)  # graph output buffer of ubatch 0
        graph = st.end_capture()
        if not ws._captured[0]:
            errors.append(f"rank {comm.rank}: capture was not recorded")
        eager_out = empty_poisoned((T, H_r, D), dtype)
        n = 1000
        for i in range(n):
            k = i % len(pool)
            with st:
                xin[...] = pool_x[k]
                lin[...] = pool_l[k]
            check = (i % 100 == 0) or i == n - 1
            if check:
                with st:
                    poison(out)
                    poison(g_out)
            graph.launch(st)
            if check:
                st.synchronize()
                errors.append(pool[k].check(comm.rank, out, where=f"replay {i}, out="))
                errors.append(pool[k].check(comm.rank, g_out, where=f"replay {i}, graph output"))
            if i % 50 == 25:  # an eager call between replays, same ubatch
                j = (k + 3) % len(pool)
                with st:
                    poison(eager_out)
                    poison_workspace_outputs(ws)
                    xin[...] = pool_x[j]
                    lin[...] = pool_l[j]
                ws(x, lin, out=eager_out, stream=st)
                res = ws(x, lin, stream=st)  # workspace output after a capture (copy path)
                st.synchronize()
                errors.append(pool[j].check(comm.rank, eager_out, where=f"eager after {i}"))
                errors.append(pool[j].check(comm.rank, res, where=f"eager ws output after {i}"))
        ws.synchronize(st)
        # capture runs nothing; every replay ran two calls, every eager pause two: the device
        # epoch counted them all
        expected = 1 + 2 * n + 2 * len([i for i in range(n) if i % 50 == 25])  # 1: warm-up
        if int(ws._epoch[0]) != expected:
            errors.append(
                f"rank {comm.rank}: device epoch {int(ws._epoch[0])}, expected {expected}"
            )
        del graph
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, "lse_reduce graph replays")
    assert ok, msg


def _checked_out_calls(comm, ws, seed: int, n: int, T: int, where) -> list:
    """``n`` calls of ``ws`` on fresh inputs (seeds ``seed + k``) into a poisoned ``out=``, each
    checked against the reference; the error strings (empty where right)."""
    H, D, dtype = ws.num_heads, ws.head_dim, str(ws.dtype)
    errors = []
    for k in range(n):
        case = LseCase(comm, seed + k, T=T, H=H, D=D, dtype=dtype)
        x, l, kw = case.gpu_args()
        out = empty_poisoned((T, ws.heads_per_rank, D), dtype)
        ws(x, l, out=out)
        ws.synchronize()
        errors.append(case.check(comm.rank, out, where=where(k)))
    return errors


def test_epoch_wrap(comm, seed):
    """The low 32 bits of the epoch wrap inside these 8 calls."""
    H, D, dtype, T = 64, 512, "float32", 5
    geometry_ok(comm, H)
    with LseReduce(comm, max_tokens=T, num_heads=H, head_dim=D, dtype=dtype) as ws:
        ws._set_epoch(2**32 - 3)
        errors = _checked_out_calls(comm, ws, seed + 600, 8, T, lambda k: f"epoch {2**32 - 2 + k}")
        if int(ws._epoch[0]) != 2**32 - 3 + 8:
            errors.append(f"rank {comm.rank}: epoch {int(ws._epoch[0])}, expected {2**32 + 5}")
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, "lse_reduce epoch wrap")
    assert ok, msg


def test_epoch_moved_by_one_after_claiming_calls(comm, seed):
    """_set_epoch to one past the device epoch flips the parity of the next call's work counter:
    the counter it then claims from must be zero, not the claims of the last call of that parity
    (which left every unit claimed: nothing would be combined)."""
    H, D, dtype, T = 64, 512, "float32", 5  # more units than waiters: the combine claims
    geometry_ok(comm, H)
    with LseReduce(comm, max_tokens=T, num_heads=H, head_dim=D, dtype=dtype) as ws:
        errors = _checked_out_calls(comm, ws, seed + 650, 3, T, lambda k: f"call {k + 1}")
        ws._set_epoch(int(ws._epoch[0]) + 1)
        errors += _checked_out_calls(
            comm, ws, seed + 660, 2, T, lambda k: f"call {k + 1} after the move"
        )
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, "lse_reduce epoch moved by one")
    assert ok, msg


def test_direct_path_one_launch_per_call_and_rejected_calls(comm, seed):
    """The op is the direct path (one launch per call, the device epoch advances with the host
    count); T == 0 launches nothing; a rejected call changes nothing and the next call works."""
    H, D, dtype = 64, 512, "bfloat16"
    geometry_ok(comm, H)
    errors = []
    assert LseReduce.launches_per_call == 1
    with LseReduce(comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype=dtype) as ws:
        assert type(ws).launches_per_call == 1
        for k in range(3):
            case = LseCase(comm, seed + 700 + k, T=5, H=H, D=D, dtype=dtype)
            x, l, kw = case.gpu_args()
            ws(x, l)
            ws.synchronize()
            if ws._calls[0] != k + 1 or int(ws._epoch[0]) != k + 1:
                errors.append(
                    f"rank {comm.rank}: after call {k + 1}: host count "
                    f"{ws._calls[0]}, device epoch {int(ws._epoch[0])}"
                )
        empty = ws(
            cupy.empty((0, H, D), dtype=cupy.uint16).view(BF16),
            cupy.empty((0, H), dtype=cupy.float32),
        )
        if empty.shape != (0, ws.heads_per_rank, D) or ws._calls[0] != 3:
            errors.append(f"rank {comm.rank}: T == 0 gave {empty.shape}, calls {ws._calls}")
        try:
            ws(case.out_partial, l)  # host array
            errors.append(f"rank {comm.rank}: a host out_partial was accepted")
        except InvalidType:
            pass
        if ws._calls[0] != 3:
            errors.append(f"rank {comm.rank}: a rejected call changed the count: {ws._calls}")
        case = LseCase(comm, seed + 710, T=T_MAX, H=H, D=D, dtype=dtype)
        x, l, kw = case.gpu_args()
        out = empty_poisoned((T_MAX, ws.heads_per_rank, D), dtype)
        ws(x, l, out=out)
        ws.synchronize()
        errors.append(case.check(comm.rank, out, where="after a rejected call"))
        if ws.poisoned:
            errors.append(f"rank {comm.rank}: workspace poisoned")
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, "lse_reduce direct path")
    assert ok, msg


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_combine_matches_reference(comm, seed, dtype):
    """The local merge of the NCCL fallback (no communication; every rank checks its own)."""
    W, T, H_r, D = 3, 9, 4, 512
    rng_seed = seed + 800 + comm.rank
    ins = [
        make_inputs(
            s, W, rng_seed, op="lse_reduce", tokens=T, num_heads=H_r, head_dim=D, dtype=dtype
        )
        for s in range(W)
    ]
    ref_out, ref_lse = lse_reduce_reference(
        [i["out_partial"] for i in ins], [i["lse_partial"] for i in ins]
    )
    src_out = to_gpu(np.stack([i["out_partial"] for i in ins]))
    src_lse = to_gpu(np.stack([i["lse_partial"] for i in ins]).astype(np.float32))
    out = empty_poisoned((T, H_r, D), dtype)
    out_lse = empty_poisoned((T, H_r), "float32")
    res = lse_combine(src_out, src_lse, out, out_lse)
    cupy.cuda.get_current_stream().synchronize()
    errors = []
    if not (res[0] is out and res[1] is out_lse):
        errors.append(f"rank {comm.rank}: lse_combine did not return (out, out_lse)")
    case = LseCase.__new__(LseCase)
    case.ref_out, case.ref_lse, case.dtype = ref_out, ref_lse, resolve_dtype(dtype)
    case.what = f"lse_combine W={W} T={T} H_r={H_r} D_v={D} dtype={dtype}"
    errors.append(case.check(comm.rank, out, out_lse))
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"lse_combine {dtype}")
    assert ok, msg


def test_lse_reduce_programmatic_launch(comm, seed):
    """programmatic_launch=True behind a producer that lets the next kernel launch at once and
    writes out_partial only 30 us later: every eager call and graph replay reads the producer's
    out_partial (lse_partial is refreshed before the producer)."""
    from _gather_checks import check_programmatic, run_collective, sub_seed

    W = comm.world_size
    H, D = 8 * W, 512

    def body(errors):
        with LseReduce(
            comm, max_tokens=T_MAX, num_heads=H, head_dim=D, dtype="bfloat16",
            programmatic_launch=True,
        ) as ws:  # fmt: skip
            for T in (1, 8):
                out = empty_poisoned((T, H // W, D), "bfloat16")
                lse = to_gpu(LseCase(comm, seed, T=T, H=H, D=D, dtype="bfloat16").lse_partial)

                def inputs(k, T=T, lse=lse):
                    case = LseCase(comm, sub_seed(seed, 79, T, k), T=T, H=H, D=D, dtype="bfloat16")
                    lse.view(_uint(lse.dtype)).set(
                        np.ascontiguousarray(case.lse_partial).view(_uint(lse.dtype)),
                        stream=cupy.cuda.get_current_stream(),
                    )
                    return case.out_partial, case

                def call(x, s, out=out, lse=lse):
                    return ws(x, lse, out=out, stream=s)

                def check(res, case, where):
                    return case.check(comm.rank, res, where=where) or None

                check_programmatic(errors, call, inputs, 4, f"lse_reduce T={T}", check, (out,))

    run_collective(comm, "lse_reduce with programmatic_launch", body)


class _WarpCombine(LseReduce):
    """LseReduce on the default build: the warp merge for every world."""

    REG_SOURCES = 0


def _bits(x) -> np.ndarray:
    return to_host(x).view(_uint(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_register_combine_gives_the_bits_of_the_warp_combine(comm, seed, dtype):
    """Worlds up to LseReduce.REG_SOURCES: the op (its small instance merges in registers) and
    _WarpCombine (REG_SOURCES = 0: the warp merge) give the same bits of out and of the merged
    lse. T of the small instance and (with one GPU per rank) T = 128 of the large, the same code
    in both builds; rows of one pass and of two with a partial one. Inputs: LseCase's (the op also
    against the reference), with masks, and with many empty / NaN / +inf rows (NaN payload),
    lse values tied or +-0 across ranks, and spreads of 95-150 whose weights are denormal or 0.
    """
    W, r = comm.world_size, comm.rank
    if W > LseReduce.REG_SOURCES:
        pytest.skip(f"the register merge is for worlds up to {LseReduce.REG_SOURCES} (have {W})")
    H, T_max = 48, 128  # 48 heads split over 2-4 ranks; T = 128 takes the large instance
    tokens = (1, 2, 5, 8, 17, T_max)
    reg_option = f"-DDCPKIT_LSE_REG_SOURCES={LseReduce.REG_SOURCES}"
    errors = []
    for D in (512, 264):  # bf16 rows of 64 vectors; 33 (a tail lane); fp32 66 (two passes)
        kw_op = dict(max_tokens=T_max, num_heads=H, head_dim=D, dtype=dtype, return_lse=True)
        with LseReduce(comm, **kw_op) as ws, _WarpCombine(comm, **kw_op) as wc:
            if reg_option not in ws._kernel_options() or reg_option in wc._kernel_options():
                errors.append(
                    f"rank {r}: options {ws._kernel_options()} / {wc._kernel_options()}: "
                    "the op must build the register merge, _WarpCombine not"
                )
            small = [T for T in tokens if not ws._grids[T][1]]
            if not small:
                errors.append(f"rank {r}: no T of {tokens} takes the small instance")
            H_r = ws.heads_per_rank
            for k, T in enumerate(tokens):
                lse_dtype = ("float32", "bfloat16")[k % 2]
                where = f"rank {r}, T={T} D_v={D} {dtype} lse {lse_dtype}"
                where += "" if T in small else " (large instance)"
                for j, rnd in enumerate(("case", "masks", "edges")):
                    s = seed + 1000 + 100 * k + 10 * (D == 264) + j
                    case = None
                    if rnd in ("case", "masks"):
                        S = 2 if rnd == "masks" else 0
                        case = LseCase(
                            comm, s, T=T, H=H, D=D, dtype=dtype, lse_dtype=lse_dtype,
                            num_requests=S,
                        )  # fmt: skip
                        x, lse, kw = case.gpu_args()
                    else:
                        x, lse = _edge_inputs(comm, s, T, H, D, dtype, lse_dtype)
                        kw = {}
                    got = {}
                    for name, op in (("register", ws), ("warp", wc)):
                        out = empty_poisoned((T, H_r, D), dtype)
                        out_lse = empty_poisoned((T, H_r), "float32")
                        op(x, lse, out=out, out_lse=out_lse, **kw)
                        op.synchronize()
                        got[name] = (out, out_lse)
                    for i, what in enumerate(("out", "merged lse")):
                        a, b = _bits(got["register"][i]), _bits(got["warp"][i])
                        if not np.array_equal(a, b):
                            bad = np.argwhere(a != b)
                            j = tuple(int(v) for v in bad[0])
                            errors.append(
                                f"{where}, {rnd} inputs: {what} differs in {len(bad)} of "
                                f"{a.size} elements, first {j}: register {a[j]:#x}, warp "
                                f"{b[j]:#x}"
                            )
                    if case is not None:
                        errors.append(case.check(r, *got["register"], where=f"{rnd} inputs"))
    errors = [e for e in errors if e]
    ok, msg = agree(comm, errors, f"register combine against the warp combine {dtype} W={W}")
    assert ok, msg


def _edge_inputs(comm, seed, T, H, D, dtype, lse_dtype):
    """This rank's out_partial and lse_partial on the GPU: make_inputs with 30 % empty rows (lse
    -inf, payload NaN) and 10 % NaN / +inf lse, then per (t, h) one of: unchanged, the same
    lse on every rank (a tie), +0 or -0 (the sign per rank), or lowered by 95, 101 or 150
    (weights denormal or 0)."""
    W, r = comm.world_size, comm.rank
    inp = make_inputs(
        r, W, seed, op="lse_reduce", tokens=T, num_heads=H, head_dim=D, dtype=dtype,
        lse_dtype=lse_dtype, empty_fraction=0.3, nonfinite_fraction=0.1,
    )  # fmt: skip
    lse = inp["lse_partial"].astype(np.float32)
    shared = np.random.default_rng([seed, 17])  # the same draws on every rank
    mine = np.random.default_rng([seed, 17, r])
    kind = shared.integers(5, size=(T, H))
    tie = shared.normal(size=(T, H)).astype(np.float32)
    sign = mine.choice(np.array([0.0, -0.0], dtype=np.float32), size=(T, H))
    drop = mine.choice(np.array([95.0, 101.0, 150.0], dtype=np.float32), size=(T, H))
    live = np.isfinite(lse)  # leave the empty and invalid rows as they are
    lse = np.where(live & (kind == 1), tie, lse)
    lse = np.where(live & (kind == 2), sign, lse)
    lse = np.where(live & (kind == 3), lse - drop, lse)
    lse = lse.astype(resolve_dtype(lse_dtype))
    return to_gpu(inp["out_partial"]), to_gpu(lse)
