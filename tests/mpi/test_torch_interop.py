"""dcpkit.torch on GPUs: zero-copy bf16 round trips, every op through TorchOps (DLPack path
and custom ops), ordering on a non-default torch stream without synchronisation, a torch CUDA
graph with the custom ops replayed 100 times (direct and NCCL paths), bad tensors, and
Communicator.from_torch over a gloo group built from the MPI job.

Run (every rank runs every test in the same order; needs torch)::

    mpirun -np 2 python -m pytest tests/mpi/test_torch_interop.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_torch_interop.py -p no:cacheprovider

Where ranks share a GPU, NCCL cannot start (one GPU per rank): the NCCL parts are skipped
(``nccl_usable`` / ``nccl_expected`` of conftest.py) and everything on the direct path runs.
"""

from __future__ import annotations

import datetime
import os
import socket

import numpy as np
import pytest

from dcpkit.errors import ClosedError, ConfigMismatch, InvalidArgument, InvalidType
from dcpkit.reference import resolve_dtype

from _dcp_checks import KVCase, LseCase, QCase, first_diff, run_all_ranks, sub_seed

torch = pytest.importorskip(
    "torch", reason="torch is not installed here (pip install 'dcpkit[torch-cu12]', or torch-cu13)"
)
cupy = pytest.importorskip("cupy")

import dcpkit.torch as dt  # noqa: E402  (after the skip: needs torch)
from dcpkit.comm import Communicator  # noqa: E402
from dcpkit.fallback import NcclKVGather  # noqa: E402
from dcpkit.manager import DCPComm  # noqa: E402
from dcpkit.ops import KVGather  # noqa: E402

BF16 = resolve_dtype("bfloat16")
T_MAX = 16
DQ, DV, DKV = 576, 512, 576
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of milliseconds on an H200


@pytest.fixture(scope="module")
def tdev(comm):
    """torch uses the GPU the comm fixture selected for CuPy."""
    dev = int(cupy.cuda.Device().id)
    torch.cuda.set_device(dev)
    return dev


@pytest.fixture(scope="module")
def dcp(comm, tdev):
    d = DCPComm(
        comm,
        max_tokens=T_MAX,
        num_heads=8 * comm.world_size,
        q_head_dim=DQ,
        v_head_dim=DV,
        kv_row_dim=DKV,
        dtype="bfloat16",
    )
    yield d
    d.close()


def t_from_np(a: np.ndarray, dev: int):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(f"cuda:{dev}")
    return torch.from_numpy(a).to(f"cuda:{dev}")


def np_from_t(t) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(BF16)
    return t.cpu().numpy()


def t_poisoned(shape, dtype, dev):
    x = torch.empty(shape, dtype=dtype, device=f"cuda:{dev}")
    x.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype
    return x


# ----------------------------------------------------------------------------- DLPack
def test_bf16_round_trip_is_zero_copy(comm, tdev):
    def body(errors):
        t = torch.randn(5, 8, 64, device=f"cuda:{tdev}").to(torch.bfloat16)
        for name, src in (("contiguous", t), ("strided view", t[:, 2:6])):
            a = dt.to_cupy(src)
            if a.data.ptr != src.data_ptr():
                errors.append(
                    f"{name}: to_cupy copied (ptr {a.data.ptr:#x} vs {src.data_ptr():#x})"
                )
            if (
                a.dtype != BF16
                or a.shape != tuple(src.shape)
                or a.strides != tuple(2 * s for s in src.stride())
            ):
                errors.append(f"{name}: dtype/shape/strides {a.dtype} {a.shape} {a.strides}")
            back = dt.from_cupy(a)
            if back.data_ptr() != src.data_ptr() or back.dtype != torch.bfloat16:
                errors.append(f"{name}: from_cupy copied or changed dtype ({back.dtype})")
            if not torch.equal(back.view(torch.int16), src.view(torch.int16)):
                errors.append(f"{name}: bits differ after the round trip")
        c = cupy.arange(64, dtype=cupy.uint16).view(BF16)  # CuPy-owned bf16 -> torch
        tc = dt.from_cupy(c)
        if tc.data_ptr() != c.data.ptr or tc.dtype != torch.bfloat16:
            errors.append("cupy -> torch copied or lost bf16")

    run_all_ranks(comm, "bf16 DLPack round trip", body)


