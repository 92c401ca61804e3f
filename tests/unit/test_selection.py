"""DCPComm's path selection, on CPU: the pure functions (select_path and the blockers) and a
DCPComm whose GPU parts (topology probe, op construction, streams) are replaced by fakes, so
that policies, capacity, unsupported dtypes / layouts, multi-host groups, policy agreement,
counters and describe() are checked without a GPU."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest

from dcpkit.comm import Communicator
from dcpkit.errors import (
    ClosedError,
    CompileError,
    ConfigMismatch,
    CudaError,
    DcpkitError,
    InvalidArgument,
    InvalidType,
    MissingDependency,
    PeerError,
)
from dcpkit.manager import (
    PATH_DIRECT_MULTICAST,
    PATH_DIRECT_UNICAST,
    PATH_NCCL,
    POLICIES,
    DCPComm,
    direct_call_blocker,
    direct_geometry_blocker,
    select_path,
    shared_gpu_blocker,
    topology_blocker,
)

from _threadgroup import run_group


# ----------------------------------------------------------------------------- select_path
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("direct_ok", [True, False])
@pytest.mark.parametrize("nccl_ok", [True, False])
def test_select_path_table(policy, direct_ok, nccl_ok):
    """Every policy against every availability: the path, or an error naming the reason."""
    kw = dict(
        direct_path=PATH_DIRECT_UNICAST,
        direct_blocker=None if direct_ok else "T must be <= max_tokens 8 (got 9)",
        nccl_blocker=None if nccl_ok else "MissingDependency: NCCL ... dcpkit[cuda12]",
    )
    if policy == "direct":
        expect = PATH_DIRECT_UNICAST if direct_ok else "error"
    elif policy == "nccl":
        expect = PATH_NCCL if nccl_ok else "error"
    else:
        expect = PATH_DIRECT_UNICAST if direct_ok else (PATH_NCCL if nccl_ok else "error")
    if expect == "error":
        with pytest.raises(InvalidArgument) as ei:
            select_path("DCPComm.q_gather", policy, **kw)
        msg = str(ei.value)
        assert msg.startswith("DCPComm.q_gather: ")
        if policy == "direct":
            assert "policy 'direct' cannot serve this call: T must be <= max_tokens 8" in msg
        else:
            assert "NCCL is unavailable" in msg and "dcpkit[cuda12]" in msg
    else:
        assert select_path("DCPComm.q_gather", policy, **kw) == expect


def test_select_path_multicast_and_missing_direct_op():
    assert (
        select_path(
            "op", "auto", direct_path=PATH_DIRECT_MULTICAST, direct_blocker=None, nccl_blocker=None
        )
        == PATH_DIRECT_MULTICAST
    )
    # no direct op at all and no reason given: never a silent direct path
    assert (
        select_path("op", "auto", direct_path=None, direct_blocker=None, nccl_blocker=None)
        == PATH_NCCL
    )
    with pytest.raises(InvalidArgument, match="no direct op was built"):
        select_path("op", "direct", direct_path=None, direct_blocker=None, nccl_blocker=None)
    with pytest.raises(
        InvalidArgument,
        match=r"policy must be one of \['auto', 'direct', "
        r"'nccl'\] \(got 'fast'\)",
    ):
        select_path(
            "op", "fast", direct_path=PATH_DIRECT_UNICAST, direct_blocker=None, nccl_blocker=None
        )


# ----------------------------------------------------------------------------- blockers
@pytest.mark.parametrize("op", ["q_gather", "kv_gather", "lse_reduce"])
def test_call_blocker_capacity(op):
    assert direct_call_blocker(op, tokens=1, max_tokens=16) is None
    assert direct_call_blocker(op, tokens=16, max_tokens=16) is None  # at capacity
    why = direct_call_blocker(op, tokens=17, max_tokens=16)  # past capacity
    assert why == "T must be <= max_tokens 16, the direct op's capacity (got 17)"


@pytest.mark.parametrize(
    "lse_dtype,ok",
    [
        ("bfloat16", True),
        (np.float16, True),
        (np.float32, True),
        (np.float64, False),
        (np.int32, False),
    ],
)
def test_call_blocker_lse_dtype(lse_dtype, ok):
    why = direct_call_blocker("lse_reduce", tokens=1, max_tokens=4, lse_dtype=lse_dtype)
    if ok:
        assert why is None
    else:
        assert why.startswith("lse_partial dtype must be one of [bfloat16, float16, float32]")
    # the gathers ignore lse dtypes
    assert direct_call_blocker("q_gather", tokens=1, max_tokens=4, lse_dtype=np.float64) is None


def test_geometry_blocker():
    assert direct_geometry_blocker("q_gather", dtype="bfloat16", row_bytes=8 * 576 * 2) is None
    assert direct_geometry_blocker("kv_gather", dtype="float8_e4m3fn", row_bytes=576) is None
    why = direct_geometry_blocker("kv_gather", dtype="bfloat16", row_bytes=2 * 65)
    assert why == (
        "kv_row_dim * itemsize must be a multiple of 16 bytes for the direct "
        "kernel's 16-byte stores (got 130)"
    )
    why = direct_geometry_blocker("q_gather", dtype=np.float32, row_bytes=12)
    assert why.startswith("heads_per_rank * q_head_dim * itemsize must be a multiple of 16")
    why = direct_geometry_blocker("lse_reduce", dtype=np.float64, row_bytes=512 * 8)
    assert why == (
        "dtype must be one of [bfloat16, float16, float32] for the direct kernel (got float64)"
    )


def test_topology_blocker():
    assert topology_blocker(hosts=["a/1"] * 4) is None
    why = topology_blocker(hosts=["a/1", "a/1", "b/2", "b/2"])
    assert why == (
        "the group spans 2 hosts (ranks [0, 1]; ranks [2, 3]): the direct ops need "
        "every rank in one NVLink domain"
    )
    why = topology_blocker(hosts=["a"] * 3, p2p_missing=[(0, 2), (0, 2), (1, 2)])
    assert why == "no GPU peer access between ranks 0-2, 1-2"


# ----------------------------------------------------------------------------- fakes
class FakeArray:
    """A 'GPU array' that dcpkit's array_info understands (no CuPy needed)."""

    def __init__(self, shape, dtype=np.float16, strides=None, ptr=1 << 20):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        if strides is None:
            acc, st = self.dtype.itemsize, []
            for n in reversed(self.shape):
                st.append(acc)
                acc *= n
            strides = tuple(reversed(st))
        self.strides = tuple(strides)
        self._dcpkit_device = 0
        self.__cuda_array_interface__ = {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "strides": self.strides,
            "data": (ptr, False),
            "version": 3,
        }


