"""Argument checks of the constructors, and the one table of the dtypes the kernels take.

Every check raises :class:`~dcpkit.errors.InvalidArgument` or
:class:`~dcpkit.errors.InvalidType` with a message of the form
``"<op>: <argument> <property> must <constraint> (got <value>)"``; none needs a GPU.
"""

from __future__ import annotations

import math
import numbers
import os
import re

import numpy as np

from . import _cuda
from ._arrays import ArrayInfo, array_info, check_device, check_dtype
from .comm import Communicator
from .errors import InvalidArgument, InvalidType

__all__ = [
    "FLOAT_DTYPE_NAMES",
    "LSE_DTYPE_NAMES",
    "COPY_ITEMSIZES",
    "MAX_TIMEOUT_MS",
    "MIN_TIMEOUT_MS",
    "DEFAULT_TIMEOUT_MS",
    "TIMEOUT_ENV",
    "decimal_float",
    "decimal_int",
    "TIMEOUT_RANGE",
    "INT32_MAX",
    "resolve_dtype",
    "float_dtypes",
    "lse_dtypes",
    "cxx_type",
    "resolve_float_dtype",
    "resolve_bytes_dtype",
    "check_int",
    "check_positive_int",
    "check_bool",
    "check_real",
    "check_lse_base",
    "check_timeout_ms",
    "default_timeout_ms",
    "check_multicast",
    "check_comm",
    "check_ubatch",
    "resolve_stream",
    "check_constructor_keywords",
    "described",
    "check_masks",
]

#: The floating dtypes the direct lse_reduce kernels and the NCCL merge kernels are built for
#: (output, ``out_partial`` and ``lse_partial``), by name.
FLOAT_DTYPE_NAMES = ("bfloat16", "float16", "float32")
#: ``lse_partial`` dtypes of the NCCL lse_reduce (the direct kernel takes the first three).
LSE_DTYPE_NAMES = FLOAT_DTYPE_NAMES + ("float64",)
#: Element sizes the byte-moving kernels (strided copy, NCCL gathers) take.
COPY_ITEMSIZES = (1, 2, 4, 8, 16)
#: Largest wait deadline accepted, in milliseconds (one hour).
MAX_TIMEOUT_MS = 3_600_000
#: The shortest wait deadline, in milliseconds (1 us): the kernels keep deadlines in whole
#: nanoseconds, and a shorter one would make every wait time out at once.
MIN_TIMEOUT_MS = 0.001
#: The wait deadline of an op built without ``timeout_ms`` while ``DCPKIT_TIMEOUT_MS`` is unset.
DEFAULT_TIMEOUT_MS = 5000.0
#: The environment variable that sets the default wait deadline, in milliseconds.
TIMEOUT_ENV = "DCPKIT_TIMEOUT_MS"
#: The range of a wait deadline in messages and docstrings.
TIMEOUT_RANGE = f"[{MIN_TIMEOUT_MS:g}, {MAX_TIMEOUT_MS}]"
#: Largest value of an ``int`` kernel parameter (``T``, heads, head dims).
INT32_MAX = 2**31 - 1

_CXX_TYPES = {
    "bfloat16": "dcpkit::bf16_t",
    "float16": "dcpkit::fp16_t",
    "float32": "float",
    "float64": "double",
}

# Short and case-insensitive names of dtypes (looked up lowercased; anything else goes to
# np.dtype unchanged, so that NumPy's case-sensitive codes keep their meaning: 'B' is uint8,
# 'F' complex64, 'U4' a 4-character string).
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "fp64": "float64",
    "float64": "float64",
    "fp8": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
}


