"""dcpkit: low-latency multi-GPU collectives for decode context parallelism (DCP).

Three exchanges of the DCP decode step, each one direct kernel over NVLink:
``q_gather`` (every rank gets the queries of all heads), ``lse_reduce`` (every rank gets the
exact LSE-merged output of its own heads) and ``kv_gather`` (every rank gets a whole chunk of
compressed KV). See README.md for a tour.

Heavy modules (CuPy, cuda-python, MPI, torch) are imported on first use, so ``import dcpkit``
works on any machine.
"""

__version__ = "0.1.0"

# The error classes come from their one module (a few class definitions, no dependency); every
# other public name is imported on first use.
from .errors import __all__ as _ERRORS

__all__ = [  # noqa: PLE0604 - _ERRORS holds the names of dcpkit.errors.__all__
    "__version__",
    "Communicator",
    "SymmetricHeap",
    "MulticastObject",
    "LseReduce",
    "QGather",
    "KVGather",
    "DCPComm",
    *_ERRORS,
]

_LAZY = {
    "Communicator": "dcpkit.comm",
    "SymmetricHeap": "dcpkit.symmetric",
    "MulticastObject": "dcpkit.multicast",
    "LseReduce": "dcpkit.ops",
    "QGather": "dcpkit.ops",
    "KVGather": "dcpkit.ops",
    "DCPComm": "dcpkit.manager",
    **dict.fromkeys(_ERRORS, "dcpkit.errors"),
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dcpkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


def __dir__():
    """The public names (``__all__``) and the submodules imported so far."""
    public = {n for n in globals() if not n.startswith("_")}
    return sorted(public | set(__all__))
