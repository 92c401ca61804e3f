"""Robustness of the collective constructors and of the per-call ``stream=`` check, on CPU.

1. A bad argument on ONE rank (``timeout_ms``, ``num_ubatches``, ``heap``, a missing GPU) makes
   every rank raise, in one agreed exchange: the failing rank its own error, the others
   :class:`PeerError` naming it; nobody is left waiting in a later collective (ranks are
   threads with real Communicators, tests/unit/_threadgroup.py: a rank that skipped or added a
   collective would break the rendezvous instead of passing).
2. Without CuPy every public constructor raises :class:`MissingDependency` naming the extra.
3. Without a GPU (this machine) they raise one clear :class:`DcpkitError`.
5. ``heap=`` is validated (type, open, same group, room) before anything is reserved.
6. ``stream=`` must be a CuPy stream, checked before anything is launched or counted.
7. :meth:`SymmetricHeap.view` bounds cannot be defeated by integer overflow.
8. Messages name the op's own arguments and variables; any real number type is a timeout.

DCPComm's share (argument validation, no silent fallback on user errors) is in
tests/unit/test_selection.py.
"""

from __future__ import annotations

import json
import math
import threading
import types

import numpy as np
import pytest

import dcpkit._cuda
from dcpkit._checks import MIN_TIMEOUT_MS
from dcpkit.comm import Communicator
from dcpkit.errors import ClosedError, DcpkitError, InvalidArgument, InvalidType, PeerError
from dcpkit.fallback import NcclKVGather, NcclLseReduce, NcclQGather, strided_copy
from dcpkit.ops import KVGather, LseReduce, QGather
from dcpkit.ops._lse_checks import validate_combine as _validate_combine
from dcpkit.ops._workspace import MAX_TIMEOUT_MS, check_timeout_ms, default_timeout_ms
from dcpkit.ops.lse_reduce import lse_combine
from dcpkit.symmetric import SymmetricHeap

from _threadgroup import run_group

W = 3
BAD_RANK = 1

# Constructors of every collective op, with good arguments for any world size (H_r = 2).
BUILDERS = {
    "LseReduce": lambda c, **kw: LseReduce(
        c, max_tokens=8, num_heads=2 * c.world_size, head_dim=64, dtype="float16", **kw
    ),
    "QGather": lambda c, **kw: QGather(
        c, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16", **kw
    ),
    "KVGather": lambda c, **kw: KVGather(c, max_tokens=8, row_dim=64, dtype="float16", **kw),
    "NcclQGather": lambda c, **kw: NcclQGather(
        c, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16", **kw
    ),
    "NcclKVGather": lambda c, **kw: NcclKVGather(
        c, max_tokens=8, row_dim=64, dtype="float16", **kw
    ),
    "NcclLseReduce": lambda c, **kw: NcclLseReduce(
        c, max_tokens=8, num_heads=2 * c.world_size, head_dim=64, dtype="float16", **kw
    ),
}
DIRECT = ("LseReduce", "QGather", "KVGather")
OP_NAME = {
    "LseReduce": "lse_reduce",
    "QGather": "q_gather",
    "KVGather": "kv_gather",
    "NcclQGather": "q_gather",
    "NcclKVGather": "kv_gather",
    "NcclLseReduce": "lse_reduce",
}

# (keyword, bad value, error class, message fragment) passed by rank 1 only.
BAD_ON_ONE_RANK = [
    (
        "timeout_ms",
        -5,
        InvalidArgument,
        "timeout_ms must lie in [0.001, 3600000] milliseconds (got -5)",
    ),
    (
        "timeout_ms",
        "soon",
        InvalidType,
        "timeout_ms must be a real number of milliseconds (got str 'soon')",
    ),
    (
        "timeout_ms",
        True,
        InvalidType,
        "timeout_ms must be a real number of milliseconds (got bool True)",
    ),
    ("timeout_ms", float("nan"), InvalidArgument, "timeout_ms must lie in"),
    ("num_ubatches", 0, InvalidArgument, "num_ubatches must be >= 1 (got 0)"),
    ("num_ubatches", 1.5, InvalidType, "num_ubatches must be an int"),
]


def _gpu_visible():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture
def gpu_everywhere(monkeypatch):
    """Every rank 'has' GPU 0 (the checks of the GPU itself are the subject of other tests)."""
    monkeypatch.setattr(dcpkit._cuda, "require_device", lambda what, device=None: 0)


