"""The one exception module of dcpkit.

Every error dcpkit raises on purpose is a :class:`DcpkitError`. Argument checks at the
Python boundary raise :class:`InvalidArgument` (also a ``ValueError``) or
:class:`InvalidType` (also a ``TypeError``) with messages of the form
``"<op>: <argument> <property> must <constraint> (got <value>)"``.
"""

from __future__ import annotations

__all__ = [
    "DcpkitError",
    "InvalidArgument",
    "InvalidType",
    "MissingDependency",
    "CudaError",
    "CompileError",
    "CollectiveTimeout",
    "ConfigMismatch",
    "PeerError",
    "ClosedError",
    "MulticastDisabled",
    "FdExchangeError",
]


class DcpkitError(Exception):
    """Base class of every error dcpkit raises on purpose."""


def _with_detail(message: str, detail: str, form: str) -> str:
    """``message``, followed by ``detail`` written in ``form`` (for example ``" ({})"``) when
    there is one."""
    return message + form.format(detail) if detail else message


class InvalidArgument(DcpkitError, ValueError):
    """An argument has a wrong value, shape, stride, alignment, device or size."""


class InvalidType(DcpkitError, TypeError):
    """An argument has a wrong type or dtype (a host array where a GPU array is needed, ...)."""


class MissingDependency(DcpkitError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, what: str, extra: str, detail: str = ""):
        self.what = what
        self.extra = extra
        msg = f"{what} is not installed: install it with `pip install 'dcpkit[{extra}]'`"
        super().__init__(_with_detail(msg, detail, " ({})"))


class CudaError(DcpkitError, RuntimeError):
    """A CUDA driver or runtime call failed.

    Attributes
    ----------
    call : str
        The driver call, for example ``"cuMemCreate"``.
    result : str
        The result name, for example ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    """

    def __init__(self, call: str, result: str, hint: str = ""):
        self.call = call
        self.result = result
        super().__init__(_with_detail(f"{call} failed with {result}", hint, ": {}"))


class CompileError(DcpkitError, RuntimeError):
    """NVRTC could not compile a kernel. Carries the kernel file, options and the NVRTC log."""

    def __init__(self, kernel: str, options, log: str):
        self.kernel = kernel
        self.options = tuple(options)
        self.log = log
        super().__init__(
            f"NVRTC failed to compile kernels/{kernel} with options {list(self.options)}:\n{log}"
        )


class CollectiveTimeout(DcpkitError, RuntimeError):
    """A collective waited past its deadline for a peer that never signalled.

    The workspace that timed out is poisoned: every later call and ``synchronize()`` raise this
    error again. The CUDA context stays usable.

    Attributes
    ----------
    op : str
        The op that timed out (``"lse_reduce"``, ``"q_gather"``, ``"kv_gather"``, ...).
    rank : int
        The rank that observed the timeout.
    peer : int
        The silent peer: the rank whose signal never arrived.
    expected_epoch, observed_epoch : int
        The low 32 bits of the epoch waited for, and the last value seen: the peer's signal
        (the pull kv_gather), or the number of the peer's calls whose every CTA had published
        (the ops that publish by share counters).
    ubatch : int
        The ubatch of the call.
    timeout_ms : float
        The deadline that expired.
    """

    def __init__(
        self,
        op: str,
        rank: int,
        peer: int,
        expected_epoch: int,
        observed_epoch: int,
        ubatch: int = 0,
        timeout_ms: float = 0.0,
    ):
        self.op = op
        self.rank = rank
        self.peer = peer
        self.expected_epoch = expected_epoch
        self.observed_epoch = observed_epoch
        self.ubatch = ubatch
        self.timeout_ms = timeout_ms
        super().__init__(
            f"{op}: rank {rank} timed out after {timeout_ms:g} ms waiting for peer {peer} "
            f"(ubatch {ubatch}, expected epoch {expected_epoch}, observed {observed_epoch}); "
            f"the workspace is poisoned: close it and build a new one"
        )


class ConfigMismatch(DcpkitError, ValueError):
    """Ranks that must agree on a setting do not. Names the setting and the ranks that differ.

    Attributes
    ----------
    what : str
        The setting compared.
    values : dict
        Value seen on each rank (rank -> value).
    ranks : list of int
        The ranks whose value differs from the value of the majority (or of rank 0 on a tie).
        Where no two ranks agree (three ranks or more), the message names every rank's value
        instead of "the others".
    """

    def __init__(self, what: str, values_by_rank):
        self.what = what
        self.values = dict(enumerate(values_by_rank))
        reprs = [repr(v) for v in values_by_rank]
        counts = {}
        for r in reprs:
            counts[r] = counts.get(r, 0) + 1
        best = max(counts.values())
        majority = next(r for r in reprs if counts[r] == best)
        self.ranks = [i for i, r in enumerate(reprs) if r != majority]
        if len(reprs) >= 3 and best == 1:  # no majority: "the others" would name no one
            detail = ", ".join(f"{reprs[i]} on rank {i}" for i in range(len(reprs)))
            super().__init__(
                f"{what} must be equal on every rank; no two ranks agree: {what}={detail}"
            )
            return
        detail = ", ".join(f"rank {i}: {reprs[i]}" for i in range(len(reprs)))
        super().__init__(
            f"{what} must be equal on every rank; ranks {self.ranks} differ from the others "
            f"({detail})"
        )


class PeerError(DcpkitError, RuntimeError):
    """A collective setup step failed on another rank; this rank unwound and raises too.

    Attributes
    ----------
    failed : dict
        rank -> error message, for every rank that failed.
    """

    def __init__(self, what: str, failed):
        self.what = what
        self.failed = dict(failed)
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failed.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.failed)}: {detail}")


class ClosedError(DcpkitError, RuntimeError):
    """A resource (heap, workspace, communicator) was used after ``close()``."""


class MulticastDisabled(DcpkitError, RuntimeError):
    """A multicast object was requested where multicast is not allowed: a disabling variable
    (``NCCL_NVLS_ENABLE=0``, ``NVSHMEM_DISABLE_NVLS=1``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
    ``DCPKIT_DISABLE_MULTICAST=1``) is set on some rank, or the device has no multicast support.
    Raised before any multicast driver call."""


class FdExchangeError(DcpkitError, RuntimeError):
    """Passing file descriptors between the ranks of one host failed: a peer did not connect or
    answer before the deadline, sent a malformed message, or the socket name was taken."""
