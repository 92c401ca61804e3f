"""vLLM's direct query gather and KV gather workspaces, on dcpkit's QGather and KVGather (see
:mod:`dcpkit.vllm._workspaces` for what the workspaces share)."""

from __future__ import annotations

from ..errors import InvalidArgument
from ._common import (
    BFLOAT16,
    InvalidGeometry,
    UnsupportedDtype,
    check_int,
    movable_view_dtype,
    resolve_torch_dtype,
)
from ._workspaces import (
    KV_GATHER_DTYPES,
    Workspace,
    check_row_bytes,
    check_sizes,
    check_two_ranks,
    dtype_in,
    head_sizes,
)

__all__ = ["DirectDCPQGatherWorkspace", "DirectDCPKVGatherWorkspace"]


# ----------------------------------------------------------------------------- q gather
class DirectDCPQGatherWorkspace(Workspace):
    """The DCP query gather: every rank gets the query heads of all ranks, one direct kernel per
    call (:class:`dcpkit.ops.QGather`), into a persistent buffer.

    Naive equivalent::

        torch.cat(all_gather(local_query), dim=1)   # [T, H_r, D] per rank -> [T, W*H_r, D]

    bit for bit. The result is a view of ``final_query[ubatch]``, storage of
    ``[max_num_tokens, padded_num_heads, head_dim]`` per ubatch, with vLLM's row stride
    ``W*H_r*head_dim`` (dense heads; the padding is room at the end of the storage, for attention
    kernels with a fixed head count that over-read; zero at construction, never written by
    dcpkit).

    Parameters
    ----------
    group, device, max_num_tokens, heads_per_rank, head_dim, num_ubatches
        As :class:`DirectDCPA2AWorkspace` (``heads_per_rank`` = ``H_r``, the local heads).
    dtype : torch.dtype
        Element type (default torch.bfloat16): any type dcpkit can move (the kernel moves
        bytes; float8 types as uint8 views). ``H_r * D * itemsize`` must be a multiple of 16.
    padded_num_heads : int, optional
        ``>= W*H_r``: heads of storage per token (``padded_num_heads * D * itemsize`` a
        multiple of 16). Default ``W*H_r``.

    Attributes
    ----------
    gathered_num_heads : int
        ``W*H_r``.
    padded_num_heads : int
        As given (or ``W*H_r``).
    final_query : torch.Tensor [num_ubatches, max_num_tokens, padded_num_heads, head_dim]
        The storage the results are views of.
    op : dcpkit.ops.QGather

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    InvalidGeometry
        ``num_ubatches < 1``, a non-positive size, rows not a multiple of 16 bytes, fewer than
        two ranks, ``padded_num_heads < W*H_r`` (a ``ValueError``); before anything is
        allocated.
    UnsupportedDtype
        A dtype dcpkit cannot move (complex, bool).
    InvalidType, MissingDependency, PeerError, ConfigMismatch
        As :class:`DirectDCPA2AWorkspace`.
    """

    _what = "DirectDCPQGatherWorkspace"

    def __init__(
        self,
        group,
        device,
        max_num_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype=BFLOAT16,
        num_ubatches: int = 1,
        padded_num_heads: int | None = None,
    ) -> None:
        what = self._what

        def check(W: int):
            U, T, H_r, D = head_sizes(what, num_ubatches, max_num_tokens, heads_per_rank, head_dim)
            dt = resolve_torch_dtype(dtype, what)
            if movable_view_dtype(dt) is None:
                raise UnsupportedDtype(
                    f"{what}: dtype must be a type dcpkit can move (a float, "
                    f"integer or float8 type) (got {dt})"
                )
            pad = (
                None
                if padded_num_heads is None
                else check_int(padded_num_heads, what, "padded_num_heads")
            )
            H = W * H_r
            storage = H if pad is None else pad
            isz = dt.itemsize
            if (H_r * D * isz) % 16 or (storage * D * isz) % 16:
                raise InvalidGeometry(
                    f"{what}: query rows must be 16-byte aligned: heads_per_rank*head_dim*"
                    f"itemsize and padded_num_heads*head_dim*itemsize must be multiples of 16 "
                    f"bytes (got {H_r}*{D}*{isz} = {H_r * D * isz} and {storage}*{D}*{isz} = "
                    f"{storage * D * isz})"
                )
            check_two_ranks(what, W, "q-gather")
            if storage < H:
                raise InvalidGeometry(
                    f"{what}: padded_num_heads must cover the gathered heads "
                    f"world_size*heads_per_rank = {H} (got {storage})"
                )
            return T, H_r, D, dt, U, storage

        T, H_r, D, dt, U, pad = self._setup(group, device, check)
        self.max_num_tokens, self.heads_per_rank, self.head_dim = T, H_r, D
        self.dtype, self.num_ubatches = dt, U
        self.gathered_num_heads = self.world_size * H_r
        self.padded_num_heads = pad
        name, self._view_dtype = movable_view_dtype(dt)
        torch = self._torch
        from ..ops import QGather

        self._start_op(
            lambda: QGather(
                self.comm, max_tokens=T, heads_per_rank=H_r, head_dim=D, dtype=name, num_ubatches=U
            )
        )
        try:
            # zeroed bytes, viewed as the dtype (no fill kernel needed for float8)
            self.final_query = self._allocate(
                lambda: torch.zeros(
                    (U, T, pad, D * dt.itemsize), dtype=torch.uint8, device=self.device
                ).view(dt)
            )
        except BaseException:
            self.close()
            raise

    def gather(self, local_query):
        """Gather the query heads of every rank.

        Naive equivalent: ``torch.cat(all_gather(local_query), dim=1)``.

        Parameters
        ----------
        local_query : torch.Tensor [T, H_r, D], the workspace dtype
            ``T <= max_num_tokens``, equal on every rank. Heads contiguous (strides
            ``(>= H_r*D, D, 1)``), 16-byte aligned rows (padded token storage is read in
            place).

        Returns
        -------
        torch.Tensor [T, W*H_r, D]
            A view of ``final_query[ubatch]`` with strides ``(W*H_r*D, D, 1)``. **Lifetime**:
            valid until the next gather of the same ubatch is issued; consume it (attention)
            on the same stream before that (vLLM: the buffer is reused after the downstream
            combine).

        Collective: every rank, same ``T`` and ubatch, in the same order.

        Stream: torch's current stream; one dcpkit kernel; never blocks the host;
        capture-safe (allocates nothing).

        Raises
        ------
        UbatchOutOfRange
            The current ubatch is outside ``[0, num_ubatches)``.
        InvalidGeometry
            ``local_query.shape[1] != heads_per_rank`` (vLLM's check).
        InvalidArgument, InvalidType
            Wrong type, device, dtype, shape, layout or ``T``; before anything is launched.
        ClosedError
            The workspace is closed.
        """
        what = "DirectDCPQGatherWorkspace.gather"
        u = self._begin(what)
        H_r, D, H = self.heads_per_rank, self.head_dim, self.gathered_num_heads
        if getattr(local_query, "ndim", None) == 3 and local_query.shape[1] != H_r:
            raise InvalidGeometry(
                f"{what}: local_query must have heads_per_rank = {H_r} local "
                f"query heads (got {local_query.shape[1]})"
            )
        self._check_tensor(local_query, what, "local_query", ndim=3)
        T = local_query.shape[0]
        if local_query.shape[2] != D:
            raise InvalidArgument(
                f"{what}: local_query head_dim must be {D} (got {local_query.shape[2]})"
            )
        self._check_rows(what, "local_query", local_query, H_r)
        output = self._torch.as_strided(self.final_query[u], (T, H, D), (H * D, D, 1))
        if T:
            vd = self._view_dtype
            q = local_query if vd is None else local_query.view(vd)
            self._ops.q_gather(q, ubatch=u, out=output if vd is None else output.view(vd))
        return output