@pytest.fixture
def nccl_everywhere(monkeypatch):
    import dcpkit.nccl.base as fb

    monkeypatch.setattr(fb, "nccl_module", lambda: object())


def _assert_one_rank_failed(res, exc, fragment, what=""):
    kind, err = res[BAD_RANK]
    assert kind == "err" and isinstance(err, exc), f"{what} rank {BAD_RANK}: {err!r}"
    assert fragment in str(err), f"{what}: {str(err)!r} lacks {fragment!r}"
    for r in range(len(res)):
        if r == BAD_RANK:
            continue
        kind, err = res[r]
        assert kind == "err" and isinstance(err, PeerError), f"{what} rank {r}: {err!r}"
        assert set(err.failed) == {BAD_RANK}, f"{what} rank {r}: {err}"
        assert fragment in err.failed[BAD_RANK], f"{what} rank {r}: {err}"


# ----------------------------------------------------------------------------- 1. one rank
@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize(
    "key,bad,exc,fragment", BAD_ON_ONE_RANK, ids=[f"{k}={v!r}" for k, v, _, _ in BAD_ON_ONE_RANK]
)
def test_bad_argument_on_one_rank_raises_on_every_rank(
    gpu_everywhere, nccl_everywhere, name, key, bad, exc, fragment
):
    build = BUILDERS[name]

    def body(comm):
        kw = {key: bad} if comm.rank == BAD_RANK else {}
        build(comm, **kw)

    res = run_group(W, body, timeout_s=10)  # asserts that no thread hangs
    _assert_one_rank_failed(res, exc, f"{OP_NAME[name]}: {fragment}", name)


@pytest.mark.parametrize("name", DIRECT)
@pytest.mark.parametrize("heap_of", ["str", "other group", "closed", "no room", "swapped rank"])
def test_bad_heap_on_one_rank_raises_on_every_rank_and_reserves_nothing(
    gpu_everywhere, name, heap_of
):
    heaps = [SymmetricHeap._unbacked(1 << 20, world_size=W, rank=r) for r in range(W)]
    bad = {
        "str": "x",
        "other group": SymmetricHeap._unbacked(1 << 20, world_size=W + 1, rank=BAD_RANK),
        "closed": SymmetricHeap._unbacked(1 << 20, world_size=W, rank=BAD_RANK),
        "no room": SymmetricHeap._unbacked(1024, world_size=W, rank=BAD_RANK),
        "swapped rank": heaps[0],
    }[heap_of]
    if heap_of == "closed":
        bad._closed = True
    exc, fragment = {
        "str": (InvalidType, "heap must be a dcpkit.SymmetricHeap (got str)"),
        "other group": (
            InvalidArgument,
            "heap must belong to the group of comm: heap "
            "world_size and rank must be 3 and 1 (got 4 and 1)",
        ),
        "closed": (ClosedError, "heap must be open (got a closed SymmetricHeap)"),
        "no room": (InvalidArgument, "heap free bytes must be >= "),
        "swapped rank": (
            InvalidArgument,
            "heap must belong to the group of comm: heap "
            "world_size and rank must be 3 and 1 (got 3 and 0)",
        ),
    }[heap_of]

    def body(comm):
        heap = bad if comm.rank == BAD_RANK else heaps[comm.rank]
        BUILDERS[name](comm, heap=heap)

    res = run_group(W, body, timeout_s=10)
    _assert_one_rank_failed(res, exc, f"{OP_NAME[name]}: {fragment}", name)
    for h in heaps + ([bad] if isinstance(bad, SymmetricHeap) else []):
        assert h.reserved_bytes == 0, "a failed constructor reserved bytes in a user heap"
        h._closed = True


@pytest.mark.parametrize("name", list(BUILDERS))
def test_missing_gpu_on_one_rank_raises_on_every_rank(monkeypatch, nccl_everywhere, name):
    """Rank 1 has no GPU: it raises the clear error, the others PeerError; none waits."""
    real = dcpkit._cuda.require_device
    tls = threading.local()

    def require_device(what, device=None):
        if getattr(tls, "rank", None) == BAD_RANK:
            return real(what, device)  # this machine has no GPU: the real error
        return 0

    monkeypatch.setattr(dcpkit._cuda, "require_device", require_device)

    def body(comm):
        tls.rank = comm.rank
        BUILDERS[name](comm)

    res = run_group(W, body, timeout_s=10)
    _assert_one_rank_failed(res, DcpkitError, f"{OP_NAME[name]}: no CUDA GPU is visible (", name)


