"""dcpkit.vllm on GPUs: the decode step of examples/vllm_api.py (written as vLLM's MLA attention
calls MLADCPManager) against full attention of the whole KV on every combine path, two ubatches,
a CUDA graph of query_gather -> attention -> combine replayed with fresh inputs, the three
workspaces bit for bit (float8 included), bad tensors, and the example end to end.

Run (every rank runs every test in the same order; needs torch)::

    mpirun -np 2 python -m pytest tests/mpi/test_vllm.py -p no:cacheprovider
    mpirun -np 4 python -m pytest tests/mpi/test_vllm.py -p no:cacheprovider

The group is gloo, built from the MPI job: it carries dcpkit's host exchange, so ranks that
share one GPU (under MPS) run every test; the collective paths run through the host there.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest

from _dcp_checks import run_all_ranks

torch = pytest.importorskip(
    "torch", reason="torch is not installed here (pip install 'dcpkit[torch-cu12]', or torch-cu13)"
)
cupy = pytest.importorskip("cupy")

import dcpkit.vllm as dv  # noqa: E402
from dcpkit.errors import InvalidArgument, InvalidType  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))  # the examples share examples/_support.py
_spec = importlib.util.spec_from_file_location(
    "vllm_api_example", REPO / "examples" / "vllm_api.py"
)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

H_R = 8
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tdev(comm):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (a CPU build of torch)")
    dev = torch.device("cuda", int(cupy.cuda.Device().id))
    torch.cuda.set_device(dev)
    return dev


@pytest.fixture(scope="module")
def group(comm, tdev):
    """The default torch.distributed group, gloo, over the MPI job's ranks."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.broadcast(port, root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def manager(group, dev, **kw):
    args = dict(padded_num_heads=None, is_lse_base_on_e=True, use_pcp=False)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return dv.MLADCPManager(
        group,
        dev,
        H_R,
        ex.D_Q,
        ex.D_LATENT,
        BF16,
        BF16,
        args["padded_num_heads"],
        args["is_lse_base_on_e"],
        args["use_pcp"],
        max_num_tokens=kw.pop("max_num_tokens", 16),
        **kw,
    )


def _check(errors, where, result, step):
    ok, _, _, msg = ex.check_step(result, step)
    if not ok:
        errors.append(f"{where}: {msg}")


# ----------------------------------------------------------------------------- decode step
@pytest.mark.parametrize(
    "backend, max_num_tokens, want",
    [
        ("a2a", 16, ("direct-a2a", "direct", "combine:direct-a2a")),
        ("a2a", 4, ("direct-a2a", "direct", "combine:a2a")),  # T = 6 > 4: the all-to-all
        ("ag_rs", 16, ("ag-rs", "direct", "combine:ag-rs")),
    ],
)
def test_decode_step_matches_full_attention(comm, group, tdev, seed, backend, max_num_tokens, want):
    def body(errors):
        with manager(group, tdev, comm_backend=backend, max_num_tokens=max_num_tokens) as m:
            got = (m.paths["combine"], m.paths["query_gather"])
            if got != want[:2]:
                errors.append(f"paths {got}, expected {want[:2]}")
            for k in range(3):
                step = ex.make_step(seed + k, comm.world_size, comm.rank, H_R, tdev)
                _check(
                    errors,
                    f"{backend} T_max={max_num_tokens} step {k}",
                    ex.decode_step(m, step),
                    step,
                )
            if m.counters.get(want[2]) != 3:
                errors.append(f"counters {m.counters}, expected 3 calls of {want[2]}")

    run_all_ranks(comm, f"decode step ({backend}, max_num_tokens={max_num_tokens})", body)


def test_decode_step_base2_lse_and_returned_lse(comm, group, tdev, seed):
    """Attention returning a base-2 lse: the combine converts, and return_lse gives the merged
    lse in base 2: log2 of the softmax denominator over the whole KV."""

    def body(errors):
        with manager(group, tdev, is_lse_base_on_e=False) as m:
            step = ex.make_step(seed + 7, comm.world_size, comm.rank, H_R, tdev)
            q_all = m.query_gather(step["q"])
            out, lse = ex.mla_decode_attention(q_all, step["kv"], step["valid"])
            res, merged = m.combine(
                out,
                lse / ex.math.log(2.0),
                seq_lens=step["seq_lens"],
                query_start_loc=step["query_start_loc"],
                return_lse=True,
            )
            _check(errors, "base-2 combine", res, step)
            B = step["num_tokens"]
            want = step["reference_lse"] / ex.math.log(2.0)
            d = float((merged[:B] - want).abs().max())
            if not d <= 1e-3:
                errors.append(f"merged base-2 lse differs from the full softmax's by {d}")
            if not torch.isneginf(merged[B:]).all():
                errors.append("merged lse of padding rows is not -inf")

    run_all_ranks(comm, "decode step, base-2 lse", body)


