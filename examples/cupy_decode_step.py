"""One decode step of attention with decode context parallelism: CuPy arrays, no framework.

Needs the CUDA and MPI extras: ``pip install 'dcpkit[cuda12,mpi]'`` (``cuda13`` instead of
``cuda12`` to match the driver). Run with one process per GPU (ranks may share a GPU under MPS)::

    mpirun -np 2 python examples/cupy_decode_step.py

Every rank holds the queries of its own ``H_r`` heads and one shard of every sequence's KV cache
(token ``i`` of a sequence lives on rank ``i mod W``). One decode step is:

1. ``q_gather``: every rank gets the queries of all ``H = W * H_r`` heads,
   ``q [B, H_r, D] -> q_all [B, H, D]``;
2. attention of all heads over the local KV shard, in float32 with CuPy: a partial output
   ``[B, H, D]`` and its natural-log log-sum-exp ``[B, H]``. Where the shard holds no token of a
   sequence the lse is ``-inf`` and the partial output NaN: ``lse_reduce`` never reads it;
3. ``lse_reduce``: every rank gets the exact attention output of its own heads,
   ``[B, H, D] + [B, H] -> [B, H_r, D]``.

Every rank builds the whole problem from one seed, so it can check its own heads against full
attention over the whole KV cache (float64, NumPy) and ``q_all`` bit for bit; the ranks agree
on the verdict. Prints PASS or FAIL on rank 0. Exit status: 0 PASS, 1 FAIL, 2 could not run
(no GPU, fewer than 2 ranks, the mpirun of another MPI library than mpi4py's).
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

B = 4  # sequences in the batch: one decode token each (T = B)
H_R = 4  # query heads per rank
D = 128  # head dim of q, k and v
SEED = 2024
#: float16 input, float32 accumulation: error bound of the merged output (2 roundings of 2^-11)
U = 2.0**-11


def make_problem(world_size: int):
    """The whole decode step, equal on every rank: ``q [B, H, D]`` and per sequence ``(K, V)``,
    each ``[L_b, D]`` float16. The last sequence has ``W - 1`` tokens, so one rank holds none."""
    rng = np.random.default_rng(SEED)
    q = (2 * rng.standard_normal((B, H_R * world_size, D))).astype(np.float16)
    lengths = (257, 64, 33, world_size - 1)
    kv = [
        (
            rng.standard_normal((n, D)).astype(np.float16),
            rng.standard_normal((n, D)).astype(np.float16),
        )
        for n in lengths
    ]
    return q, kv


def partial_attention(q_all, shards, scale: float):
    """Attention of all heads over this rank's KV shard: ``(out [B, H, D] float16, lse [B, H]
    float32)``; an empty shard gives lse ``-inf`` and a NaN output."""
    heads = q_all.shape[1]
    out = cupy.full((B, heads, D), cupy.nan, dtype=cupy.float16)
    lse = cupy.full((B, heads), -cupy.inf, dtype=cupy.float32)
    for b, (k, v) in enumerate(shards):
        if k.shape[0] == 0:
            continue
        s = (q_all[b].astype(cupy.float32) @ k.astype(cupy.float32).T) * scale  # [H, L]
        m = s.max(axis=1, keepdims=True)
        p = cupy.exp(s - m)
        total = p.sum(axis=1, keepdims=True)
        out[b] = ((p / total) @ v.astype(cupy.float32)).astype(cupy.float16)
        lse[b] = (m + cupy.log(total))[:, 0]
    return out, lse


def reference(q, kv, rank: int, scale: float) -> np.ndarray:
    """Full attention of this rank's heads over the whole KV cache, float64: ``[B, H_r, D]``."""
    heads = slice(rank * H_R, (rank + 1) * H_R)
    out = np.empty((B, H_R, D))
    for b, (k, v) in enumerate(kv):
        s = q[b, heads].astype(np.float64) @ k.astype(np.float64).T * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b] = (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    return out


def main(argv=None) -> int:
    parse_args(parser(__file__, __doc__), argv)
    comm = connect("cupy_decode_step")
    if comm is None:
        return 2
    W, r = comm.world_size, comm.rank
    if W < 2:
        say(comm, "cupy_decode_step: run under mpirun with 2 or more ranks (mpirun -np 2 ...)")
        return 2
    ndev = gpus_on_every_rank(comm, "cupy_decode_step")
    if ndev == 0:
        return 2
    cupy.cuda.Device(comm.local_rank % ndev).use()  # ranks may share a GPU

    H = H_R * W
    scale = 1.0 / np.sqrt(D)
    q, kv = make_problem(W)
    q_mine = cupy.asarray(np.ascontiguousarray(q[:, r * H_R : (r + 1) * H_R]))  # [B, H_r, D]
    shards = [
        (cupy.asarray(np.ascontiguousarray(k[r::W])), cupy.asarray(np.ascontiguousarray(v[r::W])))
        for k, v in kv
    ]

    # Collective: every rank builds the ops with the same geometry, in the same order.
    with (
        dcpkit.QGather(comm, max_tokens=B, heads_per_rank=H_R, head_dim=D, dtype="float16") as qg,
        dcpkit.LseReduce(comm, max_tokens=B, num_heads=H, head_dim=D, dtype="float16") as lr,
    ):
        q_all = qg(q_mine)  # [B, H, D]: a view of qg's workspace, read before qg's next call
        out_partial, lse_partial = partial_attention(q_all, shards, scale)
        out = lr(out_partial, lse_partial)  # [B, H_r, D] float16
        q_all_host = cupy.asnumpy(q_all)
        got = cupy.asnumpy(out).astype(np.float64)

    want = reference(q, kv, r, scale)
    max_v = max(float(np.abs(v.astype(np.float64)).max()) for _, v in kv if v.size)
    tol = 2 * U * max_v + 1e-3
    err = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
    q_exact = np.array_equal(q_all_host.view(np.uint16), q.view(np.uint16))
    ok = q_exact and err <= tol
    every = comm.allgather((ok, q_exact, err))
    for rank, (_, q_ok, e) in enumerate(every):
        say(
            comm,
            f"rank {rank}: q_gather bit-exact {q_ok}, lse_reduce max abs error {e:.3e} "
            f"(tolerance {tol:.3e})",
        )
    passed = all(x[0] for x in every)
    say(comm, "PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