class _Unhashable:
    """An argument whose comparison raises TypeError (not a DcpkitError)."""

    def __eq__(self, other):
        raise TypeError("cannot compare")

    __hash__ = None


@pytest.mark.parametrize("name", ["KVGather", "NcclKVGather"])
def test_odd_argument_raising_a_non_dcpkit_error_on_one_rank_is_shared(
    gpu_everywhere, nccl_everywhere, name
):
    def body(comm):
        BUILDERS[name](comm, **({"algorithm": _Unhashable()} if comm.rank == BAD_RANK else {}))

    res = run_group(W, body, timeout_s=10)
    _assert_one_rank_failed(
        res,
        InvalidArgument,
        "kv_gather: checking the constructor arguments failed (TypeError: cannot compare)",
        name,
    )


def test_dcpkit_timeout_variable_on_one_rank_raises_on_every_rank(gpu_everywhere, monkeypatch):
    """The default deadline is read inside the agreed check: a bad DCPKIT_TIMEOUT_MS raises
    there on every rank (here on every rank, since threads share the environment)."""
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "abc")
    res = run_group(W, lambda comm: BUILDERS["QGather"](comm), timeout_s=10)
    for r, (kind, err) in enumerate(res):
        assert kind == "err" and isinstance(err, InvalidArgument), f"rank {r}: {err!r}"
        assert (
            "q_gather: DCPKIT_TIMEOUT_MS must be a number of milliseconds in [0.001, 3600000] "
            "(got 'abc')" in str(err)
        )


def test_differing_timeouts_raise_config_mismatch_naming_the_rank(gpu_everywhere):
    def body(comm):
        BUILDERS["KVGather"](comm, timeout_ms=100 if comm.rank == 2 else 200)

    res = run_group(W, body, timeout_s=10)
    for r, (kind, err) in enumerate(res):
        assert kind == "err" and type(err).__name__ == "ConfigMismatch", f"rank {r}: {err!r}"
        assert err.ranks == [2] and "timeout_ms" in str(err), str(err)


# ----------------------------------------------------------------------------- 3. no GPU here
@pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible here: this tests the no-GPU error")
@pytest.mark.parametrize("name", list(BUILDERS) + ["SymmetricHeap", "NcclGroup", "DCPComm"])
def test_no_gpu_gives_one_clear_error_on_every_rank(nccl_everywhere, name):
    from dcpkit.fallback import NcclGroup
    from dcpkit.manager import DCPComm

    builders = dict(BUILDERS)
    builders["SymmetricHeap"] = lambda c: SymmetricHeap(c, 4096)
    builders["NcclGroup"] = NcclGroup
    builders["DCPComm"] = lambda c: DCPComm(
        c, max_tokens=8, num_heads=2 * c.world_size, q_head_dim=64, v_head_dim=64, dtype="float16"
    )
    what = OP_NAME.get(name, name)
    res = run_group(2, builders[name], timeout_s=10)
    for r, (kind, err) in enumerate(res):
        assert kind == "err" and type(err) is DcpkitError, f"{name} rank {r}: {err!r}"
        assert str(err).startswith(f"{what}: no CUDA GPU is visible ("), str(err)


def test_require_device_names_the_caller(monkeypatch):
    class Runtime:
        def __init__(self, count, error=None):
            self.count, self.error = count, error

        def getDeviceCount(self):
            if self.error:
                raise RuntimeError(self.error)
            return self.count

        def getDevice(self):
            return 0

    import types

    monkeypatch.setattr(dcpkit._cuda, "driver_library_loads", lambda: True)
    for rt, fragment in [
        (Runtime(0), "x: no CUDA GPU is visible (cudaGetDeviceCount: 0 devices)"),
        (
            Runtime(1, "cudaErrorNoDevice: no CUDA-capable device is detected"),
            "x: no CUDA GPU is visible (cudaGetDeviceCount: cudaErrorNoDevice",
        ),
    ]:
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))
        monkeypatch.setattr(dcpkit._cuda, "require_cupy", lambda fake=fake: fake)
        with pytest.raises(DcpkitError) as ei:
            dcpkit._cuda.require_device("x")
        assert str(ei.value).startswith(fragment), str(ei.value)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=Runtime(2)))
    monkeypatch.setattr(dcpkit._cuda, "require_cupy", lambda: fake)
    assert dcpkit._cuda.require_device("x") == 0
    assert dcpkit._cuda.require_device("x", 1) == 1
    with pytest.raises(InvalidArgument, match=r"x: device index must lie in \[0, 2\) \(got 2\)"):
        dcpkit._cuda.require_device("x", 2)


