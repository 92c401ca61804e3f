"""Helpers of tests/mpi/test_q_gather.py and tests/mpi/test_kv_gather.py.

Every check returns a message (or None) instead of asserting, so that each rank finishes all its
collective calls; :func:`run_collective` then agrees across ranks and asserts once, naming every
failing rank and its first problems.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MAX_REPORTED = 6

_SPIN_SRC = r"""
extern "C" __global__ void dcpkit_test_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
_SPIN = None


def run_collective(comm, what: str, body: Callable[[list[str]], None]) -> None:
    """Run ``body(errors)`` on every rank (an exception becomes an error), then agree and assert.

    Every rank reaches the agreement even when its body raised, so no rank is left waiting in a
    collective of this test."""
    errors: list[str] = []
    try:
        body(errors)
    except Exception as e:  # noqa: BLE001 - reported with the other ranks' results below
        errors.append(f"raised {type(e).__name__}: {e}")
    every = comm.allgather(
        errors[:MAX_REPORTED]
        + ([f"... {len(errors) - MAX_REPORTED} more"] if len(errors) > MAX_REPORTED else [])
    )
    bad = {r: e for r, e in enumerate(every) if e}
    assert not bad, (
        f"{what} (world_size {comm.world_size}) failed on ranks {sorted(bad)}:\n"
        + "\n".join(f"  rank {r}: " + "\n          ".join(e) for r, e in sorted(bad.items()))
    )


def sub_seed(seed: int, *keys: int) -> int:
    """A seed for one call of a test, derived from the run's seed."""
    return int(np.random.SeedSequence([int(seed)] + [int(k) for k in keys]).generate_state(1)[0])


def bits(x):
    """``x`` (host or device array) viewed as unsigned integers of the same item size, so that
    copies and assignments never depend on CuPy's support of the element type (bf16, fp8)."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def to_device(a: np.ndarray):
    import cupy

    return cupy.asarray(bits(np.ascontiguousarray(a))).view(a.dtype)


def to_host(x) -> np.ndarray:
    import cupy

    return cupy.asnumpy(bits(x)).view(x.dtype)


def byte_mismatch(got, want, what: str) -> str | None:
    """None when ``got`` and ``want`` are equal byte for byte, else where they first differ."""
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    isz = got.dtype.itemsize
    g = np.ascontiguousarray(got).view(np.uint8).reshape(got.size, isz)
    w = np.ascontiguousarray(want).view(np.uint8).reshape(want.size, isz)
    bad = np.nonzero((g != w).any(axis=1))[0]
    if bad.size == 0:
        return None
    i = int(bad[0])
    idx = tuple(int(v) for v in np.unravel_index(i, got.shape))
    poisoned = int((g[bad] == 0xFF).all(axis=1).sum())
    return (
        f"{what}: {bad.size} of {got.size} elements differ ({poisoned} still hold the 0xFF "
        f"poison); first at index {idx}: got 0x{g[i][::-1].tobytes().hex()}, "
        f"want 0x{w[i][::-1].tobytes().hex()}"
    )


def all_poison(x, what: str) -> str | None:
    """None when every byte of ``x`` (device array) is still 0xFF."""
    h = to_host(x)
    b = np.ascontiguousarray(h).view(np.uint8)
    if b.size and not (b == 0xFF).all():
        return f"{what}: {int((b != 0xFF).sum())} bytes were overwritten (must stay untouched)"
    return None


def poisoned_empty(shape, dtype):
    """A device array of ``shape`` whose bytes are all 0xFF."""
    import cupy

    dt = np.dtype(dtype)
    raw = cupy.empty(int(np.prod(shape)) * dt.itemsize, dtype=cupy.uint8)
    raw.fill(0xFF)
    return raw.view(dt).reshape(shape)


def poison_workspace(ws, comm) -> None:
    """Fill every data slot and output buffer of a gather workspace with 0xFF bytes.

    Collective; only right after construction (no peer may be writing into the slots): ends with
    a device synchronisation and a barrier, so no peer's first call can land before the poison."""
    import cupy

    with cupy.cuda.Device(ws.device):
        for u in range(ws.num_ubatches):
            for k in range(3):
                ptr = ws.data_slot_ptr(u, k)
                mem = cupy.cuda.UnownedMemory(ptr, ws.data_slot_bytes, ws, ws.device)
                cupy.ndarray(
                    (ws.data_slot_bytes,), cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)
                ).fill(0xFF)
        n = ws.graph_outputs * ws._pool_stride
        if n:  # the graph output buffers (in the symmetric region for the push gathers)
            mem = cupy.cuda.UnownedMemory(ws._graph_base, n, ws, ws.device)
            cupy.ndarray((n,), cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)).fill(0xFF)
        for buf in ws._eager_out:
            if buf is not None:
                buf.fill(0xFF)
        cupy.cuda.runtime.deviceSynchronize()
    comm.barrier()


