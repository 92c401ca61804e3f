"""The SMs one rank's dcpkit kernels may take: its share of the GPU.

Every CTA of a dcpkit kernel that waits must be co-resident with the CTAs it waits for, the
other ranks' included when ranks share a GPU (NOTE [dcpkit epoch signalling], co-residency
rule). So each rank's grids stay within its share of the SMs.

``multiProcessorCount`` is the SM count this process may use. Under an MPS daemon with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=p`` the driver already reports only ``p`` percent of the
GPU's SMs, so dividing it again by the ranks on the GPU would leave each rank a fraction of its
own share (one H200 at ``p = 25`` with four ranks: 33 SMs reported, 8 kept). The share is the
reported count, capped at the whole GPU (reported * 100 / p) divided among the ranks on it, which
keeps the shares of all ranks within the GPU whatever ``p`` each rank set. Without the variable
(no MPS, or a percentage set only in the MPS control daemon, which this process cannot see) the
reported count is taken as the whole GPU and divided among the ranks: never more than the share.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from ._checks import decimal_float

__all__ = ["sm_share", "mps_thread_percentage"]


def mps_thread_percentage(env: Mapping[str, str] | None = None) -> float | None:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of this process as a number in (0, 100], or None
    when it is unset or not such a number (then nothing is assumed about the reported SMs)."""
    raw = (os.environ if env is None else env).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if raw is None:
        return None
    try:
        p = decimal_float(raw.strip())  # not 1_0, which the driver would not read as 10
    except ValueError:
        return None
    return p if math.isfinite(p) and 0.0 < p <= 100.0 else None


def sm_share(sm_count: int, ranks_on_gpu: int, env: Mapping[str, str] | None = None) -> int:
    """The most CTAs one kernel of this rank may launch (at least 1).

    Parameters
    ----------
    sm_count : int
        ``multiProcessorCount`` as this process sees it.
    ranks_on_gpu : int
        Ranks of the group on this GPU (1 with one GPU per rank).
    env : mapping, optional
        Where to read ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (default: ``os.environ``).
    """
    sm_count = max(1, int(sm_count))
    ranks = max(1, int(ranks_on_gpu))
    p = mps_thread_percentage(env)
    whole = sm_count if p is None else sm_count * 100.0 / p
    return max(1, min(sm_count, int(whole // ranks)))
