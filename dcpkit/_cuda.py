"""Thin helpers over the cuda-python driver bindings: lazy import and error checking.

Every driver call in dcpkit goes through :func:`check`, which turns a non-success result into
:class:`~dcpkit.errors.CudaError` carrying the call and the ``CUDA_ERROR_...`` name.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import CudaError, MissingDependency

__all__ = ["driver", "check", "cuda_extra", "device_attribute", "ensure_context"]


def cuda_extra() -> str:
    """The pip extra that matches this environment (``cuda12`` or ``cuda13``).

    Decided from the installed distributions (CuPy's wheel name, then cuda-bindings' major
    version), so it works when the very package that is missing is CuPy; ``cuda12`` when
    nothing tells.
    """
    from importlib import metadata

    def has(name: str) -> Optional[str]:
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


_DRIVER = None


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
            from cuda.bindings import driver as drv  # noqa: WPS433
        except ImportError:
            try:
                from cuda import cuda as drv  # noqa: WPS433 (cuda-python < 12.6 layout)
            except ImportError as e:
                raise MissingDependency("cuda-bindings (cuda-python)", cuda_extra(), str(e)) from None
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
    import cupy  # noqa: WPS433

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
