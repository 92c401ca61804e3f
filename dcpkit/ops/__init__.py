"""The direct ops: one kernel over symmetric memory each (NVLink unicast, or multicast where
allowed). See NOTE [dcpkit epoch signalling] in kernels/dcpkit_ptx.cuh."""

from .kv_gather import KVGather
from .lse_reduce import LseReduce, lse_combine
from .q_gather import QGather

__all__ = ["LseReduce", "QGather", "KVGather", "lse_combine"]
