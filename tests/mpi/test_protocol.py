"""The self-checking, poison-on-failure, deadlock-free protocol of NOTE [dcpkit epoch signalling].

Run on GPUs (ranks may share one GPU under MPS), N = 2, 3 and 4::

    mpirun -np N python -m pytest tests/mpi/test_protocol.py -p no:cacheprovider -q

1. ``test_call_mismatch_*``: ranks that call with a different T (lse dtype, mask presence,
   ubatch) get ConfigMismatch on every rank, naming the ranks and values, with the poison
   pattern as the call's result, and the next workspace built afterwards works.
2. ``test_captured_calls_get_their_own_storage``: several calls of one ubatch captured without
   ``out=`` in one or several graphs each keep their own, right result after the replays; the
   call after the pool is exhausted raises at capture time.
3. ``test_replays_after_a_timeout_are_poisoned``: once a wait timed out inside a graph replay,
   ``poisoned`` turns True and ``check()`` raises without any synchronize, and every later
   replay fills its output with the poison pattern (0xFF bytes: NaN).
4. ``test_overlapping_calls_in_any_order_complete``: two ubatches x two ops (and up to four
   workspaces) on their own streams, launched in different orders on different ranks, with a
   long kernel holding most SMs, all complete with the right results.

Every test makes all its collective calls on every rank before asserting.
"""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from dcpkit.errors import CollectiveTimeout, ConfigMismatch, DcpkitError

from reliability_cases import OpCase, gather_failures, to_host

FAULT_TIMEOUT_MS = 300.0
#: Bounds that only rule out a hang (not performance bounds).
HANG_S = 20.0

VARIANTS = [
    ("lse_reduce", "push"),
    ("q_gather", "push"),
    ("kv_gather", "push"),
    ("kv_gather", "pull"),
]
VARIANT_IDS = ["lse_reduce", "q_gather", "kv_gather_push", "kv_gather_pull"]


def _fail_if_any(comm, msgs, what):
    msg = "\n".join(m for m in msgs if m) or None
    lines = gather_failures(comm, msg)
    if lines:
        pytest.fail(f"{what}:\n" + "\n".join(lines), pytrace=False)


def _all_ff(arr) -> bool:
    """Every byte of the GPU array is 0xFF (the poison pattern)."""
    b = arr.view(np.uint8) if arr.flags.c_contiguous else arr.copy().view(np.uint8)
    return bool((b.get() == 0xFF).all())


def _zeroed_out(case, T):
    import cupy

    with cupy.cuda.Device(case.op.device):
        return cupy.zeros(case.out_shape(T), dtype=case.dtype)


def _healthy_again(comm, seed, name, algorithm, msgs):
    """A new workspace of the same op, built after the failure, gives the right result."""
    case = OpCase(
        name,
        comm,
        max_tokens=16,
        algorithm=algorithm,
        num_ubatches=2,
        num_requests=2 if name == "lse_reduce" else 0,
    )
    try:
        dev, exp = case.prepare(seed + 7, 5)
        res = case.call(dev, out=case.poisoned_out(5))
        case.op.synchronize()
        msgs.append(case.check(res, exp, "new workspace after a mismatch"))
        res = case.call(dev)  # zero copy / workspace buffer
        case.op.synchronize()
        msgs.append(case.check(res, exp, "new workspace after a mismatch, second call"))
    except Exception as e:  # noqa: BLE001 - reported collectively
        msgs.append(f"the new workspace raised {type(e).__name__}: {e}")
    finally:
        case.op.close()


# ============================================================================ 1. mismatch
MISMATCHES = [(n, a, k) for n, a in VARIANTS for k in ("T", "ubatch")] + [
    ("lse_reduce", "push", "lse_dtype"),
    ("lse_reduce", "push", "masks"),
]


