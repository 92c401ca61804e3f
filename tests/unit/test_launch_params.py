"""dcpkit._launch on CPU: the parameter buffer's layout (each parameter aligned to its size, as
CUDA's ABI lays out a parameter list), in-place patching, the void* array, the parameter list
read from NVRTC's PTX, and the launcher's call of cuLaunchKernel (the driver replaced by a
recorder). The real launch runs in the ops' GPU tests."""

from __future__ import annotations

import ctypes
import struct
import types

import pytest

from dcpkit import _launch
from dcpkit._launch import KernelParams, Launcher, check_params_match, param_layout, ptx_param_types
from dcpkit.errors import CudaError, InvalidArgument


@pytest.mark.parametrize(
    "types,offsets,size",
    [
        (["u64"], [0], 8),
        (["u32"], [0], 4),
        (["u32", "u64"], [0, 8], 16),  # u64 aligned up to 8
        (["u64", "i32", "f32", "u64"], [0, 8, 12, 16], 24),
        (["i32", "u32", "i32"], [0, 4, 8], 12),
        (["i32", "u64", "i32"], [0, 8, 16], 24),  # total rounded to 8
        (["f32", "i64", "u32", "u32", "u64"], [0, 8, 16, 20, 24], 32),
        ([], [], 0),
    ],
)
def test_layout_aligns_every_parameter_to_its_size(types, offsets, size):
    assert param_layout(types) == (offsets, size)
    p = KernelParams(types)
    assert p.offsets == offsets and p.size == size
    base = ctypes.addressof(p.buffer)
    assert base % 8 == 0
    assert p.pointers()[: len(types)] == [base + o for o in offsets]


def test_values_are_packed_little_endian_and_patched_in_place():
    p = KernelParams(["u64", "i32", "f32", "u32", "i64"], [0x1122334455667788, -2, 1.5, 7, -1])
    raw = p.raw()
    assert raw[0:8] == struct.pack("<Q", 0x1122334455667788)
    assert raw[8:12] == struct.pack("<i", -2)
    assert raw[12:16] == struct.pack("<f", 1.5)
    assert raw[16:20] == struct.pack("<I", 7)
    assert raw[24:32] == struct.pack("<q", -1)
    addr, ptrs = p.address, p.pointers()
    p[0] = 0xDEADBEEF00
    p[3] = 2**32 + 5  # masked to 32 bits as C stores it
    p[2] = 0.25
    assert (p[0], p[3], p[2]) == (0xDEADBEEF00, 5, 0.25)
    assert p.raw()[8:12] == struct.pack("<i", -2)  # neighbours untouched
    assert (p.address, p.pointers()) == (addr, ptrs)  # the same buffer: nothing rebuilt
    arr = (ctypes.c_void_p * 5).from_address(p.address)
    assert ctypes.c_uint64.from_address(arr[0]).value == 0xDEADBEEF00
    assert ctypes.c_float.from_address(arr[2]).value == 0.25


def test_bad_types_and_counts_are_refused():
    with pytest.raises(InvalidArgument, match="parameter type must be one of"):
        KernelParams(["u64", "f64"])
    with pytest.raises(InvalidArgument, match="values must number 2"):
        KernelParams(["u64", "u32"], [1])


