"""Thin helpers over the cuda-python driver bindings: lazy import and error checking.

Every driver call in dcpkit goes through :func:`check`, which turns a non-success result into
:class:`~dcpkit.errors.CudaError` carrying the call and the ``CUDA_ERROR_...`` name.
"""

from __future__ import annotations

import sys
from typing import Any

from .errors import CudaError, DcpkitError, InvalidArgument, InvalidType, MissingDependency

__all__ = [
    "driver",
    "check",
    "cuda_extra",
    "device_attribute",
    "driver_library_loads",
    "ensure_context",
    "require_cupy",
    "require_device",
    "stream_types",
    "check_stream",
    "NO_DRIVER",
    "torch_extra",
]


def cuda_extra() -> str:
    """The pip extra that matches this environment (``cuda12`` or ``cuda13``).

    Decided from the installed distributions (CuPy's wheel name, then cuda-bindings' major
    version), so it works when the very package that is missing is CuPy; ``cuda12`` when
    nothing tells.
    """
    from importlib import metadata

    def has(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    for major in ("13", "12"):
        if has(f"cupy-cuda{major}x"):
            return f"cuda{major}"
    ver = has("cuda-bindings") or has("cuda-python")
    if ver and ver.split(".")[0] in ("12", "13"):
        return f"cuda{ver.split('.')[0]}"
    return "cuda12"


def torch_extra() -> str:
    """The pip extra that installs torch for this environment's CUDA stack (``torch-cu12`` or
    ``torch-cu13``, after :func:`cuda_extra`): it carries that stack's pins, so pip cannot swap
    cuda-bindings for another major under it (the plain ``torch`` extra can)."""
    return "torch-cu" + cuda_extra()[len("cuda") :]


_DRIVER = None


def require_cupy():
    """The ``cupy`` module; call it first in every public entry point that needs CuPy.

    Raises
    ------
    MissingDependency
        CuPy is not installed (or cannot be imported): the message names the ``cuda12`` /
        ``cuda13`` extra that brings it.
    """
    try:
        import cupy
    except ImportError as e:
        raise MissingDependency("cupy", cuda_extra(), str(e)) from None
    except Exception as e:  # noqa: BLE001 - a broken install (CUDA libraries of another major)
        raise MissingDependency(
            "cupy", cuda_extra(), f"importing it failed: {type(e).__name__}: {e}"
        ) from None
    return cupy


def require_device(what: str, device: int | None = None) -> int:
    """The CUDA device this thread uses (``device`` when given), checked to exist.

    Turns "no driver" / "no GPU" into one clear error instead of a raw CUDA runtime error from
    deep inside. Costs two CUDA runtime queries: call it at construction, never per call.

    Parameters
    ----------
    what : str
        The op or class named in the error (``"DCPComm"``, ``"lse_reduce"``, ...).
    device : int, optional
        A device index to check against the visible devices (default: the current device).

    Returns
    -------
    int
        The device index.

    Raises
    ------
    MissingDependency
        CuPy is not installed.
    DcpkitError
        No visible GPU: ``"<what>: no CUDA GPU is visible (no CUDA driver on this machine:
        ...)"`` where the driver library is missing, ``"<what>: no CUDA GPU is visible
        (cudaGetDeviceCount: ...)"`` otherwise (a driver older than the CUDA runtime, no
        device, ``CUDA_VISIBLE_DEVICES`` hiding every device).
    InvalidArgument
        ``device`` is not one of the visible devices.
    """
    cupy = require_cupy()
    rt = cupy.cuda.runtime
    try:
        count = int(rt.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - no driver, no device, driver too old
        if not driver_library_loads():
            # Without libcuda the runtime reports cudaErrorInsufficientDriver ("driver version
            # is insufficient"), which sends a user looking for a driver upgrade.
            raise DcpkitError(
                f"{what}: no CUDA GPU is visible ({NO_DRIVER}); dcpkit needs "
                f"an NVIDIA GPU and its driver"
            ) from None
        raise DcpkitError(
            f"{what}: no CUDA GPU is visible (cudaGetDeviceCount: "
            f"{_error_text(e)}); check the NVIDIA driver and "
            f"CUDA_VISIBLE_DEVICES"
        ) from None
    if count < 1:
        raise DcpkitError(
            f"{what}: no CUDA GPU is visible (cudaGetDeviceCount: 0 devices); "
            f"check the NVIDIA driver and CUDA_VISIBLE_DEVICES"
        )
    if device is None:
        try:
            device = int(rt.getDevice())
        except Exception as e:  # noqa: BLE001 - same as above, for the current device
            raise DcpkitError(
                f"{what}: no CUDA GPU is usable (cudaGetDevice: {_error_text(e)})"
            ) from None
    if not 0 <= int(device) < count:
        raise InvalidArgument(f"{what}: device index must lie in [0, {count}) (got {device})")
    return int(device)


#: What :func:`require_device` and ``dcpkit info`` say where the driver library is missing.
NO_DRIVER = (
    "no CUDA driver on this machine: the NVIDIA driver library libcuda.so.1 cannot be loaded"
)


def driver_library_loads() -> bool:
    """Whether the CUDA driver library (``libcuda.so.1``) can be loaded.

    With ctypes, so it answers without cuda-bindings or CuPy; no ``cuInit``, no side effect other
    than mapping the library. Call it on error paths only (it costs a ``dlopen``).
    """
    import ctypes

    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def _error_text(e: BaseException) -> str:
    text = str(e)
    return text if text else type(e).__name__


#: The CuPy stream classes (filled on first use; one isinstance check per call).
_STREAM_TYPES: tuple = ()


def stream_types() -> tuple:
    """The classes a ``stream=`` argument may have: CuPy's stream base class (covers
    ``cupy.cuda.Stream`` and ``cupy.cuda.ExternalStream``)."""
    global _STREAM_TYPES
    if not _STREAM_TYPES:
        cupy = require_cupy()
        mod = cupy.cuda.stream
        base = getattr(mod, "BaseStream", None) or getattr(mod, "_BaseStream", None)
        _STREAM_TYPES = (
            (base,) if base is not None else (cupy.cuda.Stream, cupy.cuda.ExternalStream)
        )
    return _STREAM_TYPES


def check_stream(stream, what: str):
    """``stream`` itself when it is None or a CuPy stream; :class:`InvalidType` otherwise
    (``"<what>: stream must be a cupy.cuda.Stream (got str)"``). One isinstance check."""
    if stream is None or isinstance(stream, _STREAM_TYPES or stream_types()):
        return stream
    raise InvalidType(f"{what}: stream must be a cupy.cuda.Stream (got {type(stream).__name__})")


def check_stream_device(stream, device: int, what: str) -> None:
    """:class:`InvalidArgument` when ``stream`` was created on a GPU other than ``device``
    (CuPy's ``device_id``; -1, the legacy and per-thread default streams and a stream of
    unknown device, pass): ``"<what>: stream is of GPU 1, the op runs on GPU 0"``."""
    d = getattr(stream, "device_id", -1)
    if d in (-1, device):
        return
    raise InvalidArgument(
        f"{what}: stream is of GPU {d}, the op runs on GPU {device}: pass a stream of GPU "
        f"{device} (or none: the current stream of GPU {device})"
    )


def driver():
    """The ``cuda.bindings.driver`` module (cuda-python), imported on first use.

    Raises
    ------
    MissingDependency
        cuda-bindings is not installed: install the ``cuda12`` or ``cuda13`` extra.
    """
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            try:
                from cuda import cuda as drv
            except ImportError as e:
                raise MissingDependency(
                    "cuda-bindings (cuda-python)", cuda_extra(), str(e)
                ) from None
        _DRIVER = drv
    return _DRIVER


def _result_name(res: Any) -> str:
    name = getattr(res, "name", None)
    return name if name else str(res)


def check(ret: Any, call: str, hint: str = "") -> Any:
    """Check the result of a cuda-bindings driver call and return its values.

    ``ret`` is what the binding returned: ``(CUresult, *values)`` or a bare ``CUresult``.
    Returns ``None``, the single value, or a tuple of values.

    Raises
    ------
    CudaError
        The result is not ``CUDA_SUCCESS``; the error names the call and the result.
    """
    if isinstance(ret, tuple):
        res, vals = ret[0], ret[1:]
    else:
        res, vals = ret, ()
    if int(res) != 0:
        raise CudaError(call, _result_name(res), hint)
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    return vals


def ensure_context(device: int) -> None:
    """Make the primary context of ``device`` current on this thread (through CuPy)."""
    import cupy

    cupy.cuda.Device(device).use()
    # CuPy creates the primary context lazily: touch the runtime so the driver sees it.
    cupy.cuda.runtime.getDevice()
    cupy.cuda.runtime.free(0)


def device_attribute(attr_name: str, device: int) -> int:
    """The driver attribute ``CU_DEVICE_ATTRIBUTE_<attr_name>`` of ``device``."""
    drv = driver()
    attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + attr_name)
    check(drv.cuInit(0), "cuInit")  # idempotent; cuDeviceGet needs it
    dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
    return int(check(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))
