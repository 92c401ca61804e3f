"""MLADCPManager's collective paths over a real gloo ``torch.distributed`` group (run by
tests/unit/test_vllm_api.py, one process per rank, CPU tensors)::

    python vllm_gloo_worker.py RANK WORLD_SIZE STORE_FILE OUT_JSON

The manager is built with a GPU device, on paths that need none (the direct ones cannot serve:
a complex query dtype or use_pcp, float32 outputs and KV), then its device is swapped for the
CPU so that its gloo (host-staged) collectives run here: the all-to-all, all-gather +
reduce-scatter and all-gather + all-reduce combines against the float64 reference, the query
all-gather and the KV all-gather bit for bit. Writes ``{"errors": [...], "modes": [...]}``;
never raises.
"""

import datetime
import json
import math
import os
import sys
import traceback


def main():
    rank, W, store, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    errors, modes = [], []
    try:
        import numpy as np
        import torch
        import torch.distributed as dist

        import dcpkit.vllm as dv
        import dcpkit.vllm._common as vllm_common

        # The collective paths run over CPU tensors here, with whatever torch build is
        # installed: skip the check that torch reaches a CUDA GPU (tested on its own).
        vllm_common.require_torch_cuda = lambda torch, what: None
        from dcpkit.reference import (
            kv_gather_reference,
            lse_reduce_reference,
            make_inputs,
            q_gather_reference,
        )

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=W,
            timeout=datetime.timedelta(seconds=60),
        )
        cpu = torch.device("cpu")
        H_r, D, T, S, seed = 2, 16, 6, 2, 99

        def manager(pcp, query_dtype=torch.complex64):
            m = dv.MLADCPManager(
                dist.group.WORLD,
                torch.device("cuda", 0),
                H_r,
                D,
                D,
                query_dtype,
                torch.float32,
                None,
                True,
                pcp,
                max_num_tokens=8,
                comm_backend="ag_rs",
            )
            m.device = cpu
            m._coll.device = cpu
            modes.append(m._coll.mode)
            return m

        ins = [
            make_inputs(
                s,
                W,
                seed,
                op="lse_reduce",
                tokens=T,
                num_heads=W * H_r,
                head_dim=D,
                dtype="float32",
                num_requests=S,
            )
            for s in range(W)
        ]
        mine = ins[rank]
        for path in ("a2a", "ag-rs", "ag-ar"):
            m = manager(path == "ag-ar")
            fn = {"a2a": m._combine_a2a, "ag-rs": m.combine, "ag-ar": m.combine}[path]
            out, lse = fn(
                torch.from_numpy(mine["out_partial"]),
                torch.from_numpy(mine["lse_partial"]),
                seq_lens=torch.from_numpy(mine["seq_lens"]),
                query_start_loc=torch.from_numpy(mine["query_start_loc"]),
                return_lse=True,
            )
            heads = slice(None) if path == "ag-ar" else slice(rank * H_r, (rank + 1) * H_r)
            ref, ref_lse = lse_reduce_reference(
                [i["out_partial"][:, heads] for i in ins],
                [i["lse_partial"][:, heads] for i in ins],
                seq_lens=[i["seq_lens"] for i in ins],
                query_start_loc=ins[0]["query_start_loc"],
            )
            err = float(np.abs(out.numpy() - ref).max())
            if not err <= 1e-5:
                errors.append(f"{path}: max abs error {err}")
            fin = np.isfinite(ref_lse)
            if not (np.isneginf(lse.numpy()) == ~fin).all() or not np.allclose(
                lse.numpy()[fin], ref_lse[fin], atol=1e-4
            ):
                errors.append(f"{path}: merged lse differs")
            if m.counters != {f"combine:{path}": 1}:
                errors.append(f"{path}: counters {m.counters}")
        m = manager(True, torch.float32)  # use_pcp: no direct q-gather is built
        qs = [
            make_inputs(
                s, W, seed, op="q_gather", tokens=T, num_heads=W * H_r, head_dim=D, dtype="float32"
            )["q"]
            for s in range(W)
        ]
        m.query_gather = m._gather_query
        got = m.query_gather(torch.from_numpy(qs[rank])).numpy()
        if not np.array_equal(got.view(np.uint32), q_gather_reference(qs).view(np.uint32)):
            errors.append("query all-gather differs")
        M = 4 * W
        m.init_kv_gather(torch.zeros(M + M // W, D), M)
        kvs = [
            make_inputs(s, W, seed, op="kv_gather", tokens=3, row_dim=D, dtype="float32")["kv"]
            for s in range(W)
        ]
        dst = torch.full((3 * W, D), float("nan"))
        m.kv_gather(dst, torch.from_numpy(kvs[rank]))
        if not np.array_equal(
            dst.numpy().view(np.uint32), kv_gather_reference(kvs).view(np.uint32)
        ):
            errors.append("KV all-gather differs")
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test
        errors.append(traceback.format_exc())
    with open(out_path, "w") as f:
        json.dump({"errors": errors, "modes": modes, "pi": math.pi}, f)
        f.flush()
        os.fsync(f.fileno())
    # The result is on disk: leave without the interpreter's teardown, where torch's gloo
    # threads can abort the process ("terminate called without an active exception", seen
    # once in about fifty runs after destroy_process_group returned).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
