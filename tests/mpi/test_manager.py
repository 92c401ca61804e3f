"""DCPComm on GPUs: which path serves each call (asserted on every rank), direct and NCCL
results equal (bit-exact gathers, lse_reduce within tolerance, all three NCCL lse algorithms),
T past the capacity, forced policies, mismatched policies, per-rank layouts.

Run (every rank runs every test in the same order)::

    mpirun -np 2 python -m pytest tests/mpi/test_manager.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_manager.py -p no:cacheprovider

Where ranks share a GPU, NCCL cannot start (one GPU per rank): the tests of the NCCL path skip
(``nccl_usable``), the direct parts still run, and
``test_auto_without_nccl_is_direct_only_and_says_why`` checks that DCPComm then runs
direct-only, names the reason and refuses calls that need NCCL on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from dcpkit.errors import ConfigMismatch, InvalidArgument
from dcpkit.fallback import LSE_ALGORITHMS, NcclLseReduce
from dcpkit.manager import DCPComm

from _dcp_checks import (
    KVCase,
    LseCase,
    QCase,
    bits,
    close_enough,
    empty_poisoned,
    first_diff,
    run_all_ranks,
    sub_seed,
    to_gpu,
    to_host,
)

cupy = pytest.importorskip("cupy")

T_MAX = 16
DQ, DV, DKV = 576, 512, 576
DTYPE = "bfloat16"


def _geometry(comm, **kw):
    g = dict(
        max_tokens=T_MAX,
        num_heads=8 * comm.world_size,
        q_head_dim=DQ,
        v_head_dim=DV,
        kv_row_dim=DKV,
        dtype=DTYPE,
    )
    g.update(kw)
    return g


@pytest.fixture(scope="module")
def dcp_auto(comm):
    d = DCPComm(comm, **_geometry(comm))
    yield d
    d.close()


@pytest.fixture(scope="module")
def dcp_nccl(comm, nccl_usable):
    d = DCPComm(comm, policy="nccl", **_geometry(comm))
    yield d
    d.close()


def _path_everywhere(comm, dcp, want_prefix: str, what: str, errors) -> None:
    """Every rank's last_path starts with ``want_prefix`` (checked with every rank's value)."""
    paths = comm.allgather(dcp.last_path)
    bad = [r for r, p in enumerate(paths) if not str(p).startswith(want_prefix)]
    if bad:
        errors.append(f"{what}: expected path {want_prefix}* on every rank, got {paths}")


def test_direct_within_capacity_equals_nccl(comm, seed, dcp_auto, nccl_expected, request):
    """T in {1, 5, T_max}: auto takes the direct path on every rank, policy='nccl' takes NCCL;
    both equal the reference and each other (bit-exact gathers, lse_reduce within
    tolerance). Where ranks share a GPU (no NCCL), the direct path against the reference."""
    H = 8 * comm.world_size
    H_r = H // comm.world_size
    r = comm.rank
    dcp_nccl = request.getfixturevalue("dcp_nccl") if nccl_expected else None

    def body(errors):
        if dcp_auto.direct_reason["q_gather"] is not None:
            errors.append(f"no direct path on this machine: {dcp_auto.describe()}")
            return
        for k, T in enumerate((1, 5, T_MAX)):
            cq = QCase(comm, sub_seed(seed, k, 1), T=T, H_r=H_r, D=DQ, dtype=DTYPE)
            q = to_gpu(cq.q)
            got = {"direct": to_host(dcp_auto.q_gather(q))}
            _path_everywhere(comm, dcp_auto, "direct-", f"q_gather T={T} auto", errors)
            if dcp_nccl is not None:
                got["nccl"] = to_host(dcp_nccl.q_gather(q))
                _path_everywhere(comm, dcp_nccl, "nccl", f"q_gather T={T} nccl", errors)
            for name, g in got.items():
                diff = first_diff(g, cq.ref)
                if diff:
                    errors.append(f"rank {r} q_gather T={T} {name}: {diff}")
            if dcp_nccl is not None and first_diff(got["direct"], got["nccl"]):
                errors.append(
                    f"rank {r} q_gather T={T}: direct != nccl: "
                    f"{first_diff(got['direct'], got['nccl'])}"
                )

            ck = KVCase(comm, sub_seed(seed, k, 2), T=T, D=DKV, dtype=DTYPE)
            kv = to_gpu(ck.kv)
            got = {"direct": to_host(dcp_auto.kv_gather(kv))}
            _path_everywhere(comm, dcp_auto, "direct-", f"kv_gather T={T} auto", errors)
            if dcp_nccl is not None:
                got["nccl"] = to_host(dcp_nccl.kv_gather(kv))
                _path_everywhere(comm, dcp_nccl, "nccl", f"kv_gather T={T} nccl", errors)
            for name, g in got.items():
                diff = first_diff(g, ck.ref)
                if diff:
                    errors.append(f"rank {r} kv_gather T={T} {name}: {diff}")

            cl = LseCase(
                comm,
                sub_seed(seed, k, 3),
                T=T,
                H=H,
                D=DV,
                dtype=DTYPE,
                num_requests=2 if T > 1 else 0,
            )
            x, l, kw = cl.gpu_args()
            out_l = empty_poisoned((T, H_r), "float32")
            od, ld = dcp_auto.lse_reduce(x, l, out_lse=out_l, **kw)
            _path_everywhere(comm, dcp_auto, "direct-", f"lse_reduce T={T} auto", errors)
            od, ld = to_host(od), to_host(ld)
            errors.append(cl.check_host(r, od, ld, f"T={T} direct"))
            if dcp_nccl is not None:
                on = to_host(dcp_nccl.lse_reduce(x, l, **kw))
                _path_everywhere(comm, dcp_nccl, "nccl", f"lse_reduce T={T} nccl", errors)
                errors.append(cl.check_host(r, on, None, f"T={T} nccl"))
                diff = close_enough(od.astype(np.float64), on.astype(np.float64), DTYPE)
                if diff:
                    errors.append(f"rank {r} lse_reduce T={T}: direct vs nccl: {diff}")

    run_all_ranks(comm, "DCPComm direct == NCCL", body)


def test_past_capacity_goes_to_nccl_on_every_rank(comm, seed, nccl_usable, dcp_auto):
    H = 8 * comm.world_size
    H_r = H // comm.world_size
    r = comm.rank

    def body(errors):
        before = {op: dict(c) for op, c in dcp_auto.counters.items()}
        for k, T in enumerate((T_MAX + 1, 3 * T_MAX)):
            cq = QCase(comm, sub_seed(seed, 20, k), T=T, H_r=H_r, D=DQ, dtype=DTYPE)
            errors.append(cq.check(r, dcp_auto.q_gather(to_gpu(cq.q)), f"T={T} > max_tokens"))
            _path_everywhere(comm, dcp_auto, "nccl", f"q_gather T={T}", errors)
            ck = KVCase(comm, sub_seed(seed, 21, k), T=T, D=DKV, dtype=DTYPE)
            errors.append(ck.check(r, dcp_auto.kv_gather(to_gpu(ck.kv)), f"T={T}"))
            _path_everywhere(comm, dcp_auto, "nccl", f"kv_gather T={T}", errors)
            cl = LseCase(comm, sub_seed(seed, 22, k), T=T, H=H, D=DV, dtype=DTYPE, num_requests=3)
            x, l, kw = cl.gpu_args()
            errors.append(cl.check(r, dcp_auto.lse_reduce(x, l, **kw), where=f"T={T}"))
            _path_everywhere(comm, dcp_auto, "nccl", f"lse_reduce T={T}", errors)
        for op in ("q_gather", "kv_gather", "lse_reduce"):
            if dcp_auto.counters[op]["nccl"] - before[op]["nccl"] != 2:
                errors.append(f"{op}: nccl counter {before[op]} -> {dcp_auto.counters[op]}")
        text = dcp_auto.describe()
        if "nccl=" not in text or "last_path: nccl" not in text:
            errors.append(f"describe() does not show the NCCL calls:\n{text}")

    run_all_ranks(comm, "DCPComm T > max_tokens", body)


def test_nccl_lse_algorithms_equal_direct(comm, seed, nccl_usable, dcp_auto):
    """The three NCCL lse_reduce algorithms against the direct op on the same inputs (the
    all-reduce variant against the direct outputs of every rank)."""
    H = 8 * comm.world_size
    r = comm.rank
    direct = dcp_auto.direct_ops["lse_reduce"]

    def body(errors):
        if direct is None:
            errors.append(f"no direct lse_reduce: {dcp_auto.direct_reason['lse_reduce']}")
            return
        for a, algorithm in enumerate(LSE_ALGORITHMS):
            with NcclLseReduce(
                comm,
                max_tokens=T_MAX,
                num_heads=H,
                head_dim=DV,
                dtype=DTYPE,
                algorithm=algorithm,
                nccl_group=dcp_auto.nccl_group,
            ) as op:
                for k, T in enumerate((1, 7, T_MAX)):
                    c = LseCase(
                        comm, sub_seed(seed, 30, a, k), T=T, H=H, D=DV, dtype=DTYPE, num_requests=2
                    )
                    x, l, kw = c.gpu_args()
                    od = to_host(direct(x, l, **kw)[0])  # [T, H_r, D_v]
                    on = to_host(op(x, l, **kw))
                    every = comm.allgather(bits(od).tobytes())
                    if algorithm == "allgather_all_reduce":
                        all_d = np.concatenate(
                            [
                                np.frombuffer(b, np.uint16).view(od.dtype).reshape(od.shape)
                                for b in every
                            ],
                            axis=1,
                        )
                        diff = close_enough(all_d.astype(np.float64), on.astype(np.float64), DTYPE)
                    else:
                        diff = close_enough(od.astype(np.float64), on.astype(np.float64), DTYPE)
                        errors.append(c.check_host(r, on, None, f"{algorithm}"))
                    if diff:
                        errors.append(f"rank {r} {algorithm} T={T}: direct vs nccl: {diff}")

    run_all_ranks(comm, "NCCL lse algorithms == direct", body)


def test_auto_without_nccl_is_direct_only_and_says_why(comm, seed, dcp_auto, nccl_expected):
    """One GPU per rank: policy 'auto' built its NCCL ops (nccl_reason None). Ranks sharing a
    GPU: NCCL cannot start, so 'auto' is direct-only on every rank with the reason recorded
    (nccl_reason, describe()); calls that need NCCL (T > max_tokens, a float64 lse) raise
    InvalidArgument naming it on every rank, before any transfer; policy 'nccl' raises at
    construction on every rank; the direct path still serves T <= max_tokens."""
    H = 8 * comm.world_size
    H_r = H // comm.world_size
    r = comm.rank

    def body(errors):
        reasons = comm.allgather(dcp_auto.nccl_reason)
        if nccl_expected:
            if any(x is not None for x in reasons) or dcp_auto.nccl_group is None:
                errors.append(f"one GPU per rank, yet NCCL is unavailable: {reasons}")
            return
        why = reasons[0]
        if (
            why is None
            or any(x != why for x in reasons)
            or not why.startswith("NCCL needs one GPU per rank: ranks ")
        ):
            errors.append(f"ranks share a GPU: nccl_reason per rank {reasons}")
            return
        if any(o is not None for o in dcp_auto.nccl_ops.values()):
            errors.append(f"NCCL ops built although NCCL is unavailable: {dcp_auto.nccl_ops}")
        if f"nccl: unavailable: {why}" not in dcp_auto.describe():
            errors.append(f"describe() does not name the reason:\n{dcp_auto.describe()}")
        calls = {
            "q_gather T > max_tokens": lambda: dcp_auto.q_gather(
                to_gpu(QCase(comm, sub_seed(seed, 45), T=T_MAX + 1, H_r=H_r, D=DQ, dtype=DTYPE).q)
            ),
            "float64 lse": lambda: dcp_auto.lse_reduce(
                *LseCase(
                    comm, sub_seed(seed, 46), T=3, H=H, D=DV, dtype=DTYPE, lse_dtype="float64"
                ).gpu_args()[:2]
            ),
        }
        for what, call in calls.items():
            try:
                call()
                errors.append(f"{what}: no error without NCCL")
            except InvalidArgument as e:
                if f"NCCL is unavailable ({why})" not in str(e):
                    errors.append(f"{what}: the error does not name the reason: {e}")
        try:
            DCPComm(comm, policy="nccl", **_geometry(comm)).close()
            errors.append("policy='nccl' was built although ranks share a GPU")
        except InvalidArgument as e:
            if f"policy 'nccl' cannot be served: NCCL is unavailable ({why})" not in str(e):
                errors.append(f"policy='nccl': unexpected message: {e}")
        cq = QCase(comm, sub_seed(seed, 47), T=T_MAX, H_r=H_r, D=DQ, dtype=DTYPE)
        errors.append(cq.check(r, dcp_auto.q_gather(to_gpu(cq.q)), "T = max_tokens, no NCCL"))
        _path_everywhere(comm, dcp_auto, "direct-", "q_gather without NCCL", errors)

    run_all_ranks(comm, "DCPComm auto without NCCL", body)


def test_policy_direct_refuses_past_capacity_on_every_rank(comm, seed):
    H_r = 8

    def body(errors):
        with DCPComm(comm, policy="direct", **_geometry(comm)) as dcp:
            if dcp.nccl_ops["q_gather"] is not None:
                errors.append("policy='direct' built NCCL ops")
            cq = QCase(comm, sub_seed(seed, 40), T=T_MAX + 1, H_r=H_r, D=DQ, dtype=DTYPE)
            try:
                dcp.q_gather(to_gpu(cq.q))
                errors.append("T > max_tokens with policy='direct' did not raise")
            except InvalidArgument as e:
                if "policy 'direct' cannot serve this call: T must be <= max_tokens" not in str(e):
                    errors.append(f"unexpected message: {e}")
            if dcp.last_path is not None:
                errors.append(f"a refused call recorded a path: {dcp.last_path}")
            cq = QCase(comm, sub_seed(seed, 41), T=T_MAX, H_r=H_r, D=DQ, dtype=DTYPE)
            errors.append(cq.check(comm.rank, dcp.q_gather(to_gpu(cq.q)), "T = max_tokens"))
            _path_everywhere(comm, dcp, "direct-", "policy direct at capacity", errors)

    run_all_ranks(comm, "policy='direct' past capacity", body)


def test_mismatched_policies_raise_config_mismatch_naming_ranks(comm):
    policy = "nccl" if comm.rank == 1 else "auto"

    def body(errors):
        try:
            DCPComm(comm, policy=policy, **_geometry(comm)).close()
            errors.append("no ConfigMismatch")
        except ConfigMismatch as e:
            if e.ranks != [1] or "DCPComm: policy" not in str(e):
                errors.append(f"ConfigMismatch names ranks {e.ranks}: {e}")

    run_all_ranks(comm, "mismatched policies", body)


def test_float64_lse_goes_to_nccl(comm, seed, nccl_usable, dcp_auto):
    H = 8 * comm.world_size

    def body(errors):
        c = LseCase(comm, sub_seed(seed, 50), T=5, H=H, D=DV, dtype=DTYPE, lse_dtype="float64")
        x, l, kw = c.gpu_args()
        errors.append(c.check(comm.rank, dcp_auto.lse_reduce(x, l, **kw), where="float64 lse"))
        _path_everywhere(comm, dcp_auto, "nccl", "float64 lse", errors)

    run_all_ranks(comm, "float64 lse_partial", body)


def test_per_rank_layouts_do_not_change_the_path(comm, seed, dcp_auto):
    """Rank 0 passes a misaligned q and out_partial, rank 1 a strided out=: every rank still
    takes the direct path (the layouts are normalised by copies) and gets the right result."""
    H = 8 * comm.world_size
    H_r = H // comm.world_size
    r = comm.rank

    def body(errors):
        cq = QCase(comm, sub_seed(seed, 60), T=5, H_r=H_r, D=DQ, dtype=DTYPE)
        q = to_gpu(cq.q)
        out = None
        if r == 0:  # 2 bytes off the 16-byte alignment
            buf = empty_poisoned((q.size + 8,), DTYPE)
            bits(buf)[1 : 1 + q.size] = bits(q).ravel()
            q = buf[1 : 1 + q.size].reshape(q.shape)
        if r == 1:  # strided destination
            wide = empty_poisoned((5, H + 1, DQ), DTYPE)
            out = wide[:, 1:]
        res = dcp_auto.q_gather(q, out=out)
        errors.append(cq.check(r, res, f"rank {r} layout"))
        _path_everywhere(comm, dcp_auto, "direct-", "q_gather with per-rank layouts", errors)

        cl = LseCase(comm, sub_seed(seed, 61), T=5, H=H, D=DV, dtype=DTYPE)
        x, l, kw = cl.gpu_args()
        if r == 0:
            buf = empty_poisoned((x.size + 8,), DTYPE)
            bits(buf)[1 : 1 + x.size] = bits(x).ravel()
            x = buf[1 : 1 + x.size].reshape(x.shape)
        errors.append(cl.check(r, dcp_auto.lse_reduce(x, l, **kw), where="per-rank layouts"))
        _path_everywhere(comm, dcp_auto, "direct-", "lse_reduce with per-rank layouts", errors)

    run_all_ranks(comm, "per-rank layouts", body)


def test_the_three_direct_ops_share_one_heap_in_disjoint_regions(comm, seed):
    """One SymmetricHeap per DCPComm: every direct op reserves its region in it (no two
    regions overlap), calls on all three still equal the reference, and closing DCPComm closes
    the heap (the ops never own it)."""
    H = 8 * comm.world_size
    H_r = H // comm.world_size
    dcp = DCPComm(comm, **_geometry(comm))
    heap = dcp.heap

    def body(errors):
        if any(dcp.direct_reason[op] is not None for op in dcp.ops):
            errors.append(f"no direct path on this machine: {dcp.describe()}")
            return
        if heap is None or heap.closed:
            errors.append(f"DCPComm.heap is {heap!r}")
            return
        spans = []
        for op in dcp.ops:
            o = dcp.direct_ops[op]
            if o.heap is not heap or o._owns_heap:
                errors.append(f"{op}: its heap is {o.heap!r}, not DCPComm's {heap!r}")
            spans.append((o._base, o._base + o._region, op))
        spans.sort()
        for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
            if b0 < a1:
                errors.append(f"regions overlap: {a} [{a0}, {a1}) and {b} [{b0}, {b1})")
        if spans[-1][1] > heap.nbytes:
            errors.append(f"{spans[-1][2]} ends at {spans[-1][1]} past the heap's {heap.nbytes}")
        r = comm.rank
        cq = QCase(comm, sub_seed(seed, 7, 1), T=5, H_r=H_r, D=DQ, dtype=DTYPE)
        ck = KVCase(comm, sub_seed(seed, 7, 2), T=5, D=DKV, dtype=DTYPE)
        cl = LseCase(comm, sub_seed(seed, 7, 3), T=5, H=H, D=DV, dtype=DTYPE)
        errors.append(cq.check(r, dcp.q_gather(to_gpu(cq.q)), "(shared heap)"))
        errors.append(ck.check(r, dcp.kv_gather(to_gpu(ck.kv)), "(shared heap)"))
        x, lse, kw = cl.gpu_args()
        errors.append(cl.check(r, dcp.lse_reduce(x, lse, **kw), where="shared heap"))
        dcp.synchronize()

    try:
        run_all_ranks(comm, "one heap for the three direct ops", body)
    finally:
        dcp.close()
    assert heap is None or heap.closed, "closing DCPComm must close its heap"


def test_dcpcomm_programmatic_launch_reaches_every_direct_op(comm, seed):
    """DCPComm(programmatic_launch=True) builds its direct ops with the option, and their
    calls give the reference results."""
    r, W = comm.rank, comm.world_size
    H, H_r = 8 * W, 8

    def body(errors):
        with DCPComm(comm, programmatic_launch=True, **_geometry(comm)) as dcp:
            for op, o in dcp.direct_ops.items():
                if o is None:
                    errors.append(f"{op}: no direct op ({dcp.describe()})")
                elif o.programmatic_launch is not True:
                    errors.append(f"{op}: built without programmatic_launch")
            cq = QCase(comm, sub_seed(seed, 40), T=3, H_r=H_r, D=DQ, dtype=DTYPE)
            errors.append(cq.check(r, dcp.q_gather(to_gpu(cq.q)), "programmatic"))
            ck = KVCase(comm, sub_seed(seed, 41), T=3, D=DKV, dtype=DTYPE)
            errors.append(ck.check(r, dcp.kv_gather(to_gpu(ck.kv)), "programmatic"))
            cl = LseCase(comm, sub_seed(seed, 42), T=3, H=H, D=DV, dtype=DTYPE)
            x, l, kw = cl.gpu_args()
            errors.append(cl.check(r, dcp.lse_reduce(x, l, **kw), where="programmatic"))

    run_all_ranks(comm, "DCPComm(programmatic_launch=True)", body)
