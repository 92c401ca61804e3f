"""One MLA decode step with decode context parallelism, written exactly as vLLM's MLA attention
calls its DCP manager, on dcpkit's vLLM-shaped classes; checked against full attention of the
whole KV (``torch.nn.functional.scaled_dot_product_attention``).

Needs the CUDA, MPI and torch extras: ``pip install 'dcpkit[cuda12,mpi,torch]'`` (``cuda13``
instead of ``cuda12`` to match the driver; torch must be a CUDA build). Run (one process per
GPU; ranks may share a GPU for a functional run)::

    mpirun -np 2 python examples/vllm_api.py          # Open MPI as root: --allow-run-as-root
    mpirun -np 4 python examples/vllm_api.py --comm-backend ag_rs

Every rank

1. joins a gloo ``torch.distributed`` group built from the MPI job (gloo carries dcpkit's host
   exchange, so ranks sharing a GPU work too) and builds ``MLADCPManager`` on it;
2. builds its shard of the step from ``--seed``: the queries of its own heads ``[T, H_r, 576]``
   (absorbed MLA: 512 latent + 64 rope), and the KV tokens ``j`` of every request with
   ``j % world_size == rank`` (request 0 is shorter than the world size, so some ranks hold no
   KV for it); two padding rows at the end of the batch, as a CUDA graph pads;
3. ``query_gather`` -> attention of all heads over its KV shard (natural-log lse; rows with no
   KV here, an empty shard or a padding row, attend over a stale slot and give finite garbage,
   as a kernel run on padded metadata does) -> ``combine`` with ``seq_lens`` /
   ``query_start_loc``, which mask those rows -> the output of its own heads ``[T, H_r, 512]``;
4. checks it against SDPA over the whole KV in fp32 (max abs error within
   ``2 u max|V| + 1e-3``, ``u = 2^-8``; padding rows exactly 0), then gathers a chunk of
   compressed KV with ``init_kv_gather`` / ``kv_gather`` in vLLM's workspace layout and checks
   it bit for bit.

Rank 0 prints every rank's lines, then PASS or FAIL (agreed across ranks). Exit status 0 PASS,
1 FAIL, 2 could not run (no torch, no GPU, fewer than 2 ranks, the mpirun of another MPI library
than mpi4py's), with one line saying why.
"""

from __future__ import annotations

import datetime
import math
import socket
import sys

from _support import connect, integer, missing, parse_args, parser, say, torch_problem

D_LATENT, D_ROPE = 512, 64
D_Q = D_LATENT + D_ROPE  # query / KV row width of absorbed MLA
CONTEXTS = (1, 37, 100, 6)  # tokens of each request (request 0: shorter than world_size)
PAD_ROWS = 2


