"""A decode step with decode context parallelism in torch, captured once in a CUDA graph.

Needs the CUDA, MPI and torch extras: ``pip install 'dcpkit[cuda12,mpi,torch]'`` (``cuda13``
instead of ``cuda12`` to match the driver; torch must be a CUDA build). Run with one process
per GPU (ranks may share a GPU under MPS)::

    mpirun -np 2 python examples/torch_cuda_graph.py

The step is ``q_gather`` -> attention of all heads over this rank's KV shard (torch, float32) ->
``lse_reduce``, on bf16 tensors. :class:`dcpkit.torch.TorchOps` runs dcpkit's ops on torch
tensors without a copy, on the current torch stream; called with ``out=`` they are the torch
custom ops ``torch.ops.dcpkit.q_gather`` / ``torch.ops.dcpkit.lse_reduce``, which write into
the caller's tensors and allocate nothing, so the whole step can be captured in one
``torch.cuda.CUDAGraph`` (after an eager warm-up) and replayed with new queries copied into the
graph's input tensor. The KV shard of each sequence (token ``i`` on rank ``i mod W``) is padded
to the longest shard with a mask; a shard with no token of a sequence gives lse ``-inf`` and a
NaN partial output, which ``lse_reduce`` never reads.

Every replay is checked on every rank against full attention over the whole KV cache (float64,
NumPy), ``q_gather`` bit for bit; the ranks agree on the verdict. Prints PASS or FAIL on
rank 0. Exit status: 0 PASS, 1 FAIL, 2 could not run (no torch, no GPU, fewer than 2 ranks, the
mpirun of another MPI library than mpi4py's).
"""

from __future__ import annotations

import sys

import numpy as np
from _support import connect, missing, parse_args, parser, say, torch_problem

import dcpkit

B = 4  # sequences, one decode token each
H_R = 4  # query heads per rank
D = 128  # head dim of q, k and v
SEED = 99
REPLAYS = 3
U = 2.0**-8  # bfloat16 rounding


def make_kv(torch, world_size: int):
    """Per sequence ``(K, V)``, each ``[L_b, D]`` bfloat16 on the host, equal on every rank;
    the last sequence has ``W - 1`` tokens, so one rank holds none of it."""
    g = torch.Generator().manual_seed(SEED)
    lengths = (257, 64, 33, world_size - 1)
    return [
        (torch.randn(n, D, generator=g).bfloat16(), torch.randn(n, D, generator=g).bfloat16())
        for n in lengths
    ]


def make_queries(torch, world_size: int, i: int):
    """The queries of replay ``i``, all heads: ``[B, H, D]`` bfloat16 on the host."""
    g = torch.Generator().manual_seed(SEED + 1 + i)
    return (2 * torch.randn(B, H_R * world_size, D, generator=g)).bfloat16()


def local_shard(torch, kv, rank: int, world_size: int, device):
    """This rank's tokens of every sequence, padded: ``K, V [B, L, D]`` float32 and a mask
    ``valid [B, L]`` (False on padding)."""
    parts = [(k[rank::world_size], v[rank::world_size]) for k, v in kv]
    n_max = max(1, max(k.shape[0] for k, _ in parts))
    k_loc = torch.zeros(B, n_max, D)
    v_loc = torch.zeros(B, n_max, D)
    valid = torch.zeros(B, n_max, dtype=torch.bool)
    for b, (k, v) in enumerate(parts):
        k_loc[b, : k.shape[0]] = k.float()
        v_loc[b, : v.shape[0]] = v.float()
        valid[b, : k.shape[0]] = True
    return k_loc.to(device), v_loc.to(device), valid.to(device)


