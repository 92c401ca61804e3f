"""The GPU side of the harness on one rank: streams, events, the device barrier, the ceilings
kernels (kernels/ceilings.cu), timing and array helpers, over CuPy (:class:`CupyDevice`), and
the array helpers shared with the CPU tests' fake device (:class:`DeviceBase`)."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DcpkitError
from .common import BarrierTimeout, BenchHang
from .meta import driver_version
from .stats import median

__all__ = ["DeviceBase", "CupyDevice", "uint_dtype", "to_f32"]

# Offsets in the small symmetric heap of the ceilings kernels.
_PP_OFF = 0  # ping-pong word (u32)
_BAR_OFF = 256  # barrier words (u32 [world_size])
_SYNC_HEAP_BYTES = 4096


def uint_dtype(itemsize: int):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[int(itemsize)]


def to_f32(xp, a):
    """float32 copy of ``a``; bfloat16 through its bits (no reliance on bf16 casts)."""
    if a.dtype.name == "bfloat16":
        return (a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32)


class DeviceBase:
    """Array helpers shared by the CuPy device and test doubles (``xp`` = cupy or numpy)."""

    xp = np

    def upload(self, a: np.ndarray):
        """A device copy of the host array ``a`` (any dtype, bfloat16 included)."""
        a = np.ascontiguousarray(a)
        u = uint_dtype(a.dtype.itemsize)
        d = self.xp.asarray(a.view(u))
        return d if a.dtype == np.dtype(u) else d.view(a.dtype)

    def empty(self, shape, dtype):
        dt = np.dtype(dtype)
        d = self.xp.empty(tuple(shape), dtype=uint_dtype(dt.itemsize))
        return d if dt == np.dtype(uint_dtype(dt.itemsize)) else d.view(dt)

    def pci_bus_id(self) -> str | None:
        """The PCI bus id of this rank's GPU; None where unknown (then it is never counted as
        shared with another rank's)."""
        return None

    def poison(self, arrays) -> None:
        """Set every bit of every array (NaN for floats), then wait for it."""
        for a in arrays:
            u = uint_dtype(a.dtype.itemsize)
            a.view(u).fill(np.iinfo(u).max)
        self.sync_null()

    def sync_null(self) -> None:
        """Wait for work issued on the current stream (no-op for host arrays)."""

    def compare(self, outs, refs) -> dict[str, Any]:
        """Compare op outputs with references.

        ``refs`` holds ``("bits", ref_uint_view, None)`` (bit-exact) or ``("close", ref_f32,
        tol)`` (``|out - ref| <= tol``; NaN fails) per output. Returns ``wrong`` (elements that
        differ), ``first_bad`` (flat index per output, or None), ``max_abs_err``, ``rel_err``
        (‖out − ref‖ / ‖ref‖ for the tolerance outputs).
        """
        xp = self.xp
        if len(outs) != len(refs):
            raise ValueError(f"compare: {len(outs)} outputs for {len(refs)} references")
        wrong, first, max_err, rel = 0, [], None, None
        for i, (o, (kind, ref, tol)) in enumerate(zip(outs, refs)):
            if tuple(o.shape) != tuple(ref.shape):
                raise ValueError(
                    f"output {i} has shape {tuple(o.shape)}, the reference {tuple(ref.shape)}"
                )
            if kind == "bits":
                bad = o.view(uint_dtype(o.dtype.itemsize)) != ref
            else:
                of = to_f32(xp, o)
                err = xp.abs(of - ref)
                bad = ~(err <= tol)
                finite = xp.where(xp.isnan(err), xp.inf, err)
                m = float(finite.max()) if finite.size else 0.0
                max_err = m if max_err is None else max(max_err, m)
                den = float(xp.linalg.norm(ref.ravel()))
                num = float(xp.linalg.norm(xp.where(xp.isnan(of), xp.inf, of - ref).ravel()))
                r = num / den if den > 0 else (0.0 if num == 0 else math.inf)
                rel = r if rel is None else max(rel, r)
            n = int(xp.count_nonzero(bad))
            wrong += n
            first.append(int(xp.argmax(bad.ravel())) if n else None)
        return {"wrong": wrong, "first_bad": first, "max_abs_err": max_err, "rel_err": rel}

    # stages
    def quiesce(self) -> None:
        """Wait (with a deadline) until no work of this process is left on the GPU."""

    def barrier_token(self) -> int:
        return 0

    def barrier_resync(self, token: int) -> None:
        pass

    def free_memory(self) -> None:
        pass