# ----------------------------------------------------------------------------- dtypes
def resolve_dtype(dtype, *, op: str = "resolve_dtype", name: str = "dtype") -> np.dtype:
    """A NumPy dtype from a dtype, a type or a name.

    Names are looked up case-insensitively among the aliases ``bf16``/``bfloat16`` (ml_dtypes'
    bfloat16), ``fp16``/``half``/``float16``, ``fp32``/``float``/``float32`` (note: ``float``
    is float32 here), ``fp64``/``float64``, ``fp8``/``e4m3`` (ml_dtypes' float8_e4m3fn),
    ``e5m2`` and every ``float8_*`` type of ml_dtypes. Any other string goes to ``np.dtype``
    as written, so NumPy's case-sensitive codes keep their meaning (``"B"`` is uint8, ``"b"``
    int8, ``"F"`` complex64, ``"U4"`` a string type).

    Raises
    ------
    InvalidType
        ``dtype`` is None, or not a dtype NumPy (or ml_dtypes) knows. ``op`` and ``name`` name
        the caller and argument in the message.
    """
    if dtype is None:
        raise InvalidType(
            f"{op}: {name} must be a NumPy dtype or dtype name such as 'bfloat16' (got None)"
        )
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        key = _DTYPE_ALIASES.get(key, key if key.startswith("float8_") else None)
        if key is not None:
            if key == "bfloat16" or key.startswith("float8_"):
                import ml_dtypes

                t = getattr(ml_dtypes, key, None)
                if t is None:
                    raise InvalidType(
                        f"{op}: {name} must be a dtype ml_dtypes "
                        f"{ml_dtypes.__version__} knows (got {dtype!r})"
                    )
                return np.dtype(t)
            return np.dtype(key)
    try:
        return np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise InvalidType(
            f"{op}: {name} must be a NumPy dtype or dtype name such as "
            f"'bfloat16' (got {dtype!r}: {e})"
        ) from None


def float_dtypes() -> tuple[np.dtype, ...]:
    """bfloat16, float16, float32 as NumPy dtypes (:data:`FLOAT_DTYPE_NAMES`)."""
    return tuple(resolve_dtype(n) for n in FLOAT_DTYPE_NAMES)


def lse_dtypes() -> tuple[np.dtype, ...]:
    """The ``lse_partial`` dtypes of the NCCL lse_reduce (:data:`LSE_DTYPE_NAMES`)."""
    return tuple(resolve_dtype(n) for n in LSE_DTYPE_NAMES)


def cxx_type(dt) -> str:
    """The C++ type of a dtype of :data:`LSE_DTYPE_NAMES` in the kernels
    (``dcpkit::bf16_t``, ...)."""
    return _CXX_TYPES[np.dtype(dt).name]


def resolve_float_dtype(dtype, op: str, name: str = "dtype") -> np.dtype:
    """``dtype`` as one of :data:`FLOAT_DTYPE_NAMES`; :class:`InvalidType` otherwise."""
    choices = f"[{', '.join(FLOAT_DTYPE_NAMES)}]"
    try:
        dt = resolve_dtype(dtype, op=op, name=name)
    except (TypeError, ValueError, AttributeError, ImportError):
        raise InvalidType(f"{op}: {name} must be one of {choices} (got {dtype!r})") from None
    if dt not in float_dtypes():
        raise InvalidType(f"{op}: {name} must be one of {choices} (got {dt})")
    return dt


def resolve_bytes_dtype(dtype, op: str, itemsizes: tuple[int, ...] | None = None) -> np.dtype:
    """``dtype`` for a kernel that moves bytes: any fixed-size, non-object dtype, with an
    itemsize among ``itemsizes`` when given."""
    try:
        dt = resolve_dtype(dtype, op=op)
    except (TypeError, ValueError, AttributeError, ImportError):
        raise InvalidType(
            f"{op}: dtype must be a NumPy dtype or dtype name (got {dtype!r})"
        ) from None
    if dt.hasobject or dt.itemsize == 0:
        raise InvalidType(f"{op}: dtype must be a fixed-size data type (got {dt})")
    if itemsizes is not None and dt.itemsize not in itemsizes:
        sizes = ", ".join(map(str, itemsizes[:-1])) + f" or {itemsizes[-1]}"
        raise InvalidType(
            f"{op}: dtype itemsize must be {sizes} bytes (got {dt}, {dt.itemsize} bytes)"
        )
    return dt


# ----------------------------------------------------------------------------- numbers
def check_int(
    value, op: str, name: str, *, minimum: int | None = 0, maximum: int | None = None
) -> int:
    """``value`` as an int (Python or NumPy integer, never a bool) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidType(f"{op}: {name} must be an int (got {type(value).__name__} {value!r})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise InvalidArgument(f"{op}: {name} must be >= {minimum} (got {v})")
    if maximum is not None and v > maximum:
        bound = "2**31 - 1" if maximum == INT32_MAX else str(maximum)
        raise InvalidArgument(f"{op}: {name} must be <= {bound} (got {v})")
    return v


def check_positive_int(
    value, op: str, name: str, *, minimum: int = 1, maximum: int | None = None
) -> int:
    """An integer size argument, ``>= minimum`` (1 by default)."""
    return check_int(value, op, name, minimum=minimum, maximum=maximum)


def check_bool(value, op: str, name: str) -> bool:
    """``value`` as a bool (Python or NumPy bool only); :class:`InvalidType` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidType(f"{op}: {name} must be a bool (got {value!r})")
    return bool(value)