def decode_step(torch, ops, q_s, q_all_s, k_loc, v_loc, valid, scale, out_s) -> None:
    """One step, from the static input ``q_s [B, H_r, D]`` into the static output
    ``out_s [B, H_r, D]`` (``q_all_s [B, H, D]`` holds the gathered queries). Capturable: the
    dcpkit calls take ``out=``, and torch's temporaries come from the graph's memory pool."""
    ops.q_gather(q_s, out=q_all_s)
    s = torch.einsum("bhd,bld->bhl", q_all_s.float(), k_loc) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H]; -inf where this shard is empty
    p = torch.exp(s - lse[..., None])  # NaN rows where the shard is empty: never read
    part = torch.einsum("bhl,bld->bhd", p, v_loc).to(torch.bfloat16).contiguous()
    ops.lse_reduce(part, lse.contiguous(), out=out_s)


def reference(q, kv, rank: int, scale: float) -> np.ndarray:
    """Full attention of this rank's heads over the whole KV cache, float64: ``[B, H_r, D]``."""
    q64 = q[:, rank * H_R : (rank + 1) * H_R].double().numpy()
    out = np.empty((B, H_R, D))
    for b, (k, v) in enumerate(kv):
        s = q64[b] @ k.double().numpy().T * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b] = (p / p.sum(axis=1, keepdims=True)) @ v.double().numpy()
    return out


def main(argv=None) -> int:
    parse_args(parser(__file__, __doc__), argv)
    comm = connect("torch_cuda_graph")
    if comm is None:
        return 2
    W, r = comm.world_size, comm.rank
    if W < 2:
        say(comm, "torch_cuda_graph: run under mpirun with 2 or more ranks (mpirun -np 2 ...)")
        return 2
    try:
        import cupy
        import torch

        from dcpkit.torch import TorchOps
    except ImportError as e:
        torch = None
        why = missing(e)
    else:
        why = torch_problem(torch)
    if not all(comm.allgather(not why)):
        say(comm, f"torch_cuda_graph: could not run on every rank: {why or 'another rank'}")
        return 2
    dev = comm.local_rank % torch.cuda.device_count()  # ranks may share a GPU
    torch.cuda.set_device(dev)
    cupy.cuda.Device(dev).use()  # dcpkit builds its workspaces on CuPy's current device
    device = torch.device("cuda", dev)

    H = H_R * W
    scale = 1.0 / D**0.5
    kv = make_kv(torch, W)
    k_loc, v_loc, valid = local_shard(torch, kv, r, W, device)
    q_s = torch.zeros(B, H_R, D, dtype=torch.bfloat16, device=device)
    q_all_s = torch.zeros(B, H, D, dtype=torch.bfloat16, device=device)
    out_s = torch.zeros(B, H_R, D, dtype=torch.bfloat16, device=device)
    problems = []

    # Collective: every rank, same geometry and order.
    with (
        dcpkit.DCPComm(
            comm, max_tokens=B, num_heads=H, q_head_dim=D, v_head_dim=D, dtype="bfloat16"
        ) as dcp,
        TorchOps(dcp) as ops,
    ):

        def step():
            decode_step(torch, ops, q_s, q_all_s, k_loc, v_loc, valid, scale, out_s)

        side = torch.cuda.Stream()  # warm up on a side stream, as torch recommends
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        path = dcp.last_path

        for i in range(REPLAYS):
            q = make_queries(torch, W, i)
            q_s.copy_(q[:, r * H_R : (r + 1) * H_R])
            out_s.fill_(float("nan"))  # a replay that wrote nothing cannot pass
            q_all_s.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(q_all_s.cpu().view(torch.int16), q.view(torch.int16)):
                problems.append(f"replay {i}: q_gather is not bit-exact")
            got = out_s.double().cpu().numpy()
            want = reference(q, kv, r, scale)
            max_v = max(float(v.double().abs().max()) for _, v in kv if v.numel())
            tol = 2 * U * max_v + 1e-3
            err = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
            if err > tol:
                problems.append(f"replay {i}: lse_reduce max abs error {err:.3e} > {tol:.3e}")
        del graph

    every = comm.allgather((problems, path))
    for rank, (probs, p) in enumerate(every):
        say(comm, f"rank {rank}: {REPLAYS} graph replays, path {p}: {'; '.join(probs) or 'ok'}")
    passed = not any(x[0] for x in every)
    say(comm, "PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