class FakeStream:
    def __init__(self, capturing=False):
        self.capturing = capturing

    def is_capturing(self):
        return self.capturing


class FakeOp:
    """Stands in for a direct or NCCL op: records every call, returns a marker."""

    def __init__(self, name, kind, transport="unicast", return_lse=True):
        self.op_name = name
        self.kind = kind
        self.transport = transport
        self.return_lse = return_lse  # lse_reduce: like the real ops, a pair only when asked
        self.calls = []
        self.closed = False
        self.device = 0

    def __call__(self, *args, **kw):
        self.calls.append((args, kw))
        out = kw.get("out")
        res = out if out is not None else ("result", self.kind, self.op_name)
        if self.op_name == "lse_reduce":
            lse = kw.get("out_lse")
            if lse is None and not self.return_lse:
                return res
            return res, (lse if lse is not None else ("lse", self.kind))
        return res

    def _call_keyed(self, key, x, ubatch, out, stream, _flag):
        """The gathers' keyed entry DCPComm calls on a route that takes every array in place."""
        return self(x, ubatch=ubatch, out=out, stream=stream)

    def _lse_keyed(self, key, arrays, ubatch, stream):
        """lse_reduce's keyed entry, likewise."""
        x, lse, seq, qsl, out, out_lse = arrays
        return self(
            x,
            lse,
            seq_lens=seq,
            query_start_loc=qsl,
            ubatch=ubatch,
            out=out,
            out_lse=out_lse,
            stream=stream,
        )

    def close(self):
        self.closed = True

    def synchronize(self, stream=None):
        pass

    def accepts_layout(self, **arrays):
        """The fake's layout rule: 16-byte aligned data pointers, and token strides of 3-D
        arrays."""
        return all(
            a.ptr % 16 == 0 and (len(a.shape) < 3 or a.shape[0] <= 1 or a.strides[0] % 16 == 0)
            for a in arrays.values()
        )


def fake_comm(world_size=2, rank=0, *, peer_policy=None, peer_host=None):
    """A Communicator whose peers echo this rank's objects, except the policy (peer_policy)
    and the host identity (peer_host) where given."""

    def allgather(obj):
        out = []
        for r in range(world_size):
            v = obj
            if r != rank:
                if isinstance(obj, str) and peer_host is not None:
                    v = peer_host
                elif (
                    peer_policy is not None
                    and isinstance(obj, tuple)
                    and len(obj) == 2
                    and obj[1] in POLICIES
                ):
                    v = (None, peer_policy(r))
            out.append(v)
        return out

    return Communicator(
        rank,
        world_size,
        allgather=allgather,
        broadcast=lambda o, root: o,
        barrier=lambda: None,
        backend="fake",
    )


class FakeDCPComm(DCPComm):
    """DCPComm with the GPU parts replaced: fake ops, a fake topology probe and streams."""

    transport = "unicast"
    nccl_error = None
    direct_error = None

    def _current_device(self):
        return 0

    def _pci_bus_id(self):
        return None  # unknown: never counted as shared (the echo comm would repeat it)

    def _probe_topology(self):
        return topology_blocker(hosts=self.comm.hosts)

    def _build_heap(self, nbytes):
        self.heap_nbytes = nbytes
        heap = FakeOp("heap", "direct")
        heap.nbytes = nbytes
        return heap

    def _build_direct(self, op):
        if self.direct_error is not None:
            raise self.direct_error
        return FakeOp(op, "direct", self.transport, return_lse=self.return_lse)

    def _build_nccl_group(self):
        if self.nccl_error is not None:
            raise self.nccl_error
        return FakeOp("group", "nccl")

    def _build_nccl(self, op, group):
        return FakeOp(op, "nccl")

    def _load_copy_kernel(self):
        pass

    def _stream(self, stream):
        return stream if stream is not None else FakeStream()


GEOM = dict(max_tokens=8, num_heads=4, q_head_dim=64, v_head_dim=64, kv_row_dim=64, dtype="float16")


