"""The three direct workspaces of vLLM's direct DCP module, on dcpkit's ops.

Each class keeps vLLM's constructor (names, order, defaults), methods, shapes and errors, and
runs one dcpkit op (:class:`~dcpkit.ops.LseReduce`, :class:`~dcpkit.ops.QGather`,
:class:`~dcpkit.ops.KVGather`) through :class:`dcpkit.torch.TorchOps`, always with ``out=``
so that the op allocates nothing and every call is capture-safe.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

from ..errors import ClosedError, InvalidArgument
from ._common import (BFLOAT16, LN2, LOG2E, InvalidGeometry, UnsupportedDtype, agree, check_bool,
                      check_int, check_masks, check_tensor, check_ubatch, device_index,
                      movable_view_dtype, require_torch, resolve_device, resolve_group,
                      resolve_torch_dtype)

__all__ = ["DirectDCPA2AWorkspace", "DirectDCPQGatherWorkspace", "DirectDCPKVGatherWorkspace",
           "A2A_DTYPES", "KV_GATHER_DTYPES"]

#: Names of the torch dtypes the A2A combine takes (vLLM's set).
A2A_DTYPES = ("float16", "bfloat16")
#: Names of the torch dtypes the KV gather takes (vLLM's set).
KV_GATHER_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")


@contextlib.contextmanager
def _on_device(index: int):
    """CuPy's current device set to ``index`` for a dcpkit constructor (which builds on the
    current device). Where CuPy or the device is missing, nothing is set: the constructor then
    raises its own clear error, on every rank."""
    dev = None
    try:
        import cupy  # noqa: WPS433

        dev = cupy.cuda.Device(index)
        dev.__enter__()
    except Exception:  # noqa: BLE001 - reported by the dcpkit constructor instead
        dev = None
    try:
        yield
    finally:
        if dev is not None:
            dev.__exit__(None, None, None)


def _positive(what: str, **dims) -> None:
    bad = {k: v for k, v in dims.items() if v < 1}
    if bad:
        got = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise InvalidGeometry(f"{what}: dimensions must be positive (got {got})")


def _ubatches(what: str, num_ubatches) -> int:
    u = check_int(num_ubatches, what, "num_ubatches")
    if u < 1:
        raise InvalidGeometry(f"{what}: num_ubatches must be >= 1: at least one ubatch slot "
                              f"(got {u})")
    return u


def _dtype_in(what: str, dtype, names) -> None:
    if str(dtype).replace("torch.", "") not in names:
        want = ", ".join(f"torch.{n}" for n in names)
        raise UnsupportedDtype(f"{what}: dtype must be one of [{want}] (got {dtype})")


def _rows_aligned(what: str, name: str, t, heads: int) -> None:
    """Elements contiguous, head stride = head_dim, pointer and strides multiples of 16 bytes
    (what the direct kernels read in place)."""
    isz = t.element_size()
    T, H, D = t.shape
    s_tok, s_head, s_elem = t.stride()
    if (D > 1 and s_elem != 1) or (H > 1 and s_head != D):
        raise InvalidArgument(f"{what}: {name} must have contiguous heads (strides (any, {D}, "
                              f"1)) (got strides {tuple(t.stride())}; use .contiguous())")
    if T > 1 and s_tok < heads * D:
        raise InvalidArgument(f"{what}: {name} token stride must be >= {heads * D} elements "
                              f"(got {s_tok})")
    if t.data_ptr() % 16 or (T > 1 and (s_tok * isz) % 16):
        raise InvalidArgument(f"{what}: {name} rows must be 16-byte aligned: data pointer and "
                              f"token stride multiples of 16 bytes (got pointer offset "
                              f"{t.data_ptr() % 16}, token stride {s_tok * isz} bytes)")


class _Workspace:
    """What the three share: the group, the device, ubatch slots, one dcpkit op, ``close()``."""

    _what = "workspace"

    def _setup(self, group, device, check) -> Tuple:
        """Resolve the group, run every argument check on every rank in one exchange, and
        return what ``check(world_size)`` returned. Sets ``group``, ``comm``, ``world_size``,
        ``rank``, ``device``."""
        self._op = self._ops = None
        self._closed = True
        self._torch = require_torch(self._what)
        comm, _ = resolve_group(group, self._what)
        self.group = group
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
        holder = {}

        def checked():
            dev = resolve_device(device, self._what)
            values = check(comm.world_size)
            holder["device"] = self._torch.device("cuda", device_index(dev))
            return values

        values = agree(comm, self._what, checked)
        self.device = holder["device"]
        return values

    def _allocate(self, make):
        """``make()`` (local torch allocations) on every rank; a failure anywhere raises on every
        rank (:class:`~dcpkit.errors.PeerError` on the others)."""
        err = None
        out = None
        try:
            out = make()
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            err = e
        self.comm.all_ok(f"{self._what}: allocation", err)
        return out

    def _start_op(self, build) -> None:
        """Build the dcpkit op on this workspace's GPU (collective) and its torch front end."""
        from ..torch import TorchOps  # noqa: WPS433

        with _on_device(self.device.index):
            self._op = build()
        self._ops = TorchOps(self._op)
        self._closed = False

    @property
    def op(self):
        """The dcpkit op under this workspace (its ``transport`` says unicast or multicast)."""
        return self._op

    @property
    def transport(self) -> str:
        """``"unicast"`` or ``"multicast"``: what every call of the dcpkit op launches."""
        return getattr(self._op, "transport", "unicast")

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"{what}: the workspace is closed")

    def close(self) -> None:
        """Release the dcpkit op and its symmetric memory (collective, idempotent)."""
        self._closed = True
        if self._ops is not None:
            self._ops.close()
        if self._op is not None:
            self._op.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- A2A combine
