"""One row of the benchmark: one op, path, mode and case.

The harness fills the measured fields while it runs; :func:`dcpkit.bench.stats.annotate` fills
the derived ones; :meth:`BenchRow.to_json` is what the JSON holds and what the renderer and the
targets read (they read plain dicts, so JSON of older runs renders too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BenchRow", "case_key"]


@dataclass
class BenchRow:
    """One benchmark row (op, path, mode, case): what was measured and what it means.

    JSON schema (``rows[i]`` of ``dcpkit-bench/2``; every key below, ``null`` where unknown).

    Measured by the harness:

    op : str
        ``q_gather``, ``lse_reduce``, ``decode_layer`` or ``kv_gather``.
    path : str
        ``direct`` / ``direct-pull`` / ``multicast`` (dcpkit), ``floor`` (the floor kernel of
        ``kernels/ceilings.cu`` moving this case's egress bytes), ``nvshmem`` (NVSHMEM's
        on-stream collectives), ``nccl`` / ``torch`` (NCCL).
    mode : str
        ``eager`` (host launch included) or ``graph`` (20 calls per CUDA graph replay).
    variant : str or None
        None for the op as shipped; ``no_self_check`` for the op built with
        ``_self_check=False`` (the self-check cost target); ``paired`` and
        ``paired_no_self_check`` for both builds timed in alternating samples; ``pull_grid``
        for the floor kernel run on the pull kv_gather's grid where that differs from the push
        one's (the floor row without a variant has the push grid).
    T : int
        Tokens (rows for kv_gather) per call.
    nominal_bytes, bytes_per_rank, egress_bytes : int
        The requested size, the input bytes of one rank, the bytes one rank sends to its peers.
    exchanges : int
        Dependent cross-rank exchanges of one call (2 for the decode layer).
    geometry : dict
        ``H``, ``D``, ``D_v``, ``D_kv``, ``itemsize``, ``T``.
    world_size : int
    times_us : list of float
        Iteration times, µs per call: each the maximum over ranks of one sample.
    plan : dict or None
        Calls per sample (``calls``, or ``graph_calls`` x ``replays``) and ``samples``.
    wrong : int
        Output elements that differed from the reference, summed over ranks and checks.
    checks : list of dict
        Each check (``stage``, ``wrong``, ``first_bad_by_rank``, ``max_abs_err``, ``rel_err``).
    error : str or None
        Why the row has no times (the run went on).
    launches_per_call : int or None
    ctas : int or None
        CTAs of one launch (the op's grid; a floor row's is the grid it ran with: the push
        path's, or the pull path's for variant ``pull_grid``).

    Derived (:func:`~dcpkit.bench.stats.annotate`):

    median_us, p90_us, p95_us, min_us, max_us, mean_us, samples
        Statistics of ``times_us``.
    algbw_GBps, busbw_GBps : float
        Bytes per rank / time and egress bytes / time (GB = 1e9 bytes).
    floor_us, x_floor : float
        ``exchanges * one-way latency + egress / egress ceiling`` and median / floor.
    busbw_frac : float
        busbw / egress ceiling.
    floor_kernel_us, x_floor_kernel : float
        Median of the ``floor`` row of the same op, case, mode and grid, and median / it: a
        ``direct-pull`` row takes the ``pull_grid`` floor row where the run has one, every other
        row the floor row without a variant.
    speedup_vs_nccl, baseline_path
        Median of the fastest NCCL row of the same case and mode / this median, and its path.
    speedup_vs_peer, peer_path
        The same against the fastest ``nvshmem*`` row.
    """

    op: str
    path: str
    mode: str
    T: int | None = None
    nominal_bytes: int | None = None
    bytes_per_rank: int = 0
    egress_bytes: int = 0
    exchanges: int = 1
    geometry: dict[str, Any] = field(default_factory=dict)
    world_size: int | None = None
    variant: str | None = None
    times_us: list[float] = field(default_factory=list)
    plan: dict[str, int] | None = None
    wrong: int = 0
    checks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    launches_per_call: int | None = None
    ctas: int | None = None
    # derived
    median_us: float | None = None
    p90_us: float | None = None
    p95_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    mean_us: float | None = None
    samples: int = 0
    algbw_GBps: float | None = None
    busbw_GBps: float | None = None
    floor_us: float | None = None
    x_floor: float | None = None
    busbw_frac: float | None = None
    floor_kernel_us: float | None = None
    x_floor_kernel: float | None = None
    speedup_vs_nccl: float | None = None
    baseline_path: str | None = None
    speedup_vs_peer: float | None = None
    peer_path: str | None = None

    @classmethod
    def for_case(
        cls, case: Mapping[str, Any], path: str, mode: str, world_size: int, **kw: Any
    ) -> BenchRow:
        """A fresh row of ``case`` (a :func:`~dcpkit.bench.cases.cases_for` item)."""
        return cls(
            op=case["op"],
            path=path,
            mode=mode,
            T=case["T"],
            nominal_bytes=case["nominal_bytes"],
            bytes_per_rank=case["bytes_per_rank"],
            egress_bytes=case["egress_bytes"],
            exchanges=case["exchanges"],
            geometry=dict(case["geom"]),
            world_size=world_size,
            **kw,
        )

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BenchRow:
        """A row from its JSON (unknown keys of other versions are dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        """The row as the JSON holds it (a plain dict, copies of the lists)."""
        return dataclasses.asdict(self)

    def copy(self) -> BenchRow:
        return BenchRow.from_json(self.to_json())


def case_key(row: Mapping[str, Any]):
    """Rows of one case and mode: op, T, requested size, mode (path and variant aside)."""
    return (row["op"], row.get("T"), row.get("nominal_bytes"), row["mode"])