def q_input(T, W=2):
    return FakeArray((T, 4 // W, 64))


def lse_inputs(T, lse_dtype=np.float32):
    return FakeArray((T, 4, 64)), FakeArray((T, 4), lse_dtype)


# ----------------------------------------------------------------------------- DCPComm
def test_auto_direct_at_capacity_nccl_past_it():
    dcp = FakeDCPComm(fake_comm(), **GEOM)
    assert dcp.q_gather(q_input(8)) == ("result", "direct", "q_gather")
    assert dcp.last_path == PATH_DIRECT_UNICAST
    assert dcp.q_gather(q_input(9)) == ("result", "nccl", "q_gather")
    assert dcp.last_path == PATH_NCCL
    assert dcp.kv_gather(FakeArray((8, 64))) == ("result", "direct", "kv_gather")
    assert dcp.kv_gather(FakeArray((9, 64))) == ("result", "nccl", "kv_gather")
    out = dcp.lse_reduce(*lse_inputs(8))
    assert out == ("result", "direct", "lse_reduce")  # no lse unless asked
    out = dcp.lse_reduce(*lse_inputs(9))
    assert out == ("result", "nccl", "lse_reduce")
    assert dcp.counters == {
        "q_gather": {PATH_DIRECT_UNICAST: 1, PATH_DIRECT_MULTICAST: 0, PATH_NCCL: 1},
        "lse_reduce": {PATH_DIRECT_UNICAST: 1, PATH_DIRECT_MULTICAST: 0, PATH_NCCL: 1},
        "kv_gather": {PATH_DIRECT_UNICAST: 1, PATH_DIRECT_MULTICAST: 0, PATH_NCCL: 1},
    }
    text = dcp.describe()
    assert "policy 'auto'" in text and "one NVLink domain" in text
    assert "q_gather: direct direct-unicast (T <= 8); nccl" in text
    assert "direct-unicast=1, nccl=1" in text
    built = [
        o
        for o in list(dcp.direct_ops.values())
        + list(dcp.nccl_ops.values())
        + [dcp.nccl_group, dcp.heap]
        if o is not None
    ]
    assert len(built) == 8  # 3 direct, 3 NCCL ops, the NCCL group, the one heap
    dcp.close()
    assert all(o.closed for o in built)
    assert dcp.direct_ops == {"q_gather": None, "lse_reduce": None, "kv_gather": None}
    with pytest.raises(ClosedError, match="DCPComm.q_gather: DCPComm is closed"):
        dcp.q_gather(q_input(1))
    dcp.close()  # idempotent


def test_policy_direct_raises_past_capacity_never_falls_back():
    dcp = FakeDCPComm(fake_comm(), policy="direct", **GEOM)
    assert dcp.nccl_ops["q_gather"] is None and dcp.nccl_reason == "policy is 'direct'"
    assert dcp.q_gather(q_input(8))[1] == "direct"
    with pytest.raises(InvalidArgument) as ei:
        dcp.q_gather(q_input(9))
    assert str(ei.value) == (
        "DCPComm.q_gather: policy 'direct' cannot serve this call: T must "
        "be <= max_tokens 8, the direct op's capacity (got 9) "
        "(policy='auto' falls back to NCCL)"
    )
    with pytest.raises(InvalidArgument, match="lse_partial dtype must be one of"):
        dcp.lse_reduce(*lse_inputs(2, np.float64))
    assert dcp.counters["q_gather"] == {
        PATH_DIRECT_UNICAST: 1,
        PATH_DIRECT_MULTICAST: 0,
        PATH_NCCL: 0,
    }
    assert dcp.last_path == PATH_DIRECT_UNICAST
    dcp.close()


def test_policy_nccl_always_nccl():
    dcp = FakeDCPComm(fake_comm(), policy="nccl", **GEOM)
    assert dcp.direct_ops["q_gather"] is None
    assert dcp.direct_reason["q_gather"] == "policy is 'nccl'"
    for T in (1, 8, 9):
        assert dcp.q_gather(q_input(T))[1] == "nccl"
        assert dcp.last_path == PATH_NCCL
    dcp.close()


def test_unsupported_lse_dtype_goes_to_nccl_in_auto():
    dcp = FakeDCPComm(fake_comm(), **GEOM)
    assert dcp.lse_reduce(*lse_inputs(2, np.float64))[1] == "nccl"
    assert dcp.lse_reduce(*lse_inputs(2, np.float16))[1] == "direct"
    dcp.close()


def test_unsupported_geometry_goes_to_nccl_or_raises_with_direct_policy():
    geom = dict(GEOM, kv_row_dim=65)  # 130 bytes per row
    dcp = FakeDCPComm(fake_comm(), **geom)
    assert dcp.direct_ops["kv_gather"] is None
    assert dcp.direct_reason["kv_gather"].startswith("kv_row_dim * itemsize must be a multiple")
    assert dcp.kv_gather(FakeArray((2, 65)))[1] == "nccl"
    assert dcp.q_gather(q_input(2))[1] == "direct"
    assert "kv_gather: direct none: kv_row_dim * itemsize" in dcp.describe()
    dcp.close()
    with pytest.raises(
        InvalidArgument,
        match="policy 'direct' cannot serve kv_gather: kv_row_dim \\* itemsize must be a multiple",
    ):
        FakeDCPComm(fake_comm(), policy="direct", **geom)


def test_multi_host_group_uses_nccl_and_refuses_direct_policy():
    comm = fake_comm(world_size=2, peer_host="other-host/boot")
    dcp = FakeDCPComm(comm, **GEOM)
    assert "spans 2 hosts" in dcp.topology_reason
    for T in (1, 8):
        assert dcp.q_gather(q_input(T))[1] == "nccl"
        assert dcp.lse_reduce(*lse_inputs(T))[1] == "nccl"
    assert "spans 2 hosts" in dcp.describe()
    dcp.close()
    with pytest.raises(
        InvalidArgument, match="policy 'direct' cannot serve q_gather: the group spans 2 hosts"
    ):
        FakeDCPComm(fake_comm(world_size=2, peer_host="other-host/boot"), policy="direct", **GEOM)


def test_multicast_path_name():
    class Mc(FakeDCPComm):
        transport = "multicast"

    dcp = Mc(fake_comm(), **GEOM)
    dcp.q_gather(q_input(1))
    assert dcp.last_path == PATH_DIRECT_MULTICAST
    dcp.close()


def test_direct_construction_failure_falls_back_in_auto_only():
    class Broken(FakeDCPComm):
        direct_error = PeerError("heap setup", {1: "CudaError: cuMemCreate failed"})

    dcp = Broken(fake_comm(), **GEOM)
    assert dcp.direct_reason["q_gather"].startswith("building the direct op failed")
    assert dcp.q_gather(q_input(1))[1] == "nccl"
    dcp.close()
    with pytest.raises(PeerError, match="heap setup"):
        Broken(fake_comm(), policy="direct", **GEOM)


def test_nccl_missing():
    missing = MissingDependency("NCCL for cupy.cuda.nccl (libnccl.so.2)", "cuda12")

    class NoNccl(FakeDCPComm):
        nccl_error = missing

    # auto: the direct path still serves what it can; past capacity the error names the extra
    with pytest.warns(
        RuntimeWarning,
        match="DCPComm: NCCL is unavailable, the direct ops "
        "serve every call they can: .*MissingDependency",
    ):
        dcp = NoNccl(fake_comm(), **GEOM)
    assert dcp.q_gather(q_input(1))[1] == "direct"
    with pytest.raises(InvalidArgument) as ei:
        dcp.q_gather(q_input(9))
    assert "NCCL is unavailable" in str(ei.value) and "pip install 'dcpkit[cuda12]'" in str(
        ei.value
    )
    assert (
        "nccl: unavailable: building the NCCL group and ops failed on every rank: "
        "MissingDependency" in dcp.describe()
    )
    dcp.close()
    # nccl policy: the construction itself raises MissingDependency
    with pytest.raises(MissingDependency, match=r"dcpkit\[cuda12\]"):
        NoNccl(fake_comm(), policy="nccl", **GEOM)


def test_policy_mismatch_names_the_ranks():
    comm = fake_comm(world_size=4, rank=0, peer_policy=lambda r: "nccl" if r == 2 else "auto")
    with pytest.raises(ConfigMismatch) as ei:
        FakeDCPComm(comm, policy="auto", **GEOM)
    assert ei.value.ranks == [2]
    assert ei.value.what == "DCPComm: policy"
    assert "rank 2: 'nccl'" in str(ei.value)


def test_bad_policy_and_geometry():
    with pytest.raises(
        InvalidArgument,
        match=r"DCPComm: policy must be one of \['auto', "
        r"'direct', 'nccl'\] \(got 'fastest'\)",
    ):
        FakeDCPComm(fake_comm(), policy="fastest", **GEOM)
    with pytest.raises(
        InvalidArgument,
        match="num_heads must be a multiple of world_size 2 "
        r"\(got 5\)",
    ):
        FakeDCPComm(fake_comm(), **dict(GEOM, num_heads=5))
    with pytest.raises(InvalidArgument, match="lse_base must be math.e or 2"):
        FakeDCPComm(fake_comm(), lse_base=10.0, **GEOM)
    with pytest.raises(InvalidArgument, match="nccl_lse_algorithm must be one of"):
        FakeDCPComm(fake_comm(), nccl_lse_algorithm="allgather_all_reduce", **GEOM)


def test_kv_gather_needs_kv_row_dim():
    dcp = FakeDCPComm(fake_comm(), **dict(GEOM, kv_row_dim=None))
    assert dcp.ops == ("q_gather", "lse_reduce")
    with pytest.raises(InvalidArgument, match="kv_row_dim must be given at construction"):
        dcp.kv_gather(FakeArray((1, 64)))
    assert "kv_gather: not built" in dcp.describe()
    dcp.close()


def test_return_lse_and_out_lse():
    dcp = FakeDCPComm(fake_comm(), return_lse=True, **GEOM)
    res, lse = dcp.lse_reduce(*lse_inputs(2))
    assert res[1] == "direct" and lse == ("lse", "direct")
    dcp.close()
    dcp = FakeDCPComm(fake_comm(), **GEOM)
    out = FakeArray((2, 2, 64), ptr=2 << 20)
    out_lse = FakeArray((2, 2), np.float32, ptr=3 << 20)
    res, lse = dcp.lse_reduce(*lse_inputs(2), out=out, out_lse=out_lse)
    assert res is out and lse is out_lse
    # the direct op always gets the caller's aligned, contiguous destinations
    args, kw = dcp.direct_ops["lse_reduce"].calls[-1]
    assert kw["out"] is out and kw["out_lse"] is out_lse
    dcp.close()


def test_layout_decisions_do_not_change_the_path():
    """A misaligned input (which may differ per rank) never changes the path; under capture
    the copy that would fix it is refused with a clear message."""
    dcp = FakeDCPComm(fake_comm(), **GEOM)
    misaligned = FakeArray((2, 2, 64), ptr=(1 << 20) + 2)
    with pytest.raises(InvalidArgument) as ei:
        dcp.q_gather(misaligned, stream=FakeStream(capturing=True))
    assert str(ei.value).startswith(
        "DCPComm.q_gather: q layout must be C-contiguous and "
        "16-byte aligned while a CUDA graph is being captured"
    )
    assert dcp.counters["q_gather"][PATH_NCCL] == 0
    # an aligned input with padded token stride is passed through untouched
    padded = FakeArray((2, 2, 64), strides=(2 * 64 * 2 + 32, 128, 2))
    dcp.q_gather(padded, stream=FakeStream())
    assert dcp.direct_ops["q_gather"].calls[-1][0][0] is padded
    dcp.close()


def test_lse_base_two_reaches_both_ops():
    dcp = FakeDCPComm(fake_comm(), lse_base=2, **GEOM)
    assert dcp.lse_base == 2.0 and "lse_base=2" in dcp.describe()
    dcp.close()
    dcp = FakeDCPComm(fake_comm(), lse_base=math.e, **GEOM)
    assert "lse_base=e" in dcp.describe()
    dcp.close()


# ----------------------------------------------------------------------------- NCCL unavailable
# Ranks as threads with real Communicators (tests/unit/_threadgroup.py): every collective step
# really meets the other ranks, so a rank that skipped or added one makes the test fail with
# BrokenBarrierError instead of passing.
def test_shared_gpu_blocker():
    assert shared_gpu_blocker(hosts=["a"] * 4, bus_ids=["0:1", "0:2", "0:3", "0:4"]) is None
    why = shared_gpu_blocker(hosts=["a"] * 4, bus_ids=["0:1", "0:1", "0:2", "0:2"])
    assert why == (
        "NCCL needs one GPU per rank: ranks [0, 1] share GPU 0:1; ranks [2, 3] share GPU 0:2"
    )
    # the same bus id on two hosts is two GPUs; an unknown bus id is never shared
    assert shared_gpu_blocker(hosts=["a", "b"], bus_ids=["0:1", "0:1"]) is None
    assert shared_gpu_blocker(hosts=["a", "a"], bus_ids=[None, None]) is None
    why = shared_gpu_blocker(hosts=["a", "b", "a"], bus_ids=["0:1", "0:1", "0:1"])
    assert why == "NCCL needs one GPU per rank: ranks [0, 2] share GPU 0:1"


class NcclError(RuntimeError):
    """Stands in for cupy's NcclError (not a DcpkitError)."""


class GroupDCPComm(FakeDCPComm):
    """A FakeDCPComm for thread groups: a GPU per rank given by ``bus_of(rank)``; its NCCL group
    is collective like ``ncclCommInitRank`` (an allgather; raises on every rank, own error on
    the failing ones, PeerError on the others, like NcclGroup) and records who entered it."""

    bus_of = staticmethod(lambda rank: f"0000:{rank + 0x10:02x}:00.0")
    group_fails_on = ()  # ranks whose ncclCommInitRank fails
    op_fails_on = ()  # ranks whose NCCL op build fails, locally (no collective)
    entered = None  # set of ranks that entered the NCCL group build (per test)
    lock = threading.Lock()

    def _pci_bus_id(self):
        return self.bus_of(self.rank)

    def _build_nccl_group(self):
        with self.lock:
            self.entered.add(self.rank)
        mine = self.rank in self.group_fails_on
        failed = [r for r, f in enumerate(self.comm.allgather(mine)) if f]
        if mine:
            raise NcclError("NCCL_ERROR_INVALID_USAGE: invalid usage")
        if failed:
            raise PeerError(
                "NcclGroup: ncclCommInitRank",
                dict.fromkeys(failed, "NcclError: NCCL_ERROR_INVALID_USAGE"),
            )
        return FakeOp("group", "nccl")

    def _build_nccl(self, op, group):
        if op == "lse_reduce" and self.rank in self.op_fails_on:
            raise NcclError("NCCL_ERROR_UNHANDLED_CUDA_ERROR: out of memory")
        return FakeOp(op, "nccl")


def _make(cls, **kw):
    """``comm -> cls(comm, ...)`` with 2 heads per rank."""
    cls.entered = set()
    return lambda comm: cls(comm, **dict(GEOM, num_heads=2 * comm.world_size, **kw))


def _direct_only_checks(comm, dcp, reason):
    """What every rank of a direct-only DCPComm must show (returns facts for the test)."""
    facts = {
        "reason": dcp.nccl_reason,
        "group": dcp.nccl_group,
        "nccl_ops": dict(dcp.nccl_ops),
        "describe": dcp.describe(),
    }
    H = 2 * comm.world_size
    facts["small"] = dcp.q_gather(FakeArray((8, 2, 64)))[1]
    for call in (
        lambda: dcp.q_gather(FakeArray((9, 2, 64))),
        lambda: dcp.kv_gather(FakeArray((9, 64))),
        lambda: dcp.lse_reduce(FakeArray((2, H, 64)), FakeArray((2, H), np.float64)),
    ):
        try:
            call()
            facts.setdefault("errors", []).append(None)
        except InvalidArgument as e:
            facts.setdefault("errors", []).append(str(e))
    dcp.close()
    return facts


def _assert_direct_only(res, reason):
    for rank, (kind, facts) in enumerate(res):
        assert kind == "ok", f"rank {rank} raised {facts!r}"
        assert facts["reason"] == reason, f"rank {rank}: {facts['reason']}"
        assert facts["group"] is None and set(facts["nccl_ops"].values()) == {None}
        assert f"nccl: unavailable: {reason}" in facts["describe"]
        assert facts["small"] == "direct"
        for msg in facts["errors"]:
            assert msg is not None and "no path can serve this call" in msg, msg
            assert msg.endswith(f"NCCL is unavailable ({reason})"), msg


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_a_gpu_auto_is_direct_only_and_never_enters_nccl(world):
    class Shared(GroupDCPComm):
        bus_of = staticmethod(lambda rank: "0000:19:00.0" if rank < 2 else "0000:2a:00.0")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_group(world, lambda comm: _direct_only_checks(comm, _make(Shared)(comm), None))
    _assert_direct_only(res, "NCCL needs one GPU per rank: ranks [0, 1] share GPU 0000:19:00.0")
    assert Shared.entered == set(), "a rank entered ncclCommInitRank although ranks share a GPU"


def test_ranks_sharing_a_gpu_policy_nccl_raises_on_every_rank():
    class Shared(GroupDCPComm):
        bus_of = staticmethod(lambda rank: "0000:19:00.0")

    res = run_group(2, _make(Shared, policy="nccl"))
    for rank, (kind, e) in enumerate(res):
        assert kind == "err" and isinstance(e, InvalidArgument), (rank, e)
        assert str(e) == (
            "DCPComm: policy 'nccl' cannot be served: NCCL is unavailable (NCCL "
            "needs one GPU per rank: ranks [0, 1] share GPU 0000:19:00.0)"
        )
    assert Shared.entered == set()


def test_one_gpu_per_rank_builds_nccl():
    """Distinct GPUs: nothing is weakened, NCCL serves what the direct ops cannot."""

    def body(comm):
        dcp = _make(GroupDCPComm)(comm)
        facts = (
            dcp.nccl_reason,
            dcp.q_gather(FakeArray((9, 2, 64)))[1],
            dcp.q_gather(FakeArray((8, 2, 64)))[1],
        )
        dcp.close()
        return facts

    res = run_group(2, body)
    assert res == [("ok", (None, "nccl", "direct"))] * 2
    assert GroupDCPComm.entered == {0, 1}


@pytest.mark.parametrize("fails_on", [(1,), (0, 1, 2)])
def test_nccl_init_fails_auto_is_direct_only_on_every_rank(fails_on):
    class Broken(GroupDCPComm):
        group_fails_on = fails_on

    where = "every rank" if len(fails_on) == 3 else f"rank(s) {list(fails_on)}"
    reason = (
        f"building the NCCL group and ops failed on {where}: NcclError: "
        f"NCCL_ERROR_INVALID_USAGE: invalid usage"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_group(3, lambda comm: _direct_only_checks(comm, _make(Broken)(comm), None))
    _assert_direct_only(res, reason)
    assert Broken.entered == {0, 1, 2}


def test_nccl_op_build_fails_on_one_rank_only():
    """A failure that only one rank sees (no collective inside): every rank closes what it
    built and agrees on the reason."""
    built = []

    class Broken(GroupDCPComm):
        op_fails_on = (2,)

        def _build_nccl(self, op, group):
            o = super()._build_nccl(op, group)
            built.append(o)
            return o

    reason = (
        "building the NCCL group and ops failed on rank(s) [2]: NcclError: "
        "NCCL_ERROR_UNHANDLED_CUDA_ERROR: out of memory"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_group(3, lambda comm: _direct_only_checks(comm, _make(Broken)(comm), None))
    _assert_direct_only(res, reason)
    assert built and all(o.closed for o in built)


@pytest.mark.parametrize("fails_on", [(1,), (0, 1)])
def test_nccl_init_fails_policy_nccl_raises_on_every_rank(fails_on):
    class Broken(GroupDCPComm):
        group_fails_on = fails_on

    res = run_group(2, _make(Broken, policy="nccl"))
    for rank, (kind, e) in enumerate(res):
        assert kind == "err", f"rank {rank} built a DCPComm with policy 'nccl'"
        if rank in fails_on:
            assert isinstance(e, NcclError) and "NCCL_ERROR_INVALID_USAGE" in str(e)
        else:
            assert isinstance(e, PeerError) and e.failed.keys() == set(fails_on), e


def test_nccl_op_fails_on_one_rank_policy_nccl_raises_on_every_rank():
    class Broken(GroupDCPComm):
        op_fails_on = (0,)

    res = run_group(2, _make(Broken, policy="nccl"))
    assert res[0][0] == "err" and isinstance(res[0][1], NcclError)
    assert res[1][0] == "err" and isinstance(res[1][1], PeerError)
    assert res[1][1].failed == {0: "NcclError: NCCL_ERROR_UNHANDLED_CUDA_ERROR: out of memory"}
    assert "DCPComm: building the NCCL group and ops failed on rank(s) [0]" in str(res[1][1])


def test_precondition_failing_on_one_rank_never_enters_nccl():
    """Rank 1 cannot read its GPU: no rank enters the (collective) NCCL init, so none is left
    waiting inside it; auto goes direct-only, policy 'nccl' raises on every rank."""

    class NoBus(GroupDCPComm):
        def _pci_bus_id(self):
            if self.rank == 1:
                raise RuntimeError("cudaErrorNoDevice")
            return super()._pci_bus_id()

    reason = (
        "reading the PCI bus id of the GPU failed on rank(s) [1]: rank 1: RuntimeError: "
        "cudaErrorNoDevice"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = run_group(3, lambda comm: _direct_only_checks(comm, _make(NoBus)(comm), None))
    _assert_direct_only(res, reason)
    assert NoBus.entered == set()
    res = run_group(3, _make(NoBus, policy="nccl"))
    assert res[1][0] == "err" and isinstance(res[1][1], RuntimeError)
    for rank in (0, 2):
        kind, e = res[rank]
        assert kind == "err" and isinstance(e, InvalidArgument) and reason in str(e), e
    assert NoBus.entered == set()


# ----------------------------------------------------------------------------- user errors raise
# DCPComm validates every argument itself, also as each op it may build will check it: wrong
# arguments raise on every rank instead of silently sending every call to NCCL. Only
# environment failures (CUDA, NVRTC, memory, missing packages) make the other path serve.
@pytest.mark.parametrize(
    "change,exc,fragment",
    [
        (
            dict(timeout_ms=-5),
            InvalidArgument,
            "DCPComm: timeout_ms must lie in [0.001, 3600000] milliseconds (got -5)",
        ),
        (
            dict(timeout_ms="soon"),
            InvalidType,
            "DCPComm: timeout_ms must be a real number of milliseconds (got str 'soon')",
        ),
        (dict(timeout_ms=False), InvalidType, "DCPComm: timeout_ms must be a real number"),
        (
            dict(max_tokens=2**40),
            InvalidArgument,
            "DCPComm: max_tokens must be <= 2**31 - 1 (got 1099511627776)",
        ),
        (
            dict(nccl_max_tokens=2**31),
            InvalidArgument,
            "DCPComm: nccl_max_tokens must be <= 2**31 - 1 (got 2147483648)",
        ),
        (
            dict(max_tokens=2**28),
            InvalidArgument,
            "DCPComm: direct q_gather op: max_tokens*H*head_dim*itemsize must be < 32 GiB",
        ),
        (
            dict(max_tokens=2**30, policy="nccl"),
            InvalidArgument,
            "DCPComm: NCCL q_gather op: num_ubatches * buffer bytes per ubatch must be <= 2**40",
        ),
        (
            dict(num_ubatches=2**27),
            InvalidArgument,
            "DCPComm: direct q_gather op: num_ubatches * symmetric bytes per ubatch + graph_outputs * bytes per graph output must be <= 2**40",
        ),
        (
            dict(dtype="float64"),
            InvalidType,
            "DCPComm: NCCL lse_reduce op: dtype must be one of [bfloat16, float16, float32] (got "
            "float64)",
        ),
    ],
)
def test_bad_arguments_raise_instead_of_routing_to_nccl(change, exc, fragment):
    with pytest.raises(exc) as ei:
        FakeDCPComm(fake_comm(), **dict(GEOM, **change))
    assert fragment in str(ei.value), str(ei.value)


def test_timeouts_of_any_real_type_and_the_variable(monkeypatch):
    monkeypatch.delenv("DCPKIT_TIMEOUT_MS", raising=False)
    dcp = FakeDCPComm(fake_comm(), timeout_ms=np.float32(250), **GEOM)
    assert dcp.timeout_ms == 250.0 and type(dcp.timeout_ms) is float
    dcp.close()
    dcp = FakeDCPComm(fake_comm(), **GEOM)
    assert dcp.timeout_ms == 5000.0
    dcp.close()
    monkeypatch.setenv("DCPKIT_TIMEOUT_MS", "-5")
    with pytest.raises(
        InvalidArgument,
        match=r"^DCPComm: DCPKIT_TIMEOUT_MS must be a number of "
        r"milliseconds in \[0\.001, 3600000\] \(got '-5'\)$",
    ):
        FakeDCPComm(fake_comm(), **GEOM)


def test_direct_ops_get_the_validated_timeout():
    class Spy(FakeDCPComm):
        def _build_direct(self, op):
            cls, kwargs = self._direct_spec(op)
            self.seen = getattr(self, "seen", []) + [kwargs["timeout_ms"]]
            return FakeOp(op, "direct")

    dcp = Spy(fake_comm(), timeout_ms=np.int64(300), **GEOM)
    assert dcp.seen == [300.0, 300.0, 300.0]
    dcp.close()


@pytest.mark.parametrize(
    "error,falls_back",
    [
        (InvalidArgument("q_gather: max_tokens must be >= 1 (got 0)"), False),
        (InvalidType("q_gather: dtype must be a fixed-size data type (got object)"), False),
        (CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY"), True),
        (CompileError("q_gather.cu", ["-arch=sm_90"], "error: something"), True),
        (MissingDependency("cuda-bindings (cuda-python)", "cuda12"), True),
        (DcpkitError("q_gather: no CUDA GPU is visible (cudaGetDeviceCount: ...)"), True),
        (RuntimeError("cupy OutOfMemoryError: out of memory allocating 1024 bytes"), True),
        (PeerError("q_gather: workspace state", {1: "CudaError: cuMemCreate failed"}), True),
    ],
)
def test_direct_build_user_errors_raise_environment_errors_fall_back(error, falls_back):
    class Broken(FakeDCPComm):
        direct_error = error

    if not falls_back:
        with pytest.raises(type(error)) as ei:
            Broken(fake_comm(), **GEOM)
        assert ei.value is error
        return
    dcp = Broken(fake_comm(), **GEOM)
    reason = dcp.direct_reason["q_gather"]
    assert reason.startswith("building the direct op failed on every rank: "), reason
    assert type(error).__name__ in reason
    assert dcp.q_gather(q_input(1))[1] == "nccl"
    dcp.close()
    with pytest.raises(type(error)):
        Broken(fake_comm(), policy="direct", **GEOM)


def test_nccl_build_user_error_raises_in_auto():
    class Broken(FakeDCPComm):
        nccl_error = InvalidArgument("q_gather: nccl_group must be a group on GPU 0")

    with pytest.raises(InvalidArgument, match="nccl_group must be a group on GPU 0"):
        Broken(fake_comm(), **GEOM)


class OpAgreedDCPComm(GroupDCPComm):
    """Direct op builds that fail like the real ones: every rank at once (one allgather),
    the failing rank with its own error, the others with PeerError."""

    direct_fails_on = {}  # rank -> exception

    def _build_direct(self, op):
        mine = self.direct_fails_on.get(self.rank)
        msgs = self.comm.allgather(None if mine is None else f"{type(mine).__name__}: {mine}")
        if mine is not None:
            raise mine
        failed = {r: m for r, m in enumerate(msgs) if m is not None}
        if failed:
            raise PeerError(f"{op}: constructor arguments", failed)
        return FakeOp(op, "direct")


def test_direct_user_error_on_one_rank_raises_on_every_rank():
    class Broken(OpAgreedDCPComm):
        direct_fails_on = {1: InvalidArgument("q_gather: heap free bytes must be >= 4096")}

    res = run_group(3, _make(Broken))
    assert res[1][0] == "err" and isinstance(res[1][1], InvalidArgument), res[1]
    for r in (0, 2):
        kind, e = res[r]
        assert kind == "err" and isinstance(e, PeerError) and set(e.failed) == {1}, (r, e)
    assert Broken.entered == set(), "a rank went on to build NCCL after a user error"


def test_direct_environment_error_on_one_rank_falls_back_on_every_rank():
    class Broken(OpAgreedDCPComm):
        direct_fails_on = {1: CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")}

    def body(comm):
        dcp = _make(Broken)(comm)
        facts = (dcp.direct_reason["q_gather"], dcp.q_gather(FakeArray((2, 2, 64)))[1])
        dcp.close()
        return facts

    res = run_group(3, body)
    reason = (
        "building the direct op failed on rank(s) [1]: CudaError: cuMemCreate failed "
        "with CUDA_ERROR_OUT_OF_MEMORY"
    )
    assert res == [("ok", (reason, "nccl"))] * 3, res


@pytest.mark.parametrize(
    "change,exc,fragment",
    [
        (dict(timeout_ms=-5), InvalidArgument, "DCPComm: timeout_ms must lie in"),
        (dict(max_tokens=2**40), InvalidArgument, "DCPComm: max_tokens must be <= 2**31 - 1"),
        (dict(num_ubatches=0), InvalidArgument, "DCPComm: num_ubatches must be >= 1 (got 0)"),
    ],
)
def test_bad_argument_on_one_rank_raises_on_every_rank(change, exc, fragment):
    def body(comm):
        return _make(GroupDCPComm, **(change if comm.rank == 1 else {}))(comm)

    res = run_group(3, body)
    assert res[1][0] == "err" and isinstance(res[1][1], exc) and fragment in str(res[1][1])
    for r in (0, 2):
        kind, e = res[r]
        assert kind == "err" and isinstance(e, PeerError) and set(e.failed) == {1}, (r, e)
        assert fragment in e.failed[1]


def test_missing_gpu_on_one_rank_raises_on_every_rank():
    class NoGpu(GroupDCPComm):
        def _current_device(self):
            if self.rank == 1:
                raise DcpkitError(
                    "DCPComm: no CUDA GPU is visible (cudaGetDeviceCount: cudaErrorNoDevice)"
                )
            return 0

    res = run_group(3, _make(NoGpu))
    assert res[1][0] == "err" and type(res[1][1]) is DcpkitError
    for r in (0, 2):
        kind, e = res[r]
        assert kind == "err" and isinstance(e, PeerError) and set(e.failed) == {1}, (r, e)
        assert "no CUDA GPU is visible" in e.failed[1]
    assert NoGpu.entered == set()


def test_stream_must_be_a_cupy_stream():
    dcp = FakeDCPComm(fake_comm(), **GEOM)
    with pytest.raises(
        InvalidType,
        match=r"^DCPComm: stream must be a cupy.cuda.Stream "
        r"\(got str\)$",
    ):
        DCPComm._stream(dcp, "x")
    cupy = pytest.importorskip("cupy")
    assert DCPComm._stream(dcp, cupy.cuda.Stream.null) is cupy.cuda.Stream.null
    dcp.close()


def test_world_size_past_the_direct_merge_goes_to_nccl():
    assert (
        direct_geometry_blocker("lse_reduce", dtype="bfloat16", row_bytes=128, world_size=65)
        == "world_size must be <= 64 for the direct kernel's merge (got 65)"
    )
    assert (
        direct_geometry_blocker("q_gather", dtype="bfloat16", row_bytes=128, world_size=65) is None
    )
    dcp = FakeDCPComm(fake_comm(world_size=65), **dict(GEOM, num_heads=130))
    assert dcp.direct_reason["lse_reduce"].startswith("world_size must be <= 64")
    assert dcp.direct_reason["q_gather"] is None
    dcp.close()


@pytest.mark.parametrize("return_lse", [False, True])
def test_direct_lse_reduce_is_built_with_return_lse_as_asked(return_lse):
    """A merged lse nobody asked for would take a graph output buffer of the direct op's
    bounded pool for every call captured with out= alone (the demo's graph of 20 layers ran
    out of them): DCPComm builds the direct op with the caller's return_lse."""
    dcp = FakeDCPComm(fake_comm(), return_lse=return_lse, **GEOM)
    _, kw = dcp._direct_spec("lse_reduce")
    assert kw["return_lse"] is return_lse


def test_release_graph_outputs_reaches_every_direct_op_and_refuses_when_closed():
    dcp = DCPComm.__new__(DCPComm)
    released = []

    class _Op:
        def __init__(self, name):
            self.name = name

        def release_graph_outputs(self):
            released.append(self.name)

    dcp.direct_ops = {"q_gather": _Op("q"), "kv_gather": None, "lse_reduce": _Op("lse")}
    dcp._closed = False
    dcp.release_graph_outputs()
    assert released == ["q", "lse"]
    dcp._closed = True
    with pytest.raises(ClosedError, match="DCPComm.release_graph_outputs: DCPComm is closed"):
        dcp.release_graph_outputs()
    assert released == ["q", "lse"]