class CupyDevice(DeviceBase):
    """The GPU side of the harness on one rank: streams, events, the device barrier, the
    ceilings kernels, and array helpers, over CuPy.

    Construction selects GPU ``local_rank % device_count``; :meth:`setup` (collective, inside a
    stage) compiles ``kernels/ceilings.cu`` and builds the small symmetric heap of the barrier and
    the ping-pong.
    """

    def __init__(self, comm, cfg: dict[str, Any]):
        import cupy

        self.cupy = cupy
        self.xp = cupy
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world_size
        self.gpu_count = cupy.cuda.runtime.getDeviceCount()
        if self.gpu_count < 1:
            raise DcpkitError("dcpkit bench: no CUDA GPU visible")
        self.device = comm.local_rank % self.gpu_count
        cupy.cuda.Device(self.device).use()
        self.timeout_ns = int(cfg["timeout_ms"] * 1e6)
        self.hang_s = float(cfg["hang_s"])
        self.sm_count = cupy.cuda.runtime.getDeviceProperties(self.device)["multiProcessorCount"]
        self._streams: list[Any] = []
        self._owners: list[Any] = []
        self._ev_b = cupy.cuda.Event(disable_timing=True)
        self._ev0 = cupy.cuda.Event()
        self._ev1 = cupy.cuda.Event()
        self._bar_value = 0
        self._pp_base = 0
        self.sync_heap = None
        self._status_ptr = 0
        self._status = np.zeros(16, dtype=np.uint32)
        self._egress = None
        self.stream = self.new_stream()

    # ------------------------------------------------------------------ facts
    def describe(self) -> dict[str, Any]:
        cupy = self.cupy
        props = cupy.cuda.runtime.getDeviceProperties(self.device)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        rt = cupy.cuda.runtime.runtimeGetVersion()
        dv = cupy.cuda.runtime.driverGetVersion()
        out = {
            "gpu": name,
            "gpu_count": self.gpu_count,
            "device": self.device,
            "sm_count": self.sm_count,
            "cuda_runtime": f"{rt // 1000}.{(rt % 1000) // 10}",
            "cuda_driver_api": f"{dv // 1000}.{(dv % 1000) // 10}",
            "driver": driver_version(),
        }
        try:
            from cupy.cuda import nccl

            v = nccl.get_version()
            out["nccl"] = (
                f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
                if v >= 10000
                else f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"
            )
        except Exception:  # noqa: BLE001 - NCCL not available through CuPy
            out["nccl"] = None
        return out

    def pci_bus_id(self) -> str | None:
        return str(self.cupy.cuda.runtime.deviceGetPCIBusId(self.device))

    # ------------------------------------------------------------------ streams and waits
    def new_stream(self):
        s = self.cupy.cuda.Stream(non_blocking=True)
        self._streams.append(s)
        return s

    def external_stream(self, owner):
        """A CuPy view of a stream made elsewhere (a torch stream), waited for by
        :meth:`quiesce`; ``owner`` is kept alive for the run, so the handle never dangles."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = self.cupy.cuda.ExternalStream(int(owner.cuda_stream), self.device)
        self._streams.append(s)
        self._owners.append(owner)
        return s

    def _poll(self, ev, what: str) -> None:
        if ev.done:
            return
        t0 = time.monotonic()
        n = 0
        while not ev.done:
            n += 1
            if (n & 1023) == 0 and time.monotonic() - t0 > self.hang_s:
                raise BenchHang(
                    f"rank {self.rank}: the GPU did not finish {what} within "
                    f"{self.hang_s:g} s (a kernel without deadline, e.g. NCCL, is "
                    f"stuck)"
                )

    def wait_stream(self, stream, what: str = "the stream") -> None:
        ev = self.cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        self._poll(ev, what)

    def sync_null(self) -> None:
        self.wait_stream(self.cupy.cuda.get_current_stream(), "the current stream")

    def quiesce(self) -> None:
        for s in self._streams + [self.cupy.cuda.get_current_stream()]:
            self.wait_stream(s, "outstanding work")

    def free_memory(self) -> None:
        self.cupy.get_default_memory_pool().free_all_blocks()

    # ------------------------------------------------------------------ setup and barrier
    def setup(self) -> None:
        """Collective (run inside a stage): compile the ceilings kernels, build the sync heap."""
        from .. import jit
        from ..symmetric import SymmetricHeap

        cupy = self.cupy
        # the loaded functions (what the ops launch too: the launch cost measured is theirs)
        self._k_pp = jit.get_kernel("ceilings.cu", "dcpkit::pingpong_kernel").kernel
        self._k_egress = jit.get_kernel("ceilings.cu", "dcpkit::egress_kernel").kernel
        self._k_bar = jit.get_kernel("ceilings.cu", "dcpkit::barrier_kernel").kernel
        if not self._status_ptr:
            import ctypes

            flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
            self._status_ptr = cupy.cuda.runtime.hostAlloc(64, flags)
            self._status = np.ctypeslib.as_array(
                (ctypes.c_uint32 * 16).from_address(self._status_ptr)
            )
            self._status[:] = 0
        if self.sync_heap is None:
            self.sync_heap = SymmetricHeap(self.comm, _SYNC_HEAP_BYTES, multicast=False)
            # the heap starts zeroed: no barrier or ping-pong value is ever 0
            self._bar_peers = cupy.asarray(
                np.array([p + _BAR_OFF for p in self.sync_heap.peer_ptrs], dtype=np.uint64)
            )

    def close(self) -> None:
        """Collective: release the sync heap and the host status word."""
        if self.sync_heap is not None:
            self.quiesce()
            self.sync_heap.close()
            self.sync_heap = None
        if self._status_ptr:
            self.cupy.cuda.runtime.freeHost(self._status_ptr)
            self._status_ptr = 0
            self._status = np.zeros(16, dtype=np.uint32)

    def barrier(self, stream) -> None:
        """Enqueue the device barrier (every rank must enqueue it, in the same order)."""
        self._bar_value += 1
        block = max(32, -(-self.world // 32) * 32)
        self._k_bar(
            (1,),
            (block,),
            (
                np.uint64(self.sync_heap.local_ptr + _BAR_OFF),
                self._bar_peers,
                np.int32(self.rank),
                np.int32(self.world),
                np.uint32(self._bar_value & 0xFFFFFFFF),
                np.uint64(self.timeout_ns),
                np.uint64(self._status_ptr),
            ),
            stream=stream,
        )

    def barrier_token(self) -> int:
        return self._bar_value

    def barrier_resync(self, token: int) -> None:
        # After a failed stage the ranks may have launched different numbers of barriers: every
        # rank continues from the largest count, so every later value is new to every word.
        self._bar_value = int(token)
        self._status[0] = 0

    def aligned(self, stream) -> None:
        """Device barrier on ``stream``, then wait for it on the host: the ranks leave together."""
        self.barrier(stream)
        self._ev_b.record(stream)
        self._poll(self._ev_b, "the device barrier")
        if self._status[0]:
            raise BarrierTimeout(
                f"rank {self.rank}: a peer did not reach the device barrier "
                f"within {self.timeout_ns / 1e6:g} ms"
            )

    def sample(self, stream, enqueue: Callable[[], Any]) -> float:
        """One timed region: align the ranks, then time ``enqueue()`` on ``stream`` with events.
        Returns µs."""
        self.aligned(stream)
        self._ev0.record(stream)
        enqueue()
        self._ev1.record(stream)
        self._poll(self._ev1, "the timed region")
        return self.cupy.cuda.get_elapsed_time(self._ev0, self._ev1) * 1e3

    def capture(self, stream, fn: Callable[[], Any], count: int):
        """Capture ``count`` calls of ``fn`` on ``stream`` into one CUDA graph.

        Returns ``(launch, last)``: a function that launches the graph on ``stream``, and what
        the last captured call returned.
        """
        last = None
        with stream:
            stream.begin_capture()
            try:
                for _ in range(count):
                    last = fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        return (lambda: graph.launch(stream=stream)), last

    # ------------------------------------------------------------------ ceilings
    def pingpong(self, round_trips: int, repeats: int) -> list[dict[str, float]] | None:
        """Ranks 0 and 1 bounce a signal ``round_trips`` times per launch, ``repeats`` timed
        launches after one warm-up launch. Returns, on ranks 0 and 1, per launch the event time
        (µs) and the in-kernel %globaltimer time of the round trips after the first ``warm``."""
        cupy = self.cupy
        s = self.stream
        status = cupy.zeros(2, dtype=cupy.uint32)
        elapsed = cupy.zeros(1, dtype=cupy.uint64)
        warm = min(64, round_trips // 10)
        heap = self.sync_heap
        out = []
        for rep in range(repeats + 1):
            self.aligned(s)
            if self.rank < 2:
                peer = 1 - self.rank
                self._ev0.record(s)
                self._k_pp(
                    (1,),
                    (32,),
                    (
                        np.uint64(heap.local_ptr + _PP_OFF),
                        np.uint64(heap.peer_ptrs[peer] + _PP_OFF),
                        np.int32(1 if self.rank == 0 else 0),
                        np.uint32(self._pp_base & 0xFFFFFFFF),
                        np.int32(round_trips),
                        np.int32(warm),
                        np.uint64(self.timeout_ns),
                        status,
                        elapsed,
                    ),
                    stream=s,
                )
                self._ev1.record(s)
                self._poll(self._ev1, "the ping-pong")
                st = status.get()
                if st[0] != 0:
                    raise RuntimeError(
                        f"ping-pong: rank {self.rank} timed out after {int(st[1])} "
                        f"of {round_trips} round trips"
                    )
                if rep > 0:
                    out.append(
                        {
                            "event_us": cupy.cuda.get_elapsed_time(self._ev0, self._ev1) * 1e3,
                            "globaltimer_ns": float(elapsed.get()[0]),
                            "warm": warm,
                        }
                    )
            self._pp_base += round_trips + 1
        return out if self.rank < 2 else None

    def _pattern(self, src_rank: int, nwords: int):
        cupy = self.cupy
        x = cupy.arange(nwords, dtype=cupy.uint32) * np.uint32(2654435761)
        return x ^ np.uint32((0x9E3779B9 * (src_rank + 1)) & 0xFFFFFFFF)

    def egress_setup(self, slice_bytes: int) -> None:
        """Collective: a heap of ``world_size`` slices; this rank's source filled with a
        pattern."""
        from ..symmetric import SymmetricHeap

        cupy = self.cupy
        heap = SymmetricHeap(self.comm, self.world * slice_bytes, multicast=False)
        # recorded at once, so that egress_release closes the heap on every rank even if a
        # later step of this setup fails here
        self._egress = {"heap": heap, "src": None, "dst": None, "slice": slice_bytes}
        self._egress["src"] = self._pattern(self.rank, slice_bytes // 4)
        self._egress["dst"] = cupy.asarray(
            np.array([p + self.rank * slice_bytes for p in heap.peer_ptrs], dtype=np.uint64)
        )
        cupy.cuda.runtime.deviceSynchronize()

    def _egress_launch(self, stream, nvec: int, grid: int, block: int) -> None:
        e = self._egress
        src = e["src"] if e else self._bar_peers  # any valid pointer for the empty kernel
        dst = e["dst"] if e else self._bar_peers
        self._k_egress(
            (grid,),
            (block,),
            (src, dst, np.int32(self.rank), np.int32(self.world), np.uint64(nvec)),
            stream=stream,
        )

    def egress_run(self, samples: int) -> list[float]:
        """Time ``samples`` egress launches (after two warm-up launches); µs each."""
        s = self.stream
        nvec = self._egress["slice"] // 16
        grid, block = self.sm_count * 4, 256
        for _ in range(2):
            self.aligned(s)
            self._egress_launch(s, nvec, grid, block)
        return [
            self.sample(s, lambda: self._egress_launch(s, nvec, grid, block))
            for _ in range(samples)
        ]

    def egress_check(self) -> int:
        """Words of the peers' slices that differ from their pattern (needs a host barrier
        after :meth:`egress_run` on every rank: the stage boundary is one)."""
        e = self._egress
        n = e["slice"] // 4
        wrong = 0
        for s in range(self.world):
            if s == self.rank:
                continue
            got = e["heap"].view(s * e["slice"], (n,), np.uint32)
            wrong += int(self.cupy.count_nonzero(got != self._pattern(s, n)))
        return wrong

    def egress_release(self) -> None:
        """Collective: close the egress heap."""
        e, self._egress = self._egress, None
        if e is not None:
            self.quiesce()
            e["heap"].close()
        self.free_memory()

    def launch_costs(self, samples: int) -> dict[str, float]:
        """Median cost of an empty kernel: per eager launch (200 back to back) and per kernel in
        a graph of 20 (10 replays). Local: no cross-rank work besides the barrier."""
        s = self.stream
        launch = lambda: self._egress_launch(s, 0, 1, 32)  # noqa: E731
        eager = [
            self.sample(s, lambda: [launch() for _ in range(200)]) / 200 for _ in range(samples)
        ]
        run, _ = self.capture(s, launch, 20)
        run()
        graph = [self.sample(s, lambda: [run() for _ in range(10)]) / 200 for _ in range(samples)]
        return {"launch_eager_us": median(eager), "launch_graph_us": median(graph)}