def check_real(value, op: str, name: str, what: str = "a real number") -> float:
    """``value`` as a float (any real number type, never a bool or a string)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidType(f"{op}: {name} must be {what} (got {type(value).__name__} {value!r})")
    return float(value)


def check_lse_base(value, op: str) -> float:
    """``value`` as the float base of an lse argument: ``math.e`` or ``2.0``.

    Raises
    ------
    InvalidType
        ``value`` is not a real number (bools and strings included).
    InvalidArgument
        ``value`` is a number other than e or 2.
    """
    b = check_real(value, op, "lse_base")
    if b != math.e and b != 2.0:
        raise InvalidArgument(f"{op}: lse_base must be math.e or 2 (got {value!r})")
    return b


# ASCII only (re.ASCII; [0-9], not \d): float() and int() also read the digits of other scripts
# (Arabic-Indic five and zero are 50) and strip non-ASCII spaces, which a shell script or another
# tool reading the same setting would not.
_BLANKS = r"[ \t\n\r\f\v]*"
_DECIMAL_FLOAT = re.compile(
    _BLANKS + r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?" + _BLANKS, re.ASCII
)
_DECIMAL_INT = re.compile(_BLANKS + r"[+-]?[0-9]+" + _BLANKS, re.ASCII)


def decimal_float(text: str) -> float:
    """``float(text)`` for a number as written in a setting or on a command line (``250``,
    ``0.5``, ``1e3``; ASCII blanks around it ignored), ``ValueError`` for anything else: also
    for what Python's ``float()`` and ``int()`` accept and a reader of the same setting
    elsewhere (a shell script, another tool) would not: digit separators (``1_000``), digits of
    other scripts (Arabic-Indic ``50``), non-ASCII spaces, and the words ``inf`` and ``nan``."""
    if _DECIMAL_FLOAT.fullmatch(text) is None:
        raise ValueError(f"not a decimal number in ASCII digits: {text!r}")
    return float(text)


def decimal_int(text: str) -> int:
    """``int(text, 10)`` as :func:`decimal_float` reads numbers: ASCII blanks around it
    ignored, an optional sign, ASCII digits only (``ValueError`` for ``1_000`` or Arabic-Indic
    digits)."""
    if _DECIMAL_INT.fullmatch(text) is None:
        raise ValueError(f"not a decimal integer in ASCII digits: {text!r}")
    return int(text, 10)


def default_timeout_ms(op: str = "dcpkit") -> float:
    """The wait deadline used when an op is built without ``timeout_ms``: ``DCPKIT_TIMEOUT_MS``
    (a number of milliseconds read by :func:`decimal_float`, spaces around it ignored; empty
    or blank counts as unset) or 5000 ms.

    Raises
    ------
    InvalidArgument
        ``DCPKIT_TIMEOUT_MS`` is set but is not a number of milliseconds in [0.001, 3600000]
        written in ASCII (``1_000`` is not one, nor 50 in Arabic-Indic digits).
    """
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw.strip():  # unset, empty or blank: not set
        return DEFAULT_TIMEOUT_MS
    try:
        ms = decimal_float(raw)
    except ValueError:
        ms = float("nan")
    if not MIN_TIMEOUT_MS <= ms <= MAX_TIMEOUT_MS:  # NaN fails too
        raise InvalidArgument(
            f"{op}: DCPKIT_TIMEOUT_MS must be a number of milliseconds in "
            f"{TIMEOUT_RANGE} (got {raw!r})"
        )
    return ms


def check_timeout_ms(value, op: str) -> float:
    """A ``timeout_ms`` argument (None: :func:`default_timeout_ms`) as a float in
    [0.001, 3600000]; any real number type is accepted."""
    if value is None:
        return default_timeout_ms(op)
    ms = check_real(value, op, "timeout_ms", "a real number of milliseconds")
    if not MIN_TIMEOUT_MS <= ms <= MAX_TIMEOUT_MS:  # NaN fails too
        raise InvalidArgument(
            f"{op}: timeout_ms must lie in {TIMEOUT_RANGE} milliseconds (got {value!r})"
        )
    return ms


# ----------------------------------------------------------------------------- objects
def check_multicast(value, op: str) -> bool | None:
    """A ``multicast=`` argument: True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise InvalidType(f"{op}: multicast must be True, False or None (got {value!r})")
    return value


def check_comm(comm, op: str):
    """``comm`` must be a :class:`~dcpkit.comm.Communicator`."""
    if not isinstance(comm, Communicator):
        raise InvalidType(f"{op}: comm must be a dcpkit.Communicator (got {type(comm).__name__})")
    return comm


