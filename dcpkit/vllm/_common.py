"""What the vLLM-shaped classes share: errors, the ubatch context, torch imported on first use,
the group (a torch.distributed ProcessGroup or a dcpkit Communicator), argument checks.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import threading
from collections.abc import Iterator

from .._torch_registry import require_torch_cuda
from ..errors import DcpkitError, InvalidArgument, InvalidType, MissingDependency

__all__ = [
    "UnsupportedDtype",
    "InvalidGeometry",
    "UbatchOutOfRange",
    "ubatch",
    "current_ubatch",
    "BFLOAT16",
    "logger",
    "log_once",
]

#: The logger every path decision goes to (``logging.getLogger("dcpkit.vllm")``).
logger = logging.getLogger("dcpkit.vllm")


# ----------------------------------------------------------------------------- errors
class UnsupportedDtype(InvalidType, ValueError):
    """A dtype the workspace does not support (vLLM raises ``ValueError`` there; dcpkit calls it
    :class:`~dcpkit.errors.InvalidType`): both ``except ValueError`` and ``except InvalidType``
    catch it."""


class InvalidGeometry(InvalidArgument):
    """A size vLLM's direct DCP classes reject with ``ValueError``: a non-positive dimension, a
    row that is not a multiple of 16 bytes, fewer than two ranks, a capacity that does not divide
    by the world size, padded heads that do not cover the gathered heads, no ubatch slot, or a
    ``max_gathered_tokens`` / workspace that does not fit. An
    :class:`~dcpkit.errors.InvalidArgument`, hence a ``ValueError``."""


class UbatchOutOfRange(InvalidArgument):
    """The current ubatch (``with dcpkit.vllm.ubatch(i)``) is outside ``[0, num_ubatches)``
    (vLLM's ``ValueError``)."""


# ----------------------------------------------------------------------------- ubatch
_UBATCH: contextvars.ContextVar = contextvars.ContextVar("dcpkit_vllm_ubatch", default=0)


@contextlib.contextmanager
def ubatch(index: int) -> Iterator[int]:
    """Run the calls inside the ``with`` block on ubatch ``index`` (vLLM's
    ``dbo_current_ubatch_id()``; 0 outside any block).

    The value is held in a :class:`contextvars.ContextVar`: per thread (a new thread starts at
    0) and per asyncio task. Blocks nest; leaving one restores the previous value.

    Parameters
    ----------
    index : int
        ``>= 0``. Whether it is below a workspace's ``num_ubatches`` is checked by each call
        (:class:`UbatchOutOfRange`, a ``ValueError``).

    Raises
    ------
    InvalidType
        ``index`` is not an int (bools included).
    UbatchOutOfRange
        ``index < 0``.
    """
    if isinstance(index, bool) or not _is_int(index):
        raise InvalidType(
            f"dcpkit.vllm.ubatch: index must be an int (got {type(index).__name__} {index!r})"
        )
    if index < 0:
        raise UbatchOutOfRange(f"dcpkit.vllm.ubatch: index must be >= 0 (got {index})")
    token = _UBATCH.set(int(index))
    try:
        yield int(index)
    finally:
        _UBATCH.reset(token)


def current_ubatch() -> int:
    """The ubatch of the innermost ``with dcpkit.vllm.ubatch(i)`` block of this thread (0
    outside any)."""
    return _UBATCH.get()


def check_ubatch(what: str, num_ubatches: int) -> int:
    """The current ubatch, or :class:`UbatchOutOfRange` (vLLM's message: "exceeds ... slots")."""
    u = _UBATCH.get()
    if not 0 <= u < num_ubatches:
        raise UbatchOutOfRange(
            f"{what}: ubatch {u} exceeds {num_ubatches} slots "
            f"(the current dcpkit.vllm.ubatch must lie in "
            f"[0, {num_ubatches}))"
        )
    return u


# ----------------------------------------------------------------------------- logging
_LOGGED: set = set()
_LOG_LOCK = threading.Lock()


def log_once(message: str) -> None:
    """``logger.info(message)`` once per process for each distinct message."""
    with _LOG_LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    logger.info(message)


# ----------------------------------------------------------------------------- torch
def require_torch(what: str):
    """The torch module, or :class:`~dcpkit.errors.MissingDependency` naming the torch extra
    of this CUDA stack (:func:`dcpkit._cuda.torch_extra`)."""
    try:
        import torch
    except ImportError as e:
        from .._cuda import torch_extra

        raise MissingDependency("torch", torch_extra(), f"{what} needs it: {e}") from None
    return torch


class _DefaultDtype:
    """The default ``dtype=torch.bfloat16`` of the constructors without importing torch: it
    prints as ``torch.bfloat16`` and compares equal to it."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def resolve(self):
        return getattr(require_torch("dcpkit.vllm"), self.name)

    def __eq__(self, other):
        if isinstance(other, _DefaultDtype):
            return other.name == self.name
        return type(other).__module__ == "torch" and str(other) == f"torch.{self.name}"

    def __hash__(self):
        return hash(f"torch.{self.name}")

    def __repr__(self) -> str:
        return f"torch.{self.name}"


#: ``torch.bfloat16``, resolved when a constructor runs.
BFLOAT16 = _DefaultDtype("bfloat16")


def resolve_torch_dtype(dtype, what: str, name: str = "dtype"):
    """``dtype`` as a ``torch.dtype`` (the default sentinel resolved)."""
    torch = require_torch(what)
    if isinstance(dtype, _DefaultDtype):
        return dtype.resolve()
    if not isinstance(dtype, torch.dtype):
        raise InvalidType(
            f"{what}: {name} must be a torch.dtype (got {type(dtype).__name__} {dtype!r})"
        )
    return dtype


def dtype_size(dtype) -> int:
    """Bytes per element of a ``torch.dtype``."""
    return dtype.itemsize


def movable_view_dtype(dtype):
    """For the gathers (which move bytes): ``(dcpkit dtype name, torch view dtype or None)`` for
    a torch dtype, or None when dcpkit cannot move it. 1-byte float8 types travel as uint8
    views (DLPack has no float8)."""
    torch = require_torch("dcpkit.vllm")
    names = {
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
        torch.float32: "float32",
        torch.float64: "float64",
        torch.int8: "int8",
        torch.uint8: "uint8",
        torch.int16: "int16",
        torch.int32: "int32",
        torch.int64: "int64",
    }
    if dtype in names:
        return names[dtype], None
    if str(dtype).startswith("torch.float8_") and dtype.itemsize == 1:
        return "uint8", torch.uint8
    return None


# ----------------------------------------------------------------------------- values
def _is_int(x) -> bool:
    import numbers

    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_int(value, what: str, name: str) -> int:
    """An int (Python or NumPy, not bool), or :class:`InvalidType`."""
    if not _is_int(value):
        raise InvalidType(f"{what}: {name} must be an int (got {type(value).__name__} {value!r})")
    return int(value)


def check_bool(value, what: str, name: str) -> bool:
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise InvalidType(f"{what}: {name} must be a bool (got {type(value).__name__} {value!r})")
    return bool(value)


def resolve_device(device, what: str):
    """``device`` (a ``torch.device``, ``"cuda:1"`` or an int) as a CUDA ``torch.device`` with an
    index (the current CUDA device when none is given, which needs a GPU: call it after the
    checks)."""
    torch = require_torch(what)
    try:
        if isinstance(device, int) and not isinstance(device, bool):
            dev = torch.device("cuda", device)  # an int is a CUDA ordinal, as in vLLM
        else:
            dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise InvalidType(
            f"{what}: device must be a torch.device, a device string or an int "
            f"(got {type(device).__name__} {device!r})"
        ) from None
    if dev.type != "cuda":
        raise InvalidArgument(f"{what}: device must be a CUDA device (got {dev})")
    return dev


def device_index(dev, what: str = "dcpkit.vllm") -> int:
    """The CUDA ordinal of ``dev`` (the current device when it names none). Raises
    :class:`DcpkitError` when torch cannot reach a CUDA GPU: call it after the argument checks."""
    torch = require_torch(what)
    require_torch_cuda(torch, what)
    if dev.index is not None:
        return int(dev.index)
    return int(torch.cuda.current_device())


# ----------------------------------------------------------------------------- group
#: Marker: the group has no torch.distributed process group (a Communicator over MPI).
NO_TORCH_GROUP = object()


def resolve_group(group, what: str) -> tuple[object, object]:
    """``(communicator, torch_group)`` for a ``torch.distributed.ProcessGroup`` or a dcpkit
    :class:`~dcpkit.comm.Communicator`.

    ``torch_group`` is the ProcessGroup (None for the default group of a Communicator built
    with ``Communicator.from_torch()``), or :data:`NO_TORCH_GROUP` for a Communicator of
    another backend. Collective for a ProcessGroup (``Communicator.from_torch`` exchanges host
    names).

    Raises
    ------
    InvalidType
        ``group`` is neither.
    """
    from ..comm import Communicator

    if isinstance(group, Communicator):
        return group, (group.handle if group.backend == "torch" else NO_TORCH_GROUP)
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is not None and dist.is_available() and isinstance(group, dist.ProcessGroup):
        return Communicator.from_torch(group), group
    raise InvalidType(
        f"{what}: group must be a torch.distributed.ProcessGroup or a "
        f"dcpkit.Communicator (got {type(group).__name__})"
    )


def agree(comm, what: str, check) -> object:
    """Run ``check()`` (every argument check of a constructor, no GPU) on every rank inside one
    host exchange: a rank whose check raised re-raises its own error, every other rank
    :class:`~dcpkit.errors.PeerError` naming it; different geometries raise
    :class:`~dcpkit.errors.ConfigMismatch`. No rank goes on into a collective setup alone."""

    def init():
        try:
            return check()
        except DcpkitError:
            raise
        except Exception as e:
            raise InvalidArgument(
                f"{what}: checking the arguments failed ({type(e).__name__}: {e})"
            ) from e

    return comm.agree_setup(what, init, "arguments")


# ----------------------------------------------------------------------------- tensors
def check_tensor(
    t,
    what: str,
    name: str,
    *,
    device,
    dtypes=None,
    ndim: int | None = None,
    contiguous: bool = False,
):
    """The call-time checks of a tensor argument, before anything is launched: a
    ``torch.Tensor`` on ``device``, of one of ``dtypes``, with ``ndim`` dims, contiguous when
    asked. Messages name the argument."""
    torch = require_torch(what)
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"{what}: {name} must be a torch.Tensor (got {type(t).__name__})")
    if t.device != device:
        raise InvalidArgument(
            f"{what}: {name} device must be the workspace's {device} (got {t.device})"
        )
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise InvalidType(f"{what}: {name} dtype must be {want} (got {t.dtype})")
    if ndim is not None and t.dim() != ndim:
        raise InvalidArgument(
            f"{what}: {name} must have {ndim} dimensions (got shape {tuple(t.shape)})"
        )
    if contiguous and not t.is_contiguous():
        raise InvalidArgument(
            f"{what}: {name} must be contiguous (got shape {tuple(t.shape)}, "
            f"strides {tuple(t.stride())}; use .contiguous())"
        )
    return t


def check_outputs(what: str, out, out_lse, out_shape: tuple, out_dtype, device) -> None:
    """The caller's destinations of a combine, when given: ``out`` of ``out_shape`` and
    ``out_dtype``, ``out_lse`` float32 of ``out_shape[:2]``, both contiguous on ``device``."""
    if out is not None:
        check_tensor(out, what, "out", device=device, dtypes=(out_dtype,), contiguous=True)
        if tuple(out.shape) != tuple(out_shape):
            raise InvalidArgument(
                f"{what}: out shape must be {list(out_shape)} (got {list(out.shape)})"
            )
    if out_lse is not None:
        torch = require_torch(what)
        check_tensor(
            out_lse, what, "out_lse", device=device, dtypes=(torch.float32,), contiguous=True
        )
        if tuple(out_lse.shape) != tuple(out_shape[:2]):
            raise InvalidArgument(
                f"{what}: out_lse shape must be {list(out_shape[:2])} (got {list(out_lse.shape)})"
            )


def check_combine_inputs(
    what: str, device, partial_lse, shape: tuple, masks: tuple, outs: tuple, out_shape, out_dtype
) -> None:
    """What every combine checks after its ``partial_output [T, H, D]``: ``partial_lse`` of
    ``shape = (T, H)`` (float32, float16 or bfloat16, on ``device``), ``masks = (seq_lens,
    query_start_loc)`` (:func:`check_masks`) and ``outs = (out, out_lse)`` (:func:`check_outputs`
    with ``out_shape`` and ``out_dtype``)."""
    torch = require_torch(what)
    check_tensor(
        partial_lse,
        what,
        "partial_lse",
        device=device,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        ndim=2,
    )
    if tuple(partial_lse.shape) != tuple(shape):
        raise InvalidArgument(
            f"{what}: partial_lse shape must be {list(shape)} (got {list(partial_lse.shape)})"
        )
    check_masks(what, *masks, device)
    check_outputs(what, *outs, out_shape, out_dtype, device)


def check_masks(what: str, seq_lens, query_start_loc, device) -> bool:
    """vLLM's rule for the empty-shard masks, then dcpkit's: both or neither, ``seq_lens [S]`` and
    ``query_start_loc [S+1]`` int32, 1-D, contiguous, on ``device``. Returns whether they are
    given."""
    if seq_lens is None and query_start_loc is None:
        return False
    if seq_lens is None or query_start_loc is None:
        raise InvalidArgument(
            f"{what}: seq_lens and query_start_loc must be provided together "
            f"(got seq_lens={'None' if seq_lens is None else 'a tensor'}, "
            f"query_start_loc="
            f"{'None' if query_start_loc is None else 'a tensor'})"
        )
    torch = require_torch(what)
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        check_tensor(t, what, name, device=device, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise InvalidArgument(
            f"{what}: query_start_loc must contain one boundary per sequence: "
            f"its length must be len(seq_lens) + 1 = {seq_lens.shape[0] + 1} "
            f"(got {query_start_loc.shape[0]})"
        )
    return True


LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