# ----------------------------------------------------------------------------- 2. no CuPy
_NO_CUPY = """
import importlib.abc, json, sys


class Blocker(importlib.abc.MetaPathFinder):
    # CuPy is not installed: every import of cupy, cupy_backends or a submodule fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
from dcpkit.comm import Communicator
from dcpkit.errors import MissingDependency
c = Communicator.single()
out = {}
def probe(name, fn):
    try:
        fn()
        out[name] = {"raised": None}
    except MissingDependency as e:
        out[name] = {"raised": "MissingDependency", "message": str(e), "extra": e.extra,
                     "what": e.what}
    except BaseException as e:
        out[name] = {"raised": type(e).__name__, "message": str(e)}
from dcpkit.ops import LseReduce, QGather, KVGather
from dcpkit.manager import DCPComm
from dcpkit.fallback import NcclGroup, NcclQGather, NcclKVGather, NcclLseReduce
from dcpkit.symmetric import SymmetricHeap
from dcpkit.ops.lse_reduce import lse_combine
from dcpkit import _cuda
probe("LseReduce", lambda: LseReduce(c, max_tokens=8, num_heads=8, head_dim=64,
                                     dtype="bfloat16"))
probe("QGather", lambda: QGather(c, max_tokens=8, heads_per_rank=8, head_dim=64,
                                 dtype="bfloat16"))
probe("KVGather", lambda: KVGather(c, max_tokens=8, row_dim=64, dtype="bfloat16"))
probe("DCPComm", lambda: DCPComm(c, max_tokens=8, num_heads=8, q_head_dim=64, v_head_dim=64,
                                 dtype="bfloat16"))
probe("NcclGroup", lambda: NcclGroup(c))
probe("NcclQGather", lambda: NcclQGather(c, max_tokens=8, heads_per_rank=8, head_dim=64,
                                         dtype="bfloat16"))
probe("NcclKVGather", lambda: NcclKVGather(c, max_tokens=8, row_dim=64, dtype="bfloat16"))
probe("NcclLseReduce", lambda: NcclLseReduce(c, max_tokens=8, num_heads=8, head_dim=64,
                                             dtype="bfloat16"))
probe("SymmetricHeap", lambda: SymmetricHeap(c, 4096))
probe("require_device", lambda: _cuda.require_device("x"))


class Dev:
    def __init__(self, shape, typestr="<f2", ptr=1 << 32):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "version": 3,
                                         "data": (ptr, False), "strides": None}
        self._dcpkit_device = 0


from dcpkit.fallback import strided_copy
probe("lse_combine", lambda: lse_combine(Dev((2, 4, 2, 64)), Dev((2, 4, 2), "<f4", 2 << 32),
                                         Dev((4, 2, 64), ptr=3 << 32)))
probe("strided_copy", lambda: strided_copy(Dev((4, 64)), Dev((4, 64), ptr=2 << 32)))
print(json.dumps(out))
"""


def test_missing_cupy_names_the_extra_everywhere(run_python):
    proc = run_python("from dcpkit._cuda import cuda_extra; print(cuda_extra())")
    assert proc.returncode == 0, proc.stderr
    extra = proc.stdout.strip()
    proc = run_python(_NO_CUPY)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, res in got.items():
        assert res["raised"] == "MissingDependency", f"{name}: {res}"
        assert res["what"] == "cupy" and res["extra"] == extra, f"{name}: {res}"
        assert f"pip install 'dcpkit[{extra}]'" in res["message"], f"{name}: {res}"