# ----------------------------------------------------------------------------- ops
def test_torch_ops_match_reference(comm, seed, dcp, tdev, nccl_expected):
    """q_gather, kv_gather, lse_reduce with torch bf16 tensors: the DLPack path (workspace
    views as torch tensors) and the custom-op path (out=), against the references; T up to
    max_tokens on the direct path, and T > max_tokens on the NCCL path where ranks have a GPU
    each (NCCL cannot start where they share one)."""
    H = 8 * comm.world_size
    H_r, r = 8, comm.rank
    sizes = (1, 5, T_MAX) + ((T_MAX + 3,) if nccl_expected else ())  # T_MAX + 3: NCCL

    def body(errors):
        with dt.TorchOps(dcp) as ops:
            for k, T in enumerate(sizes):
                cq = QCase(comm, sub_seed(seed, k, 1), T=T, H_r=H_r, D=DQ, dtype="bfloat16")
                q = t_from_np(cq.q, tdev)
                res = ops.q_gather(q)
                if not isinstance(res, torch.Tensor) or res.device.index != tdev:
                    errors.append(f"q_gather returned {type(res)} on {getattr(res, 'device', '')}")
                else:
                    d = first_diff(np_from_t(res), cq.ref)
                    errors.append(f"rank {r} q_gather T={T} view: {d}" if d else "")
                out = t_poisoned((T, H, DQ), torch.bfloat16, tdev)
                if ops.q_gather(q, out=out) is not out:
                    errors.append("q_gather(out=) did not return out")
                d = first_diff(np_from_t(out), cq.ref)
                errors.append(f"rank {r} q_gather T={T} custom op: {d}" if d else "")

                ck = KVCase(comm, sub_seed(seed, k, 2), T=T, D=DKV, dtype="bfloat16")
                kv = t_from_np(ck.kv, tdev)
                d = first_diff(np_from_t(ops.kv_gather(kv)), ck.ref)
                errors.append(f"rank {r} kv_gather T={T} view: {d}" if d else "")
                out = t_poisoned((comm.world_size * T, DKV), torch.bfloat16, tdev)
                ops.kv_gather(kv, out=out)
                d = first_diff(np_from_t(out), ck.ref)
                errors.append(f"rank {r} kv_gather T={T} custom op: {d}" if d else "")

                cl = LseCase(
                    comm, sub_seed(seed, k, 3), T=T, H=H, D=DV, dtype="bfloat16", num_requests=2
                )
                x, l = t_from_np(cl.out_partial, tdev), t_from_np(cl.lse_partial, tdev)
                kw = dict(
                    query_start_loc=t_from_np(cl.qsl, tdev), seq_lens=t_from_np(cl.seq_lens, tdev)
                )
                errors.append(
                    cl.check_host(
                        r, np_from_t(ops.lse_reduce(x, l, **kw)), None, f"T={T} DLPack path"
                    )
                )
                out = t_poisoned((T, H_r, DV), torch.bfloat16, tdev)
                out_lse = t_poisoned((T, H_r), torch.float32, tdev)
                res = ops.lse_reduce(x, l, out=out, out_lse=out_lse, **kw)
                if res[0] is not out or res[1] is not out_lse:
                    errors.append("lse_reduce(out=, out_lse=) did not return them")
                errors.append(
                    cl.check_host(r, np_from_t(out), np_from_t(out_lse), f"T={T} custom op")
                )
            paths = comm.allgather(dcp.last_path)
            want = "nccl" if nccl_expected else "direct-"
            if any(not str(p).startswith(want) for p in paths):
                errors.append(f"T = {sizes[-1]} through torch: paths {paths}, expected {want}*")

    run_all_ranks(comm, "TorchOps(DCPComm) against the references", body)


