"""What vLLM's three direct workspaces share, and the A2A combine workspace.

Each workspace keeps vLLM's constructor (names, order, defaults), methods, shapes and errors,
and runs one dcpkit op (:class:`~dcpkit.ops.LseReduce` here; :class:`~dcpkit.ops.QGather` and
:class:`~dcpkit.ops.KVGather` in :mod:`dcpkit.vllm._gathers`) through
:class:`dcpkit.torch.TorchOps`, always with ``out=`` so that the op allocates nothing and every
call is capture-safe.
"""

from __future__ import annotations

import contextlib

from .._lifecycle import Resource
from ..errors import InvalidArgument
from ._common import (
    BFLOAT16,
    LN2,
    LOG2E,
    InvalidGeometry,
    UnsupportedDtype,
    agree,
    check_bool,
    check_combine_inputs,
    check_int,
    check_tensor,
    check_ubatch,
    device_index,
    require_torch,
    resolve_device,
    resolve_group,
    resolve_torch_dtype,
)

__all__ = ["DirectDCPA2AWorkspace", "A2A_DTYPES", "KV_GATHER_DTYPES"]

#: Names of the torch dtypes the A2A combine takes (vLLM's set).
A2A_DTYPES = ("float16", "bfloat16")
#: Names of the torch dtypes the KV gather takes (vLLM's set).
KV_GATHER_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")


@contextlib.contextmanager
def on_device(index: int):
    """CuPy's current device set to ``index`` for a dcpkit constructor (which builds on the
    current device). Where CuPy or the device is missing, nothing is set: the constructor then
    raises its own clear error, on every rank."""
    dev = None
    try:
        import cupy

        dev = cupy.cuda.Device(index)
        dev.__enter__()
    except Exception:  # noqa: BLE001 - reported by the dcpkit constructor instead
        dev = None
    try:
        yield
    finally:
        if dev is not None:
            dev.__exit__(None, None, None)


def check_sizes(what: str, num_ubatches, **sizes) -> tuple[int, ...]:
    """The size arguments of a workspace constructor: ``num_ubatches`` an int >= 1, then every
    size an int, then all of them >= 1. ``sizes`` maps the name a message gives a dimension
    (``T``, ``H``, ``D``) to ``(argument name, value)``, in the constructor's order. Returns
    ``(num_ubatches, *sizes)``."""
    u = check_int(num_ubatches, what, "num_ubatches")
    if u < 1:
        raise InvalidGeometry(
            f"{what}: num_ubatches must be >= 1: at least one ubatch slot (got {u})"
        )
    dims = {k: check_int(value, what, name) for k, (name, value) in sizes.items()}
    if any(v < 1 for v in dims.values()):
        got = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise InvalidGeometry(f"{what}: dimensions must be positive (got {got})")
    return (u, *dims.values())


def head_sizes(what: str, num_ubatches, max_num_tokens, heads_per_rank, head_dim) -> tuple:
    """:func:`check_sizes` of a workspace over ``[T, H_r, D]`` rows (the A2A combine, the query
    gather); returns ``(num_ubatches, T, H_r, D)``."""
    return check_sizes(
        what,
        num_ubatches,
        T=("max_num_tokens", max_num_tokens),
        H=("heads_per_rank", heads_per_rank),
        D=("head_dim", head_dim),
    )


def check_row_bytes(what: str, name: str, dim: int, itemsize: int, why: str = "") -> None:
    """``dim * itemsize`` (the bytes of one row the kernel moves) a multiple of 16; ``why``
    opens the message."""
    if (dim * itemsize) % 16:
        raise InvalidGeometry(
            f"{what}: {why}{name} * itemsize must be a multiple of 16 bytes (got {dim} * "
            f"{itemsize} = {dim * itemsize})"
        )


def check_two_ranks(what: str, world_size: int, op: str) -> None:
    """A gather needs a peer: ``world_size >= 2``."""
    if world_size <= 1:
        raise InvalidGeometry(
            f"{what}: world_size must be >= 2: the {op} requires at least two ranks "
            f"(got {world_size})"
        )


def dtype_in(what: str, dtype, names):
    """``dtype`` as a ``torch.dtype`` (:func:`resolve_torch_dtype`), one of ``names``."""
    dt = resolve_torch_dtype(dtype, what)
    if str(dt).replace("torch.", "") not in names:
        want = ", ".join(f"torch.{n}" for n in names)
        raise UnsupportedDtype(f"{what}: dtype must be one of [{want}] (got {dt})")
    return dt


def rows_aligned(what: str, name: str, t, heads: int) -> None:
    """Elements contiguous, head stride = head_dim, pointer and strides multiples of 16 bytes
    (what the direct kernels read in place)."""
    isz = t.element_size()
    T, H, D = t.shape
    s_tok, s_head, s_elem = t.stride()
    if (D > 1 and s_elem != 1) or (H > 1 and s_head != D):
        raise InvalidArgument(
            f"{what}: {name} must have contiguous heads (strides (any, {D}, "
            f"1)) (got strides {tuple(t.stride())}; use .contiguous())"
        )
    if T > 1 and s_tok < heads * D:
        raise InvalidArgument(
            f"{what}: {name} token stride must be >= {heads * D} elements (got {s_tok})"
        )
    if t.data_ptr() % 16 or (T > 1 and (s_tok * isz) % 16):
        raise InvalidArgument(
            f"{what}: {name} rows must be 16-byte aligned: data pointer and "
            f"token stride multiples of 16 bytes (got pointer offset "
            f"{t.data_ptr() % 16}, token stride {s_tok * isz} bytes)"
        )