def check_ubatch(ubatch, num_ubatches: int, op: str) -> int:
    """A ``ubatch=`` call argument: an int in ``[0, num_ubatches)``."""
    if isinstance(ubatch, bool) or not isinstance(ubatch, (int, np.integer)):
        raise InvalidType(f"{op}: ubatch must be an int (got {ubatch!r})")
    if not 0 <= ubatch < num_ubatches:
        raise InvalidArgument(f"{op}: ubatch must lie in [0, {num_ubatches}) (got {ubatch})")
    return int(ubatch)


def resolve_stream(stream, op: str, device: int = -1):
    """``stream``, or for None the current CuPy stream of GPU ``device`` (-1: of the current
    GPU); :class:`InvalidType` unless a CuPy stream (``cupy.cuda.Stream`` /
    ``ExternalStream``)."""
    if stream is None:
        cupy = _cuda.require_cupy()
        return cupy.cuda.get_current_stream(device)
    return _cuda.check_stream(stream, op)


def check_constructor_keywords(cls, world_size, keywords: dict, heap_type=None) -> tuple:
    """What an op class's public ``check_arguments`` runs: its constructor's checks of
    ``keywords`` for a group of ``world_size`` ranks, without a GPU or a collective.

    ``heap`` is type-checked against ``heap_type`` when given (else left to the constructor,
    which checks it against the group), ``multicast`` checked, ``nccl_group`` left to the
    constructor; the rest goes to ``cls._check_arguments(world_size, **rest)`` on an instance
    that holds nothing (never set up, never closed). Returns what every rank must agree on.
    """
    op = cls.op_name
    rest = dict(keywords)
    heap = rest.pop("heap", None)
    if heap_type is not None and heap is not None and not isinstance(heap, heap_type):
        raise InvalidType(
            f"{op}: heap must be None or a dcpkit.{heap_type.__name__} (got {type(heap).__name__})"
        )
    check_multicast(rest.pop("multicast", None), op)
    rest.pop("nccl_group", None)
    W = check_int(world_size, op, "world_size", minimum=1)
    probe = cls.__new__(cls)
    probe._closed = True
    return tuple(probe._check_arguments(W, **rest))


def described(op: str, **arrays):
    """``(name, ArrayInfo)`` of every array given (not None), in order: an :class:`ArrayInfo` is
    taken as it is, anything else described by :func:`~dcpkit._arrays.array_info` (which
    raises :class:`InvalidType` for a host array)."""
    for name, x in arrays.items():
        if x is not None:
            yield name, (x if isinstance(x, ArrayInfo) else array_info(x, op, name))


def _index_array(x, op: str, name: str, dims: str, device: int) -> ArrayInfo:
    info = array_info(x, op, name)
    check_dtype(info, (np.int32,), op, name)
    if len(info.shape) != 1:
        raise InvalidArgument(
            f"{op}: {name} must have 1 dimension [{dims}] (got shape {info.shape})"
        )
    if info.shape[0] > 1 and info.strides[0] != 4:
        raise InvalidArgument(
            f"{op}: {name} must be contiguous (got stride {info.strides[0]} bytes)"
        )
    check_device(info, device, op, name)
    return info


def check_masks(op: str, seq_lens, query_start_loc, device: int) -> tuple[int, int, int]:
    """The masks of an lse_reduce call: ``query_start_loc [S+1]`` and ``seq_lens [S]`` (which
    needs ``query_start_loc``), each int32, 1-D, contiguous, on ``device``. Returns ``(S,
    query_start_loc pointer, seq_lens pointer)``, 0 for an array not given."""
    if query_start_loc is None:
        if seq_lens is not None:
            raise InvalidArgument(
                f"{op}: seq_lens requires query_start_loc (got query_start_loc=None)"
            )
        return 0, 0, 0
    qi = _index_array(query_start_loc, op, "query_start_loc", "S+1", device)
    if qi.shape[0] < 1:
        raise InvalidArgument(f"{op}: query_start_loc length must be >= 1 for [S+1] (got 0)")
    S = qi.shape[0] - 1
    if seq_lens is None:
        return S, qi.ptr, 0
    si = _index_array(seq_lens, op, "seq_lens", "S", device)
    if si.shape[0] != S:
        raise InvalidArgument(
            f"{op}: seq_lens length must be len(query_start_loc) - 1 = {S} (got {si.shape[0]})"
        )
    return S, qi.ptr, si.ptr
