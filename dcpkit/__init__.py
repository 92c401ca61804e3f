"""dcpkit: low-latency multi-GPU collectives for decode context parallelism (DCP).

Three exchanges of the DCP decode step, each one direct kernel over NVLink:
``q_gather`` (every rank gets the queries of all heads), ``lse_reduce`` (every rank gets the
exact LSE-merged output of its own heads) and ``kv_gather`` (every rank gets a whole chunk of
compressed KV). See README.md for a tour.

Heavy modules (CuPy, cuda-python, MPI, torch) are imported on first use, so ``import dcpkit``
works on any machine.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Communicator",
    "SymmetricHeap",
    "MulticastObject",
    "LseReduce",
    "QGather",
    "KVGather",
    "DCPComm",
    "DcpkitError",
    "CollectiveTimeout",
    "ConfigMismatch",
    "CompileError",
    "CudaError",
    "MissingDependency",
]

_LAZY = {
    "Communicator": "dcpkit.comm",
    "SymmetricHeap": "dcpkit.symmetric",
    "MulticastObject": "dcpkit.multicast",
    "LseReduce": "dcpkit.ops",
    "QGather": "dcpkit.ops",
    "KVGather": "dcpkit.ops",
    "DCPComm": "dcpkit.manager",
    "DcpkitError": "dcpkit.errors",
    "CollectiveTimeout": "dcpkit.errors",
    "ConfigMismatch": "dcpkit.errors",
    "CompileError": "dcpkit.errors",
    "CudaError": "dcpkit.errors",
    "MissingDependency": "dcpkit.errors",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dcpkit' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