# ----------------------------------------------------------------------------- kv gather
class DirectDCPKVGatherWorkspace(Workspace):
    """The chunked-context KV gather: every rank gets every rank's KV rows, rank-major, written
    into the caller's tensor; one direct kernel per call (:class:`dcpkit.ops.KVGather`).

    Naive equivalent::

        torch.distributed.all_gather_into_tensor(gathered_kv, local_kv)   # [W*T, D] <- [T, D]

    bit for bit. Unicast stores through peer pointers by default; multicast only where
    dcpkit's multicast guard allows it (opt-in ``DCPKIT_MULTICAST=1``, device support, none of
    the disabling variables set); this class never asks for it.

    Parameters
    ----------
    group, device, num_ubatches
        As :class:`DirectDCPA2AWorkspace`.
    max_gathered_tokens : int
        Capacity of ``gathered_kv`` in rows (``W*T`` of a call at most); a multiple of the
        world size.
    token_dim : int
        ``D``, elements per KV row; ``D * itemsize`` a multiple of 16 bytes.
    dtype : torch.dtype
        torch.bfloat16 (default), torch.float16 or torch.float8_e4m3fn.

    Attributes
    ----------
    max_gathered_tokens, token_dim, dtype, num_ubatches, world_size, rank, device, op

    Collective: construction, every call, :meth:`close`.

    Raises
    ------
    UnsupportedDtype
        ``dtype`` outside the three (a ``ValueError``).
    InvalidGeometry
        ``num_ubatches < 1``, a non-positive size, rows not a multiple of 16 bytes, fewer
        than two ranks, ``max_gathered_tokens % world_size != 0`` (a ``ValueError``); before
        anything is allocated.
    InvalidType, MissingDependency, PeerError, ConfigMismatch
        As :class:`DirectDCPA2AWorkspace`.
    """

    _what = "DirectDCPKVGatherWorkspace"

    def __init__(
        self,
        group,
        device,
        max_gathered_tokens: int,
        token_dim: int,
        dtype=BFLOAT16,
        num_ubatches: int = 1,
    ) -> None:
        what = self._what

        def check(W: int):
            dt = dtype_in(what, dtype, KV_GATHER_DTYPES)
            U, T, D = check_sizes(
                what,
                num_ubatches,
                T=("max_gathered_tokens", max_gathered_tokens),
                D=("token_dim", token_dim),
            )
            check_row_bytes(what, "token_dim", D, dt.itemsize, "KV rows must be 16-byte aligned: ")
            check_two_ranks(what, W, "kv-gather")
            if T % W:
                raise InvalidGeometry(
                    f"{what}: max_gathered_tokens must divide evenly across "
                    f"ranks: a multiple of world_size {W} (got {T}; {T} % "
                    f"{W} = {T % W})"
                )
            return T, D, dt, U

        T, D, dt, U = self._setup(group, device, check)
        self.max_gathered_tokens, self.token_dim, self.dtype, self.num_ubatches = T, D, dt, U
        name, self._view_dtype = movable_view_dtype(dt)
        from ..ops import KVGather

        self._start_op(
            lambda: KVGather(
                self.comm, max_tokens=T // self.world_size, row_dim=D, dtype=name, num_ubatches=U
            )
        )

    def gather(self, gathered_kv, local_kv) -> None:
        """Gather ``local_kv`` of every rank into ``gathered_kv``, rank-major.

        Naive equivalent: ``all_gather_into_tensor(gathered_kv, local_kv)``.

        Parameters
        ----------
        gathered_kv : torch.Tensor [W*T, D], the workspace dtype
            Contiguous, 16-byte aligned destination; rows ``[s*T, (s+1)*T)`` get rank ``s``'s
            ``local_kv``.
        local_kv : torch.Tensor [T, D], the workspace dtype
            Contiguous, 16-byte aligned; ``1 <= T``, ``W*T <= max_gathered_tokens``, equal on
            every rank.

        Returns
        -------
        None (as vLLM): the result is in ``gathered_kv``.

        Collective: every rank, same ``T`` and ubatch, in the same order.

        Stream: torch's current stream; one dcpkit kernel; never blocks the host;
        capture-safe (allocates nothing).

        Raises
        ------
        UbatchOutOfRange
            The current ubatch is outside ``[0, num_ubatches)``.
        InvalidArgument, InvalidType
            Wrong type, device, dtype, shape, contiguity or alignment, ``T < 1`` or
            ``W*T > max_gathered_tokens``; before anything is launched.
        ClosedError
            The workspace is closed.
        """
        what = "DirectDCPKVGatherWorkspace.gather"
        u = self._begin(what)
        W, D = self.world_size, self.token_dim
        self._check_tensor(local_kv, what, "local_kv", ndim=2, contiguous=True)
        T = local_kv.shape[0]
        if T < 1 or local_kv.shape[1] != D:
            raise InvalidArgument(
                f"{what}: local_kv shape must be [T, {D}] with T >= 1 (got {list(local_kv.shape)})"
            )
        if W * T > self.max_gathered_tokens:
            raise InvalidArgument(
                f"{what}: world_size * local_kv tokens must be <= "
                f"max_gathered_tokens {self.max_gathered_tokens} (got {W} * "
                f"{T} = {W * T})"
            )
        self._check_tensor(gathered_kv, what, "gathered_kv", ndim=2, contiguous=True)
        if tuple(gathered_kv.shape) != (W * T, D):
            raise InvalidArgument(
                f"{what}: gathered_kv shape must be [world_size*T, D] = "
                f"[{W * T}, {D}] (got {list(gathered_kv.shape)})"
            )
        for name, t in (("local_kv", local_kv), ("gathered_kv", gathered_kv)):
            if t.data_ptr() % 16:
                raise InvalidArgument(
                    f"{what}: {name} data pointer must be 16-byte aligned "
                    f"(got offset {t.data_ptr() % 16})"
                )
        vd = self._view_dtype
        if vd is None:
            self._ops.kv_gather(local_kv, ubatch=u, out=gathered_kv)
        else:
            self._ops.kv_gather(local_kv.view(vd), ubatch=u, out=gathered_kv.view(vd))
        return None
