"""``q_gather`` on NCCL: an all-gather of ``q`` plus the head reorder (:class:`NcclQGather`)."""

from __future__ import annotations

from .._checks import COPY_ITEMSIZES, check_positive_int, resolve_bytes_dtype
from .._overlap import check_disjoint, check_writable_layout
from .._strided import c_contiguous, launch_copy, owner_to_heads_plan
from ..comm import Communicator
from ..errors import InvalidArgument
from .base import NcclGather
from .group import NcclGroup

__all__ = ["NcclQGather"]


class NcclQGather(NcclGather):
    """``q_gather`` on NCCL: an all-gather of ``q`` plus the head reorder.

    Naive equivalent::

        q_all = torch.cat(all_gather(q), dim=1)      # [T, H_r, D] per rank -> [T, H, D]

    ``ncclAllGather`` of ``q`` (made contiguous) into ``[W, T, H_r, D]``, then one strided copy
    into ``[T, H, D]`` (``T == 1``: NCCL gathers straight into the result). Bit for bit the
    result of :class:`~dcpkit.ops.QGather`.

    Parameters
    ----------
    comm : Communicator
    max_tokens : int
        ``T_max``: buffers are sized for it. Larger ``T`` works eagerly (allocates per call).
    heads_per_rank : int
        ``H_r``; the result has ``H = H_r * world_size`` heads.
    head_dim : int
        ``D``.
    dtype : dtype or str
        Any dtype of 1, 2, 4, 8 or 16 bytes (bytes are moved).
    num_ubatches : int
        Independent buffer sets (calls of different ubatches may overlap on different streams).
    padded_num_heads : int, optional
        ``H_pad >= H``: the workspace result sits in ``[T, H_pad, D]`` storage (pad heads never
        written); ``return_padded=True`` returns that storage.
    timeout_ms, heap, multicast
        Accepted for signature compatibility with :class:`~dcpkit.ops.QGather`; unused.
    nccl_group : NcclGroup, optional
        Share this NCCL communicator instead of creating one.

    Attributes
    ----------
    path : str
        ``"nccl"``.
    algorithm : str
        ``"all_gather"``.
    launches_per_call : int
        2 (all-gather and reorder; 1 for ``T == 1`` with contiguous ``q``).

    Collective: construction (NCCL init, warm-up, barrier), every call, :meth:`close`.

    Raises
    ------
    InvalidArgument, InvalidType
        A bad geometry argument.
    MissingDependency
        NCCL is not usable through CuPy (names the cuda12 / cuda13 extra).
    ConfigMismatch, PeerError
        Ranks passed different geometries, or another rank failed.
    """

    op_name = "q_gather"
    algorithm = "all_gather"
    launches_per_call = 2
    agreed_names = "max_tokens, heads_per_rank, head_dim, dtype, padded_num_heads, num_ubatches"

    def __init__(
        self,
        comm: Communicator,
        *,
        max_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype,
        num_ubatches: int = 1,
        padded_num_heads: int | None = None,
        timeout_ms: float | None = None,
        heap=None,
        multicast: bool | None = None,
        nccl_group: NcclGroup | None = None,
    ):
        self._construct(locals())  # every keyword: none is left unchecked

    def _make_buffers(self) -> None:
        super()._make_buffers()
        self._gather = self._per_ubatch(self.world_size * self.max_tokens * self.row_bytes)

    @classmethod
    def _check_geometry(
        cls,
        world_size: int,
        *,
        max_tokens,
        heads_per_rank,
        head_dim,
        dtype,
        num_ubatches=1,
        padded_num_heads=None,
        timeout_ms=None,
    ) -> tuple[tuple, dict]:
        """Every check of the geometry keywords that needs no GPU and no collective; returns
        ``(agreed, geometry)``: the values every rank must agree on, and the checked geometry by
        attribute name."""
        op = cls.op_name
        g = cls._check_common(world_size, max_tokens, num_ubatches, timeout_ms)
        W, T = g["world_size"], g["max_tokens"]
        g["heads_per_rank"] = check_positive_int(heads_per_rank, op, "heads_per_rank")
        g["head_dim"] = check_positive_int(head_dim, op, "head_dim")
        dt = g["dtype"] = resolve_bytes_dtype(dtype, op, COPY_ITEMSIZES)
        H = g["num_heads"] = g["heads_per_rank"] * W
        pad = H if padded_num_heads is None else padded_num_heads
        g["padded_num_heads"] = check_positive_int(pad, op, "padded_num_heads", minimum=H)
        row = g["row_bytes"] = g["heads_per_rank"] * g["head_dim"] * dt.itemsize
        g["_token_bytes"] = g["padded_num_heads"] * g["head_dim"] * dt.itemsize
        g["_result_bytes"] = T * g["_token_bytes"]
        cls._check_buffer_bytes(
            g["num_ubatches"],
            T * row * (1 + W) + 3 * T * g["_token_bytes"],
            "max_tokens, heads_per_rank, head_dim, padded_num_heads",
        )
        return (
            T,
            g["heads_per_rank"],
            g["head_dim"],
            str(dt),
            g["padded_num_heads"],
            g["num_ubatches"],
        ), g

    def _free_buffers(self) -> None:
        super()._free_buffers()
        self._gather = None

    def _warmup_call(self, T: int) -> None:
        cupy = self._cupy
        q = cupy.zeros(
            (T, self.heads_per_rank, self.head_dim * self.dtype.itemsize), dtype=cupy.uint8
        ).view(self.dtype)
        self._call(q, 0, None, None, False)

    def __call__(self, q, *, ubatch: int = 0, out=None, stream=None, return_padded: bool = False):
        """Gather ``q`` of every rank: ``[T, H_r, D]`` here -> ``[T, H, D]`` everywhere.

        Parameters
        ----------
        q : GPU array [T, H_r, D], the workspace dtype
            Any strides (a strided ``q`` is first copied to a contiguous buffer).
        ubatch : int
        out : GPU array [T, H, D], optional
            Any strides; ``out`` is returned.
        stream : cupy.cuda.Stream, optional
            Default: the current CuPy stream.
        return_padded : bool
            Return the ``[T, H_pad, D]`` storage (only with ``out=None``).

        Returns
        -------
        GPU array [T, H, D] (or [T, H_pad, D])
            ``out``, or a view of a workspace buffer with token stride ``H_pad*D`` (lifetime:
            module docstring; ``T > max_tokens``: a fresh array).

        Collective: every rank, same ``T``, dtype and ubatch, same order.

        Stream: NCCL and copy kernels on ``stream``; the host does not wait; capture-safe for
        ``T <= max_tokens``.

        Raises
        ------
        InvalidArgument, InvalidType
            Bad shape, dtype, device, ubatch; ``T > max_tokens`` while capturing.
        ClosedError
        """
        self.check_open()
        return self._call(q, ubatch, out, stream, return_padded)

    def _call(self, q, ubatch, out, stream, return_padded):
        op = self.op_name
        u = self.check_ubatch(ubatch)
        if return_padded and out is not None:
            raise InvalidArgument(
                f"{op}: return_padded must be False when out= is given (got return_padded=True)"
            )
        H_r, D, H, isz = self.heads_per_rank, self.head_dim, self.num_heads, self.dtype.itemsize
        qi = self._checked(q, "q", (None, H_r, D), "T, H_r, D")
        T = qi.shape[0]
        oi = None if out is None else self._checked(out, "out", (T, H, D), "T, H, D")
        check_disjoint(op, (("out", oi),), (("q", qi),))
        check_writable_layout(op, "out", oi)
        stream = self.get_stream(stream)
        if T == 0:
            if out is not None:
                return out
            v = self._view(self._outs[u][0], (0, self.padded_num_heads, D), self.dtype)
            return v if return_padded else v[:, :H]
        idx, _ = self._begin(u, T, stream, (T, str(self.dtype), u))
        W = self.world_size
        res = None
        if oi is None:
            buf = self._out_buffer(self._outs, u, idx, T, T * self._token_bytes, stream)
            full = self._view(buf, (T, self.padded_num_heads, D), self.dtype)
            res = full if return_padded else full[:, :H]
            oi = self._info(full[:, :H], "out")
        else:
            res = out
        # send buffer: q itself when contiguous, else a contiguous copy
        if c_contiguous(qi):
            send_ptr = qi.ptr
        else:
            sbuf = self._scratch(self._send, u, T, T * self.row_bytes, stream)
            sv = self._info(self._view(sbuf, (T, H_r, D), self.dtype), "q")
            self._copy(sv, qi, stream)
            send_ptr = sv.ptr
        nbytes = T * self.row_bytes
        heads_contig = (H == 1 or oi.strides[1] == D * isz) and (D == 1 or oi.strides[2] == isz)
        if T == 1 and heads_contig:
            # [W, 1, H_r, D] is [1, H, D]: gather straight into the result
            self._nccl.allGather(send_ptr, oi.ptr, nbytes, self._nccl_mod.NCCL_UINT8, stream.ptr)
            return res
        gbuf = self._scratch(self._gather, u, T, W * nbytes, stream)
        self._nccl.allGather(send_ptr, gbuf.data.ptr, nbytes, self._nccl_mod.NCCL_UINT8, stream.ptr)
        # [W, T, H_r, D] -> out[t, s*H_r + j, d]
        p = owner_to_heads_plan(W, T, H_r, D, isz, oi.strides, oi.ptr, gbuf.data.ptr)
        launch_copy(self.device, p, oi.ptr, gbuf.data.ptr, stream)
        return res