class DirectDCPA2AWorkspace(_Workspace):
    """The DCP output combine: all-to-all of partial attention plus the exact LSE merge, one
    direct kernel per call (:class:`dcpkit.ops.LseReduce`).

    Naive equivalent (``W = world_size``, ``H_r = heads_per_rank``, rank ``r`` owns heads
    ``[r*H_r, (r+1)*H_r)``)::

        parts = all_to_all(partial_output.split(H_r, dim=1))      # [W][T, H_r, D]
        lses  = all_to_all(partial_lse.split(H_r, dim=1))         # [W][T, H_r]
        output = lse_merge(parts, lses)                           # [T, H_r, D]

    with dcpkit's merge (DESIGN.md, "The three ops: contracts"): NaN or +inf lse count as an
    empty shard, a zero-weight source is never read, fp32 accumulation rounded once, a row
    empty everywhere is 0 (merged lse -inf); rows of a request with ``seq_lens == 0`` and
    padding rows at or past ``query_start_loc[-1]`` are empty.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or dcpkit.Communicator
        Any backend (gloo carries the host-side setup exchange).
    device : torch.device
        This rank's GPU.
    max_num_tokens : int
        ``T_max``, the largest ``T`` of a call.
    heads_per_rank : int
        ``H_r``; ``partial_output`` has ``H = world_size * H_r`` heads.
    head_dim : int
        ``D``; ``D * itemsize`` must be a multiple of 16 bytes.
    dtype : torch.dtype
        torch.bfloat16 (default) or torch.float16: ``partial_output`` and the result.
    num_ubatches : int
        Ubatch slots (``with dcpkit.vllm.ubatch(i)``).

    Attributes
    ----------
    max_num_tokens, heads_per_rank, head_dim, dtype, num_ubatches, world_size, rank, device
        As given / found.
    op : dcpkit.ops.LseReduce
        The op under the workspace.

    Collective: construction (one argument exchange, then the op's setup), every call (same
    ``T``, masks present or not, ubatch, in the same order), :meth:`close`.

    Raises
    ------
    UnsupportedDtype
        ``dtype`` is not float16 / bfloat16 (a ``ValueError``).
    InvalidGeometry
        ``num_ubatches < 1``, a non-positive size, ``head_dim * itemsize % 16 != 0``,
        ``world_size > 64`` (a ``ValueError``). Raised before anything is allocated.
    InvalidType
        An argument of the wrong type; ``group`` neither a ProcessGroup nor a Communicator.
    MissingDependency
        torch (or CuPy) is not installed.
    PeerError, ConfigMismatch
        Another rank rejected its arguments; the ranks passed different ones.
    """

    _what = "DirectDCPA2AWorkspace"

    def __init__(self, group, device, max_num_tokens: int, heads_per_rank: int, head_dim: int,
                 dtype=BFLOAT16, num_ubatches: int = 1) -> None:
        what = self._what

        def check(W: int):
            dt = resolve_torch_dtype(dtype, what)
            _dtype_in(what, dt, A2A_DTYPES)
            U = _ubatches(what, num_ubatches)
            T = check_int(max_num_tokens, what, "max_num_tokens")
            H_r = check_int(heads_per_rank, what, "heads_per_rank")
            D = check_int(head_dim, what, "head_dim")
            _positive(what, T=T, H=H_r, D=D)
            if (D * dt.itemsize) % 16:
                raise InvalidGeometry(f"{what}: head_dim * itemsize must be a multiple of 16 "
                                      f"bytes (got {D} * {dt.itemsize} = {D * dt.itemsize})")
            if W > 64:
                raise InvalidGeometry(f"{what}: world_size must be <= 64 (got {W})")
            return T, H_r, D, dt, U

        T, H_r, D, dt, U = self._setup(group, device, check)
        self.max_num_tokens, self.heads_per_rank, self.head_dim = T, H_r, D
        self.dtype, self.num_ubatches = dt, U
        name = str(dt).replace("torch.", "")
        from ..ops import LseReduce  # noqa: WPS433

        self._start_op(lambda: LseReduce(self.comm, max_tokens=T, num_heads=self.world_size * H_r,
                                         head_dim=D, dtype=name, num_ubatches=U))

    def lse_reduce(self, partial_output, partial_lse, is_lse_base_on_e: bool, seq_lens=None,
                   query_start_loc=None, *, return_lse: bool = False, out=None, out_lse=None):
        """Merge every rank's partial attention for this rank's heads.

        Naive equivalent: see the class docstring.

        Parameters
        ----------
        partial_output : torch.Tensor [T, W*H_r, D], the workspace dtype
            Attention of all heads over this rank's KV shard. ``T <= max_num_tokens``, equal
            on every rank. Heads contiguous (strides ``(>= H*D, D, 1)``), 16-byte aligned rows.
        partial_lse : torch.Tensor [T, W*H_r], float32 (or float16 / bfloat16)
            Its log-sum-exp: natural log if ``is_lse_base_on_e``, else base 2.
        is_lse_base_on_e : bool
            Base of ``partial_lse`` (and of the returned lse).
        seq_lens : torch.Tensor [S] int32, optional
            This rank's KV length per request (a request with 0 is an empty shard here).
        query_start_loc : torch.Tensor [S+1] int32, optional
            Token offsets of the requests; rows at or past ``query_start_loc[-1]`` are padding
            (0 in the result). Given together with ``seq_lens`` or not at all.
        return_lse : bool
            Also return the merged lse ``[T, H_r]`` float32, in the base of ``partial_lse``
            (a keyword vLLM's direct workspace lacks).
        out : torch.Tensor [T, H_r, D], optional
            Contiguous destination of the workspace dtype (nothing is allocated for it).
        out_lse : torch.Tensor [T, H_r] float32, optional
            Contiguous destination of the merged lse (filled whenever given).

        Returns
        -------
        torch.Tensor [T, H_r, D]
            ``out``, or a new tensor (torch's allocator; inside a CUDA-graph capture, the
            graph's private pool, which torch keeps for the graph's life), as vLLM returns.
            ``(output, lse)`` with ``return_lse=True``.

        Collective: every rank, same ``T``, masks present or not, ubatch, in the same order.

        Stream: torch's current stream; one dcpkit kernel (plus one elementwise kernel each way
        for base-2 lse); never blocks the host; capture-safe.

        Raises
        ------
        UbatchOutOfRange
            The current ubatch is outside ``[0, num_ubatches)``.
        InvalidArgument, InvalidType
            A tensor of the wrong type, device, dtype, shape or layout, ``T > max_num_tokens``,
            one mask without the other (vLLM's ``ValueError``), masks of other lengths.
            Raised before anything is launched.
        ClosedError
            The workspace is closed.
        """
        what = "DirectDCPA2AWorkspace.lse_reduce"
        self._check_open(what)
        u = check_ubatch(what, self.num_ubatches)
        torch = self._torch
        base_e = check_bool(is_lse_base_on_e, what, "is_lse_base_on_e")
        want_lse = check_bool(return_lse, what, "return_lse")
        H_r, D, H = self.heads_per_rank, self.head_dim, self.world_size * self.heads_per_rank
        check_tensor(partial_output, what, "partial_output", device=self.device,
                     dtypes=(self.dtype,), ndim=3)
        T = partial_output.shape[0]
        if tuple(partial_output.shape[1:]) != (H, D):
            raise InvalidArgument(f"{what}: partial_output shape must be [T, {H}, {D}] "
                                  f"([T, world_size*heads_per_rank, head_dim]) (got "
                                  f"{list(partial_output.shape)})")
        if T > self.max_num_tokens:
            raise InvalidArgument(f"{what}: partial_output tokens must be <= max_num_tokens "
                                  f"{self.max_num_tokens} (got {T})")
        if T:
            _rows_aligned(what, "partial_output", partial_output, H)
        check_tensor(partial_lse, what, "partial_lse", device=self.device,
                     dtypes=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
        if tuple(partial_lse.shape) != (T, H):
            raise InvalidArgument(f"{what}: partial_lse shape must be [{T}, {H}] (got "
                                  f"{list(partial_lse.shape)})")
        check_masks(what, seq_lens, query_start_loc, self.device)
        if out is not None:
            check_tensor(out, what, "out", device=self.device, dtypes=(self.dtype,),
                         contiguous=True)
            if tuple(out.shape) != (T, H_r, D):
                raise InvalidArgument(f"{what}: out shape must be [{T}, {H_r}, {D}] (got "
                                      f"{list(out.shape)})")
        if out_lse is not None:
            check_tensor(out_lse, what, "out_lse", device=self.device, dtypes=(torch.float32,),
                         contiguous=True)
            if tuple(out_lse.shape) != (T, H_r):
                raise InvalidArgument(f"{what}: out_lse shape must be [{T}, {H_r}] (got "
                                      f"{list(out_lse.shape)})")
        if out is None:
            out = torch.empty((T, H_r, D), dtype=self.dtype, device=self.device)
        if want_lse and out_lse is None:
            out_lse = torch.empty((T, H_r), dtype=torch.float32, device=self.device)
        if T:
            lse_in = partial_lse if base_e else partial_lse.float() * LN2
            self._ops.lse_reduce(partial_output, lse_in, seq_lens=seq_lens,
                                 query_start_loc=query_start_loc, ubatch=u, out=out,
                                 out_lse=out_lse)
            if out_lse is not None and not base_e:
                out_lse.mul_(LOG2E)
        return (out, out_lse) if want_lse else out


# ----------------------------------------------------------------------------- q gather
class DirectDCPQGatherWorkspace(_Workspace):
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

    def __init__(self, group, device, max_num_tokens: int, heads_per_rank: int, head_dim: int,
                 dtype=BFLOAT16, num_ubatches: int = 1,
                 padded_num_heads: Optional[int] = None) -> None:
        what = self._what

        def check(W: int):
            U = _ubatches(what, num_ubatches)
            T = check_int(max_num_tokens, what, "max_num_tokens")
            H_r = check_int(heads_per_rank, what, "heads_per_rank")
            D = check_int(head_dim, what, "head_dim")
            _positive(what, T=T, H=H_r, D=D)
            dt = resolve_torch_dtype(dtype, what)
            if movable_view_dtype(dt) is None:
                raise UnsupportedDtype(f"{what}: dtype must be a type dcpkit can move (a float, "
                                       f"integer or float8 type) (got {dt})")
            pad = None if padded_num_heads is None else check_int(
                padded_num_heads, what, "padded_num_heads")
            H = W * H_r
            storage = H if pad is None else pad
            isz = dt.itemsize
            if (H_r * D * isz) % 16 or (storage * D * isz) % 16:
                raise InvalidGeometry(
                    f"{what}: query rows must be 16-byte aligned: heads_per_rank*head_dim*"
                    f"itemsize and padded_num_heads*head_dim*itemsize must be multiples of 16 "
                    f"bytes (got {H_r}*{D}*{isz} = {H_r * D * isz} and {storage}*{D}*{isz} = "
                    f"{storage * D * isz})")
            if W <= 1:
                raise InvalidGeometry(f"{what}: world_size must be >= 2: the q-gather requires "
                                      f"at least two ranks (got {W})")
            if storage < H:
                raise InvalidGeometry(f"{what}: padded_num_heads must cover the gathered heads "
                                      f"world_size*heads_per_rank = {H} (got {storage})")
            return T, H_r, D, dt, U, storage

        T, H_r, D, dt, U, pad = self._setup(group, device, check)
        self.max_num_tokens, self.heads_per_rank, self.head_dim = T, H_r, D
        self.dtype, self.num_ubatches = dt, U
        self.gathered_num_heads = self.world_size * H_r
        self.padded_num_heads = pad
        name, self._view_dtype = movable_view_dtype(dt)
        torch = self._torch
        from ..ops import QGather  # noqa: WPS433

        self._start_op(lambda: QGather(self.comm, max_tokens=T, heads_per_rank=H_r, head_dim=D,
                                       dtype=name, num_ubatches=U))
        try:
            # zeroed bytes, viewed as the dtype (no fill kernel needed for float8)
            self.final_query = self._allocate(lambda: torch.zeros(
                (U, T, pad, D * dt.itemsize), dtype=torch.uint8, device=self.device).view(dt))
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
        self._check_open(what)
        u = check_ubatch(what, self.num_ubatches)
        H_r, D, H = self.heads_per_rank, self.head_dim, self.gathered_num_heads
        if getattr(local_query, "ndim", None) == 3 and local_query.shape[1] != H_r:
            raise InvalidGeometry(f"{what}: local_query must have heads_per_rank = {H_r} local "
                                  f"query heads (got {local_query.shape[1]})")
        check_tensor(local_query, what, "local_query", device=self.device, dtypes=(self.dtype,),
                     ndim=3)
        T = local_query.shape[0]
        if local_query.shape[2] != D:
            raise InvalidArgument(f"{what}: local_query head_dim must be {D} (got "
                                  f"{local_query.shape[2]})")
        if T > self.max_num_tokens:
            raise InvalidArgument(f"{what}: local_query tokens must be <= max_num_tokens "
                                  f"{self.max_num_tokens} (got {T})")
        if T:
            _rows_aligned(what, "local_query", local_query, H_r)
        output = self._torch.as_strided(self.final_query[u], (T, H, D), (H * D, D, 1))
        if T:
            vd = self._view_dtype
            q = local_query if vd is None else local_query.view(vd)
            self._ops.q_gather(q, ubatch=u, out=output if vd is None else output.view(vd))
        return output


# ----------------------------------------------------------------------------- kv gather
class DirectDCPKVGatherWorkspace(_Workspace):
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

    def __init__(self, group, device, max_gathered_tokens: int, token_dim: int,
                 dtype=BFLOAT16, num_ubatches: int = 1) -> None:
        what = self._what

        def check(W: int):
            dt = resolve_torch_dtype(dtype, what)
            _dtype_in(what, dt, KV_GATHER_DTYPES)
            U = _ubatches(what, num_ubatches)
            T = check_int(max_gathered_tokens, what, "max_gathered_tokens")
            D = check_int(token_dim, what, "token_dim")
            _positive(what, T=T, D=D)
            if (D * dt.itemsize) % 16:
                raise InvalidGeometry(f"{what}: KV rows must be 16-byte aligned: token_dim * "
                                      f"itemsize must be a multiple of 16 bytes (got {D} * "
                                      f"{dt.itemsize} = {D * dt.itemsize})")
            if W <= 1:
                raise InvalidGeometry(f"{what}: world_size must be >= 2: the kv-gather requires "
                                      f"at least two ranks (got {W})")
            if T % W:
                raise InvalidGeometry(f"{what}: max_gathered_tokens must divide evenly across "
                                      f"ranks: a multiple of world_size {W} (got {T}; {T} % "
                                      f"{W} = {T % W})")
            return T, D, dt, U

        T, D, dt, U = self._setup(group, device, check)
        self.max_gathered_tokens, self.token_dim, self.dtype, self.num_ubatches = T, D, dt, U
        name, self._view_dtype = movable_view_dtype(dt)
        from ..ops import KVGather  # noqa: WPS433

        self._start_op(lambda: KVGather(self.comm, max_tokens=T // self.world_size, row_dim=D,
                                        dtype=name, num_ubatches=U))

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
        self._check_open(what)
        u = check_ubatch(what, self.num_ubatches)
        W, D = self.world_size, self.token_dim
        check_tensor(local_kv, what, "local_kv", device=self.device, dtypes=(self.dtype,),
                     ndim=2, contiguous=True)
        T = local_kv.shape[0]
        if T < 1 or local_kv.shape[1] != D:
            raise InvalidArgument(f"{what}: local_kv shape must be [T, {D}] with T >= 1 (got "
                                  f"{list(local_kv.shape)})")
        if W * T > self.max_gathered_tokens:
            raise InvalidArgument(f"{what}: world_size * local_kv tokens must be <= "
                                  f"max_gathered_tokens {self.max_gathered_tokens} (got {W} * "
                                  f"{T} = {W * T})")
        check_tensor(gathered_kv, what, "gathered_kv", device=self.device,
                     dtypes=(self.dtype,), ndim=2, contiguous=True)
        if tuple(gathered_kv.shape) != (W * T, D):
            raise InvalidArgument(f"{what}: gathered_kv shape must be [world_size*T, D] = "
                                  f"[{W * T}, {D}] (got {list(gathered_kv.shape)})")
        for name, t in (("local_kv", local_kv), ("gathered_kv", gathered_kv)):
            if t.data_ptr() % 16:
                raise InvalidArgument(f"{what}: {name} data pointer must be 16-byte aligned "
                                      f"(got offset {t.data_ptr() % 16})")
        vd = self._view_dtype
        if vd is None:
            self._ops.kv_gather(local_kv, ubatch=u, out=gathered_kv)
        else:
            self._ops.kv_gather(local_kv.view(vd), ubatch=u, out=gathered_kv.view(vd))
        return None
