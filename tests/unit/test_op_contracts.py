"""What the ops say they accept, publicly: ``check_arguments`` (the constructor's checks without a
GPU or a collective) and ``accepts_layout`` (whether a call reads an array in place), on the
direct ops and the NCCL ops; the NCCL ops' ``heap=`` / ``multicast=`` type checks; and the one
symmetric heap that DCPComm's direct ops share."""

from __future__ import annotations

import numpy as np
import pytest
from test_selection import GEOM, FakeArray, FakeDCPComm, fake_comm

from dcpkit.comm import Communicator
from dcpkit.errors import InvalidArgument, InvalidType
from dcpkit.nccl import NcclKVGather, NcclLseReduce, NcclQGather
from dcpkit.ops import KVGather, LseReduce, QGather


# ----------------------------------------------------------------------------- check_arguments
@pytest.mark.parametrize(
    "cls,kw",
    [
        (QGather, dict(max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")),
        (KVGather, dict(max_tokens=8, row_dim=64, dtype="bfloat16")),
        (LseReduce, dict(max_tokens=8, num_heads=4, head_dim=64, dtype="float16")),
        (NcclQGather, dict(max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")),
        (NcclKVGather, dict(max_tokens=8, row_dim=64, dtype="bfloat16")),
        (NcclLseReduce, dict(max_tokens=8, num_heads=4, head_dim=64, dtype="float16")),
    ],
)
def test_check_arguments_returns_the_agreed_geometry_and_rejects_like_the_constructor(cls, kw):
    agreed = cls.check_arguments(2, **kw)
    assert isinstance(agreed, tuple) and agreed[0] == 8
    assert cls.check_arguments(2, **kw) == agreed  # pure: same every time
    assert cls.check_arguments(2, **dict(kw, max_tokens=9)) != agreed
    with pytest.raises(
        InvalidArgument,
        match=rf"^{cls.op_name}: max_tokens must be >= 1 "
        rf"\(got 0\)$",
    ):
        cls.check_arguments(2, **dict(kw, max_tokens=0))
    with pytest.raises(InvalidType, match=rf"^{cls.op_name}: max_tokens must be an int"):
        cls.check_arguments(2, **dict(kw, max_tokens="8"))
    with pytest.raises(InvalidArgument, match=rf"^{cls.op_name}: world_size must be >= 1"):
        cls.check_arguments(0, **kw)
    # the constructor raises the same message before any collective or GPU work
    with pytest.raises(InvalidArgument) as ei:
        cls(Communicator.single(), **dict(kw, max_tokens=0))
    assert str(ei.value) == f"{cls.op_name}: max_tokens must be >= 1 (got 0)"


def test_check_arguments_of_the_direct_ops_ends_with_their_symmetric_bytes():
    small = QGather.check_arguments(2, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")
    big = QGather.check_arguments(2, max_tokens=16, heads_per_rank=2, head_dim=64, dtype="float16")
    assert big[-1] > small[-1] > 0


def test_check_arguments_checks_multicast():
    for cls, kw in (
        (QGather, dict(heads_per_rank=2, head_dim=64)),
        (NcclQGather, dict(heads_per_rank=2, head_dim=64)),
        (NcclKVGather, dict(row_dim=64)),
    ):
        with pytest.raises(
            InvalidType,
            match=r"multicast must be True, False or None "
            r"\(got 'x'\)",
        ):
            cls.check_arguments(2, max_tokens=8, dtype="float16", multicast="x", **kw)


# ----------------------------------------------------------------------------- NCCL heap=
@pytest.mark.parametrize(
    "build",
    [
        lambda c, **k: NcclQGather(
            c, max_tokens=4, heads_per_rank=2, head_dim=8, dtype="float16", **k
        ),
        lambda c, **k: NcclKVGather(c, max_tokens=4, row_dim=8, dtype="float16", **k),
    ],
)
def test_nccl_ops_reject_a_heap_or_multicast_of_the_wrong_type(build):
    comm = Communicator.single()
    with pytest.raises(
        InvalidType,
        match=r"heap must be None or a dcpkit.SymmetricHeap "
        r"\(got str\)",
    ):
        build(comm, heap="x")
    with pytest.raises(
        InvalidType,
        match=r"multicast must be True, False or None "
        r"\(got 'x'\)",
    ):
        build(comm, multicast="x")


def test_nccl_lse_reduce_rejects_a_heap_of_the_wrong_type():
    with pytest.raises(
        InvalidType,
        match=r"^lse_reduce: heap must be None or a "
        r"dcpkit.SymmetricHeap \(got int\)$",
    ):
        NcclLseReduce(
            Communicator.single(), max_tokens=4, num_heads=2, head_dim=8, dtype="float32", heap=3
        )


# ----------------------------------------------------------------------------- accepts_layout
def _probe(cls, world_size=2, **kw):
    """An op with its geometry set and nothing behind it (the layout rules need no GPU)."""
    op = cls.__new__(cls)
    op._closed = True
    op._check_arguments(world_size, **kw)
    op.world_size = world_size
    return op


def test_q_gather_accepts_padded_tokens_but_not_strided_heads_or_misalignment():
    op = _probe(QGather, max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")
    assert op.accepts_layout(q=FakeArray((4, 2, 64)))
    assert op.accepts_layout(q=FakeArray((4, 2, 64), strides=(2 * 128 + 32, 128, 2)))
    assert not op.accepts_layout(q=FakeArray((4, 2, 64), strides=(512, 256, 2)))
    assert not op.accepts_layout(q=FakeArray((4, 2, 64), ptr=(1 << 20) + 2))
    assert not op.accepts_layout(q=FakeArray((4, 2, 64), strides=(264, 128, 2)))
    assert op.accepts_layout(out=FakeArray((4, 4, 64)))
    assert not op.accepts_layout(out=FakeArray((4, 4, 64), ptr=(1 << 20) + 8))


def test_kv_gather_accepts_only_aligned_contiguous_rows():
    op = _probe(KVGather, max_tokens=8, row_dim=64, dtype="float16")
    assert op.accepts_layout(kv=FakeArray((4, 64)), out=FakeArray((8, 64)))
    assert not op.accepts_layout(kv=FakeArray((4, 64), strides=(256, 2)))
    assert not op.accepts_layout(out=FakeArray((8, 64), ptr=(1 << 20) + 4))


def test_lse_reduce_layouts():
    op = _probe(LseReduce, max_tokens=8, num_heads=4, head_dim=64, dtype="float16")
    assert op.accepts_layout(
        out_partial=FakeArray((4, 4, 64)),
        lse_partial=FakeArray((4, 4), np.float32),
        out=FakeArray((4, 2, 64)),
        out_lse=FakeArray((4, 2), np.float32),
    )
    # a strided innermost dimension is copied by the op itself: still in place for DCPComm
    assert op.accepts_layout(out_partial=FakeArray((4, 4, 64), strides=(1024, 256, 4)))
    assert not op.accepts_layout(out_partial=FakeArray((4, 4, 64), ptr=(1 << 20) + 2))
    assert not op.accepts_layout(out_partial=FakeArray((4, 4, 64), strides=(-512, 128, 2)))
    assert not op.accepts_layout(lse_partial=FakeArray((4, 4), np.float32, ptr=(1 << 20) + 2))
    assert op.accepts_layout(lse_partial=FakeArray((4, 4), np.float32, strides=(32, 4)))
    assert not op.accepts_layout(out=FakeArray((4, 2, 64), strides=(512, 128, 2)))
    assert not op.accepts_layout(out_lse=FakeArray((4, 2), np.float32, strides=(16, 4)))


# ----------------------------------------------------------------------------- one heap
def test_dcpcomm_builds_one_heap_for_its_three_direct_ops():
    seen = []

    class Spy(FakeDCPComm):
        def _build_direct(self, op):
            cls, kwargs = self._direct_spec(op)
            seen.append(kwargs["heap"])
            return super()._build_direct(op)

    dcp = Spy(fake_comm(), **GEOM)
    assert len(seen) == 3 and all(h is dcp.heap for h in seen) and dcp.heap is not None
    regions = [
        cls.check_arguments(2, **{k: v for k, v in kw.items() if k != "heap"})[-1]
        for cls, kw in (dcp._direct_spec(op) for op in ("q_gather", "lse_reduce", "kv_gather"))
    ]
    assert dcp.heap_nbytes == sum(-(-r // 256) * 256 for r in regions)
    assert "heap: one SymmetricHeap" in dcp.describe()
    heap = dcp.heap
    dcp.close()
    assert heap.closed and dcp.heap is None


def test_dcpcomm_with_policy_nccl_builds_no_heap():
    dcp = FakeDCPComm(fake_comm(), policy="nccl", **GEOM)
    assert dcp.heap is None and not hasattr(dcp, "heap_nbytes")
    dcp.close()


def test_a_failed_heap_leaves_auto_on_nccl_with_the_reason():
    class NoHeap(FakeDCPComm):
        def _build_heap(self, nbytes):
            from dcpkit.errors import CudaError

            raise CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")

    dcp = NoHeap(fake_comm(), **GEOM)
    for op in ("q_gather", "lse_reduce", "kv_gather"):
        assert dcp.direct_ops[op] is None
        assert "symmetric heap of the direct ops" in dcp.direct_reason[op]
        assert "CUDA_ERROR_OUT_OF_MEMORY" in dcp.direct_reason[op]
    dcp.close()


# ----------------------------------------------------------------------------- from_checked
def test_an_nccl_op_built_from_checked_arguments_makes_no_second_check_or_exchange(monkeypatch):
    from dcpkit.nccl import NcclGroup
    from dcpkit.nccl.base import CheckedArguments

    kw = dict(max_tokens=8, heads_per_rank=2, head_dim=64, dtype="float16")
    checked = NcclQGather.prepare(1, **kw)
    assert isinstance(checked, CheckedArguments) and checked.cls is NcclQGather
    assert checked.agreed == NcclQGather.check_arguments(1, **kw)
    assert checked.geometry["num_heads"] == 2 and checked.geometry["max_tokens"] == 8
    with pytest.raises(InvalidArgument, match="^q_gather: max_tokens must be >= 1"):
        NcclQGather.prepare(2, **dict(kw, max_tokens=0))

    exchanges = []
    comm = Communicator(
        0,
        1,
        allgather=lambda o: exchanges.append(o) or [o],
        broadcast=lambda o, root: o,
        barrier=lambda: None,
        backend="fake",
    )
    exchanges.clear()  # the Communicator's own host exchange
    built = []
    monkeypatch.setattr(
        NcclQGather,
        "_build",
        lambda self, group: built.append((group, self.max_tokens, self.num_heads, self.dtype)),
    )
    group = NcclGroup.__new__(NcclGroup)
    op = NcclQGather.from_checked(comm, checked, group)
    assert built == [(group, 8, 2, np.dtype(np.float16))] and exchanges == []
    assert op.comm is comm and op.world_size == 1
    with pytest.raises(InvalidType, match=r"checked must come from NcclKVGather.prepare"):
        NcclKVGather.from_checked(comm, checked, group)
    with pytest.raises(InvalidType, match=r"nccl_group must be a dcpkit.nccl.NcclGroup"):
        NcclQGather.from_checked(comm, checked, None)
    with pytest.raises(InvalidArgument, match=r"checked world_size must be comm's 1 \(got 2\)"):
        NcclQGather.from_checked(comm, NcclQGather.prepare(2, **kw), group)


def test_dcpcomm_checks_each_nccl_op_once_and_builds_it_from_that_check():
    seen = []

    class Spy(FakeDCPComm):
        def _build_nccl(self, op, group):
            seen.append(
                (
                    op,
                    self._nccl_checked[op].cls.op_name,
                    self._nccl_checked[op].geometry["max_tokens"],
                )
            )
            return super()._build_nccl(op, group)

    dcp = Spy(fake_comm(), nccl_max_tokens=32, **GEOM)
    assert sorted(seen) == [
        ("kv_gather", "kv_gather", 32),
        ("lse_reduce", "lse_reduce", 32),
        ("q_gather", "q_gather", 32),
    ]
    dcp.close()


# ----------------------------------------------------------------------------- one lse_reduce call
def test_both_lse_reduce_ops_take_one_call_signature_and_check_they_are_open():
    """The direct and the NCCL lse_reduce are called through one ``__call__``: the same
    explicit signature, and each op's own entry behind it (a closed op raises ClosedError)."""
    import inspect

    from dcpkit.errors import ClosedError

    assert NcclLseReduce.__call__ is LseReduce.__call__
    sig = inspect.signature(LseReduce.__call__)
    assert list(sig.parameters) == [
        "self",
        "out_partial",
        "lse_partial",
        "seq_lens",
        "query_start_loc",
        "ubatch",
        "out",
        "out_lse",
        "stream",
    ]
    assert [p.default for p in list(sig.parameters.values())[3:]] == [None, None, 0] + [None] * 3
    for cls in (LseReduce, NcclLseReduce):
        op = cls.__new__(cls)
        op._closed = True
        with pytest.raises(ClosedError, match=r"^lse_reduce: the workspace is closed"):
            op(FakeArray((1, 2, 8)), FakeArray((1, 2)))
