"""torch's CUDA streams as CuPy stream objects, for :mod:`dcpkit.torch` (torch is passed in,
never imported here)."""

from __future__ import annotations

from ._cuda import require_cupy

__all__ = ["StreamHandle", "wrap_stream", "current_stream", "raw_stream_fn"]


class StreamHandle:
    """A CUDA stream handle with the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def wrap_stream(ptr: int, device: int | None):
    """A CuPy stream object over the stream handle ``ptr`` (no new stream)."""
    cupy = require_cupy()
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        s = from_external(StreamHandle(ptr))
        if device is not None:  # from_external records the current device: say which it is
            s.device_id = int(device)
        return s
    return cupy.cuda.ExternalStream(ptr, -1 if device is None else int(device))


def current_stream(torch, device: int | None):
    """torch's current stream on ``device`` (None: torch's current device) as a CuPy stream
    object, without :func:`dcpkit.torch.cupy_stream`'s checks: for call paths whose ``device``
    is already a GPU torch sees (no device or driver query beyond torch's stream)."""
    return wrap_stream(torch.cuda.current_stream(device).cuda_stream, device)


def raw_stream_fn(torch):
    """``device -> torch's current stream handle`` as cheaply as torch allows."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream
