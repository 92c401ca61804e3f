"""The NCCL communicator of the NCCL ops, and the check that NCCL is usable through CuPy.

Usage, on every rank::

    group = NcclGroup(comm)          # collective: rank 0 draws the id, every rank joins
    qg = NcclQGather(comm, ..., nccl_group=group)
    ...
    qg.close(); group.close()        # collective
"""

from __future__ import annotations

from .. import _cuda
from .._checks import check_comm
from .._cuda import cuda_extra
from .._lifecycle import Resource
from .._setup import collective_step, guarded
from ..comm import Communicator
from ..errors import CudaError, MissingDependency

__all__ = ["NcclGroup", "nccl_module"]


def nccl_module():
    """``cupy.cuda.nccl``, checked to be usable.

    Raises
    ------
    MissingDependency
        CuPy or its NCCL library is not installed; the message names the ``cuda12`` /
        ``cuda13`` extra (which brings ``nvidia-nccl-cu12`` / ``-cu13``).
    """
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise MissingDependency("cupy (cupy.cuda.nccl)", cuda_extra(), str(e)) from None
    if not getattr(nccl, "available", False):
        raise MissingDependency(
            "NCCL for cupy.cuda.nccl (libnccl.so.2)",
            cuda_extra(),
            "cupy.cuda.nccl.available is False",
        )
    return nccl


class NcclGroup(Resource):
    """One NCCL communicator over the ranks of a :class:`~dcpkit.comm.Communicator`, on this
    rank's current CuPy device. The NCCL ops can share one (``nccl_group=``).

    Rank 0 draws the NCCL unique id (``ncclGetUniqueId``), the Communicator broadcasts it, every
    rank calls ``ncclCommInitRank``.

    Attributes
    ----------
    nccl : cupy.cuda.nccl.NcclCommunicator
    device : int
        The GPU of this rank.

    Collective: construction and :meth:`close`.

    Raises
    ------
    MissingDependency
        CuPy or NCCL is not usable through CuPy (on any rank: the others raise PeerError).
    DcpkitError
        No CUDA GPU is visible (on any rank: the others raise PeerError).
    """

    _resource_name = "NcclGroup"

    def __init__(self, comm: Communicator):
        self.comm = check_comm(comm, "NcclGroup")

        def init():
            # CuPy, NCCL and a GPU on every rank, agreed before any rank enters NCCL.
            _cuda.require_cupy()
            self._nccl_mod = nccl_module()
            self.device = _cuda.require_device("NcclGroup")

        comm.agree_setup("NcclGroup", guarded("NcclGroup", init), "nothing")
        import cupy

        nccl = self._nccl_mod
        uid = collective_step(
            comm,
            "NcclGroup: ncclGetUniqueId on rank 0",
            lambda: nccl.get_unique_id() if comm.rank == 0 else None,
        )
        uid = comm.broadcast(uid, root=0)

        def init_rank():
            with cupy.cuda.Device(self.device):
                return nccl.NcclCommunicator(comm.world_size, uid, comm.rank)

        self.nccl = collective_step(comm, "NcclGroup: ncclCommInitRank", init_rank)
        self._closed = False

    @property
    def nccl_mod(self):
        """The ``cupy.cuda.nccl`` module this group runs on."""
        return self._nccl_mod

    def check_async_error(self) -> None:
        """Raise :class:`CudaError` if NCCL reported an asynchronous error."""
        try:
            self.nccl.check_async_error()
        except self._nccl_mod.NcclError as e:
            raise CudaError(
                "ncclCommGetAsyncError", str(e), "the NCCL communicator is unusable: close it"
            ) from None

    def close(self) -> None:
        """Wait for the device, then destroy the NCCL communicator (collective, idempotent)."""
        super().close()

    def _close(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            self.nccl.destroy()
        self.nccl = None