@pytest.mark.parametrize(
    "name,algorithm,kind",
    MISMATCHES,
    ids=[f"{VARIANT_IDS[VARIANTS.index((n, a))]}-{k}" for n, a, k in MISMATCHES],
)
def test_call_mismatch_raises_config_mismatch_on_every_rank(comm, seed, name, algorithm, kind):
    """Rank 0 calls with another T / ubatch / lse dtype / mask presence than the others."""
    import cupy

    W, rank = comm.world_size, comm.rank
    odd = rank == 0
    case = OpCase(
        name,
        comm,
        max_tokens=16,
        algorithm=algorithm,
        num_ubatches=2,
        timeout_ms=FAULT_TIMEOUT_MS,
        num_requests=2 if name == "lse_reduce" else 0,
    )
    op = case.op
    T = 2 if (kind == "T" and odd) else 6
    dev, _ = case.prepare(seed, T)
    ubatch = 1 if (kind == "ubatch" and odd) else 0
    if kind == "lse_dtype" and odd:
        dev["lse_partial"] = dev["lse_partial"].astype(cupy.float16)
    if kind == "masks" and odd:
        dev["seq_lens"] = dev["query_start_loc"] = None
    want = {
        "T": ("T=2 on rank 0", "T=6 on rank"),
        "ubatch": ("ubatch=1 on rank 0", "ubatch=0 on rank"),
        "lse_dtype": ("lse_partial dtype=float16 on rank 0", "lse_partial dtype=float32 on rank"),
        "masks": ("query_start_loc given=no on rank 0", "query_start_loc given=yes on rank"),
    }[kind]
    msgs = []
    comm.barrier()
    out = _zeroed_out(case, T)
    t0 = time.monotonic()
    err = None
    try:
        case.call(dev, ubatch=ubatch, out=out)
        op.synchronize()
        msgs.append(f"no ConfigMismatch (rank 0 {kind} differs)")
    except ConfigMismatch as e:
        err = e
    except Exception as e:  # noqa: BLE001
        msgs.append(f"{type(e).__name__} instead of ConfigMismatch: {e}")
    if time.monotonic() - t0 > HANG_S:
        msgs.append(f"the mismatch took {time.monotonic() - t0:.1f} s to surface")
    if err is not None:
        text = str(err)
        for frag in want:
            if frag not in text:
                msgs.append(f"ConfigMismatch lacks {frag!r}: {text}")
        if name not in text:
            msgs.append(f"ConfigMismatch does not name the op: {text}")
        if not op.poisoned:
            msgs.append("op.poisoned is False after the mismatch")
        try:
            op.check()
            msgs.append("check() after the mismatch did not raise")
        except ConfigMismatch:
            pass
        if not _all_ff(out):
            msgs.append(
                "the call that found the mismatch left data other than the poison "
                "pattern in its result"
            )
        before = list(op._calls)
        try:
            case.call(dev, ubatch=ubatch, out=out)
            msgs.append("the call after the mismatch did not raise")
        except ConfigMismatch:
            pass
        if op._calls != before:
            msgs.append("the rejected call counted")
    comm.barrier()
    op.close()
    _healthy_again(comm, seed, name, algorithm, msgs)
    _fail_if_any(comm, msgs, f"{case.label}: {kind} mismatch at W={W}")


# ============================================================================ 2. graph storage
@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_captured_calls_get_their_own_storage(comm, seed, name, algorithm):
    import cupy

    T = 5
    case = OpCase(
        name,
        comm,
        max_tokens=8,
        algorithm=algorithm,
        graph_outputs=4,
        num_requests=2 if name == "lse_reduce" else 0,
    )
    op = case.op
    inputs = [case.prepare(seed + i, T) for i in range(4)]
    msgs = []
    s = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(op.device):
        case.call(inputs[0][0], stream=s)  # the first call is eager
        s.synchronize()
        results, graphs = [], []
        for group in ((0, 1), (2,)):  # two calls in one graph, one in another
            s.begin_capture()
            try:
                for i in group:
                    results.append(case.call(inputs[i][0], stream=s))
            finally:
                graphs.append(s.end_capture())
        s.begin_capture()  # the fourth buffer, then none left
        try:
            results.append(case.call(inputs[3][0], stream=s))
            try:
                case.call(inputs[3][0], stream=s)
                msgs.append("a fifth captured call without out= did not raise")
            except DcpkitError as e:
                if "graph_outputs=4" not in str(e):
                    msgs.append(f"pool exhaustion message: {e}")
        finally:
            graphs.append(s.end_capture())
        for _ in range(2):
            for g in graphs:
                g.launch(s)
        s.synchronize()
    ptrs = [r.data.ptr for r in results]
    if len(set(ptrs)) != len(ptrs):
        msgs.append(f"captured calls share storage: {ptrs}")
    for i, r in enumerate(results):
        msgs.append(case.check(r, inputs[i][1], f"captured call {i} after the replays"))
    op.close()
    _fail_if_any(comm, msgs, f"{case.label}: captured calls")