def test_argument_errors_come_before_the_missing_cupy(run_python):
    proc = run_python(
        _NO_CUPY.split("from dcpkit.comm")[0]
        + """
from dcpkit.comm import Communicator
from dcpkit.errors import InvalidArgument
from dcpkit.ops import QGather
try:
    QGather(Communicator.single(), max_tokens=0, heads_per_rank=8, head_dim=64,
            dtype="bfloat16")
except InvalidArgument as e:
    print("ok", e)
"""
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok q_gather: max_tokens must be >= 1"), proc.stdout


# ----------------------------------------------------------------------------- 5. heap=
def test_heap_rank_and_world_size_are_read_only():
    h = SymmetricHeap._unbacked(4096, world_size=4, rank=3)
    assert (h.rank, h.world_size) == (3, 4)
    with pytest.raises(AttributeError):
        h.rank = 0
    with pytest.raises(AttributeError):
        h.world_size = 1
    h._closed = True


@pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible here: this tests the no-GPU error")
def test_good_heap_without_gpu_reserves_nothing():
    """Every check passes but the GPU is missing: the error comes before the reservation."""
    h = SymmetricHeap._unbacked(1 << 20)
    for name in DIRECT:
        with pytest.raises(DcpkitError, match="no CUDA GPU is visible"):
            BUILDERS[name](Communicator.single(), heap=h)
        assert h.reserved_bytes == 0, name
    h._closed = True


def test_heap_with_exactly_enough_room_passes_the_checks(gpu_everywhere, monkeypatch):
    """The room check is exact (the region, aligned at 256 bytes after the last
    reservation); construction then goes on (here it stops at the first GPU step)."""
    probe = LseReduce.__new__(LseReduce)
    probe._closed = True
    probe._check_arguments(1, max_tokens=8, num_heads=2, head_dim=64, dtype="float16")
    region = probe._region
    h = SymmetricHeap._unbacked(region + 256)
    h.reserve(1)  # the next offset is 256
    reached = []

    def stop(self, heap, multicast):
        reached.append(heap.reserved_bytes)
        raise RuntimeError("stop before any GPU work")

    monkeypatch.setattr(LseReduce, "_init_region", stop)
    with pytest.raises(RuntimeError, match="stop before any GPU work"):
        BUILDERS["LseReduce"](Communicator.single(), heap=h)
    assert reached == [1]
    h2 = SymmetricHeap._unbacked(region + 255)
    h2.reserve(1)
    with pytest.raises(InvalidArgument, match=rf"heap free bytes must be >= {region}"):
        BUILDERS["LseReduce"](Communicator.single(), heap=h2)
    assert h2.reserved_bytes == 1
    h._closed = h2._closed = True


# ----------------------------------------------------------------------------- 6. stream=
class FakeArray:
    """A GPU array as far as dcpkit can tell (``__cuda_array_interface__``, device 0)."""

    def __init__(self, shape, dtype=np.float16, ptr=1 << 32, device=0):
        dt = np.dtype(dtype)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": dt.str,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }
        self._dcpkit_device = device


def _direct_state(ws, world_size=2, num_ubatches=2):
    ws.rank, ws.world_size, ws.device = 0, world_size, 0
    ws.num_ubatches = num_ubatches
    ws.timeout_ms = 5000.0
    ws._closed = False
    ws._debug = False
    ws._rec = np.zeros(8, dtype=np.uint32)
    ws._calls = [0] * num_ubatches
    ws._captured = [False] * num_ubatches
    ws._kernel = None
    # what the setup gives a call plan to pack (made-up values; nothing is launched here)
    ws._proto = [(0,) * 17] * num_ubatches
    ws._peer_data = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1 << 30))
    ws.multicast, ws.max_ctas = False, 8
    ws.heap, ws._base = types.SimpleNamespace(local_ptr=1 << 31, mc_ptr=0), 0
    return ws