def init_group(comm):
    """A gloo group of the MPI job's ranks (rank 0 picks the port)."""
    import torch.distributed as dist

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    host = "127.0.0.1" if not comm.spans_hosts else socket.gethostname()
    host, port = comm.broadcast((host, port), root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=comm.rank,
        world_size=comm.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    return dist.group.WORLD


def make_step(seed, world_size, rank, heads_per_rank, device, contexts=CONTEXTS, pad_rows=PAD_ROWS):
    """This rank's inputs of one decode step and its reference output, reproducible on every
    rank from ``seed`` alone (every rank rebuilds the whole KV for the reference)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    B, W, H_r = len(contexts), world_size, heads_per_rank
    T, H = B + pad_rows, W * H_r
    q = torch.randn(T, H, D_Q, generator=g).to(torch.bfloat16)
    kv = [torch.randn(n, D_Q, generator=g).to(torch.bfloat16) for n in contexts]
    local = [x[rank::W] for x in kv]  # token j lives on rank j % W
    n_max = max(1, max(len(x) for x in local))
    kv_local = torch.zeros(T, n_max, D_Q, dtype=torch.bfloat16)
    valid = torch.zeros(T, n_max, dtype=torch.bool)
    for b, x in enumerate(local):
        kv_local[b, : len(x)] = x
        valid[b, : len(x)] = True
    # Rows with no KV here (an empty shard of a request, or a padding row of the batch) attend
    # over one stale slot, as a kernel does that runs on padded metadata: finite garbage with a
    # large lse, which only the seq_lens / query_start_loc masks of the combine remove.
    for b in range(T):
        if not valid[b].any():
            kv_local[b, 0] = (4.0 * torch.randn(D_Q, generator=g)).to(torch.bfloat16)
            valid[b, 0] = True
    step = {
        "q": q[:, rank * H_r : (rank + 1) * H_r].contiguous().to(device),
        "kv": kv_local.to(device),
        "valid": valid.to(device),
        "seq_lens": torch.tensor([len(x) for x in local], dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(B + 1, dtype=torch.int32, device=device),
        "num_tokens": B,
    }
    ref, ref_lse, vmax = [], [], 0.0
    for b in range(B):  # full attention of this rank's heads over the whole KV, fp32
        qb = q[b, rank * H_r : (rank + 1) * H_r].float().to(device)[None, :, None]  # [1,H_r,1,D]
        k = kv[b].float().to(device)[None, None].expand(1, H_r, -1, -1)
        v = k[..., :D_LATENT]
        ref.append(torch.nn.functional.scaled_dot_product_attention(qb, k, v)[0, :, 0])
        ref_lse.append(
            torch.logsumexp((qb @ k.transpose(-1, -2))[0, :, 0] / math.sqrt(D_Q), dim=-1)
        )
        vmax = max(vmax, float(v.abs().max()))
    step["reference"] = torch.stack(ref)  # [B, H_r, 512] fp32
    step["reference_lse"] = torch.stack(ref_lse)  # [B, H_r] fp32, natural log
    step["vmax"] = vmax
    return step


def mla_decode_attention(q_all, kv, valid):
    """Partial attention of every query head over this rank's KV shard (the role of vLLM's
    ``impl.forward_mqa``): ``q_all [T, H, 576]``, ``kv [T, N, 576]`` (rows of each request),
    ``valid [T, N]`` -> ``out [T, H, 512]`` bf16, ``lse [T, H]`` float32 natural log."""
    import torch

    scale = 1.0 / math.sqrt(D_Q)
    s = torch.einsum("thd,tnd->thn", q_all.float(), kv.float()) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("thn,tnd->thd", p, kv[..., :D_LATENT].float())
    return out.to(torch.bfloat16), lse


def decode_step(mgr, step):
    """The DCP part of vLLM's MLA decode, call for call."""
    mqa_q = mgr.query_gather(step["q"])
    attn_out, lse = mla_decode_attention(mqa_q, step["kv"], step["valid"])
    attn_out = mgr.combine(
        attn_out, lse, seq_lens=step["seq_lens"], query_start_loc=step["query_start_loc"]
    )
    return attn_out


def check_step(result, step):
    """``(ok, max_abs_err, tol, message)`` of one step's result against its reference."""
    B = step["num_tokens"]
    tol = 2 * 2.0**-8 * step["vmax"] + 1e-3
    got = result.float()
    err = float((got[:B] - step["reference"]).abs().max())
    pad_zero = bool((got[B:] == 0).all())
    finite = bool(got.isfinite().all())
    ok = err <= tol and pad_zero and finite
    msg = (
        f"max abs error {err:.3e} (tolerance {tol:.3e}), padding rows zero: {pad_zero}, "
        f"all finite: {finite}"
    )
    return ok, err, tol, msg