class Workspace(Resource):
    """What the three share: the group, the device, ubatch slots, one dcpkit op, ``close()``."""

    _what = "workspace"
    _noun = "workspace"

    def _setup(self, group, device, check) -> tuple:
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
            holder["device"] = self._torch.device("cuda", device_index(dev, self._what))
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
        from ..torch import TorchOps

        with on_device(self.device.index):
            self._op = build()
        self._ops = TorchOps(self._op)
        self._closed = False

    # ------------------------------------------------------------------ per call
    def _begin(self, what: str) -> int:
        """The checks every call starts with: the workspace open, the current ubatch in range;
        returns the ubatch."""
        self._check_open(what)
        return check_ubatch(what, self.num_ubatches)

    def _check_tensor(self, t, what: str, name: str, ndim: int, contiguous: bool = False):
        """:func:`check_tensor` of a tensor of the workspace dtype on its device."""
        return check_tensor(
            t,
            what,
            name,
            device=self.device,
            dtypes=(self.dtype,),
            ndim=ndim,
            contiguous=contiguous,
        )

    def _check_rows(self, what: str, name: str, t, heads: int) -> None:
        """``t [T, heads, D]`` (``T = t.shape[0]``): ``T <= max_num_tokens`` and, for ``T >= 1``,
        rows the kernel can read in place (:func:`rows_aligned`)."""
        T = t.shape[0]
        if T > self.max_num_tokens:
            raise InvalidArgument(
                f"{what}: {name} tokens must be <= max_num_tokens {self.max_num_tokens} (got {T})"
            )
        if T:
            rows_aligned(what, name, t, heads)

    @property
    def op(self):
        """The dcpkit op under this workspace (its ``transport`` says unicast or multicast)."""
        return self._op

    @property
    def transport(self) -> str:
        """``"unicast"`` or ``"multicast"``: what every call of the dcpkit op launches."""
        return getattr(self._op, "transport", "unicast")

    def close(self) -> None:
        """Release the dcpkit op and its symmetric memory (collective, idempotent)."""
        super().close()

    def _close(self) -> None:
        if self._ops is not None:
            self._ops.close()
        if self._op is not None:
            self._op.close()

    def _left_open(self) -> bool:
        return False  # the dcpkit op holds the memory, and warns for itself when dropped open


# ----------------------------------------------------------------------------- A2A combine
class DirectDCPA2AWorkspace(Workspace):
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

    def __init__(
        self,
        group,
        device,
        max_num_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype=BFLOAT16,
        num_ubatches: int = 1,
    ) -> None:
        what = self._what

        def check(W: int):
            dt = dtype_in(what, dtype, A2A_DTYPES)
            U, T, H_r, D = head_sizes(what, num_ubatches, max_num_tokens, heads_per_rank, head_dim)
            check_row_bytes(what, "head_dim", D, dt.itemsize)
            if W > 64:
                raise InvalidGeometry(f"{what}: world_size must be <= 64 (got {W})")
            return T, H_r, D, dt, U

        T, H_r, D, dt, U = self._setup(group, device, check)
        self.max_num_tokens, self.heads_per_rank, self.head_dim = T, H_r, D
        self.dtype, self.num_ubatches = dt, U
        name = str(dt).replace("torch.", "")
        from ..ops import LseReduce

        self._start_op(
            lambda: LseReduce(
                self.comm,
                max_tokens=T,
                num_heads=self.world_size * H_r,
                head_dim=D,
                dtype=name,
                num_ubatches=U,
            )
        )

    def lse_reduce(
        self,
        partial_output,
        partial_lse,
        is_lse_base_on_e: bool,
        seq_lens=None,
        query_start_loc=None,
        *,
        return_lse: bool = False,
        out=None,
        out_lse=None,
    ):
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
        u = self._begin(what)
        torch = self._torch
        base_e = check_bool(is_lse_base_on_e, what, "is_lse_base_on_e")
        want_lse = check_bool(return_lse, what, "return_lse")
        H_r, D, H = self.heads_per_rank, self.head_dim, self.world_size * self.heads_per_rank
        self._check_tensor(partial_output, what, "partial_output", ndim=3)
        T = partial_output.shape[0]
        if tuple(partial_output.shape[1:]) != (H, D):
            raise InvalidArgument(
                f"{what}: partial_output shape must be [T, {H}, {D}] "
                f"([T, world_size*heads_per_rank, head_dim]) (got "
                f"{list(partial_output.shape)})"
            )
        self._check_rows(what, "partial_output", partial_output, H)
        masks, outs = (seq_lens, query_start_loc), (out, out_lse)
        check_combine_inputs(
            what, self.device, partial_lse, (T, H), masks, outs, (T, H_r, D), self.dtype
        )
        if out is None:
            out = torch.empty((T, H_r, D), dtype=self.dtype, device=self.device)
        if want_lse and out_lse is None:
            out_lse = torch.empty((T, H_r), dtype=torch.float32, device=self.device)
        if T:
            lse_in = partial_lse if base_e else partial_lse.float() * LN2
            self._ops.lse_reduce(
                partial_output,
                lse_in,
                seq_lens=seq_lens,
                query_start_loc=query_start_loc,
                ubatch=u,
                out=out,
                out_lse=out_lse,
            )
            if out_lse is not None and not base_e:
                out_lse.mul_(LOG2E)
        return (out, out_lse) if want_lse else out