def _q():
    ws = _direct_state(QGather.__new__(QGather))
    ws._check_arguments(2, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")
    ws.num_ubatches, ws._calls, ws._captured = 2, [0, 0], [False, False]
    return ws, (FakeArray((4, 2, 64)),)


def _kv():
    ws = _direct_state(KVGather.__new__(KVGather))
    ws._check_arguments(2, max_tokens=8, row_dim=64, dtype="float16")
    ws.num_ubatches, ws._calls, ws._captured = 2, [0, 0], [False, False]
    return ws, (FakeArray((4, 64)),)


def _lse():
    ws = LseReduce.__new__(LseReduce)
    ws._init_geometry(
        2,
        max_tokens=8,
        num_heads=4,
        head_dim=64,
        dtype="float16",
        lse_base=math.e,
        return_lse=False,
    )
    _direct_state(ws)
    ws._head_args = [(0,) * 21] * ws.num_ubatches
    ws._tail_args, ws._grids = (4, 2, 64), [(1, False)] * 9
    return ws, (FakeArray((4, 4, 64)), FakeArray((4, 4), np.float32))


@pytest.mark.parametrize("make", [_q, _kv, _lse], ids=["q_gather", "kv_gather", "lse_reduce"])
@pytest.mark.parametrize("stream", ["x", 7, object()])
def test_bad_stream_raises_before_anything_is_counted(make, stream):
    ws, args = make()
    with pytest.raises(InvalidType) as ei:
        ws(*args, stream=stream)
    assert str(ei.value) == (
        f"{ws.op_name}: stream must be a cupy.cuda.Stream (got {type(stream).__name__})"
    )
    assert ws._calls == [0, 0] and ws._captured == [False, False]
    # also an empty call (T == 0), which launches nothing
    empty = tuple(
        FakeArray(
            (0,) + a.__cuda_array_interface__["shape"][1:], a.__cuda_array_interface__["typestr"]
        )
        for a in args
    )
    with pytest.raises(InvalidType, match="stream must be a cupy.cuda.Stream"):
        ws(*empty, stream=stream)
    with pytest.raises(InvalidType, match="stream must be a cupy.cuda.Stream"):
        ws.synchronize(stream)
    ws._closed = True


@pytest.mark.filterwarnings("ignore:ExternalStream is deprecated:DeprecationWarning")
def test_cupy_streams_pass_the_check():
    cupy = pytest.importorskip("cupy")
    ws, _ = _q()
    for s in (cupy.cuda.Stream.null, cupy.cuda.ExternalStream(0)):
        assert ws.get_stream(s) is s
    assert dcpkit._cuda.check_stream(None, "x") is None
    ws._closed = True


def test_nccl_op_bad_stream_raises_before_anything_is_counted():
    cupy = pytest.importorskip("cupy")
    ws = NcclQGather.__new__(NcclQGather)
    ws._check_arguments(2, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")
    ws.device, ws._closed, ws._cupy, ws._debug = 0, False, cupy, False
    ws._calls, ws._captured = [0], [False]
    with pytest.raises(
        InvalidType,
        match=r"^q_gather: stream must be a cupy.cuda.Stream "
        r"\(got str\)$",
    ):
        ws(FakeArray((4, 2, 64)), stream="x")
    assert ws._calls == [0]
    assert ws.get_stream(cupy.cuda.Stream.null) is cupy.cuda.Stream.null
    ws._closed = True


def test_local_functions_check_the_stream():
    args = dict(
        src_out=FakeArray((2, 4, 2, 64)),
        src_lse=FakeArray((2, 4, 2), np.float32, ptr=2 << 32),
        out=FakeArray((4, 2, 64), ptr=3 << 32),
    )
    with pytest.raises(
        InvalidType,
        match=r"^lse_combine: stream must be a cupy.cuda.Stream "
        r"\(got str\)$",
    ):
        lse_combine(stream="x", **args)
    with pytest.raises(InvalidType, match=r"^strided_copy: stream must be a cupy.cuda.Stream"):
        strided_copy(FakeArray((4, 64)), FakeArray((4, 64), ptr=2 << 32), stream="x")


# ----------------------------------------------------------------------------- 7. view bounds
@pytest.mark.parametrize(
    "shape,exc,fragment",
    [
        (
            (2**32, 2**32),
            InvalidArgument,
            f"offset + view bytes must be <= nbytes 1048576 (got 0 + {2**64} = {2**64})",
        ),
        ((2**63,), InvalidArgument, f"(got 0 + {2**63} = {2**63})"),
        ((2**62, 4, 0), None, None),  # zero bytes: fits
        ((2**31, 2**31, 4), InvalidArgument, "offset + view bytes must be <= nbytes"),
        ((-1, 4), InvalidArgument, "shape entry must be >= 0 (got -1)"),
        ((4, 2.0), InvalidType, "shape entry must be an int (got float 2.0)"),
        ((np.int64(2**40), np.int64(2**40)), InvalidArgument, "offset + view bytes"),
    ],
)
def test_view_bounds_use_exact_integers(shape, exc, fragment):
    h = SymmetricHeap._unbacked(1 << 20)
    if exc is None:
        pytest.importorskip("cupy")
        v = h.view(0, shape, np.uint8)
        assert v.shape == shape and v.nbytes == 0
    else:
        with pytest.raises(exc) as ei:
            h.view(0, shape, np.uint8)
        assert fragment in str(ei.value), str(ei.value)
    with pytest.raises(InvalidArgument, match="offset \\+ view bytes"):
        h.view(16, (2**61,), np.float64)  # 2**64 bytes: overflows int64 to 0
    h._closed = True


# ----------------------------------------------------------------------------- 8. messages
def test_timeout_accepts_any_real_number_and_names_the_variable(monkeypatch):
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)
    assert check_timeout_ms(None, "op") == default_timeout_ms() == 5000.0
    for v in (np.float32(2.5), np.float64(2.5), np.int64(3), 7, 2.5):
        assert check_timeout_ms(v, "op") == float(v)
    assert check_timeout_ms(MAX_TIMEOUT_MS, "op") == MAX_TIMEOUT_MS
    assert check_timeout_ms(MIN_TIMEOUT_MS, "op") == MIN_TIMEOUT_MS
    for v, exc in (
        (1e-300, InvalidArgument),  # positive, but 0 ns on the device: every wait would expire
        (np.float32(0.0009), InvalidArgument),
        (True, InvalidType),
        (np.bool_(True), InvalidType),
        ("5", InvalidType),
        (None.__class__, InvalidType),
        (0, InvalidArgument),
        (-5, InvalidArgument),
        (math.inf, InvalidArgument),
        (MAX_TIMEOUT_MS + 1, InvalidArgument),
    ):
        with pytest.raises(exc, match=r"^op: timeout_ms must"):
            check_timeout_ms(v, "op")
    for raw in ("-5", "abc", "0", "nan", "1e12", "1e-300", "0.0005", "1_000", "2_5.0"):
        monkeypatch.setenv("DCPKIT_TIMEOUT_MS", raw)
        with pytest.raises(InvalidArgument) as ei:
            check_timeout_ms(None, "kv_gather")
        assert str(ei.value) == (
            "kv_gather: DCPKIT_TIMEOUT_MS must be a number of "
            f"milliseconds in [0.001, 3600000] (got {raw!r})"
        )
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "250")
    assert check_timeout_ms(None, "op") == 250.0


