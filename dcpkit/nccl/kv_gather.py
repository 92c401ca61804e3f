"""``kv_gather`` on NCCL: one ``ncclAllGather`` (:class:`NcclKVGather`)."""

from __future__ import annotations

from .._checks import COPY_ITEMSIZES, check_positive_int, resolve_bytes_dtype
from .._overlap import check_disjoint, check_writable_layout
from .._strided import c_contiguous
from ..comm import Communicator
from ..errors import InvalidArgument
from .base import NcclGather
from .group import NcclGroup

__all__ = ["NcclKVGather"]


class NcclKVGather(NcclGather):
    """``kv_gather`` on NCCL: one ``ncclAllGather``.

    Naive equivalent::

        out = all_gather_into_tensor(kv)             # [T, D_kv] per rank -> [W*T, D_kv]

    Bit for bit the result of :class:`~dcpkit.ops.KVGather`.

    Parameters
    ----------
    comm, max_tokens, num_ubatches, nccl_group
        As :class:`NcclQGather`.
    row_dim : int
        ``D_kv``.
    dtype : dtype or str
        Any dtype of 1, 2, 4, 8 or 16 bytes.
    algorithm, timeout_ms, heap, multicast
        Accepted for signature compatibility with :class:`~dcpkit.ops.KVGather` (``algorithm``
        must still be ``"push"`` or ``"pull"``); unused.

    Attributes
    ----------
    path, algorithm : str
        ``"nccl"``, ``"all_gather"``.
    launches_per_call : int
        1 (plus a copy for a strided ``kv`` or ``out``).

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    InvalidArgument, InvalidType, MissingDependency, ConfigMismatch, PeerError
        As :class:`NcclQGather`.
    """

    op_name = "kv_gather"
    algorithm = "all_gather"
    launches_per_call = 1
    agreed_names = "max_tokens, row_dim, dtype, num_ubatches"

    def __init__(
        self,
        comm: Communicator,
        *,
        max_tokens: int,
        row_dim: int,
        dtype,
        num_ubatches: int = 1,
        algorithm: str = "push",
        timeout_ms: float | None = None,
        heap=None,
        multicast: bool | None = None,
        nccl_group: NcclGroup | None = None,
    ):
        self._construct(locals())  # every keyword: none is left unchecked

    @classmethod
    def _check_geometry(
        cls,
        world_size: int,
        *,
        max_tokens,
        row_dim,
        dtype,
        num_ubatches=1,
        algorithm="push",
        timeout_ms=None,
    ) -> tuple[tuple, dict]:
        """Every check of the constructor keywords that needs no GPU and no collective; returns
        ``(agreed, geometry)`` as :meth:`NcclQGather._check_geometry`."""
        op = cls.op_name
        g = cls._check_common(world_size, max_tokens, num_ubatches, timeout_ms)
        g["row_dim"] = check_positive_int(row_dim, op, "row_dim")
        dt = g["dtype"] = resolve_bytes_dtype(dtype, op, COPY_ITEMSIZES)
        if algorithm not in ("push", "pull"):
            raise InvalidArgument(f"{op}: algorithm must be 'push' or 'pull' (got {algorithm!r})")
        T = g["max_tokens"]
        g["row_bytes"] = g["row_dim"] * dt.itemsize
        g["_result_bytes"] = g["world_size"] * T * g["row_bytes"]
        cls._check_buffer_bytes(
            g["num_ubatches"], T * g["row_bytes"] * (1 + 3 * g["world_size"]), "max_tokens, row_dim"
        )
        return (T, g["row_dim"], str(dt), g["num_ubatches"]), g

    def _warmup_call(self, T: int) -> None:
        cupy = self._cupy
        kv = cupy.zeros((T, self.row_bytes), dtype=cupy.uint8).view(self.dtype)
        self._call(kv, 0, None, None)

    def __call__(self, kv, *, ubatch: int = 0, out=None, stream=None):
        """Gather ``kv`` of every rank: ``[T, D_kv]`` here -> ``[world_size*T, D_kv]``.

        Parameters
        ----------
        kv : GPU array [T, D_kv], the workspace dtype
            Any strides (a strided ``kv`` is first copied to a contiguous buffer).
        ubatch : int
        out : GPU array [world_size*T, D_kv], optional
            Any strides; ``out`` is returned.
        stream : cupy.cuda.Stream, optional

        Returns
        -------
        GPU array [world_size*T, D_kv]
            ``out``, or a C-contiguous view of a workspace buffer (lifetime: module docstring).

        Collective: every rank, same ``T``, dtype and ubatch, same order.

        Stream: on ``stream``; the host does not wait; capture-safe for ``T <= max_tokens``.

        Raises
        ------
        InvalidArgument, InvalidType, ClosedError
        """
        self.check_open()
        return self._call(kv, ubatch, out, stream)

    def _call(self, kv, ubatch, out, stream):
        u = self.check_ubatch(ubatch)
        W, Dk = self.world_size, self.row_dim
        ki = self._checked(kv, "kv", (None, Dk), "T, D_kv")
        T = ki.shape[0]
        oi = None if out is None else self._checked(out, "out", (W * T, Dk), "world_size*T, D_kv")
        check_disjoint(self.op_name, (("out", oi),), (("kv", ki),))
        check_writable_layout(self.op_name, "out", oi)
        stream = self.get_stream(stream)
        if T == 0:
            return out if out is not None else self._view(self._outs[u][0], (0, Dk), self.dtype)
        idx, _ = self._begin(u, T, stream, (T, str(self.dtype), u))
        nbytes = T * self.row_bytes
        if c_contiguous(ki):
            send_ptr = ki.ptr
        else:
            sbuf = self._scratch(self._send, u, T, nbytes, stream)
            sv = self._info(self._view(sbuf, (T, Dk), self.dtype), "kv")
            self._copy(sv, ki, stream)
            send_ptr = sv.ptr
        if oi is not None and c_contiguous(oi):
            self._nccl.allGather(send_ptr, oi.ptr, nbytes, self._nccl_mod.NCCL_UINT8, stream.ptr)
            return out
        buf = self._out_buffer(self._outs, u, idx, T, W * nbytes, stream)
        res = self._view(buf, (W * T, Dk), self.dtype)
        self._nccl.allGather(send_ptr, buf.data.ptr, nbytes, self._nccl_mod.NCCL_UINT8, stream.ptr)
        if oi is None:
            return res
        self._copy(oi, self._info(res, "out"), stream)
        return out