def _ptx(src: str) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"k.cu", 0, [], [])
    (res,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"])
    if int(res) != 0:
        pytest.skip(f"NVRTC could not compile here: {res}")
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    buf = bytearray(n)
    nvrtc.nvrtcGetPTX(prog, buf)
    return buf.decode().rstrip("\0 ")


def test_parameter_list_from_ptx():
    ptx = _ptx(
        'extern "C" __global__ void k(unsigned long long a, int b, float c, '
        "unsigned int d, long long e, const float* f) { if (b < 0) *(float*)a = "
        "c + d + e + f[0]; }\n"
        'extern "C" __global__ void j(int x) { if (x < 0) asm("trap;"); }'
    )
    assert ptx_param_types(ptx, "k") == ["u64", "u32", "f32", "u32", "u64", "u64"]
    assert ptx_param_types(ptx, "j") == ["u32"]
    check_params_match(["u64", "i32", "f32", "u32", "i64", "u64"], ptx, "k")
    with pytest.raises(InvalidArgument, match="parameter 2 must be f32"):
        check_params_match(["u64", "i32", "i32", "u32", "i64", "u64"], ptx, "k")
    with pytest.raises(InvalidArgument, match="parameter count must be 6"):
        check_params_match(["u64"], ptx, "k")
    with pytest.raises(InvalidArgument, match="entry must be given"):
        ptx_param_types(ptx)
    with pytest.raises(InvalidArgument, match="entry must be one of"):
        ptx_param_types(ptx, "nope")
    struct_ptx = _ptx(
        "struct S { int a[4]; };\n"
        'extern "C" __global__ void s(S v) { if (v.a[0] < 0) asm("trap;"); }'
    )
    with pytest.raises(InvalidArgument, match="must be a scalar"):
        ptx_param_types(struct_ptx)


class _FakeFunction:
    ptr = 0xF00D


def test_launcher_calls_cuLaunchKernel_with_the_buffer(monkeypatch):
    calls = []

    def fake_launch(*args):
        calls.append(args)
        return 0 if len(calls) == 1 else 700

    def fake_name(code, out):
        out._obj.value = b"CUDA_ERROR_ILLEGAL_ADDRESS"
        return 0

    monkeypatch.setattr(_launch, "_LIBCUDA", (fake_launch, fake_name))
    p = KernelParams(["u64", "u32"], [1, 2])
    ln = Launcher(_FakeFunction(), block=512, shared_mem=64, backend="ctypes")
    ln.launch(7, p, 0xABC)
    assert calls == [(0xF00D, 7, 1, 1, 512, 1, 1, 64, 0xABC, p.address, 0)]
    with pytest.raises(CudaError, match="cuLaunchKernel failed with CUDA_ERROR_ILLEGAL_ADDRESS"):
        ln.launch(7, p, 0xABC)
    with pytest.raises(InvalidArgument, match="backend must be one of"):
        Launcher(1, block=32, backend="cuda")


def test_cupy_launcher_passes_integers_and_names_the_error(monkeypatch):
    """The "cupy" backend: CuPy's own cuLaunchKernel binding with every argument an int; its
    CUDADriverError becomes dcpkit's CudaError with the CUDA_ERROR_ name."""
    pytest.importorskip("cupy_backends.cuda.api.driver", reason="needs CuPy")
    from cupy_backends.cuda.api import driver as cdrv

    calls = []

    class FakeError(Exception):
        pass

    def fake_launch(*args):
        calls.append(args)
        if len(calls) > 1:
            raise FakeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources requested")

    monkeypatch.setattr(cdrv, "launchKernel", fake_launch)
    monkeypatch.setattr(cdrv, "CUDADriverError", FakeError)
    p = KernelParams(["u64", "u32"], [1, 2])
    ln = Launcher(_FakeFunction(), block=128, shared_mem=16, backend="cupy")
    ln.launch(5, p, 0xABC)
    assert calls == [(0xF00D, 5, 1, 1, 128, 1, 1, 16, 0xABC, p.address, 0)]
    assert all(type(a) is int for a in calls[0])
    with pytest.raises(CudaError, match="CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
        ln.launch(5, p, 0xABC)


class _FakeDriver:
    """cuda.bindings.driver as far as the launcher uses it: handle types and cuLaunchKernel."""

    class CUresult(int):
        pass

    class CUfunction(int):
        pass

    class CUstream(int):
        made = 0

        def __new__(cls, v):
            cls.made += 1
            return int.__new__(cls, v)

    def __init__(self):
        self.calls = []
        self.CUresult.CUDA_SUCCESS = self.CUresult(0)

    def cuLaunchKernel(self, *args):
        self.calls.append(args)
        return (self.CUresult.CUDA_SUCCESS if len(self.calls) < 3 else self.CUresult(700),)


def test_bindings_launcher_wraps_function_and_streams_once(monkeypatch):
    from dcpkit import _cuda

    drv = _FakeDriver()
    monkeypatch.setattr(_cuda, "driver", lambda: drv)
    p = KernelParams(["u64", "u32"], [1, 2])
    ln = Launcher(_FakeFunction(), block=256, backend="bindings")
    ln.launch(3, p, 0xABC)
    ln.launch(4, p, 0xABC)  # the same handle: no new CUstream
    assert drv.CUstream.made == 1
    (f, *dims, smem, s, params, extra) = drv.calls[0]
    assert (int(f), dims, smem, int(s), params, extra) == (
        0xF00D,
        [3, 1, 1, 256, 1, 1],
        0,
        0xABC,
        p.address,
        0,
    )
    assert drv.calls[1][0] is f and drv.calls[1][8] is s  # the same wrapped objects
    with pytest.raises(CudaError, match="cuLaunchKernel"):
        ln.launch(3, p, 0xABC)


def test_default_backend_is_cupy_then_bindings_then_ctypes(monkeypatch):
    from dcpkit import _cuda
    from dcpkit.errors import MissingDependency

    cdrv = types.SimpleNamespace(launchKernel=lambda *a: None, CUDADriverError=RuntimeError)
    monkeypatch.setattr(_launch, "_DEFAULT_BACKEND", None)
    monkeypatch.setattr(_launch, "_cupy_launch", lambda: cdrv)
    monkeypatch.setattr(_cuda, "driver", lambda: _FakeDriver())
    assert _launch.default_backend() == "cupy"
    assert Launcher(_FakeFunction(), block=32).backend == "cupy"

    monkeypatch.setattr(_launch, "_DEFAULT_BACKEND", None)
    monkeypatch.setattr(_launch, "_cupy_launch", lambda: None)
    assert _launch.default_backend() == "bindings"
    assert Launcher(_FakeFunction(), block=32).backend == "bindings"
    with pytest.raises(InvalidArgument, match="backend 'cupy' needs CuPy's driver binding"):
        Launcher(_FakeFunction(), block=32, backend="cupy")

    def missing():
        raise MissingDependency("cuda-bindings", "cuda12", "not installed")

    monkeypatch.setattr(_launch, "_DEFAULT_BACKEND", None)
    monkeypatch.setattr(_cuda, "driver", missing)
    monkeypatch.setattr(_launch, "_LIBCUDA", (lambda *a: 0, lambda c, o: 1))
    assert _launch.default_backend() == "ctypes"
    assert Launcher(_FakeFunction(), block=32).backend == "ctypes"
    assert not _launch.bindings_available()


# ----------------------------------------------------------------------------- programmatic
def _bindings_or_skip():
    try:
        from dcpkit import _cuda

        return _cuda.driver()
    except Exception as e:  # noqa: BLE001 - no cuda.bindings here: say so
        pytest.skip(f"cuda.bindings is not available here: {e}")


def test_programmatic_launcher_needs_the_bindings_backend():
    with pytest.raises(InvalidArgument, match="needs the 'bindings' backend.*'ctypes'"):
        _launch.ProgrammaticLauncher(0x1000, 512, backend="ctypes")


def test_programmatic_launcher_passes_grid_stream_and_the_attribute():
    drv = _bindings_or_skip()
    launcher = _launch.ProgrammaticLauncher(0x1000, 512, shared_mem=64)
    seen = []

    def fake(cfg, fn, params, extra):
        attr = cfg.attrs[0]
        seen.append(
            (
                cfg.gridDimX,
                cfg.gridDimY,
                cfg.blockDimX,
                cfg.sharedMemBytes,
                int(cfg.hStream),
                cfg.numAttrs,
                attr.id,
                attr.value.programmaticStreamSerializationAllowed,
                int(fn),
                params,
                extra,
            )
        )
        return (drv.CUresult.CUDA_SUCCESS,)

    launcher._call = fake
    params = KernelParams(["u64", "u32"], [5, 6])
    launcher.launch(7, params, 0xABC)
    launcher.launch(3, params, 0xDEF)
    pss = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert seen == [
        (7, 1, 512, 64, 0xABC, 1, pss, 1, 0x1000, params.address, 0),
        (3, 1, 512, 64, 0xDEF, 1, pss, 1, 0x1000, params.address, 0),
    ]

    def failing(cfg, fn, params, extra):
        return (drv.CUresult.CUDA_ERROR_INVALID_VALUE,)

    launcher._call = failing
    with pytest.raises(CudaError, match="cuLaunchKernelEx.*CUDA_ERROR_INVALID_VALUE"):
        launcher.launch(1, params, 0)


@pytest.mark.parametrize("cls", [Launcher, _launch.ProgrammaticLauncher])
def test_bindings_launchers_wrap_each_stream_once_and_keep_at_most_256(cls):
    drv = _bindings_or_skip()
    launcher = cls(0x1000, 256, backend="bindings")
    seen = []

    def fake(*args):
        s = args[8] if cls is Launcher else args[0].hStream
        seen.append(int(s))
        return (drv.CUresult.CUDA_SUCCESS,)

    launcher._call = fake
    params = KernelParams(["u32"], [1])
    launcher.launch(1, params, 0x10)
    first = launcher._streams[0x10]
    launcher.launch(1, params, 0x10)
    assert launcher._streams[0x10] is first  # wrapped once
    for ptr in range(0x20, 0x20 + 300):
        launcher.launch(1, params, ptr)
        assert len(launcher._streams) <= 256
    assert seen == [0x10, 0x10, *range(0x20, 0x20 + 300)]