# ============================================================================ 3. poison
@pytest.mark.parametrize("name,algorithm", VARIANTS, ids=VARIANT_IDS)
def test_replays_after_a_timeout_are_poisoned(comm, seed, name, algorithm):
    import cupy

    W, rank = comm.world_size, comm.rank
    silent = W - 1
    T = 4
    case = OpCase(
        name,
        comm,
        max_tokens=8,
        algorithm=algorithm,
        timeout_ms=FAULT_TIMEOUT_MS,
        num_requests=2 if name == "lse_reduce" else 0,
    )
    op = case.op
    dev, exp = case.prepare(seed, T)
    msgs = []
    s = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(op.device):
        case.call(dev, stream=s)
        s.synchronize()
        s.begin_capture()
        try:
            res = case.call(dev, stream=s)
        finally:
            graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
        msgs.append(case.check(res, exp, "replay before the fault"))
        comm.barrier()
        if rank != silent:
            graph.launch(s)  # rank `silent` never replays: a timeout
            t0 = time.monotonic()
            while not op.poisoned and time.monotonic() - t0 < HANG_S:
                time.sleep(0.001)  # the mapped record, no synchronize
            if not op.poisoned:
                msgs.append("op.poisoned stayed False after the wait's deadline")
            try:
                op.check()
                msgs.append("check() did not raise after the timeout")
            except CollectiveTimeout as e:
                if e.peer != silent:
                    msgs.append(f"the timeout names peer {e.peer}, not {silent}: {e}")
            s.synchronize()
            for j in range(2):  # later replays: the poison pattern
                with s:
                    res.fill(0)
                graph.launch(s)
                s.synchronize()
                if not _all_ff(res):
                    host = to_host(res, case.dtype)
                    msgs.append(
                        f"replay {j} after the timeout left non-poison data: {host.ravel()[:4]}"
                    )
        comm.barrier()
    op.close()
    _fail_if_any(comm, msgs, f"{case.label}: replays after a timeout")


# ============================================================================ 4. no deadlock
_HOG = r"""
extern "C" __global__ void __launch_bounds__(1024) hog(unsigned long long ns, int* sink) {
  __shared__ int pad[12 * 1024];          // 48 KiB: two CTAs of 1024 threads fill an SM
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  int acc = 0;
  do {
    pad[threadIdx.x] = acc++;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
  if (acc == -1) sink[0] = pad[threadIdx.x ^ 1];
}
"""


@pytest.mark.parametrize(
    "workspaces,hog", [(2, False), (2, True), (4, True)], ids=["2ws", "2ws-hog", "4ws-hog"]
)
def test_overlapping_calls_in_any_order_complete(comm, seed, workspaces, hog):
    """Workspaces (q_gather and lse_reduce alternating) x 2 ubatches, one stream each, launched
    in a different order on every rank (reversed on rank 0) for several rounds; full-size
    grids; optionally a kernel holding most SMs for 0.3 s launched first."""
    import cupy

    W, rank = comm.world_size, comm.rank
    T = 64
    names = ["q_gather" if i % 2 == 0 else "lse_reduce" for i in range(workspaces)]
    cases = [OpCase(n, comm, max_tokens=T, num_ubatches=2, timeout_ms=20000.0) for n in names]
    for c in cases:
        if c.name == "q_gather":
            c.op.vectors_per_cta = 8  # a full-size grid (max_ctas CTAs) at the test geometry
    msgs = []
    with cupy.cuda.Device(cases[0].op.device):
        dev = cupy.cuda.Device()
        sms = dev.attributes["MultiProcessorCount"]
        hog_fn = cupy.RawKernel(_HOG, "hog") if hog else None
        sink = cupy.zeros(1, dtype=cupy.int32)
        streams = [[cupy.cuda.Stream(non_blocking=True) for _ in range(2)] for _ in cases]
        hog_stream = cupy.cuda.Stream(non_blocking=True)
        rng = np.random.default_rng([seed, rank])
        work = [(i, u) for i in range(len(cases)) for u in range(2)]
        for rnd in range(4):
            inputs = {(i, u): cases[i].prepare(seed + 100 * rnd + 10 * i + u, T) for i, u in work}
            outs = {(i, u): cases[i].poisoned_out(T) for i, u in work if u == 0}
            comm.barrier()
            if hog_fn is not None:
                hog_fn(
                    (2 * sms * 9 // 10,), (1024,), (np.uint64(300_000_000), sink), stream=hog_stream
                )
            order = list(work)
            if rank == 0:
                order.reverse()
            elif rnd:
                order = [order[k] for k in rng.permutation(len(order))]
            results = {}
            t0 = time.monotonic()
            for i, u in order:
                results[(i, u)] = cases[i].call(
                    inputs[(i, u)][0], ubatch=u, out=outs.get((i, u)), stream=streams[i][u]
                )
            for i, u in work:
                try:
                    streams[i][u].synchronize()
                    cases[i].op.check()
                except Exception as e:  # noqa: BLE001
                    msgs.append(f"round {rnd} workspace {i} ubatch {u}: {type(e).__name__}: {e}")
            hog_stream.synchronize()
            if time.monotonic() - t0 > HANG_S:
                msgs.append(f"round {rnd} took {time.monotonic() - t0:.1f} s")
            for i, u in work:
                msgs.append(
                    cases[i].check(
                        results[(i, u)],
                        inputs[(i, u)][1],
                        f"round {rnd} workspace {i} ubatch {u} order {order}",
                    )
                )
            if any(msgs):
                break
    comm.barrier()
    for c in cases:
        c.op.close()
    _fail_if_any(comm, msgs, f"{workspaces} workspaces x 2 ubatches at W={W}, hog={hog}")
