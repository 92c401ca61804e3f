"""Deprecated alias of :mod:`dcpkit.nccl` (the NCCL ops) and :mod:`dcpkit._strided` (the
strided copy), kept for one release: ``from dcpkit.fallback import NcclQGather, strided_copy``
still works. Import from :mod:`dcpkit.nccl` instead; this module will be removed in the next
release."""

from ._strided import CopyPlan, copy_plan, heads_to_owner_plan, owner_to_heads_plan, strided_copy
from .nccl import (
    LSE_ALGORITHMS,
    PATH_NCCL,
    LseLayout,
    NcclGroup,
    NcclKVGather,
    NcclLseReduce,
    NcclQGather,
    lse_layout,
    nccl_module,
)

__all__ = [
    "NcclGroup",
    "NcclQGather",
    "NcclKVGather",
    "NcclLseReduce",
    "LSE_ALGORITHMS",
    "PATH_NCCL",
    "nccl_module",
    "strided_copy",
    "copy_plan",
    "CopyPlan",
    "owner_to_heads_plan",
    "heads_to_owner_plan",
    "lse_layout",
    "LseLayout",
]