def test_timeout_variable_ignores_spaces_around_it_and_blank_is_unset(monkeypatch):
    """As README says: spaces around the number are ignored, an empty or blank value counts as
    unset; only the digit separators Python alone reads (``1_000``) are refused (above)."""
    for raw, ms in (
        (" 100 ", 100.0),
        ("\t250\n", 250.0),
        ("1e3", 1000.0),
        ("", 5000.0),
        ("  ", 5000.0),
    ):
        monkeypatch.setenv("DCPKIT_TIMEOUT_MS", raw)
        assert default_timeout_ms() == ms, raw


@pytest.mark.parametrize("name", list(BUILDERS))
def test_float32_timeout_is_accepted_by_every_op(
    gpu_everywhere, nccl_everywhere, name, monkeypatch
):
    """np.float32 passes the argument checks; construction then goes on to the GPU part."""
    import dcpkit.nccl.base as fb
    import dcpkit.ops._workspace as wsmod

    seen = []

    def stop(self, *a, **k):
        seen.append(self.timeout_ms)
        raise RuntimeError("stop before any GPU work")

    monkeypatch.setattr(wsmod.OpWorkspace, "_init_region", stop)
    monkeypatch.setattr(fb.NcclOp, "_setup_nccl", stop)
    with pytest.raises(RuntimeError, match="stop before any GPU work"):
        BUILDERS[name](Communicator.single(), timeout_ms=np.float32(250))
    assert seen == [250.0]