def test_bad_tensors(comm, dcp, tdev):
    """CPU tensors, unsupported dtypes, tensors on another GPU, closed handles: clear errors on
    every rank before any collective."""

    def body(errors):
        ops = dt.TorchOps(dcp)
        q_cpu = torch.zeros(2, 8, DQ, dtype=torch.bfloat16)
        cases = [
            ("CPU tensor", lambda: ops.q_gather(q_cpu), InvalidType, "must be a CUDA tensor"),
            (
                "CPU tensor, custom op",
                lambda: ops.q_gather(
                    q_cpu, out=torch.zeros(2, 8 * comm.world_size, DQ, dtype=torch.bfloat16)
                ),
                InvalidType,
                "must be a CUDA tensor",
            ),
            (
                "complex64",
                lambda: ops.kv_gather(
                    torch.zeros(2, DKV, dtype=torch.complex64, device=f"cuda:{tdev}")
                ),
                InvalidType,
                "dtype must be one of",
            ),
            (
                "not a tensor",
                lambda: ops.q_gather(np.zeros((2, 8, DQ), np.float32)),
                InvalidType,
                "must be a torch.Tensor",
            ),
            ("not an op", lambda: dt.TorchOps(object()), InvalidType, "target must be a dcpkit op"),
        ]
        if torch.cuda.device_count() > 1:
            other = (tdev + 1) % torch.cuda.device_count()
            cases.append(
                (
                    "other GPU",
                    lambda: ops.q_gather(
                        torch.zeros(2, 8, DQ, dtype=torch.bfloat16, device=f"cuda:{other}")
                    ),
                    InvalidArgument,
                    f"device must be the op's GPU cuda:{tdev}",
                )
            )
        for what, call, exc, text in cases:
            try:
                call()
                errors.append(f"{what}: no error")
            except exc as e:
                if text not in str(e):
                    errors.append(f"{what}: message {e!r}")
            except Exception as e:  # noqa: BLE001 - wrong type is a failure with its message
                errors.append(f"{what}: {type(e).__name__}: {e}")
        handle = ops.handle
        ops.close()
        try:
            torch.ops.dcpkit.q_gather(
                handle,
                torch.zeros(1, 8, DQ, dtype=torch.bfloat16, device=f"cuda:{tdev}"),
                torch.zeros(
                    1, 8 * comm.world_size, DQ, dtype=torch.bfloat16, device=f"cuda:{tdev}"
                ),
                0,
            )
            errors.append("a closed handle was accepted")
        except ClosedError:
            pass
        except Exception as e:  # noqa: BLE001
            errors.append(f"closed handle: {type(e).__name__}: {e}")

    run_all_ranks(comm, "bad torch tensors", body)


# ----------------------------------------------------------------------------- streams
def test_ordered_on_current_torch_stream(comm, seed, dcp, tdev):
    """On a non-default torch stream: a torch kernel writes the input after a long sleep, the
    op runs, a torch kernel reads the output, with no synchronisation in between. Results are
    right only if the op ran on that stream, after the write and before the read."""
    H = 8 * comm.world_size
    H_r, r, T = 8, comm.rank, 5

    def body(errors):
        with dt.TorchOps(dcp) as ops:
            cq = QCase(comm, sub_seed(seed, 70), T=T, H_r=H_r, D=DQ, dtype="bfloat16")
            cl = LseCase(comm, sub_seed(seed, 71), T=T, H=H, D=DV, dtype="bfloat16")
            q_src = t_from_np(cq.q, tdev)
            x_src, l_src = t_from_np(cl.out_partial, tdev), t_from_np(cl.lse_partial, tdev)
            q_in = t_poisoned(q_src.shape, torch.bfloat16, tdev)
            x_in = t_poisoned(x_src.shape, torch.bfloat16, tdev)
            l_in = t_poisoned(l_src.shape, torch.float32, tdev)
            out_q = t_poisoned((T, H, DQ), torch.bfloat16, tdev)
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(SLEEP_CYCLES)
                q_in.copy_(q_src)  # written right before the call
                ops.q_gather(q_in, out=out_q)  # out=: the custom op's work, called directly
                got_q1 = out_q.clone()  # read right after
                got_q2 = ops.q_gather(q_in).clone()  # DLPack path, workspace view
                torch.cuda._sleep(SLEEP_CYCLES)
                x_in.copy_(x_src)
                l_in.copy_(l_src)
                got_o = ops.lse_reduce(x_in, l_in).clone()
            s.synchronize()
            for name, got in (("custom op", got_q1), ("DLPack path", got_q2)):
                d = first_diff(np_from_t(got), cq.ref)
                if d:
                    errors.append(f"rank {r} q_gather {name} on a side stream: {d}")
            errors.append(cl.check_host(r, np_from_t(got_o), None, "lse_reduce on a side stream"))

    run_all_ranks(comm, "ordering on the current torch stream", body)


