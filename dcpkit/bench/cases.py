"""The cases of each op (sizes, byte counts) and their inputs and references on the host."""

from __future__ import annotations

from typing import Any

import numpy as np

from .device import uint_dtype
from .stats import geometry_bytes

__all__ = ["cases_for", "host_inputs"]


def cases_for(op: str, cfg: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """The cases (sizes) of ``op``: a geometry each, with its byte counts."""
    g = cfg["geometry"]
    base = {"H": g["H"], "D": g["D"], "D_v": g["D_v"], "D_kv": g["D_kv"], "itemsize": 2}
    out = []
    if op in ("q_gather", "lse_reduce"):
        Ts = cfg["tokens"]
    elif op == "decode_layer":
        Ts = [g["decode_T"]]
    else:
        Ts = None
    if Ts is not None:
        for T in Ts:
            geom = dict(base, T=int(T))
            b = geometry_bytes(op, geom, world_size)
            out.append(
                {"op": op, "T": int(T), "nominal_bytes": b["bytes_per_rank"], "geom": geom, **b}
            )
        return out
    row_bytes = g["D_kv"] * 2
    for nominal in cfg["kv_sizes"]:
        T = max(1, int(round(nominal / row_bytes)))
        geom = dict(base, T=T)
        b = geometry_bytes(op, geom, world_size)
        out.append({"op": op, "T": T, "nominal_bytes": int(nominal), "geom": geom, **b})
    return out


def host_inputs(
    op: str, geom: dict[str, Any], rank: int, world_size: int, seed: int, finite: bool
) -> tuple[dict[str, np.ndarray], list[tuple[str, np.ndarray, Any]]]:
    """This rank's inputs of one case and the references of its outputs, on the host.

    Every rank rebuilds every peer's input from ``(seed, peer)`` (:func:`make_inputs`) and keeps
    only its own share of the reference. ``finite=False`` draws lse_reduce inputs with empty and
    non-finite entries (the correctness check); ``finite=True`` draws all-finite ones (timed).
    References: ``("bits", uint view)`` for data movement, ``("close", float32, tol)`` for the
    merge.
    """
    from .. import reference as ref

    W, T = world_size, int(geom["T"])
    dt = ref.resolve_dtype(geom.get("dtype", "bfloat16"))
    u = uint_dtype(dt.itemsize)
    if op == "q_gather":
        qs = [
            ref.make_inputs(
                s,
                W,
                seed,
                op="q_gather",
                tokens=T,
                num_heads=geom["H"],
                head_dim=geom["D"],
                dtype=dt,
            )["q"]
            for s in range(W)
        ]
        return {"q": qs[rank]}, [("bits", ref.q_gather_reference(qs).view(u), None)]
    if op == "kv_gather":
        D = int(geom["D_kv"])
        full = np.empty((W * T, D), dtype=dt)
        for s in range(W):
            full[s * T : (s + 1) * T] = ref.make_inputs(
                s, W, seed, op="kv_gather", tokens=T, row_dim=D, dtype=dt
            )["kv"]
        return {"kv": full[rank * T : (rank + 1) * T].copy()}, [("bits", full.view(u), None)]
    if op == "lse_reduce":
        H, Dv = int(geom["H"]), int(geom["D_v"])
        extra = {"empty_fraction": 0.0, "nonfinite_fraction": 0.0} if finite else {}
        ins = [
            ref.make_inputs(
                s,
                W,
                seed,
                op="lse_reduce",
                tokens=T,
                num_heads=H,
                head_dim=Dv,
                dtype=dt,
                lse_dtype="float32",
                **extra,
            )
            for s in range(W)
        ]
        out, _ = ref.lse_reduce_reference(
            [i["out_partial"] for i in ins], [i["lse_partial"] for i in ins]
        )
        Hr = H // W
        mine = np.ascontiguousarray(out[:, rank * Hr : (rank + 1) * Hr]).astype(np.float32)
        local = {"out_partial": ins[rank]["out_partial"], "lse_partial": ins[rank]["lse_partial"]}
        return local, [("close", mine, float(ref.lse_reduce_tolerance(dt)))]
    if op == "decode_layer":
        lq, rq = host_inputs("q_gather", geom, rank, W, seed, finite)
        ll, rl = host_inputs("lse_reduce", geom, rank, W, seed + 7919, finite)
        return {**lq, **ll}, rq + rl
    raise ValueError(f"host_inputs: unknown op {op!r}")