_PRODUCER_SRC = r"""
extern "C" __global__ void dcpkit_test_producer(const unsigned char* src, unsigned char* dst,
                                                unsigned long long n, unsigned long long ns) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"""
_PRODUCER = None


def produce(dst, src, ns: int = 30_000) -> None:
    """A producer kernel on the current stream: it lets the kernel after it launch at once
    (``griddepcontrol.launch_dependents``, sm_90+), spins ``ns`` nanoseconds, then copies
    ``src`` into ``dst`` (same byte size, both contiguous). A kernel launched programmatically
    after it reads ``dst`` correctly only if it waits for the producer to complete."""
    import cupy

    global _PRODUCER
    if _PRODUCER is None:
        _PRODUCER = cupy.RawKernel(_PRODUCER_SRC, "dcpkit_test_producer")
    assert dst.nbytes == src.nbytes and dst.flags.c_contiguous and src.flags.c_contiguous
    _PRODUCER((4,), (256,), (src, dst, np.uint64(src.nbytes), np.uint64(ns)))


def spin(ns: int, stream=None) -> None:
    """Keep ``stream`` (default: the current stream) busy for ``ns`` nanoseconds on the GPU."""
    import cupy

    global _SPIN
    if _SPIN is None:
        _SPIN = cupy.RawKernel(_SPIN_SRC, "dcpkit_test_spin")
    if stream is None:
        _SPIN((1,), (1,), (np.uint64(ns),))
    else:
        with stream:
            _SPIN((1,), (1,), (np.uint64(ns),))


def check_programmatic(errors, call, inputs, rounds: int, what: str, check, outs=()) -> None:
    """The calls of an op built with ``programmatic_launch=True`` behind :func:`produce`.

    ``inputs(k)`` -> (this rank's input of round k as a host array, whatever ``check`` needs);
    ``call(x, stream)`` makes the op's call on ``x`` (writing its own ``out=``) and returns the
    result; ``check(result, expected, where)`` returns a message or None. The op's input ``x``
    and the arrays ``outs`` are filled with 0xFF before each producer (never between it and the
    call: the call's launch must follow the producer itself), so a call that read ``x`` before
    the producer completed sees the poison. Eager: ``rounds`` calls. Graph: one capture of (producer, call),
    ``rounds`` replays with the producer's source refreshed before each."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    first, _ = inputs(0)
    x = poisoned_empty(first.shape, first.dtype)
    src = poisoned_empty(first.shape, first.dtype)
    with s:
        for k in range(rounds):
            mine, want = inputs(k)
            bits(src).set(bits(np.ascontiguousarray(mine)), stream=s)
            for a in (x, *outs):
                bits(a).fill(np.iinfo(bits(a).dtype).max)
            produce(x, src)
            res = call(x, s)
            s.synchronize()
            m = check(res, want, f"{what}, eager call {k}")
            if m:
                errors.append(m)
        s.begin_capture()
        produce(x, src)
        res = call(x, s)
        graph = s.end_capture()
        for k in range(rounds):
            mine, want = inputs(rounds + k)
            bits(src).set(bits(np.ascontiguousarray(mine)), stream=s)
            for a in (x, *outs):
                bits(a).fill(np.iinfo(bits(a).dtype).max)
            graph.launch(s)
            s.synchronize()
            m = check(res, want, f"{what}, graph replay {k}")
            if m:
                errors.append(m)
