"""A kernel launcher with a parameter buffer packed once per plan and patched in place.

CuPy's ``Function.__call__`` converts every argument on every launch (a Python int becomes an
8-byte integer, a NumPy scalar its own size) and builds the ``void*`` array anew. A decode loop
launches the same kernel with the same parameters except a few (data pointers, the output, ``T``):
:class:`KernelParams` keeps the parameter values in one buffer laid out as CUDA's ABI lays out a
parameter list (each parameter aligned to its size), and an array of ``void*`` pointing into it,
both built once. A call patches the fields that change and hands the array to
``cuLaunchKernel``, which copies the values during the call (eager launch or graph capture
alike), so patching the buffer afterwards never changes a launched or captured kernel.

:class:`Launcher` calls ``cuLaunchKernel`` through CuPy's own binding of it
(``backend="cupy"``, ``cupy_backends.cuda.api.driver.launchKernel``: every argument a C integer,
nothing converted; the default wherever CuPy has it), through cuda-python's
``cuda.bindings.driver`` (``backend="bindings"``; the only one with ``cuLaunchKernelEx``, which
:class:`ProgrammaticLauncher` needs) or through ``ctypes`` on ``libcuda`` (``backend="ctypes"``,
the fallback). Measured on an H200 host, a launch of a 19-parameter kernel costs about 0.5 to
0.8 us less host time through CuPy's binding than through cuda.bindings, and cuda.bindings
about 1.3 to 2.4 us less than ctypes (``scripts/host_overhead.py``'s "Launcher" rows). It takes
the ``CUfunction`` of a loaded CuPy kernel (``cupy.cuda.function.Function.ptr``) and a stream
handle (``cupy.cuda.Stream.ptr``). Nothing is converted or created per launch: the function and
every stream seen are wrapped once where the backend has handle types (cuda.bindings), and the
parameter array is passed by address.

Parameter types: ``"u64"``, ``"i64"`` (pointers go as ``"u64"``), ``"u32"``, ``"i32"``,
``"f32"``. :func:`ptx_param_types` reads a kernel's parameter list from its PTX, so a test can
check a plan's type list against the kernel the op really launches.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence

from .errors import CudaError, InvalidArgument

__all__ = [
    "KernelParams",
    "Launcher",
    "ProgrammaticLauncher",
    "check_programmatic_launch",
    "PARAM_TYPES",
    "param_layout",
    "ptx_param_types",
    "check_params_match",
    "default_backend",
    "BACKENDS",
]

#: The launch backends, in order of preference (see :func:`default_backend`).
BACKENDS = ("cupy", "bindings", "ctypes")

#: Parameter type name -> ctypes type (size == alignment for every one of them).
PARAM_TYPES = {
    "u64": ctypes.c_uint64,
    "i64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "i32": ctypes.c_int32,
    "f32": ctypes.c_float,
}
_PTX_TYPES = {
    "u64": "u64",
    "s64": "i64",
    "b64": "u64",
    "u32": "u32",
    "s32": "i32",
    "b32": "u32",
    "f32": "f32",
}
#: What PTX keeps of a parameter type: its width and whether it is a float (NVRTC declares
#: ``int`` as ``.u32`` and ``long long`` as ``.u64``: signedness lives in the C++ source only).
_KIND = {"u64": "b64", "i64": "b64", "u32": "b32", "i32": "b32", "f32": "f32"}


def param_layout(types: Sequence[str]) -> tuple[list[int], int]:
    """Byte offsets of the parameters and the total size, as CUDA's ABI lays out a kernel
    parameter list: each parameter at the next multiple of its size; the total rounded up to
    the largest alignment.

    Raises
    ------
    InvalidArgument
        An unknown type name.
    """
    offsets, pos, align = [], 0, 1
    for t in types:
        ct = PARAM_TYPES.get(t)
        if ct is None:
            raise InvalidArgument(
                f"KernelParams: parameter type must be one of {list(PARAM_TYPES)} (got {t!r})"
            )
        size = ctypes.sizeof(ct)
        pos = -(-pos // size) * size
        offsets.append(pos)
        pos += size
        align = max(align, size)
    return offsets, -(-pos // align) * align


class KernelParams:
    """The parameter values of one kernel launch, packed once, patched in place.

    Parameters
    ----------
    types : sequence of str
        The kernel's parameter types in order (see the module docstring).
    values : sequence, optional
        Initial values (default all zero).

    Attributes
    ----------
    address : int
        Address of the ``void*`` array (``kernelParams`` of ``cuLaunchKernel``).
    offsets : list of int
        Byte offset of every parameter in :attr:`buffer`.
    buffer : ctypes array
        The packed values (``size`` bytes, 8-byte aligned).
    """

    __slots__ = ("_fields", "_ptrs", "address", "buffer", "offsets", "size", "types")

    def __init__(self, types: Sequence[str], values: Sequence | None = None):
        self.types = tuple(types)
        self.offsets, self.size = param_layout(self.types)
        # c_uint64 elements: the buffer itself is 8-byte aligned
        self.buffer = (ctypes.c_uint64 * max(1, self.size // 8 + (self.size % 8 > 0)))()
        self._fields = [
            PARAM_TYPES[t].from_buffer(self.buffer, off) for t, off in zip(self.types, self.offsets)
        ]
        base = ctypes.addressof(self.buffer)
        self._ptrs = (ctypes.c_void_p * max(1, len(self.types)))(
            *[base + off for off in self.offsets]
        )
        self.address = ctypes.addressof(self._ptrs)
        if values is not None:
            self.set_all(values)

    def __len__(self) -> int:
        return len(self.types)

    def field(self, i: int):
        """The ctypes object of parameter ``i``: ``field(i).value = v`` patches it (what
        :meth:`__setitem__` does, without a Python call on a hot path)."""
        return self._fields[i]

    def __setitem__(self, i: int, value) -> None:
        """Patch parameter ``i`` (an int for the integer types, a float for ``"f32"``; masked
        to the type's width as C would store it)."""
        self._fields[i].value = value

    def __getitem__(self, i: int):
        return self._fields[i].value

    def set_all(self, values: Sequence) -> None:
        if len(values) != len(self.types):
            raise InvalidArgument(
                f"KernelParams: values must number {len(self.types)} (got {len(values)})"
            )
        for f, v in zip(self._fields, values):
            f.value = v

    def raw(self) -> bytes:
        """The packed bytes (for tests)."""
        return ctypes.string_at(ctypes.addressof(self.buffer), self.size)

    def pointers(self) -> list[int]:
        """The ``void*`` array's entries (for tests)."""
        return [int(p) for p in self._ptrs[: len(self.types)]]


_LIBCUDA = None


def _libcuda():
    """``cuLaunchKernel`` and ``cuGetErrorName`` of libcuda through ctypes (loaded once)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        u = ctypes.c_uint
        fn.argtypes = [
            ctypes.c_void_p,
            u,
            u,
            u,
            u,
            u,
            u,
            u,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        fn.restype = ctypes.c_int
        name = lib.cuGetErrorName
        name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        name.restype = ctypes.c_int
        _LIBCUDA = (fn, name)
    return _LIBCUDA


_DEFAULT_BACKEND: str | None = None


def default_backend() -> str:
    """``"cupy"`` where CuPy's driver binding has ``launchKernel``, else ``"bindings"`` where
    ``cuda.bindings.driver`` imports, else ``"ctypes"`` (decided once per process)."""
    global _DEFAULT_BACKEND
    if _DEFAULT_BACKEND is None:
        if _cupy_launch() is not None:
            _DEFAULT_BACKEND = "cupy"
        elif bindings_available():
            _DEFAULT_BACKEND = "bindings"
        else:
            _DEFAULT_BACKEND = "ctypes"
    return _DEFAULT_BACKEND


def bindings_available() -> bool:
    """Whether ``cuda.bindings.driver`` imports (the "bindings" backend, and the only one with
    ``cuLaunchKernelEx``)."""
    from . import _cuda
    from .errors import MissingDependency

    try:
        _cuda.driver()
    except (MissingDependency, ImportError, OSError):
        return False
    return True


def _cupy_launch():
    """CuPy's driver module where it has ``launchKernel`` (and its error type), else None."""
    try:
        from cupy_backends.cuda.api import driver as cdrv
    except (ImportError, OSError):
        return None
    if not hasattr(cdrv, "launchKernel") or not hasattr(cdrv, "CUDADriverError"):
        return None
    return cdrv


def _error_name(code: int) -> str:
    try:
        s = ctypes.c_char_p()
        if _libcuda()[1](code, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
    except OSError:
        pass
    return f"CUresult {code}"


class _NotRaised(Exception):
    """The failure a launch raises where the backend returns its result instead (none)."""


def _cupy_error_name(e) -> str:
    """The ``CUDA_ERROR_...`` name of CuPy's ``CUDADriverError`` (its message starts with it)."""
    name = str(e).split(":", 1)[0].strip()
    return name if name.startswith("CUDA_ERROR_") else _error_name(getattr(e, "status", -1))


class Launcher:
    """Launches one loaded kernel with a :class:`KernelParams` buffer.

    Parameters
    ----------
    function : int or object with ``.ptr``
        The ``CUfunction`` (``cupy.cuda.function.Function`` or its ``.ptr``).
    block : int
        Threads per CTA (1-D).
    shared_mem : int
        Dynamic shared memory bytes.
    backend : {"bindings", "cupy", "ctypes"}, optional
        ``"bindings"``: ``cuLaunchKernel`` of ``cuda.bindings.driver``; ``"cupy"``: CuPy's own
        binding of it (``cupy_backends.cuda.api.driver.launchKernel``: every argument a C
        integer, a failure raised as CuPy's ``CUDADriverError``); ``"ctypes"``: libcuda's
        through ctypes. Default: :func:`default_backend`.

    Stream: :meth:`launch` enqueues on the given stream handle and never blocks the host.
    The current CUDA context must be the function's (the op's device is current).
    """

    __slots__ = (
        "_call",
        "_cupy_error",
        "_fn_obj",
        "_ok",
        "_stream_type",
        "_streams",
        "backend",
        "block",
        "function",
        "shared_mem",
    )

    @staticmethod
    def resolve(backend: str | None) -> str:
        """The backend a launcher built with ``backend`` uses (None: :func:`default_backend`)."""
        return default_backend() if backend is None else backend

    def __init__(self, function, block: int, shared_mem: int = 0, backend: str | None = None):
        self.function = int(getattr(function, "ptr", function))
        self.block = int(block)
        self.shared_mem = int(shared_mem)
        backend = self.resolve(backend)
        if backend not in BACKENDS:
            raise InvalidArgument(
                f"Launcher: backend must be one of {list(BACKENDS)} (got {backend!r})"
            )
        self.backend = backend
        self._streams = {}
        self._cupy_error = _NotRaised  # what the call raises on a failed launch (CuPy's only)
        if backend == "ctypes":
            self._call = _libcuda()[0]
            self._fn_obj = None
            self._ok = self._stream_type = None
        elif backend == "cupy":
            cdrv = _cupy_launch()
            if cdrv is None:
                raise InvalidArgument(
                    "Launcher: backend 'cupy' needs CuPy's driver binding with launchKernel "
                    "(cupy_backends.cuda.api.driver), which does not load here"
                )
            self._call = cdrv.launchKernel
            self._cupy_error = cdrv.CUDADriverError
            self._fn_obj = self._ok = self._stream_type = None
        else:
            from . import _cuda

            drv = _cuda.driver()
            self._call = drv.cuLaunchKernel
            self._fn_obj = drv.CUfunction(self.function)
            self._ok = drv.CUresult.CUDA_SUCCESS
            self._stream_type = drv.CUstream

    def _wrap_stream(self, stream_ptr: int):
        """The bindings' ``CUstream`` of ``stream_ptr``, wrapped once per handle (a handle is the
        stream: never stale; at most 256 kept)."""
        if len(self._streams) >= 256:
            self._streams.clear()
        s = self._streams[stream_ptr] = self._stream_type(stream_ptr)
        return s

    def launch(self, grid: int, params: KernelParams, stream_ptr: int) -> None:
        """Enqueue the kernel: ``grid`` CTAs of :attr:`block` threads, on the stream handle
        ``stream_ptr`` (0: the legacy default stream).

        Raises
        ------
        CudaError
            ``cuLaunchKernel`` failed (its ``CUDA_ERROR_...`` name).
        """
        if self._fn_obj is None:  # CuPy's binding (raises) or ctypes (returns the CUresult)
            try:
                res = self._call(
                    self.function,
                    grid,
                    1,
                    1,
                    self.block,
                    1,
                    1,
                    self.shared_mem,
                    stream_ptr,
                    params.address,
                    0,
                )
            except self._cupy_error as e:
                raise CudaError("cuLaunchKernel", _cupy_error_name(e)) from None
            if res:
                raise CudaError("cuLaunchKernel", _error_name(res))
            return
        s = self._streams.get(stream_ptr)
        if s is None:
            s = self._wrap_stream(stream_ptr)
        (res,) = self._call(
            self._fn_obj, grid, 1, 1, self.block, 1, 1, self.shared_mem, s, params.address, 0
        )
        if res is not self._ok and int(res):
            raise CudaError("cuLaunchKernel", getattr(res, "name", str(res)))


def check_programmatic_launch(cupy, device: int, op: str, wanted=True) -> None:
    """What ``programmatic_launch=True`` needs of this rank (NOTE [dcpkit programmatic
    launch]): a GPU of compute capability 9.0 or newer (``griddepcontrol``) and the cuda.bindings
    launch backend (``cuLaunchKernelEx``). Raises :class:`InvalidArgument` otherwise; nothing
    when not ``wanted``."""
    if not wanted:
        return
    props = cupy.cuda.runtime.getDeviceProperties(device)
    major, minor = int(props["major"]), int(props["minor"])
    if major < 9:
        raise InvalidArgument(
            f"{op}: programmatic_launch=True needs a GPU of compute capability 9.0 or newer "
            f"(device {device} is {major}.{minor}); build the op without it"
        )
    if not bindings_available():
        raise InvalidArgument(
            f"{op}: programmatic_launch=True launches through cuda.bindings' cuLaunchKernelEx, "
            "which does not load here; install cuda-bindings"
        )


class ProgrammaticLauncher(Launcher):
    """A :class:`Launcher` whose launches may overlap the end of the kernel before them on the
    stream: ``cuLaunchKernelEx`` (cuda.bindings only) with the programmatic stream serialization
    attribute. The kernel must wait for that kernel itself before it reads anything it wrote
    (``griddepcontrol.wait``: the op kernels compiled with ``DCPKIT_PDL=1``, NOTE [dcpkit
    programmatic launch] in kernels/dcpkit_ptx.cuh). Needs compute capability 9.0 or newer.

    The launch configuration is built once; a launch sets its grid and stream and passes the
    same parameter array as :meth:`Launcher.launch` (captured into a graph, the launch keeps
    its programmatic dependency on the node before it). So, like the op that owns it and its
    parameter buffers, it serves one thread at a time."""

    __slots__ = ("_config",)

    @staticmethod
    def resolve(backend: str | None) -> str:
        """Always cuda.bindings (None included): the only backend with ``cuLaunchKernelEx``."""
        return "bindings" if backend is None else backend

    def __init__(self, function, block: int, shared_mem: int = 0, backend: str | None = None):
        if (backend or "bindings") != "bindings":
            raise InvalidArgument(
                "ProgrammaticLauncher: a programmatic launch needs the 'bindings' backend "
                f"(cuda.bindings' cuLaunchKernelEx; got {backend!r})"
            )
        super().__init__(function, block, shared_mem, "bindings")
        from . import _cuda

        drv = _cuda.driver()
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block, 1, 1
        cfg.sharedMemBytes = self.shared_mem
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        self._config = cfg
        self._call = drv.cuLaunchKernelEx

    def launch(self, grid: int, params: KernelParams, stream_ptr: int) -> None:
        """:meth:`Launcher.launch` through ``cuLaunchKernelEx``.

        Raises
        ------
        CudaError
            ``cuLaunchKernelEx`` failed (its ``CUDA_ERROR_...`` name).
        """
        s = self._streams.get(stream_ptr)
        if s is None:
            s = self._wrap_stream(stream_ptr)
        cfg = self._config
        cfg.gridDimX = grid
        cfg.hStream = s
        (res,) = self._call(cfg, self._fn_obj, params.address, 0)
        if res is not self._ok and int(res):
            raise CudaError("cuLaunchKernelEx", getattr(res, "name", str(res)))


_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\S+?(\[\d+\])?\s*(?:,|$)")


def ptx_param_types(ptx: str, entry: str | None = None) -> list[str]:
    """The parameter types of a kernel entry in PTX, as :class:`KernelParams` names them.

    Parameters
    ----------
    ptx : str
        PTX text (from NVRTC).
    entry : str, optional
        The (mangled) entry name; default the only entry.

    Raises
    ------
    InvalidArgument
        No such entry (or several, with ``entry=None``), or a parameter that is not a scalar
        of a supported type (a struct or an array parameter).
    """
    entries = {m.group(1): m.group(2) for m in _ENTRY.finditer(ptx)}
    if entry is None:
        if len(entries) != 1:
            raise InvalidArgument(
                f"ptx_param_types: entry must be given when the PTX has "
                f"{len(entries)} entries (got None)"
            )
        (params,) = entries.values()
    elif entry in entries:
        params = entries[entry]
    else:
        raise InvalidArgument(
            f"ptx_param_types: entry must be one of {sorted(entries)} (got {entry!r})"
        )
    out = []
    for line in [p.strip() for p in params.split(",") if p.strip()]:
        m = _PARAM.match(line + ",")
        if m is None or m.group(2) or m.group(1) not in _PTX_TYPES:
            raise InvalidArgument(
                f"ptx_param_types: parameter must be a scalar u64/s64/u32/s32/f32 (got {line!r})"
            )
        out.append(_PTX_TYPES[m.group(1)])
    return out


def check_params_match(
    types: Sequence[str], ptx: str, entry: str | None = None, what: str = "kernel"
) -> None:
    """Raise :class:`InvalidArgument` unless ``types`` (a plan's parameter list) has the
    kernel's parameter count and, parameter by parameter, its width and float-ness as the PTX
    declares them.
    """
    want = ptx_param_types(ptx, entry)
    if len(want) != len(types):
        raise InvalidArgument(
            f"{what}: parameter count must be {len(want)} as the kernel declares (got {len(types)})"
        )
    for i, (t, w) in enumerate(zip(types, want)):
        if _KIND.get(t) != _KIND[w]:
            raise InvalidArgument(
                f"{what}: parameter {i} must be {_KIND[w]} as the kernel declares (got {t!r})"
            )