# ----------------------------------------------------------------------------- ubatches
def test_two_ubatches_interleaved(comm, group, tdev, seed):
    def body(errors):
        with manager(group, tdev, num_ubatches=2) as m:
            steps = [
                ex.make_step(seed + 20 + u, comm.world_size, comm.rank, H_R, tdev) for u in range(2)
            ]
            q_all = []
            for u in range(2):  # both gathers first: two live views
                with dv.ubatch(u):
                    q_all.append(m.query_gather(steps[u]["q"]))
            if q_all[0].data_ptr() == q_all[1].data_ptr():
                errors.append("the two ubatches' gathered queries share storage")
            parts = [
                ex.mla_decode_attention(q, s["kv"], s["valid"])
                for q, s in zip(q_all, steps, strict=True)
            ]
            for u in (1, 0):  # combines in the other order
                with dv.ubatch(u):
                    res = m.combine(
                        *parts[u],
                        seq_lens=steps[u]["seq_lens"],
                        query_start_loc=steps[u]["query_start_loc"],
                    )
                _check(errors, f"ubatch {u}", res, steps[u])
            try:
                with dv.ubatch(2):
                    m.query_gather(steps[0]["q"])
                errors.append("ubatch 2 of 2 slots was accepted")
            except dv.UbatchOutOfRange as e:
                if "ubatch 2 exceeds 2 slots" not in str(e):
                    errors.append(f"message: {e}")
            # a good step after the rejected call
            with dv.ubatch(1):
                _check(errors, "after a rejected call", ex.decode_step(m, steps[1]), steps[1])

    run_all_ranks(comm, "two ubatches", body)


# ----------------------------------------------------------------------------- CUDA graph
def test_cuda_graph_query_gather_attention_combine(comm, group, tdev, seed):
    """query_gather -> attention -> combine captured in one torch CUDA graph; 10 replays with
    fresh queries, KV and masks copied into the captured inputs, each checked."""

    def body(errors):
        with manager(group, tdev) as m:
            step = ex.make_step(seed + 40, comm.world_size, comm.rank, H_R, tdev)
            static = {
                k: step[k].clone() for k in ("q", "kv", "valid", "seq_lens", "query_start_loc")
            }
            static["num_tokens"] = step["num_tokens"]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up, as torch recommends
                for _ in range(2):
                    ex.decode_step(m, static)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            calls = dict(m.counters)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                result = ex.decode_step(m, static)
            if m.counters.get("combine:direct-a2a", 0) != calls.get("combine:direct-a2a", 0) + 1:
                errors.append(f"the captured combine was not the direct path: {m.counters}")
            for i in range(10):
                fresh = ex.make_step(seed + 41 + i, comm.world_size, comm.rank, H_R, tdev)
                for k in ("q", "kv", "valid", "seq_lens", "query_start_loc"):
                    static[k].copy_(fresh[k])
                result.view(torch.int16).fill_(-1)  # NaN: stale data cannot pass
                g.replay()
                torch.cuda.synchronize()
                _check(errors, f"replay {i}", result, fresh)
            del g

    run_all_ranks(comm, "CUDA graph of query_gather -> attention -> combine", body)


