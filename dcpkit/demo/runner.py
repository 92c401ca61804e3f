"""One run of the demo on every rank: inputs, the checked decode step, the reference, the
verdict and the timings."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ..errors import DcpkitError
from .cupy_side import CupySide
from .environment import distinct_gpus
from .exchanges import Exchanges, build_exchanges, build_kv_exchange, nccl_unavailable
from .model import PRESETS, Q_STD, Model, checksums, deinterleave, make_host_inputs
from .numerics import local_stats, to_float32, verdict
from .steps import PREFIX, Say, step
from .timing import TIMING_NOTES, run_timings
from .torch_side import TorchSide


def gpu_name() -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def gathered_reference(
    side,
    kv_ex: Exchanges,
    q,
    kv,
    lengths: np.ndarray,
    world_size: int,
    T_local: int,
    shard_sums: list[list[int]],
    model: Model,
):
    """kv_gather of every rank's KV shard, sequence by sequence (rank-major rows), de-interleaved
    to token order; then the reference attention of this rank's heads over the whole KV.

    Returns ``(ref [B, H_r, D_v] float32, kv_gather bit-exact (bool), max |V| (float))``."""
    import cupy

    B, H_r, D_v = q.shape[0], q.shape[1], model.v_dim
    ref = side.new_ref((B, H_r, D_v))
    exact, v_max = True, 0.0
    for b in range(B):
        gathered = kv_ex.kv_gather(kv[b])  # [W*T_local, D_qk]; consumed here
        g = side.to_cupy(gathered)
        got = checksums(cupy, [g[s * T_local : (s + 1) * T_local] for s in range(world_size)])
        exact &= got == [shard_sums[s][b] for s in range(world_size)]
        full = deinterleave(gathered, world_size, int(lengths[b]))  # a copy
        ref[b] = side.reference(q[b], full, model)
        v = to_float32(side.to_cupy(full), cupy)[:, :D_v]
        if v.size:
            v_max = max(v_max, float(cupy.abs(v).max()))
    return ref, bool(exact), v_max


def run(args: argparse.Namespace, comm, say: Say) -> dict[str, Any]:
    """The demo on every rank, after the environment checks; ``args.torch`` selects torch
    tensors. Returns the report, equal on every rank. Collective."""
    import cupy

    model = PRESETS[args.model]
    deadline = getattr(args, "timeout_ms", None)
    W, rank = comm.world_size, comm.rank
    H_r = model.num_heads // W
    side = (
        step(comm, "demo: importing torch and dcpkit.torch", TorchSide)
        if args.torch
        else CupySide()
    )
    with say.timed(f"building inputs (from --seed {args.seed} and the rank)"):
        host = step(comm, "demo: building inputs", lambda: make_host_inputs(args, model, rank, W))
    dt, T_local, lengths = host["dtype"], host["T_local"], host["lengths"]
    say(
        f"context lengths {', '.join(str(int(x)) for x in lengths)} tokens; {T_local} KV rows "
        f"per sequence per rank"
    )
    report: dict[str, Any] = {
        "demo": "one MLA decode attention layer with decode context parallelism",
        "model": model.name,
        "num_heads": model.num_heads,
        "heads_per_rank": H_r,
        "qk_dim": model.qk_dim,
        "kv_lora_rank": model.kv_lora_rank,
        "rope_dim": model.rope_dim,
        "v_dim": model.v_dim,
        "softmax_scale": model.softmax_scale,
        "q_std": Q_STD,
        "dtype": np.dtype(dt).name,
        "batch": args.batch,
        "context": args.context,
        "context_lengths": [int(x) for x in lengths],
        "kv_rows_per_rank": T_local,
        "layout": "token i on rank i mod world_size",
        "seed": args.seed,
        "world_size": W,
        "gpus": comm.allgather(gpu_name()),
        "tensors": side.name,
        "distinct_gpus": distinct_gpus(comm),
    }

    def upload():
        q, kv = side.upload(host["q"]), side.upload(host["kv"])  # [B, H_r, D], [B, T_l, D]
        kv_c = side.to_cupy(kv)
        sums = checksums(cupy, [kv_c[b] for b in range(args.batch)])
        return q, kv, sums, CupySide().upload(host["q_all"])

    q, kv, own_sums, q_all = step(comm, "demo: uploading the inputs", upload)
    shard_sums = comm.allgather(own_sums)  # [W][B], for the kv_gather check

    owned: list[Exchanges] = []
    agreed = True  # False: an error not agreed across ranks; closing could hang then
    try:
        with say.timed(
            "building the ops (NVRTC compiles the kernels on the first run, CuPy "
            "caches them on disk)"
        ):
            base = step(
                comm,
                "demo: building the ops",
                lambda: build_exchanges(
                    comm,
                    model=model,
                    batch=args.batch,
                    dtype=dt,
                    policy="auto",
                    with_kv=True,
                    timeout_ms=deadline,
                ),
            )
            owned.append(base)
            kv_base = step(
                comm,
                "demo: building the kv_gather of the check",
                lambda: build_kv_exchange(
                    comm, base, rows=T_local, model=model, dtype=dt, timeout_ms=deadline
                ),
            )
            owned.append(kv_base)
            ex = step(comm, "demo: torch front end", lambda: side.wrap(base))
            if ex is not base:
                owned.append(ex)
            kv_ex = step(comm, "demo: torch front end", lambda: side.wrap(kv_base))
            if kv_ex is not kv_base:
                owned.append(kv_ex)
        indent = "\n" + " " * (len(PREFIX) + 6)
        say("ops: " + ex.description.replace("\n", indent))
        say(f"kv_gather of the check: {kv_ex.description}".replace("\n", indent))
        nccl_reason = nccl_unavailable(base)
        report["nccl_unavailable_reason"] = nccl_reason
        report["nccl_path"] = "available" if nccl_reason is None else f"unavailable ({nccl_reason})"
        if nccl_reason is not None:
            say(
                f"NCCL path: {report['nccl_path']}; the check and the verdict are the direct path's"
            )

        with say.timed("decode step: q_gather -> partial attention (fp32) -> lse_reduce"):

            def decode():
                res = side.decode(ex, q, kv, host["local_lengths"], model, dt)
                base.synchronize()
                return res

            out, q_full, out_partial, lse_partial = step(comm, "demo: decode step", decode)

        what = "torch scaled_dot_product_attention" if args.torch else "attention in fp32"
        with say.timed(
            f"reference: kv_gather of the whole KV, then {what} of each rank's {H_r} heads over it"
        ):

            def reference():
                res = gathered_reference(side, kv_ex, q, kv, lengths, W, T_local, shard_sums, model)
                kv_base.synchronize()
                return res

            ref, kv_exact, v_max = step(comm, "demo: reference", reference)

        def check():
            mine = local_stats(side.to_cupy(out), side.to_cupy(ref), rank, H_r)
            q_exact = bool(
                cupy.array_equal(side.to_cupy(q_full).view(cupy.uint16), q_all.view(cupy.uint16))
            )
            mine.update(
                {
                    "q_gather_exact": q_exact,
                    "kv_gather_exact": kv_exact,
                    "v_max": v_max,
                    "paths": {
                        "q_gather": ex.paths.get("q_gather", "?"),
                        "lse_reduce": ex.paths.get("lse_reduce", "?"),
                        "kv_gather": kv_ex.paths.get("kv_gather", "?"),
                    },
                }
            )
            return mine

        stats = comm.allgather(step(comm, "demo: check", check))
        report["ops"] = base.description
        report["kv_gather_op"] = kv_base.description
        report["paths"] = stats[0]["paths"]
        report["paths_agree"] = all(s["paths"] == stats[0]["paths"] for s in stats)
        report["check"] = verdict(stats, dt)
        c = report["check"]
        say(
            f"check: max abs error {c['max_abs_error']:.3e} (tolerance "
            f"{c['tolerance_abs']:.3e}) -> {c['verdict']}"
        )
    except DcpkitError:
        raise  # agreed (PeerError from step): every rank closes below
    except BaseException:
        agreed = False  # a bug outside the agreed steps: main ends the job
        raise
    finally:
        while agreed and owned:
            owned.pop().close()

    report["timing"] = {}
    if args.iters > 0:
        inputs = {
            "q": q,
            "out_partial": out_partial,
            "lse_partial": lse_partial,
            "dtype": dt,
            "q_full_shape": (args.batch, model.num_heads, model.qk_dim),
            "out_shape": (args.batch, H_r, model.v_dim),
        }
        report["timing"] = run_timings(
            comm, args, model, side, inputs, say, report["nccl_unavailable_reason"]
        )
        report["timing_notes"] = TIMING_NOTES
    return report
