"""How :class:`~dcpkit.manager.DCPComm` picks the path of a call: pure functions of values
that are equal on every rank (tested on the CPU).

The direct op serves a call when

1. the group is one NVLink domain (:func:`topology_blocker`: every rank on one host, peer access
   between every pair of GPUs);
2. the geometry suits the direct kernel (:func:`direct_geometry_blocker`: dtype, row bytes a
   multiple of 16);
3. the call suits it (:func:`direct_call_blocker`: ``T <= max_tokens``, and for ``lse_reduce``
   an lse dtype the kernel reads);

otherwise the NCCL op serves it, if NCCL can run the group (:func:`shared_gpu_blocker`).
:func:`select_path` combines the reasons under a policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._arrays import dtype_name
from ._checks import FLOAT_DTYPE_NAMES, float_dtypes, resolve_dtype
from .errors import InvalidArgument, PeerError
from .nccl.base import PATH_NCCL

__all__ = [
    "select_path",
    "direct_call_blocker",
    "direct_geometry_blocker",
    "topology_blocker",
    "shared_gpu_blocker",
    "failure_reason",
    "POLICIES",
    "OPS",
    "PATHS",
    "PATH_DIRECT_UNICAST",
    "PATH_DIRECT_MULTICAST",
    "PATH_NCCL",
    "DIRECT_LSE_DTYPES",
]

POLICIES = ("auto", "direct", "nccl")
OPS = ("q_gather", "lse_reduce", "kv_gather")
PATH_DIRECT_UNICAST = "direct-unicast"
PATH_DIRECT_MULTICAST = "direct-multicast"
PATHS = (PATH_DIRECT_UNICAST, PATH_DIRECT_MULTICAST, PATH_NCCL)


#: Names of the output and lse dtypes the direct lse_reduce kernel is built for.
DIRECT_LSE_DTYPES = FLOAT_DTYPE_NAMES


# ----------------------------------------------------------------------------- selection
def topology_blocker(
    *, hosts: Sequence[str], p2p_missing: Sequence[tuple[int, int]] = ()
) -> str | None:
    """Why the group is not one NVLink domain (None when it is).

    Parameters
    ----------
    hosts : sequence of str
        Host identity of every rank (``Communicator.hosts``).
    p2p_missing : sequence of (int, int)
        Rank pairs whose GPUs report no peer access.
    """
    distinct = sorted(set(hosts))
    if len(distinct) > 1:
        per_host = {h: [r for r, x in enumerate(hosts) if x == h] for h in distinct}
        detail = "; ".join(f"ranks {v}" for v in per_host.values())
        return (
            f"the group spans {len(distinct)} hosts ({detail}): the direct ops need every "
            f"rank in one NVLink domain"
        )
    if p2p_missing:
        pairs = ", ".join(f"{a}-{b}" for a, b in sorted(set(map(tuple, p2p_missing))))
        return f"no GPU peer access between ranks {pairs}"
    return None


def shared_gpu_blocker(*, hosts: Sequence[str], bus_ids: Sequence[str | None]) -> str | None:
    """Why NCCL cannot run this group: ranks of one host on one GPU (None when every rank has
    a GPU of its own). NCCL compares the same two things (host and PCI bus id) in
    ``ncclCommInitRank`` and refuses duplicates with ``ncclInvalidUsage``.

    Parameters
    ----------
    hosts : sequence of str
        Host identity of every rank (``Communicator.hosts``).
    bus_ids : sequence of str or None
        PCI bus id of every rank's GPU (``cudaDeviceGetPCIBusId``); None where unknown (never
        counted as shared).
    """
    ranks_of: dict[tuple[str, str], list[int]] = {}
    for r, (h, b) in enumerate(zip(hosts, bus_ids)):
        if b is not None:
            ranks_of.setdefault((h, str(b)), []).append(r)
    shared = [(ranks, b) for (_, b), ranks in ranks_of.items() if len(ranks) > 1]
    if not shared:
        return None
    detail = "; ".join(f"ranks {ranks} share GPU {b}" for ranks, b in shared)
    return f"NCCL needs one GPU per rank: {detail}"


def direct_geometry_blocker(
    op: str, *, dtype, row_bytes: int, world_size: int | None = None
) -> str | None:
    """Why the direct op cannot be built for this geometry (None when it can).

    ``row_bytes`` is what the direct kernel moves with 16-byte stores: ``H_r * D * itemsize``
    for ``q_gather``, ``D_kv * itemsize`` for ``kv_gather``, ``D_v * itemsize`` for
    ``lse_reduce``. ``world_size`` (optional) is checked against the sources the direct
    ``lse_reduce`` merge handles.
    """
    from .ops.lse_reduce import MAX_WORLD_SIZE

    dt = resolve_dtype(dtype)
    if op == "lse_reduce" and dt not in float_dtypes():
        return (
            f"dtype must be one of [{', '.join(DIRECT_LSE_DTYPES)}] for the direct kernel "
            f"(got {dtype_name(dt)})"
        )
    if op == "lse_reduce" and world_size is not None and world_size > MAX_WORLD_SIZE:
        return (
            f"world_size must be <= {MAX_WORLD_SIZE} for the direct kernel's merge "
            f"(got {world_size})"
        )
    if row_bytes % 16:
        what = {
            "q_gather": "heads_per_rank * q_head_dim * itemsize",
            "kv_gather": "kv_row_dim * itemsize",
            "lse_reduce": "v_head_dim * itemsize",
        }.get(op, "row bytes")
        return (
            f"{what} must be a multiple of 16 bytes for the direct kernel's 16-byte stores "
            f"(got {row_bytes})"
        )
    return None


def direct_call_blocker(op: str, *, tokens: int, max_tokens: int, lse_dtype=None) -> str | None:
    """Why the direct op cannot serve this call (None when it can). Depends only on values
    equal on every rank."""
    if tokens > max_tokens:
        return f"T must be <= max_tokens {max_tokens}, the direct op's capacity (got {tokens})"
    if op == "lse_reduce" and lse_dtype is not None:
        try:
            dt = resolve_dtype(lse_dtype)
        except (TypeError, ValueError):
            dt = None
        if dt not in float_dtypes():
            return (
                f"lse_partial dtype must be one of [{', '.join(DIRECT_LSE_DTYPES)}] for "
                f"the direct kernel (got {dtype_name(lse_dtype)})"
            )
    return None


def select_path(
    op: str,
    policy: str,
    *,
    direct_path: str | None,
    direct_blocker: str | None,
    nccl_blocker: str | None,
) -> str:
    """The path that serves one call: ``direct_path`` or ``"nccl"``.

    Parameters
    ----------
    op : str
        Name used in error messages (``"DCPComm.q_gather"``).
    policy : str
        ``"auto"``, ``"direct"`` or ``"nccl"``.
    direct_path : str or None
        ``"direct-unicast"`` / ``"direct-multicast"``: the direct op's path; None when there is
        no direct op (then ``direct_blocker`` says why).
    direct_blocker : str or None
        Why the direct op cannot serve this call (setup or call reason); None when it can.
    nccl_blocker : str or None
        Why the NCCL op is unavailable; None when it is available.

    Raises
    ------
    InvalidArgument
        ``policy="direct"`` and the direct op cannot serve the call; ``policy="nccl"`` (or
        ``"auto"`` with no direct path) and NCCL is unavailable; an unknown policy.
    """
    if policy not in POLICIES:
        raise InvalidArgument(f"{op}: policy must be one of {list(POLICIES)} (got {policy!r})")
    if direct_path is None and direct_blocker is None:
        direct_blocker = "no direct op was built"
    if policy == "direct":
        if direct_blocker is not None:
            raise InvalidArgument(
                f"{op}: policy 'direct' cannot serve this call: "
                f"{direct_blocker} (policy='auto' falls back to NCCL)"
            )
        return direct_path
    if policy == "auto" and direct_blocker is None:
        return direct_path
    if nccl_blocker is not None:
        why = "" if policy == "nccl" else f"the direct op cannot ({direct_blocker}) and "
        raise InvalidArgument(
            f"{op}: no path can serve this call: {why}NCCL is unavailable ({nccl_blocker})"
        )
    return PATH_NCCL


def failure_reason(what: str, failed: dict[int, str], world_size: int) -> str:
    """One line naming what failed where: the ranks' own errors (a PeerError only echoes
    them), one message when every failing rank reported the same."""
    own = {r: m for r, m in failed.items() if not m.startswith("PeerError:")} or failed
    texts = set(own.values())
    if len(texts) == 1:
        where = "every rank" if len(own) == world_size else f"rank(s) {sorted(own)}"
        return f"{what} failed on {where}: {texts.pop()}"
    return str(PeerError(what, own))
