"""DCPComm: the three exchanges of decode context parallelism behind one object.

Needs the CUDA and MPI extras: ``pip install 'dcpkit[cuda12,mpi]'`` (``cuda13`` instead of
``cuda12`` to match the driver). Run with one process per GPU (ranks may share a GPU under MPS)::

    mpirun -np 2 python examples/dcpcomm_step.py

:class:`dcpkit.DCPComm` owns ``q_gather``, ``lse_reduce`` and ``kv_gather`` for one geometry and
picks, per call, the direct kernel or the NCCL version of the op (``dcp.last_path`` says which
ran). Here every rank holds chunk ``r`` of the context of every sequence (tokens
``[r*C, (r+1)*C)``), as rows ``[K | V]`` of width ``2*D``:

1. ``kv_gather`` collects every rank's KV rows (as a chunked-prefill step would);
   ``[B*C, 2*D] -> [W*B*C, 2*D]``, checked bit for bit;
2. a decode step: ``q_gather`` (``[B, H_r, D] -> [B, H, D]``), attention of all heads over the
   local chunk (CuPy, float32), and ``lse_reduce`` with the merged lse
   (``-> [B, H_r, D]`` and ``[B, H_r]``), checked against full attention over the gathered KV.

Prints the paths, ``dcp.describe()`` and PASS or FAIL on rank 0. Exit status: 0 PASS, 1 FAIL,
2 could not run (no GPU, fewer than 2 ranks, the mpirun of another MPI library than mpi4py's).
"""

from __future__ import annotations

import sys

import numpy as np
from _support import connect, gpus_on_every_rank, parse_args, parser, say

import dcpkit

try:
    import cupy
except ImportError:  # main() says which extra brings it
    cupy = None

B = 4  # sequences, one decode token each
C = 16  # context tokens per sequence on each rank
H_R = 4  # query heads per rank
D = 128  # head dim of q, k and v; a KV row is [K | V], 2*D wide
SEED = 7
U = 2.0**-11  # float16 rounding


def kv_rows(world_size: int) -> np.ndarray:
    """Every rank's KV rows, ``[W, B*C, 2*D]`` float16 (rank-major; row ``b*C + i`` of rank
    ``r`` is token ``r*C + i`` of sequence ``b``). Equal on every rank."""
    rng = np.random.default_rng(SEED)
    return rng.standard_normal((world_size, B * C, 2 * D)).astype(np.float16)


def queries(world_size: int) -> np.ndarray:
    rng = np.random.default_rng(SEED + 1)
    return (2 * rng.standard_normal((B, H_R * world_size, D))).astype(np.float16)


def attention(q, k, v, scale):
    """Attention of ``q [H, D]`` over ``k, v [L, D]`` in float32: ``(out [H, D], lse [H])``."""
    s = (q.astype(cupy.float32) @ k.astype(cupy.float32).T) * scale
    m = s.max(axis=1, keepdims=True)
    p = cupy.exp(s - m)
    total = p.sum(axis=1, keepdims=True)
    return (p / total) @ v.astype(cupy.float32), (m + cupy.log(total))[:, 0]


def main(argv=None) -> int:
    parse_args(parser(__file__, __doc__), argv)
    comm = connect("dcpcomm_step")
    if comm is None:
        return 2
    W, r = comm.world_size, comm.rank
    if W < 2:
        say(comm, "dcpcomm_step: run under mpirun with 2 or more ranks (mpirun -np 2 ...)")
        return 2
    ndev = gpus_on_every_rank(comm, "dcpcomm_step")
    if ndev == 0:
        return 2
    cupy.cuda.Device(comm.local_rank % ndev).use()  # ranks may share a GPU

    H = H_R * W
    scale = 1.0 / np.sqrt(D)
    rows = kv_rows(W)
    q = queries(W)
    problems = []

    # Collective: every rank, same geometry. max_tokens bounds T of every op (here B*C rows of
    # kv_gather); a larger call would take the NCCL path.
    with dcpkit.DCPComm(
        comm,
        max_tokens=B * C,
        num_heads=H,
        q_head_dim=D,
        v_head_dim=D,
        kv_row_dim=2 * D,
        dtype="float16",
        return_lse=True,
    ) as dcp:
        # 1. kv_gather: every rank's chunk, rank-major
        kv_all = dcp.kv_gather(cupy.asarray(rows[r]))  # [W*B*C, 2*D]
        paths = {"kv_gather": dcp.last_path}
        kv_host = cupy.asnumpy(kv_all).reshape(W, B, C, 2 * D)
        if not np.array_equal(
            kv_host.view(np.uint16), rows.reshape(W, B, C, 2 * D).view(np.uint16)
        ):
            problems.append("kv_gather is not bit-exact")

        # 2. the decode step: q_gather, local attention over this rank's chunk, lse_reduce
        q_all = dcp.q_gather(cupy.asarray(np.ascontiguousarray(q[:, r * H_R : (r + 1) * H_R])))
        paths["q_gather"] = dcp.last_path
        if not np.array_equal(cupy.asnumpy(q_all).view(np.uint16), q.view(np.uint16)):
            problems.append("q_gather is not bit-exact")
        local = cupy.asarray(rows[r]).reshape(B, C, 2 * D)
        out_partial = cupy.empty((B, H, D), dtype=cupy.float16)
        lse_partial = cupy.empty((B, H), dtype=cupy.float32)
        for b in range(B):
            o, lse = attention(q_all[b], local[b, :, :D], local[b, :, D:], scale)
            out_partial[b] = o.astype(cupy.float16)
            lse_partial[b] = lse
        out, out_lse = dcp.lse_reduce(out_partial, lse_partial)  # [B, H_r, D], [B, H_r]
        paths["lse_reduce"] = dcp.last_path
        got = cupy.asnumpy(out).astype(np.float64)
        got_lse = cupy.asnumpy(out_lse).astype(np.float64)
        described = dcp.describe()

    # Reference: full attention of this rank's heads over the gathered context, float64.
    heads = slice(r * H_R, (r + 1) * H_R)
    kv64 = rows.astype(np.float64).reshape(W, B, C, 2 * D).transpose(1, 0, 2, 3)
    kv64 = kv64.reshape(B, W * C, 2 * D)  # [B, W*C, 2*D]: every chunk of every sequence
    s = np.einsum("bhd,bld->bhl", q[:, heads].astype(np.float64), kv64[..., :D]) * scale
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    want = np.einsum("bhl,bld->bhd", p / p.sum(axis=-1, keepdims=True), kv64[..., D:])
    want_lse = (m + np.log(p.sum(axis=-1, keepdims=True)))[..., 0]
    tol = 2 * U * float(np.abs(kv64[..., D:]).max()) + 1e-3
    err = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
    lse_err = float(np.abs(got_lse - want_lse).max()) if np.isfinite(got_lse).all() else 1e30
    if err > tol:
        problems.append(f"lse_reduce max abs error {err:.3e} > {tol:.3e}")
    if lse_err > 1e-3:
        problems.append(f"merged lse max abs error {lse_err:.3e} > 1e-3")

    every = comm.allgather((problems, paths, err, lse_err))
    say(comm, described)
    for rank, (probs, p_r, e, le) in enumerate(every):
        say(
            comm,
            f"rank {rank}: paths {p_r}; lse_reduce max abs error {e:.3e} "
            f"(tolerance {tol:.3e}), merged lse {le:.3e}; {'; '.join(probs) or 'ok'}",
        )
    passed = not any(x[0] for x in every)
    say(comm, "PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