# ----------------------------------------------------------------------------- graphs
@pytest.mark.parametrize("policy", ["auto", "nccl"])
def test_torch_graph_with_custom_ops_100_replays(comm, seed, tdev, policy, request):
    """q_gather + lse_reduce custom ops captured in a torch CUDA graph; 100 replays with
    fresh inputs copied in place and poisoned outputs; every replay checked. ``auto`` runs
    the direct path (also where ranks share a GPU); ``nccl`` needs one GPU per rank."""
    if policy == "nccl":
        request.getfixturevalue("nccl_usable")  # skips where ranks share a GPU
    H_r, Dq, Dv, T = 8, 128, 128, 5
    H = H_r * comm.world_size
    r = comm.rank
    want_path = "direct-" if policy == "auto" else "nccl"

    def body(errors):
        with (
            DCPComm(
                comm,
                max_tokens=8,
                num_heads=H,
                q_head_dim=Dq,
                v_head_dim=Dv,
                dtype="bfloat16",
                policy=policy,
            ) as d,
            dt.TorchOps(d) as ops,
        ):
            dev = f"cuda:{tdev}"
            q_s = torch.zeros(T, H_r, Dq, dtype=torch.bfloat16, device=dev)
            x_s = torch.zeros(T, H, Dv, dtype=torch.bfloat16, device=dev)
            l_s = torch.zeros(T, H, dtype=torch.float32, device=dev)
            out_q = torch.zeros(T, H, Dq, dtype=torch.bfloat16, device=dev)
            out_o = torch.zeros(T, H_r, Dv, dtype=torch.bfloat16, device=dev)
            out_l = torch.zeros(T, H_r, dtype=torch.float32, device=dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up, as torch recommends
                for _ in range(2):
                    ops.q_gather(q_s, out=out_q)
                    ops.lse_reduce(x_s, l_s, out=out_o, out_lse=out_l)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                # the custom op itself, and TorchOps' eager out= entry (the same work without
                # the dispatcher): both captured
                torch.ops.dcpkit.q_gather(ops.handle, q_s, out_q, 0)
                ops.lse_reduce(x_s, l_s, out=out_o, out_lse=out_l)
            paths = comm.allgather(d.last_path)
            if any(not str(p).startswith(want_path) for p in paths):
                errors.append(f"captured calls took paths {paths}, expected {want_path}*")
            for i in range(100):
                cq = QCase(comm, sub_seed(seed, 80, i), T=T, H_r=H_r, D=Dq, dtype="bfloat16")
                cl = LseCase(comm, sub_seed(seed, 81, i), T=T, H=H, D=Dv, dtype="bfloat16")
                q_s.copy_(t_from_np(cq.q, tdev))
                x_s.copy_(t_from_np(cl.out_partial, tdev))
                l_s.copy_(t_from_np(cl.lse_partial, tdev))
                for o in (out_q, out_o, out_l):
                    o.view(torch.uint8).fill_(0xFF)
                g.replay()
                torch.cuda.synchronize()
                dq = first_diff(np_from_t(out_q), cq.ref)
                if dq:
                    errors.append(f"rank {r} replay {i}: q_gather {dq}")
                errors.append(cl.check_host(r, np_from_t(out_o), np_from_t(out_l), f"replay {i}"))
            del g

    run_all_ranks(comm, f"torch CUDA graph with dcpkit custom ops (policy {policy})", body)


# ----------------------------------------------------------------------------- torch groups
def test_communicator_from_torch(comm, seed, tdev, nccl_expected):
    """torch.distributed (gloo) started from the MPI job; Communicator.from_torch gives the
    same ranks, working collectives, ConfigMismatch naming the ranks, and carries a direct op
    (its symmetric heap set up over the torch group) and, where ranks have a GPU each, an
    NCCL op."""
    import torch.distributed as dist

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.broadcast(port, root=0)
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def body(errors):
        dist.init_process_group(
            "gloo",
            rank=comm.rank,
            world_size=comm.world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            tc = Communicator.from_torch()
            if (tc.rank, tc.world_size, tc.backend) != (comm.rank, comm.world_size, "torch"):
                errors.append(f"from_torch: rank/world/backend {tc!r}")
            if tc.local_rank != comm.local_rank:
                errors.append(f"local_rank {tc.local_rank} != {comm.local_rank}")
            if tc.allgather({"r": comm.rank}) != [{"r": s} for s in range(comm.world_size)]:
                errors.append("allgather over torch gave wrong values")
            root = comm.world_size - 1
            if tc.broadcast(("x", comm.rank), root=root) != ("x", root):
                errors.append("broadcast over torch gave a wrong value")
            try:
                tc.agree("test value", comm.rank == 1)
                errors.append("agree did not raise")
            except ConfigMismatch as e:
                if e.ranks != [1]:
                    errors.append(f"ConfigMismatch names ranks {e.ranks}, expected [1]")
            tc.barrier()
            ops = [("direct", KVGather)] + ([("NCCL", NcclKVGather)] if nccl_expected else [])
            for k, (name, cls) in enumerate(ops):
                with cls(tc, max_tokens=4, row_dim=64, dtype="bfloat16") as op:
                    ck = KVCase(comm, sub_seed(seed, 90, k), T=3, D=64, dtype="bfloat16")
                    res = op(cupy.asarray(ck.kv.view(np.uint16)).view(BF16))
                    errors.append(ck.check(comm.rank, res, f"{name} op on from_torch"))
                    want = ("nccl",) if name == "NCCL" else ("unicast", "multicast")
                    if getattr(op, "transport", None) not in want:
                        errors.append(
                            f"{name} op on from_torch has transport "
                            f"{getattr(op, 'transport', None)!r}, expected {want}"
                        )
        finally:
            dist.destroy_process_group()

    try:
        run_all_ranks(comm, "Communicator.from_torch", body)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- memoised views
def test_slices_and_restrided_views_of_one_storage_give_their_own_results(comm, seed, dcp, tdev):
    """TorchOps describes tensors without DLPack, memoised per description: inputs that are
    slices of one storage (non-zero storage offset), a view re-strided under the same data
    pointer, and an input freed and reallocated between calls must each give the result of
    their own contents, call after call; custom ops bump the version of what they write."""
    H_r = 8
    T = 5

    def body(errors):
        with dt.TorchOps(dcp) as ops:
            cq = QCase(comm, sub_seed(seed, 7, 1), T=T, H_r=H_r, D=DQ, dtype="bfloat16")
            q = t_from_np(cq.q, tdev)
            store = torch.zeros((2 * T + 1, H_r, DQ), dtype=torch.bfloat16, device=f"cuda:{tdev}")
            store[1 : T + 1] = q  # offset one token
            padded = torch.zeros((T, 2 * H_r, DQ), dtype=torch.bfloat16, device=f"cuda:{tdev}")
            padded[:, :H_r] = q  # token stride 2*H_r*D
            for rep in range(3):
                for name, x in (
                    ("contiguous", q),
                    ("slice at offset", store[1 : T + 1]),
                    ("token-padded view", padded[:, :H_r]),
                ):
                    d = first_diff(np_from_t(ops.q_gather(x)), cq.ref)
                    errors.append(f"rank {comm.rank} rep {rep} {name}: {d}" if d else "")
                # the padded view's data pointer again, contiguous strides, other contents:
                # only this rank's heads are known here (each rank's are its own input)
                flat = padded.view(-1)[: T * H_r * DQ].view(T, H_r, DQ)
                mine = np_from_t(ops.q_gather(flat))[:, comm.rank * H_r : (comm.rank + 1) * H_r]
                d = first_diff(mine, np_from_t(flat))
                errors.append(
                    f"rank {comm.rank} rep {rep} same pointer, contiguous: {d}" if d else ""
                )
                fresh = t_from_np(cq.q, tdev)  # freed and reallocated
                d = first_diff(np_from_t(ops.q_gather(fresh)), cq.ref)
                errors.append(f"rank {comm.rank} rep {rep} fresh tensor: {d}" if d else "")
                del fresh
            out = t_poisoned((T, 8 * comm.world_size, DQ), torch.bfloat16, tdev)
            v = out._version
            ops.q_gather(q, out=out)
            if out._version != v + 1:
                errors.append(f"custom op did not bump out's version ({v} -> {out._version})")

    run_all_ranks(comm, "TorchOps with slices and re-strided views", body)


def test_q_gather_plan_cache_and_every_launcher_match_the_reference(comm, seed, tdev):
    """QGather through its plan cache and packed-parameter launch, on every launcher backend
    (ctypes on libcuda, cuda.bindings, CuPy's own binding: the default), view and out= forms,
    against the reference, with the plan cache hit."""
    from dcpkit.ops import QGather

    H_r = 8

    def body(errors):
        with QGather(
            comm, max_tokens=T_MAX, heads_per_rank=H_r, head_dim=DQ, dtype="bfloat16"
        ) as qg:
            if qg.launch_backend != "cupy":  # CuPy's own cuLaunchKernel binding
                errors.append(f"default launcher: got {qg.launch_backend}, want cupy")
            for backend in ("ctypes", "bindings", "cupy"):
                qg._set_launch_backend(backend)
                hits = qg._plans.hits
                for k, T in enumerate((1, 5, T_MAX)):
                    cq = QCase(comm, sub_seed(seed, k, 9), T=T, H_r=H_r, D=DQ, dtype="bfloat16")
                    q = cupy.asarray(cq.q)
                    out = cupy.full((T, H_r * comm.world_size, DQ), 0xFFFF, dtype=cupy.uint16).view(
                        q.dtype
                    )
                    for rep in range(4):
                        errors.append(cq.check(comm.rank, qg(q), f"{backend} view {rep}"))
                        qg(q, out=out)
                        errors.append(cq.check(comm.rank, out, f"{backend} out= {rep}"))
                if qg._plans.hits == hits:
                    errors.append(f"{backend}: the plan cache was never hit")

    run_all_ranks(comm, "QGather plan cache on every launcher against the reference", body)
