"""A fake CUDA driver and a fake CuPy, so that the symmetric-heap setup can run on the CPU.

The ranks are threads of one process (tests/unit/_threadgroup.py), rank ``r`` on fake device
``r``. The fake driver keeps the books a real driver keeps (allocations, handles, exported
descriptors, reserved ranges, mappings, access, multicast objects) and refuses what a real one
refuses (mapping outside a reservation, freeing a range that is still mapped, binding memory to
a multicast object before every device joined, calls without a current context, ...), so a test
can check that every setup step, every unwinding and every close leaves nothing behind.

Structs and enums are cuda-python's real ones (they need no driver); every ``cu*`` function is
the fake's own, and asking for one the fake does not implement fails the test instead of
reaching a real driver.
"""

import ctypes
import enum
import itertools
import os
import threading
import types

from cuda.bindings import driver as _real

GRAN = 2 << 20
MC_GRAN = 2 << 20


class R(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801


OK = R.CUDA_SUCCESS
_FD = _real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_FABRIC = _real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
_A = _real.CUdevice_attribute


class FakeCupy:
    """The parts of CuPy the heap setup uses: Device (as a context), and runtime queries."""

    def __init__(self, ndev: int):
        self.ndev = ndev
        self._tls = threading.local()
        fake = self

        class Device:
            def __init__(self, d=None):
                self.id = fake.current() if d is None else int(d)

            def __enter__(self):
                fake._stack().append(self.id)
                return self

            def __exit__(self, *exc):
                fake._stack().pop()

            def use(self):
                fake._stack().append(self.id)

        runtime = types.SimpleNamespace(
            free=self._free,
            deviceGetPCIBusId=lambda d: f"0000:{int(d):02x}:00.0",
            deviceSynchronize=self._sync,
            getDevice=lambda: fake.current() or 0,
            getDeviceCount=lambda: fake.ndev,
            getDeviceProperties=lambda d: {"totalGlobalMem": 80 << 30},
            memset=self._memset,
        )
        self.memsets = []  # (device, ptr, value, size)
        self.cuda = types.SimpleNamespace(Device=Device, runtime=runtime)

    def _stack(self):
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def current(self) -> int | None:
        s = self._stack()
        return s[-1] if s else None

    def _free(self, ptr):
        assert self.current() is not None, "cudaFree(0) without a current device"

    def _memset(self, ptr, value, size):
        assert self.current() is not None, "cudaMemset without a current device"
        self.memsets.append((self.current(), int(ptr), int(value), int(size)))

    def _sync(self):
        assert self.current() is not None, "deviceSynchronize without a current device"


class FakeDriver:
    """See the module docstring. ``fail`` maps (call name, device) to a result name that the
    call returns on that device; ``fabric`` is "ok", "not_permitted" (every device) or a set of
    devices that refuse; ``p2p(a, b)`` says whether device a can access device b."""

    def __init__(
        self,
        cupy: FakeCupy,
        *,
        fabric="not_permitted",
        p2p=None,
        mc_supported=1,
        fail: dict | None = None,
    ):
        self._cupy = cupy
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.fabric = fabric
        self.p2p = p2p or (lambda a, b: True)
        self.mc_supported = mc_supported
        self.fail = dict(fail or {})
        self.allocs = {}  # alloc id -> dict(kind, size, device, type)
        self.handles = {}  # handle -> alloc id
        self.fds = {}  # exported fd -> alloc id (fds still owned by the caller)
        self.reserved = {}  # base -> size
        self.maps = {}  # va -> (size, handle)
        self.access = {}  # va of a mapping -> set of devices
        self.mc = {}  # alloc id -> dict(num, added set, bound {device: (handle, size)})
        self.calls = []  # (name, device)
        self._va = itertools.count(1 << 44, 1 << 40)

    # -------------------------------------------------------------- plumbing
    def __getattr__(self, name):
        if name.startswith("cu"):
            raise AssertionError(f"the fake driver does not implement {name}")
        return getattr(_real, name)

    def _enter(self, name, need_ctx=True):
        dev = self._cupy.current()
        self.calls.append((name, dev))
        if need_ctx and dev is None:
            return R.CUDA_ERROR_INVALID_CONTEXT
        res = self.fail.get((name, dev))
        return R[res] if res else OK

    def _new_handle(self, aid):
        h = next(self._ids)
        self.handles[h] = aid
        return _real.CUmemGenericAllocationHandle(h)

    def live(self):
        """What is still held: every count must be 0 after a close or an unwinding."""
        with self._lock:
            return {
                "handles": len(self.handles),
                "reserved": len(self.reserved),
                "maps": len(self.maps),
                "bound": sum(len(m["bound"]) for m in self.mc.values()),
            }

    def owner_of(self, va):
        """Device whose physical allocation is mapped at ``va``."""
        size, h = self.maps[va]
        return self.allocs[self.handles[int(h)]]["device"]

    def count(self, name):
        return sum(1 for n, _ in self.calls if n == name)

    # -------------------------------------------------------------- devices
    def cuInit(self, flags):
        self.calls.append(("cuInit", self._cupy.current()))
        return (OK,)

    def cuDeviceGet(self, ordinal):
        self.calls.append(("cuDeviceGet", self._cupy.current()))
        if not 0 <= ordinal < self._cupy.ndev:
            return (R.CUDA_ERROR_INVALID_DEVICE, None)
        return (OK, _real.CUdevice(ordinal))

    def cuDeviceGetAttribute(self, attr, dev):
        self.calls.append(("cuDeviceGetAttribute", self._cupy.current()))
        values = {
            _A.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: self.mc_supported,
            _A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: 1,
            _A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
            _A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
        }
        if attr not in values:
            raise AssertionError(f"fake driver: unexpected attribute {attr}")
        return (OK, values[attr])

    def cuDeviceGetByPCIBusId(self, bus):
        self.calls.append(("cuDeviceGetByPCIBusId", self._cupy.current()))
        assert isinstance(bus, bytes), f"cuDeviceGetByPCIBusId takes bytes (got {bus!r})"
        return (OK, _real.CUdevice(int(bus.decode().split(":")[1], 16)))

    def cuDeviceCanAccessPeer(self, dev, peer):
        self.calls.append(("cuDeviceCanAccessPeer", self._cupy.current()))
        return (OK, int(self.p2p(int(dev), int(peer))))

    # -------------------------------------------------------------- allocations
    def cuMemGetAllocationGranularity(self, prop, option):
        res = self._enter("cuMemGetAllocationGranularity", need_ctx=False)
        return (res, GRAN if res == OK else None)

    def cuMemCreate(self, size, prop, flags):
        with self._lock:
            res = self._enter("cuMemCreate")
            if res != OK:
                return (res, None)
            dev = self._cupy.current()
            if size % GRAN or size <= 0 or prop.location.id != dev:
                return (R.CUDA_ERROR_INVALID_VALUE, None)
            kind = prop.requestedHandleTypes
            if kind == _FABRIC and (
                self.fabric == "not_permitted"
                or (isinstance(self.fabric, set) and dev in self.fabric)
            ):
                return (R.CUDA_ERROR_NOT_PERMITTED, None)
            aid = next(self._ids)
            self.allocs[aid] = dict(kind="mem", size=size, device=dev, type=kind)
            return (OK, self._new_handle(aid))

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        with self._lock:
            res = self._enter("cuMemExportToShareableHandle")
            if res != OK:
                return (res, None)
            aid = self.handles.get(int(handle))
            if aid is None or self.allocs[aid]["type"] != kind:
                return (R.CUDA_ERROR_INVALID_VALUE, None)
            if kind == _FD:
                fd = os.memfd_create("fake-cuda-export")
                os.write(fd, str(aid).encode())
                self.fds[fd] = aid
                return (OK, fd)
            fh = _real.CUmemFabricHandle()
            fh.data = str(aid).encode().ljust(64, b"\0")
            return (OK, fh)

    def cuMemImportFromShareableHandle(self, os_handle, kind):
        with self._lock:
            res = self._enter("cuMemImportFromShareableHandle")
            if res != OK:
                return (res, None)
            if kind == _FD:
                assert isinstance(os_handle, int), f"import takes the fd as an int ({os_handle!r})"
                aid = int(os.pread(os_handle, 64, 0).decode())
            else:
                assert isinstance(os_handle, int), "fabric import takes the handle's address"
                aid = int(ctypes.string_at(os_handle, 64).rstrip(b"\0").decode())
            if aid not in self.allocs or self.allocs[aid]["type"] != kind:
                return (R.CUDA_ERROR_INVALID_VALUE, None)
            return (OK, self._new_handle(aid))

    def cuMemRelease(self, handle):
        with self._lock:
            res = self._enter("cuMemRelease")
            if res != OK:
                return (res,)
            if int(handle) not in self.handles:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            if any(int(h) == int(handle) for _, h in self.maps.values()):
                pass  # legal: the mapping keeps the memory; it must be unmapped later
            del self.handles[int(handle)]
            return (OK,)

    # -------------------------------------------------------------- address space
    def cuMemAddressReserve(self, size, alignment, addr, flags):
        with self._lock:
            res = self._enter("cuMemAddressReserve")
            if res != OK:
                return (res, None)
            if size % GRAN or alignment % GRAN:
                return (R.CUDA_ERROR_INVALID_VALUE, None)
            base = next(self._va)
            self.reserved[base] = size
            return (OK, _real.CUdeviceptr(base))

    def cuMemAddressFree(self, ptr, size):
        with self._lock:
            res = self._enter("cuMemAddressFree")
            if res != OK:
                return (res,)
            ptr = int(ptr)
            if self.reserved.get(ptr) != size:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            if any(ptr <= va < ptr + size for va in self.maps):
                return (R.CUDA_ERROR_INVALID_VALUE,)  # still mapped
            del self.reserved[ptr]
            return (OK,)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        with self._lock:
            res = self._enter("cuMemMap")
            if res != OK:
                return (res,)
            ptr = int(ptr)
            aid = self.handles.get(int(handle))
            inside = any(b <= ptr and ptr + size <= b + s for b, s in self.reserved.items())
            overlap = any(va < ptr + size and ptr < va + s for va, (s, _) in self.maps.items())
            if (
                aid is None
                or not inside
                or overlap
                or offset != 0
                or size != self.allocs[aid]["size"]
            ):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self.maps[ptr] = (size, int(handle))
            return (OK,)

    def cuMemUnmap(self, ptr, size):
        with self._lock:
            res = self._enter("cuMemUnmap")
            if res != OK:
                return (res,)
            if self.maps.get(int(ptr), (None,))[0] != size:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            del self.maps[int(ptr)]
            self.access.pop(int(ptr), None)
            return (OK,)

    def _covered(self, ptr, size):
        vas = sorted(va for va, (s, _) in self.maps.items() if ptr <= va < ptr + size)
        pos = ptr
        for va in vas:
            if va != pos:
                return []
            pos += self.maps[va][0]
        return vas if pos >= ptr + size else []

    def cuMemSetAccess(self, ptr, size, desc, count):
        with self._lock:
            res = self._enter("cuMemSetAccess")
            if res != OK:
                return (res,)
            assert all(isinstance(d, _real.CUmemAccessDesc) for d in desc) and len(desc) == count
            vas = self._covered(int(ptr), size)
            if not vas:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            for va in vas:
                self.access.setdefault(va, set()).update(int(d.location.id) for d in desc)
            return (OK,)

    def cuMemsetD8(self, ptr, value, n):
        with self._lock:
            res = self._enter("cuMemsetD8")
            if res != OK:
                return (res,)
            vas = self._covered(int(ptr), n)
            dev = self._cupy.current()
            if not vas or any(dev not in self.access.get(va, ()) for va in vas):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            return (OK,)

    # -------------------------------------------------------------- multicast
    def cuMulticastGetGranularity(self, prop, option):
        res = self._enter("cuMulticastGetGranularity", need_ctx=False)
        return (res, MC_GRAN if res == OK else None)

    def cuMulticastCreate(self, prop):
        with self._lock:
            res = self._enter("cuMulticastCreate")
            if res != OK:
                return (res, None)
            if prop.size % MC_GRAN or prop.numDevices < 1:
                return (R.CUDA_ERROR_INVALID_VALUE, None)
            aid = next(self._ids)
            kind = _FD if prop.handleTypes == int(_FD) else _FABRIC
            self.allocs[aid] = dict(
                kind="mc", size=prop.size, device=self._cupy.current(), type=kind
            )
            self.mc[aid] = dict(num=prop.numDevices, added=set(), bound={})
            return (OK, self._new_handle(aid))

    def cuMulticastAddDevice(self, mc_handle, dev):
        with self._lock:
            res = self._enter("cuMulticastAddDevice")
            if res != OK:
                return (res,)
            m = self.mc.get(self.handles.get(int(mc_handle)))
            if m is None or m["bound"] or len(m["added"]) >= m["num"]:
                return (R.CUDA_ERROR_INVALID_VALUE,)  # adding after a bind is refused
            m["added"].add(int(dev))
            return (OK,)

    def cuMulticastBindMem(self, mc_handle, mc_offset, mem_handle, mem_offset, size, flags):
        with self._lock:
            res = self._enter("cuMulticastBindMem")
            if res != OK:
                return (res,)
            m = self.mc.get(self.handles.get(int(mc_handle)))
            dev = self._cupy.current()
            mem = self.handles.get(int(mem_handle))
            if (
                m is None
                or len(m["added"]) != m["num"]
                or dev not in m["added"]
                or mem is None
                or self.allocs[mem]["device"] != dev
                or size % MC_GRAN
                or dev in m["bound"]
            ):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            m["bound"][dev] = (int(mem_handle), size)
            return (OK,)

    def cuMulticastUnbind(self, mc_handle, dev, mc_offset, size):
        with self._lock:
            res = self._enter("cuMulticastUnbind")
            if res != OK:
                return (res,)
            m = self.mc.get(self.handles.get(int(mc_handle)))
            if m is None or int(dev) not in m["bound"]:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            del m["bound"][int(dev)]
            return (OK,)