@pytest.mark.parametrize(
    "build,fragment",
    [
        (
            lambda c: LseReduce(c, max_tokens=8, num_heads=8, head_dim=2**40, dtype="bfloat16"),
            "lse_reduce: head_dim must be <= 2**31 - 1 (got 1099511627776)",
        ),
        (
            lambda c: LseReduce(
                c, max_tokens=8, num_heads=8, head_dim=64, dtype="bfloat16", num_ubatches=2**30
            ),
            "lse_reduce: num_ubatches * symmetric bytes per ubatch + graph_outputs * bytes per graph output must be <= 2**40 bytes "
            "(got 1073741824 * ",
        ),
        (
            lambda c: QGather(
                c,
                max_tokens=2**16,
                heads_per_rank=64,
                head_dim=2**11,
                dtype="uint8",
                num_ubatches=2**7,
            ),
            "lower max_tokens, heads_per_rank, head_dim, padded_num_heads, num_ubatches or "
            "graph_outputs",
        ),
        (
            lambda c: KVGather(
                c, max_tokens=2**20, row_dim=2**14, dtype="uint8", num_ubatches=2**12
            ),
            "kv_gather: num_ubatches * symmetric bytes per ubatch + graph_outputs * bytes per graph output must be <= 2**40",
        ),
        # a huge pool of graph outputs, in the symmetric region (push) or in device memory
        (
            lambda c: QGather(
                c,
                max_tokens=8,
                heads_per_rank=4,
                head_dim=64,
                dtype="bfloat16",
                graph_outputs=10**9,
            ),
            "(got 1 * 12544 + 1000000000 * 4096 = 4096000012544): lower max_tokens, "
            "heads_per_rank, head_dim, padded_num_heads, num_ubatches or graph_outputs",
        ),
        (
            lambda c: KVGather(
                c, max_tokens=8, row_dim=64, dtype="bfloat16", algorithm="pull", graph_outputs=2**64
            ),
            "kv_gather: num_ubatches * symmetric bytes per ubatch + graph_outputs * bytes per graph output must be <= 2**40 bytes",
        ),
        (
            lambda c: LseReduce(
                c, max_tokens=8, num_heads=8, head_dim=64, dtype="bfloat16", graph_outputs=2**64
            ),
            "or graph_outputs",
        ),
        (
            lambda c: NcclQGather(
                c,
                max_tokens=2**16,
                heads_per_rank=64,
                head_dim=2**11,
                dtype="uint8",
                num_ubatches=2**7,
            ),
            "q_gather: num_ubatches * buffer bytes per ubatch must be <= 2**40",
        ),
        (
            lambda c: NcclLseReduce(c, max_tokens=8, num_heads=8, head_dim=2**40, dtype="bfloat16"),
            "lse_reduce: head_dim must be <= 2**31 - 1",
        ),
        (
            lambda c: NcclKVGather(c, max_tokens=2**31, row_dim=8, dtype="uint8"),
            "kv_gather: max_tokens must be <= 2**31 - 1",
        ),
    ],
)
def test_absurd_sizes_name_the_op_arguments(build, fragment):
    with pytest.raises(InvalidArgument) as ei:
        build(Communicator.single())
    assert fragment in str(ei.value), str(ei.value)
    assert "SymmetricHeap" not in str(ei.value)


def test_workspace_larger_than_the_gpu_names_the_op_arguments():
    import types

    ws = LseReduce.__new__(LseReduce)
    ws._closed = True
    ws._check_arguments(1, max_tokens=8, num_heads=8, head_dim=2**29, dtype="bfloat16")
    props = {"totalGlobalMem": 80 << 30}
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceProperties=lambda d: props)
        )
    )
    with pytest.raises(InvalidArgument) as ei:
        ws._check_fits(fake, 3)
    assert str(ei.value).startswith(
        "lse_reduce: num_ubatches * symmetric bytes per ubatch + graph_outputs * bytes per graph output must "
        f"be <= the memory of GPU 3, {80 << 30} bytes (got 1 * "
    )
    assert "lower max_tokens, num_heads, head_dim, num_ubatches or graph_outputs" in str(ei.value)
    props["totalGlobalMem"] = 1 << 40
    ws._check_fits(fake, 3)  # fits


def test_lse_combine_device_error_names_src_out_not_a_workspace():
    args = dict(
        src_out=FakeArray((2, 4, 2, 64)),
        src_lse=FakeArray((2, 4, 2), np.float32),
        out=FakeArray((4, 2, 64), device=1),
        out_lse=None,
    )
    with pytest.raises(InvalidArgument) as ei:
        _validate_combine(**args)
    assert str(ei.value) == "lse_combine: out device must be src_out's GPU 0 (got GPU 1)"
    args.update(out=FakeArray((4, 2, 64)), src_lse=FakeArray((2, 4, 2), np.float32, device=2))
    with pytest.raises(InvalidArgument, match="src_lse device must be src_out's GPU 0 "):
        _validate_combine(**args)