def test_kv_gather_in_cuda_graph(comm, group, tdev, seed):
    """init_kv_gather / kv_gather in vLLM's workspace layout, the gather captured in a CUDA
    graph; 5 replays with a fresh local chunk each, bit for bit."""
    W, r, toks, D = comm.world_size, comm.rank, 5, ex.D_Q

    def chunks(i):
        return [
            torch.randn(toks, D, generator=torch.Generator().manual_seed(seed + 300 + 10 * i + s))
            .to(BF16)
            .to(tdev)
            for s in range(W)
        ]

    def body(errors):
        with manager(group, tdev) as m:
            M = 8 * W
            workspace = torch.zeros(M + M // W, D, dtype=BF16, device=tdev)
            m.init_kv_gather(workspace, M)
            if m.paths["kv_gather"] != "direct":
                errors.append(f"kv_gather path {m.paths['kv_gather']}, expected direct")
            local, gathered = workspace[:toks], workspace[M // W : M // W + toks * W]
            local.copy_(chunks(0)[r])
            m.kv_gather(gathered, local)  # eager warm-up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                m.kv_gather(gathered, local)
            for i in range(1, 6):
                c = chunks(i)
                local.copy_(c[r])
                gathered.view(torch.int16).fill_(-1)
                g.replay()
                torch.cuda.synchronize()
                if not torch.equal(gathered.view(torch.int16), torch.cat(c).view(torch.int16)):
                    errors.append(f"replay {i}: gathered KV differs")
            del g

    run_all_ranks(comm, "kv_gather in a CUDA graph", body)


# ----------------------------------------------------------------------------- workspaces
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_workspaces_bit_exact(comm, group, tdev, seed, dtype):
    """DirectDCPQGatherWorkspace (padded storage, vLLM's row stride) and
    DirectDCPKVGatherWorkspace (into the caller's tensor, rank-major) against all-gathers of the
    inputs every rank rebuilds from the seed."""
    dt = getattr(torch, dtype)
    W, r, T, D = comm.world_size, comm.rank, 5, 576

    def inputs(s, shape):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + s))
        return x.to(dt).to(tdev)

    def bits(x):  # bit patterns (torch.cat and comparisons of float8 go through these)
        return x.view(torch.int16 if x.element_size() == 2 else torch.uint8)

    def poison(x):  # all bits set: NaN in every float dtype
        bits(x).fill_(-1 if x.element_size() == 2 else 255)

    def body(errors):
        pad = W * H_R + 3
        with dv.DirectDCPQGatherWorkspace(group, tdev, 8, H_R, D, dt, 1, pad) as qg:
            # unicast unless the user opted in to multicast (and dcpkit's guard allowed it)
            allowed = (
                ("unicast", "multicast")
                if os.environ.get("DCPKIT_MULTICAST", "") not in ("", "0")
                else ("unicast",)
            )
            if qg.transport not in allowed or qg.transport != qg.op.transport:
                errors.append(f"q gather transport {qg.transport}, expected one of {allowed}")
            qs = [inputs(100 + s, (T, H_R, D)) for s in range(W)]
            out = qg.gather(qs[r])
            if out.stride() != (W * H_R * D, D, 1) or tuple(out.shape) != (T, W * H_R, D):
                errors.append(f"q view shape {tuple(out.shape)} strides {out.stride()}")
            if out.data_ptr() != qg.final_query[0].data_ptr():
                errors.append("the gathered query is not a view of final_query")
            if not torch.equal(bits(out), torch.cat([bits(q) for q in qs], dim=1)):
                errors.append("q gather differs from the all-gather")
        with dv.DirectDCPKVGatherWorkspace(group, tdev, 4 * W, D, dt) as kg:
            kvs = [inputs(200 + s, (3, D)) for s in range(W)]
            dst = torch.empty(3 * W, D, dtype=dt, device=tdev)
            poison(dst)
            if kg.gather(dst, kvs[r]) is not None:
                errors.append("kv gather returned something")
            if not torch.equal(bits(dst), torch.cat([bits(k) for k in kvs])):
                errors.append("kv gather differs from all_gather_into_tensor")

    run_all_ranks(comm, f"workspaces bit-exact ({dtype})", body)


def test_bad_tensors_raise_before_launch(comm, group, tdev, seed):
    def body(errors):
        with manager(group, tdev) as m:
            step = ex.make_step(seed + 60, comm.world_size, comm.rank, H_R, tdev)
            cases = [
                (
                    "cpu query",
                    lambda: m.query_gather(step["q"].cpu()),
                    InvalidArgument,
                    f"local_query device must be the workspace's {tdev} (got cpu)",
                ),
                (
                    "float query",
                    lambda: m.query_gather(step["q"].float()),
                    InvalidType,
                    "local_query dtype must be torch.bfloat16",
                ),
                (
                    "int64 seq_lens",
                    lambda: m.combine(
                        torch.zeros(6, comm.world_size * H_R, 512, dtype=BF16, device=tdev),
                        torch.zeros(6, comm.world_size * H_R, device=tdev),
                        seq_lens=step["seq_lens"].long(),
                        query_start_loc=step["query_start_loc"],
                    ),
                    InvalidType,
                    "seq_lens dtype must be torch.int32",
                ),
            ]
            for what, call, exc, text in cases:
                try:
                    call()
                    errors.append(f"{what}: no error")
                except exc as e:
                    if text not in str(e):
                        errors.append(f"{what}: {e}")
            _check(errors, "after rejected calls", ex.decode_step(m, step), step)

    run_all_ranks(comm, "bad tensors", body)


def test_example_run(comm, group, tdev, seed):
    """examples/vllm_api.py's run(): the step and the KV gather, PASS on every rank."""
    lines = []
    ok = ex.run(comm, group, tdev, seed=seed, out=lines.append)
    oks = comm.allgather(ok)
    assert all(oks), (
        f"example run failed on ranks {[i for i, v in enumerate(oks) if not v]}: {lines}"
    )
