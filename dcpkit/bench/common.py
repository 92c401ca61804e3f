"""What every part of the benchmark shares: the geometry, the names of ops, paths and modes,
the JSON schema, the errors of a run, and small text helpers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import DcpkitError

__all__ = [
    "GEOMETRY",
    "ALL_OPS",
    "ALL_PATHS",
    "ALL_MODES",
    "NCCL_PATHS",
    "PEER_PATHS",
    "FLOOR_PATH",
    "PULL_PATH",
    "FLOOR_PULL_GRID",
    "SCHEMA",
    "SCHEMAS_READ",
    "StageFailed",
    "BenchHang",
    "BarrierTimeout",
    "short",
    "jsonable",
    "KiB",
    "MiB",
]

KiB = 1024
MiB = 1024 * KiB

#: The DCP decode geometry (DeepSeek-V3 style MLA): heads, q head dim, value dim, compressed KV
#: row width; decode batch of the demo.
GEOMETRY = {"H": 128, "D": 576, "D_v": 512, "D_kv": 576, "dtype": "bfloat16", "decode_T": 8}
ALL_OPS = ("q_gather", "lse_reduce", "decode_layer", "kv_gather")
#: ``floor`` = the floor kernel (kernels/ceilings.cu) moving each case's egress bytes;
#: ``nvshmem`` = NVSHMEM's on-stream collectives through nvshmem4py (the peer).
ALL_PATHS = ("direct", "direct-pull", "multicast", "floor", "nvshmem", "nccl", "torch")
ALL_MODES = ("eager", "graph")
#: Paths that run on NCCL (dcpkit.fallback, torch.distributed's NCCL backend).
NCCL_PATHS = ("nccl", "torch")
#: Paths of a peer library measured beside dcpkit (each starts with "nvshmem").
PEER_PATHS = ("nvshmem",)
FLOOR_PATH = "floor"
#: kv_gather's pull algorithm: a kernel on a grid of its own (the push path's is ``direct``'s).
PULL_PATH = "direct-pull"
#: The variant of a floor row run on the pull path's grid, where that differs from the push
#: path's: the floor row without a variant runs on the push grid, and a pull row compared with
#: it would compare two kernels on two grids.
FLOOR_PULL_GRID = "pull_grid"
#: Written by this version; read by the renderer (older runs stay renderable as baselines).
SCHEMA = "dcpkit-bench/2"
SCHEMAS_READ = ("dcpkit-bench/1", "dcpkit-bench/2")


def short(s: Any, n: int = 400) -> str:
    """``s`` on one line, at most ``n`` characters."""
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


class StageFailed(DcpkitError):
    """A stage failed on at least one rank; raised on every rank (same branch everywhere).

    Attributes
    ----------
    what : str
    errors : dict rank -> message
    """

    def __init__(self, what: str, errors: dict[int, str]):
        self.what = what
        self.errors = dict(errors)
        detail = "; ".join(f"rank {r}: {short(m)}" for r, m in sorted(self.errors.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.errors)}: {detail}")


class BenchHang(DcpkitError):
    """A host wait for the GPU outlived ``--hang-s``: a kernel (NCCL has no deadline) is stuck."""


class BarrierTimeout(DcpkitError):
    """The device barrier before a timed region expired: a peer never reached it."""


def jsonable(x: Any) -> Any:
    """Plain JSON values: non-finite floats become None, numpy scalars Python numbers."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)