def kv_gather_step(mgr, seed, world_size, rank, device, toks=13):
    """vLLM's chunked-context KV gather: workspace ``[M + M // W, 576]`` with ``M = 16 W``, this
    rank's chunk in rows ``[0, toks)``, the gathered chunk at row ``M // W``. Returns whether
    it is bit-exact."""
    import torch

    W = world_size
    M = 16 * W
    workspace = torch.empty(M + M // W, D_Q, dtype=torch.bfloat16, device=device)
    mgr.init_kv_gather(workspace, M)
    chunks = [
        torch.randn(toks, D_Q, generator=torch.Generator().manual_seed(seed + 1000 + s)).to(
            torch.bfloat16
        )
        for s in range(W)
    ]
    local = workspace[:toks]
    local.copy_(chunks[rank])
    offset = workspace.shape[0] // (W + 1)
    gathered = workspace[offset : offset + toks * W]
    mgr.kv_gather(gathered, local)
    want = torch.cat(chunks).to(device)
    return bool(torch.equal(gathered.view(torch.int16), want.view(torch.int16)))


def run(
    comm,
    group,
    device,
    *,
    seed=0,
    heads_per_rank=8,
    comm_backend="a2a",
    max_num_tokens=16,
    out=print,
):
    """Build the manager, run and check one decode step and one KV gather; True when this rank
    passed."""
    import torch

    from dcpkit.vllm import MLADCPManager

    W, r = comm.world_size, comm.rank
    mgr = MLADCPManager(
        group,
        device,
        heads_per_rank,
        D_Q,
        D_LATENT,
        torch.bfloat16,
        torch.bfloat16,
        None,
        True,
        False,
        max_num_tokens=max_num_tokens,
        comm_backend=comm_backend,
    )
    try:
        step = make_step(seed, W, r, heads_per_rank, device)
        result = decode_step(mgr, step)
        ok, _, _, msg = check_step(result, step)
        kv_ok = kv_gather_step(mgr, seed, W, r, device)
        torch.cuda.synchronize(device)
        if r == 0:
            out(f"  paths      {mgr.paths}")
        out(f"  rank {r}     decode step: {msg}; kv_gather bit-exact: {kv_ok}")
        return ok and kv_ok
    finally:
        mgr.close()


def main(argv=None) -> int:
    p = parser(__file__, __doc__)
    p.add_argument(
        "--seed",
        type=integer(0, 2**31 - 1),
        default=0,
        help="seed of the queries and the KV of the step, 0 to 2147483647 (default: 0)",
    )
    p.add_argument(
        "--heads-per-rank",
        type=integer(1),
        default=8,
        help="query heads H_r of each rank; the step has world_size * H_r heads (default: 8)",
    )
    p.add_argument(
        "--comm-backend",
        choices=("a2a", "ag_rs"),
        default="a2a",
        help="vLLM's dcp_comm_backend of the combine: a2a (all-to-all, dcpkit's direct "
        "kernel where it serves) or ag_rs (all-gather of the lse + reduce-scatter) "
        "(default: a2a)",
    )
    p.add_argument(
        "--max-num-tokens",
        type=integer(1),
        default=16,
        help=f"rows T the direct workspaces hold; a step of more rows (this one has "
        f"{len(CONTEXTS) + PAD_ROWS}) runs the collective path (default: 16)",
    )
    args = parse_args(p, argv)
    comm = connect("vllm_api")
    if comm is None:
        return 2
    if comm.world_size < 2:
        say(comm, "vllm_api: run under mpirun with 2 or more ranks (mpirun -np 2 ...)")
        return 2
    try:
        import cupy
        import torch
        import torch.distributed as dist

        from dcpkit import vllm  # noqa: F401 - the classes need torch and CuPy
    except ImportError as e:
        torch = None
        why = missing(e)
    else:
        why = torch_problem(torch)
    if not all(comm.allgather(not why)):
        say(comm, f"vllm_api: could not run on every rank: {why or 'another rank'}")
        return 2
    n = torch.cuda.device_count()
    dev = comm.local_rank % n  # ranks may share a GPU
    torch.cuda.set_device(dev)
    cupy.cuda.Device(dev).use()
    shared = " (ranks share GPUs: a functional run)" if comm.local_world_size > n else ""
    say(comm, f"vllm_api: {comm.world_size} ranks, {n} GPU(s) per host{shared}")
    group = init_group(comm)
    lines = []
    ok = False
    try:
        ok = run(
            comm,
            group,
            torch.device("cuda", dev),
            seed=args.seed,
            heads_per_rank=args.heads_per_rank,
            comm_backend=args.comm_backend,
            max_num_tokens=args.max_num_tokens,
            out=lines.append,
        )
    except Exception as e:  # noqa: BLE001 - reported, then agreed as a failure
        lines.append(f"  rank {comm.rank}     raised {type(e).__name__}: {e}")
    every = comm.allgather((ok, lines))
    dist.destroy_process_group()
    for _, rank_lines in every:
        for line in rank_lines:
            say(comm, line)
    passed = all(o for o, _ in every)
    say(comm, "PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
